"""The numerical profile: a version string for everything that fixes result bytes.

It is saved with checkpoints and digests. Any change to the digit layout (csrc/longacc.h), to
rounding rules, to the Philox stream or to the digest function is a version bump.
"""
PROFILE = "ldet-v1"

# Mirrors csrc/longacc.h; checked against the compiled core when it loads.
NDIGITS = 18  # radix-2^32 digits
WORDS = 19  # digits + one status word (NaN / +inf / -inf counters)
LSB_EXP = -298  # weight of bit 0 of digit 0 is 2^LSB_EXP
STATUS_BITS = 21
# Headroom bounds (csrc/longacc.h, "Range" and "Headroom bounds"):
TOP_BITS = 41  # canonical top digit in (-2^41, 2^41); beyond it normalize gives +-inf
COMBINE_MAX = (1 << STATUS_BITS) - 1  # canonical accumulators one word-wise sum may hold
