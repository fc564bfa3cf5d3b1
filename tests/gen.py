"""Input generators for the exactness tests: random, adversarial and special values."""
import torch


def normal(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def wide_exponents(shape, lo=-60, hi=60, dtype=torch.float32, seed=0):
    """Random signs, significands and exponents spread over [lo, hi]: defeats fp64 sums."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(shape, generator=g, dtype=torch.float64) + 1.0
    exp = torch.randint(lo, hi + 1, shape, generator=g).double()
    sign = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
    return (sign * mant * torch.pow(2.0, exp)).to(dtype)


def subnormals(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(dtype).tiny
    v = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * tiny
    return v.to(dtype)


def cancellation(n_big=24, n_tiny=8, dtype=torch.float32, seed=0):
    """x, w (1, K): pairs of huge products a*b and a*(-b) that cancel exactly, plus tiny terms
    that alone decide the result. fp64 accumulation in any order loses the tiny terms."""
    g = torch.Generator().manual_seed(seed)
    a = wide_exponents((n_big,), 40, 100, dtype, seed)
    b = wide_exponents((n_big,), 0, 20, dtype, seed + 1)
    t = wide_exponents((n_tiny,), -130, -100, dtype, seed + 2)
    x = torch.cat([a, a, t])
    w = torch.cat([b, -b, torch.ones(n_tiny, dtype=dtype)])
    perm = torch.randperm(x.numel(), generator=g)
    return x[perm].reshape(1, -1), w[perm].reshape(1, -1)
