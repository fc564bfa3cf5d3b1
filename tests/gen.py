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


def fp32_pair_ties(scale_exp=0, tail=1.0):
    """(x, w) fp32, K = 32, whose exact row-i-by-row-i products sit just beside fp32 rounding ties.

    With the fp32 split (csrc/split.h) the hi*hi segment's sum lands exactly on a tie, while the
    other segments leave a non-zero remainder (+-2^-56 and +-2^-80 relative, the sign of
    `tail`) that decides the rounding: an epilogue that rounds hi alone, or the fp64 sum once
    more, gets it wrong. Three bases (ties above 1 and above 1 + 2^-23, and 2 - 2^-24, which
    at scale_exp 126 is the fp32 overflow edge); scale_exp -65 gives subnormal results.
    """
    s = 2.0 ** scale_exp
    bases = [
        [1.0, 2.0 ** -24],                       # tie between 1 and 1 + 2^-23
        [1.0 + 2.0 ** -23, 2.0 ** -24],          # tie between 1 + 2^-23 and 1 + 2^-22
        [1.0, 1.0 - 2.0 ** -24],                 # 2 - 2^-24: at scale 2^126, the overflow edge
    ]
    rows = []
    for base in bases:
        t = 2.0 ** -17 * (1 + 2.0 ** -23)
        # the cancelling pair leaves nothing in the hi*hi segment, 2^-57 * tail in each cross
        # segment and 2^-80 * tail in the lo*lo one
        x = [b * s for b in base] + [t * s, -(2.0 ** -17) * s * tail]
        w = [1.0, 1.0, t * tail, 2.0 ** -17]
        rows.append((x, w))
    # K = 32: each segment fills whole 32-wide K-blocks, as in real use (zeros add nothing)
    x = torch.zeros(len(rows), 32, dtype=torch.float32)
    w = torch.zeros(len(rows), 32, dtype=torch.float32)
    for i, (xr, wr) in enumerate(rows):
        x[i, :4], w[i, :4] = torch.tensor(xr), torch.tensor(wr)
    assert torch.isfinite(x).all() and torch.isfinite(w).all()
    return x, w
