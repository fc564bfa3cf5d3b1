"""erf-GELU's fast way on the GPU (csrc/cuda/gelu_fast.cuh: CUDA's normcdf and exp, each element
proven to round like the series or sent to it) against the series alone
(LIGHTNING_DET_GELU_SERIES=1), byte for byte on every fp32, bf16 and fp16 input; with the control
that rounding the same fp64 formula without the proof gives other bytes."""
import os

import pytest
import torch
from conftest import bits, cuda

from lightning_det import _build

ERF = 0  # ActKind kActGeluErf
CHUNK = 1 << 28  # fp32 patterns per comparison (1 GiB each)


def _series(fn):
    os.environ["LIGHTNING_DET_GELU_SERIES"] = "1"
    try:
        return fn()
    finally:
        del os.environ["LIGHTNING_DET_GELU_SERIES"]


def _assert_same(fast, series, x, what):
    if torch.equal(bits(fast), bits(series)):
        return
    bad = (bits(fast) != bits(series)).nonzero().flatten()
    show = [f"x={x[i].item()!r}: {fast[i].item()!r} vs series {series[i].item()!r}" for i in bad[:8].tolist()]
    raise AssertionError(f"{what}: {bad.numel()} of {x.numel()} differ\n  " + "\n  ".join(show))


def _all_fp32(start, n):
    """The fp32 values with bit patterns start .. start + n - 1 (NaNs and infs included)."""
    return torch.arange(start, start + n, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)


def _grads(n, seed, device="cuda"):
    """Output gradients of mixed sizes: normal, times 2^-100 .. 2^100 on a quarter of them, and
    some 1, 0, -0, inf and NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    v = torch.randn(n, generator=g, device=device)
    scale = torch.randint(-100, 101, (n,), generator=g, device=device).float().exp2()
    pick = torch.randint(0, 16, (n,), generator=g, device=device)
    v = torch.where(pick < 4, v * scale, v)
    specials = torch.tensor([1.0, 0.0, -0.0, float("inf"), float("nan")], device=device)
    return torch.where(pick == 15, specials[torch.randint(0, 5, (n,), generator=g, device=device)], v)


@cuda
def test_every_fp32_input_forward_and_backward():
    _build.load()
    controls = 0
    for c, start in enumerate(range(-(1 << 31), 1 << 31, CHUNK)):
        x = _all_fp32(start, CHUNK)
        fast = torch.ops.ldet.act(x, ERF)
        _assert_same(fast, _series(lambda: torch.ops.ldet.act(x, ERF)), x, f"forward, chunk {c}")
        # the control: the same fp64 formula rounded without the proof
        unproven = (x.double() * torch.special.ndtr(x.double())).float()
        finite = torch.isfinite(x) & (x.abs() <= 16)
        controls += int((bits(unproven) != bits(fast))[finite].sum())
        del fast, unproven
        for seed, g in ((None, torch.ones_like(x)), (c, _grads(CHUNK, c))):
            fast = torch.ops.ldet.act_backward(g, x, ERF)
            series = _series(lambda: torch.ops.ldet.act_backward(g, x, ERF))
            _assert_same(fast, series, x, f"backward, chunk {c}, grads {'ones' if seed is None else seed}")
            del fast, series
    assert controls > 0, "the unproven fp64 formula rounded like the series on every fp32 input: the control shows nothing"


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_half_input(dtype):
    _build.load()
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    x = x.repeat(64)  # each value against 64 gradients
    fast = torch.ops.ldet.act(x, ERF)
    _assert_same(fast, _series(lambda: torch.ops.ldet.act(x, ERF)), x, f"{dtype} forward")
    g = _grads(x.numel(), 7).to(dtype)
    fast = torch.ops.ldet.act_backward(g, x, ERF)
    _assert_same(fast, _series(lambda: torch.ops.ldet.act_backward(g, x, ERF)), x, f"{dtype} backward")
    # mixed dtypes: an fp32 gradient with half inputs (both widened to fp32, the output in x's dtype)
    g32 = _grads(x.numel(), 8)
    fast = torch.ops.ldet.act_backward(g32, x, ERF)
    _assert_same(fast, _series(lambda: torch.ops.ldet.act_backward(g32, x, ERF)), x, f"{dtype} x, fp32 grad")


@cuda
def test_fast_way_matches_the_cpu():
    """The CUDA bytes (fast way on) equal the CPU's series on the det_ddp step's activation sizes."""
    _build.load()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1 << 22, generator=g) * 1.5
    gy = torch.randn(1 << 22, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd, gd = x.to(dtype), gy.to(dtype)
        _assert_same(torch.ops.ldet.act(xd.cuda(), ERF).cpu(), torch.ops.ldet.act(xd, ERF), xd, f"{dtype} forward")
        _assert_same(torch.ops.ldet.act_backward(gd.cuda(), xd.cuda(), ERF).cpu(),
                     torch.ops.ldet.act_backward(gd, xd, ERF), xd, f"{dtype} backward")
