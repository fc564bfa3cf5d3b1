"""Exact references in Python fractions: wide test values, their exact sums, the float32 nearest."""
from fractions import Fraction

import torch


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def wide(shape, seed: int) -> torch.Tensor:
    """Values whose exponents spread over 60 binades: a float sum in any order rounds."""
    g = gen(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())


def exact_sum(values) -> Fraction:
    return sum((Fraction(float(v)) for v in values), Fraction(0))


def round32(fr: Fraction) -> float:
    """The float32 nearest fr (ties to even), through the neighbours of a fp64 estimate."""
    est = torch.tensor(float(fr), dtype=torch.float32)
    cands = [est, torch.nextafter(est, torch.tensor(float("inf"))), torch.nextafter(est, torch.tensor(float("-inf")))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - fr), int(c.view(torch.int32)) & 1)).item()
