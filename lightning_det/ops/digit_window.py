"""Packing LongAcc values into per-block bit windows, for a compact exact int64 SUM all-reduce.

The collective lives in :mod:`lightning_det.ops.distributed`; everything here is local and pure
torch (CPU or CUDA), so the packing can be tested by summing packed buffers by hand.

Scheme (all ranks build the same layout from the same agreed numbers):

1. Every element's value v (an integer in units of 2^-298, two's complement over the canonical
   digits) has a lowest set bit ``lo`` and a signed width ``top``: -2^top <= v < 2^top.
2. Elements form blocks of ``block`` consecutive elements. One small MAX all-reduce agrees on
   each block's window over all ranks: lo_b = min lo, top_b = max top (and whether any rank has
   a NaN/inf in it). Every v of the block is then a multiple of 2^lo_b and v >> lo_b fits in
   B = top_b - lo_b + 1 signed bits.
3. A block is packed as one big non-negative integer: element k's field of F = B + h bits holds
   (v >> lo_b) + 2^(B-1), in [0, 2^B). A SUM of W <= 2^h such fields is below 2^(B+h) = 2^F, so
   fields never spill into their neighbours. The block's integer is cut into limbs of L = 63 - h
   bits (at most 62): a SUM of W limbs < 2^L is below 2^63, so the int64 all-reduce never
   overflows, for any W up to 2^h (MAX_WORLD_SIZE = 2^21 - 1 gives h = 21, L = 42).
4. After the SUM, carries are propagated over the limbs (radix 2^L), fields are read back, the
   offset W * 2^(B-1) is subtracted and the result is shifted back into digits.

Rows are processed in chunks of ``CHUNK_BLOCKS`` blocks: the per-element temporaries stay small
and are reused, where whole-tensor temporaries of n x 19 words would each cost a fresh
allocation as large as the gradient digits themselves.

Blocks whose window is wider than :data:`FIELD_CAP_BITS`, or that hold NaN/inf (or digits not in
canonical form), or whose window reaches the top digit's headroom, take the exact fallback
instead: their full 19-word LongAccs travel in a separate section of the same SUM buffer (the
plain ``det_all_reduce`` arithmetic). All-zero blocks send nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..profile import NDIGITS, STATUS_BITS, WORDS
from .longacc import det_normalize

__all__ = [
    "BLOCK",
    "FIELD_CAP_BITS",
    "WindowPlan",
    "element_bounds",
    "headroom_bits",
    "block_agreement",
    "plan_windows",
    "pack",
    "unpack",
    "carry_normalize",
]

# Elements per window. The agreement costs 8 bytes per block (0.03 per element at 256); on the
# ddp_step benchmark's gradients a block needs ~61 bits at 64 elements, ~62 at 256, ~70 at 4096.
BLOCK = 256
# Widest field the fast path packs: 8 chunks of 32 bits. Real gradients need 60-90 bits; the cap
# bounds the per-element work of the packing for everyone, and wider (adversarial) blocks go to
# the fallback.
FIELD_CAP_BITS = 256
TOP_BIT = 32 * NDIGITS - 1  # 575: the biased field's top bit must stay in digit 17's low 32 bits
_NONE = 1 << 20  # "no set bit" marker for lo (an all-zero block); bit indices stay below 640
_SPECIAL = 1 << 20  # top marker for a block holding NaN/inf on some rank (MAX keeps it)
_STATUS_CANON = 1 | (1 << STATUS_BITS) | (1 << 2 * STATUS_BITS)  # the bits a canonical status may set
_M32 = 0xFFFFFFFF
CHUNK_BLOCKS = 64  # blocks per chunk of rows: 16384 elements, ~2.5 MB of digits


def _bitlen32(x: torch.Tensor) -> torch.Tensor:
    """Bit length of int64 values in [0, 2^32): exact, since they convert to fp64 exactly."""
    return torch.frexp(x.double()).exponent.long()


def _bitlen63(x: torch.Tensor) -> torch.Tensor:
    """Bit length of int64 values in [0, 2^63), exact (fp64 would round values above 2^53)."""
    hi = x >> 32
    return torch.where(hi > 0, 32 + _bitlen32(hi), _bitlen32(x & _M32))


def _lowest_set_bit(d: torch.Tensor) -> torch.Tensor:
    """Index of the lowest set bit of digit rows (r, 18) int64, ``_NONE`` for all-zero rows: (r,)."""
    nz = d != 0
    first = nz.to(torch.int8).argmax(1)  # the first nonzero digit (0 when there is none)
    low = d.gather(1, first[:, None])[:, 0]
    low_bit = torch.frexp((low & -low).double()).exponent.long() - 1  # exact: a power of two
    return torch.where(low != 0, 32 * first + low_bit, _NONE)


def _sign_free(d: torch.Tensor) -> torch.Tensor:
    """Digits (r, 18) XOR their sign extension: non-negative; a negative value's leading ones vanish.

    Chunks 0..16 are XORed with 0xFFFFFFFF and the signed top digit with -1 when the value is
    negative, which is the bitwise NOT of the value (-v - 1 >= 0). The bit length of the result is
    the value's signed width: the smallest t with -2^t <= v < 2^t.
    """
    ext = torch.full((NDIGITS,), _M32, dtype=torch.int64, device=d.device)
    ext[-1] = -1
    return d ^ ((d[:, -1:] >> 63) & ext)


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative digit rows (r, 18) int64 (digit 17 below 2^63): (r,), 0 for zero."""
    last = NDIGITS - 1 - (x != 0).flip(1).to(torch.int8).argmax(1)  # 17 when all are zero
    top = x.gather(1, last[:, None])[:, 0]
    return torch.where(top != 0, 32 * last + _bitlen63(top), 0)


def element_bounds(acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element window of canonical LongAccs (a block's window is their min / max).

    Args:
        acc: canonical LongAcc, int64 (n, 19).

    Returns:
        (lo, top, special), each (n,): lo int64, the index of the lowest set bit of the value
        (``_NONE`` for zero); top int64, the smallest t with -2^t <= value < 2^t (0 for zero);
        special bool, a NaN/inf count is set.
    """
    d = acc[:, :NDIGITS]
    return _lowest_set_bit(d), _bit_length(_sign_free(d)), acc[:, NDIGITS] != 0


def _row_chunks(n: int, block: int):
    """(start, stop) row ranges of CHUNK_BLOCKS whole blocks each (the last may be shorter)."""
    step = CHUNK_BLOCKS * block
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _block_or(t: torch.Tensor, block: int) -> torch.Tensor:
    """Bitwise OR of every ``block`` consecutive rows of t (r, c) int64: (ceil(r / block), c).

    The lowest set bit of an OR is the lowest over its operands and its bit length the highest,
    so ORing digit rows gives a block's window with per-element work only in these ORs.
    """
    r, c = t.shape
    full = r // block
    parts = []
    for rows, count in ((t[: full * block], full), (t[full * block :], int(r % block > 0))):
        if not count:
            continue
        v = rows.reshape(count, -1, c)
        while v.shape[1] > 1:  # pairwise tree: each level halves the rows
            half = v.shape[1] // 2
            odd = v[:, 2 * half :]
            v = v[:, :half] | v[:, half : 2 * half]
            if odd.shape[1]:
                v[:, :1] |= odd
        parts.append(v[:, 0])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def block_agreement(acc: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """This rank's per-block window, ready for a MAX all-reduce.

    Args:
        acc: canonical LongAcc, int64 (n, 19), n >= 1.
        block: elements per block (the last block may be shorter).

    Returns:
        int32 (ceil(n / block), 2): column 0 is -lo_b (MAX over ranks gives the lowest bit),
        column 1 is top_b (the widest signed width), or ``_SPECIAL`` when the block holds a
        NaN/inf. An all-zero block has -lo_b = -_NONE and top_b = 0.
    """
    parts = []
    for s, e in _row_chunks(acc.shape[0], block):
        words = _block_or(acc[s:e], block)  # digits for lo, status word for NaN/inf
        top_b = _bit_length(_block_or(_sign_free(acc[s:e, :NDIGITS]), block))
        # The windows assume canonical digits: a block with any digit 0..16 outside [0, 2^32)
        # (an OR with bits above 31) or a non-canonical status word goes to the fallback too.
        odd = ((words[:, : NDIGITS - 1] >> 32) != 0).any(1) | ((words[:, NDIGITS] & ~_STATUS_CANON) != 0)
        top_b = torch.where((words[:, NDIGITS] != 0) | odd, _SPECIAL, top_b)
        parts.append(torch.stack([-_lowest_set_bit(words[:, :NDIGITS]), top_b], 1))
    return torch.cat(parts).to(torch.int32)


def headroom_bits(world: int) -> int:
    """h with 2^h >= world: the bits a SUM over ``world`` ranks can add to a non-negative field."""
    return max(0, (world - 1).bit_length())


@dataclass
class WindowPlan:
    """The payload layout every rank derives from the agreed windows (identical on every rank).

    Per block (all (nb,) tensors): ``lo_b`` (window's lowest bit), ``width_b`` (B, signed bits
    of one rank's window), ``start_b`` (the block's first bit in the limb stream, a multiple of
    L), ``fast_b`` (packed) and ``fallback_b`` (full digits). The fallback elements' rows
    (``fallback_rows``) travel as 19 words each after the ``fast_words`` limbs.
    """

    n: int
    block: int
    world: int
    head: int  # h: 2^h >= world
    limb_bits: int  # L = 63 - h, capped at 62
    lo_b: torch.Tensor
    width_b: torch.Tensor
    start_b: torch.Tensor
    fast_b: torch.Tensor
    fallback_b: torch.Tensor
    fallback_rows: torch.Tensor
    fast_words: int
    pack_chunks: int  # 32-bit chunks of the widest fast window B
    read_chunks: int  # 32-bit chunks of the widest fast field F = B + h

    @property
    def words(self) -> int:
        """int64 words of the SUM payload."""
        return self.fast_words + WORDS * int(self.fallback_rows.numel())

    @property
    def blocks(self) -> int:
        return int(self.fast_b.numel())

    @property
    def fast_blocks(self) -> int:
        return int(self.fast_b.sum())

    @property
    def fallback_blocks(self) -> int:
        return int(self.fallback_b.sum())


def plan_windows(agreed: torch.Tensor, n: int, world: int, block: int = BLOCK) -> WindowPlan:
    """The payload layout for ``n`` elements from the all-reduced :func:`block_agreement`.

    Args:
        agreed: int32 (ceil(n / block), 2), the MAX over all ranks.
        n: elements (>= 1); world: ranks in the SUM (sets the headroom); block: as agreed.
    """
    dev = agreed.device
    h = headroom_bits(world)
    L = min(62, 63 - h)
    lo_b = -agreed[:, 0].long()
    top_b = agreed[:, 1].long()
    special = top_b >= _SPECIAL
    empty = (lo_b >= _NONE) & ~special
    width_b = top_b - lo_b + 1
    field_b = width_b + h
    fast = ~special & ~empty & (field_b <= FIELD_CAP_BITS) & (top_b + h <= TOP_BIT)
    fallback = ~fast & ~empty
    nb = agreed.shape[0]
    count_b = torch.full((nb,), block, dtype=torch.int64, device=dev)
    count_b[-1] = n - (nb - 1) * block
    words_b = torch.where(fast, (count_b * field_b + L - 1) // L, 0)
    start_b = (torch.cumsum(words_b, 0) - words_b) * L  # every block starts on a limb boundary
    rows = (fallback.nonzero() * block + torch.arange(block, device=dev)).flatten()
    return WindowPlan(
        n=n, block=block, world=world, head=h, limb_bits=L, lo_b=lo_b, width_b=width_b, start_b=start_b,
        fast_b=fast, fallback_b=fallback, fallback_rows=rows[rows < n], fast_words=int(words_b.sum()),
        pack_chunks=int((torch.where(fast, width_b, 0).max() + 31) // 32),
        read_chunks=int((torch.where(fast, field_b, 0).max() + 31) // 32),
    )


def _fast_rows(plan: WindowPlan, s: int, e: int):
    """The packed elements among rows [s, e) (whole blocks) and their windows.

    Returns:
        (rows, lo, width, pos): rows, int64 local row indices, or None when all are packed;
        then per packed element (int64 (r,)): window's lowest bit, B, and its field's first
        bit in the limb stream.
    """
    dev = plan.lo_b.device
    elem = torch.arange(s, e, device=dev)
    blk = elem // plan.block
    b0 = s // plan.block
    fast = plan.fast_b[b0 : -(-e // plan.block)]
    rows = None
    if not bool(fast.all()):
        rows = fast[blk - b0].nonzero().flatten()
        elem, blk = elem[rows], blk[rows]
    width = plan.width_b[blk]
    pos = plan.start_b[blk] + (elem - blk * plan.block) * (width + plan.head)
    return rows, plan.lo_b[blk], width, pos


def _window_fields(d: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, m: int) -> torch.Tensor:
    """The biased fields (v >> lo) + 2^(B-1) as 32-bit chunks.

    Args:
        d: int64 (r, 19) canonical words of the packed elements; lo, width: (r,) windows.
        m: chunks to produce (>= ceil(max width / 32)).

    Returns:
        int64 (r, m), chunk k holds field bits [32k, 32k + 32); bits >= B are 0.
    """
    dev = d.device
    q, r = (lo // 32)[:, None], (lo % 32)[:, None]
    k = torch.arange(m, device=dev)
    # The window ends at bit top <= 575: bits read from a clamped index (past digit 17) or from
    # the signed top digit above its low 32 bits are masked off below; under that, the top
    # digit's bits are the value's two's complement bits.
    g = d.gather(1, (q + torch.arange(m + 1, device=dev)).clamp(max=NDIGITS - 1))
    c = (g[:, :m] >> r) | ((g[:, 1:] & ((1 << r) - 1)) << (32 - r))
    w = width[:, None]
    c = c & ((1 << (w - 32 * k).clamp(0, 32)) - 1)
    # +2^(B-1) on a B-bit two's complement number is a flip of its sign bit: no carries
    return c ^ torch.where(k == (w - 1) // 32, 1 << ((w - 1) % 32), 0)


def pack(acc: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """This rank's SUM payload.

    Args:
        acc: canonical LongAcc, int64 (n, 19), the same ``n`` the plan was made for.

    Returns:
        int64 (plan.words,): ``fast_words`` limbs in [0, 2^L) holding the fast fields, then the
        fallback elements' 19 words each.
    """
    L = plan.limb_bits
    out = torch.zeros(plan.words, dtype=torch.int64, device=acc.device)
    if plan.fast_words:
        last = plan.fast_words - 1
        k32 = 32 * torch.arange(plan.pack_chunks, device=acc.device)
        for s, e in _row_chunks(plan.n, plan.block):
            rows, lo, width, pos = _fast_rows(plan, s, e)
            if not lo.numel():
                continue
            d = acc[s:e] if rows is None else acc[s:e].index_select(0, rows)
            c = _window_fields(d, lo, width, plan.pack_chunks)
            p = pos[:, None] + k32
            j, off = p // L, p % L
            room = L - off  # a 32-bit chunk spans at most two limbs, as L >= 42
            # Fields occupy disjoint bits, so adding the pieces is OR-ing them. Clamped indices
            # only ever receive zeros (chunks past a field's B bits).
            out.index_add_(0, j.clamp(max=last).flatten(), ((c & ((1 << room) - 1)) << off).flatten())
            out.index_add_(0, (j + 1).clamp(max=last).flatten(), (c >> room).flatten())
    if plan.fallback_rows.numel():
        # normalized, so a SUM of up to MAX_WORLD_SIZE of them stays inside the headroom
        # whatever this rank brought (longacc.h: an out-of-range value travels as +-inf)
        out[plan.fast_words :] = det_normalize(acc.index_select(0, plan.fallback_rows)).flatten()
    return out


def carry_normalize(limbs: torch.Tensor, limb_bits: int) -> torch.Tensor:
    """Radix-2^L canonical form of a sum of limbs.

    Args:
        limbs: int64 (m,), m >= 1, non-negative, each < 2^(L + 21) and < 2^63 (a SUM of
            <= 2^h limbs below 2^L, L + h <= 63, h <= 21), least significant first.
        limb_bits: L <= 62.

    Returns:
        int64 (m,) in [0, 2^L), the same integer. Raises if it does not fit in m limbs (the
        layout guarantees it does).
    """
    L = limb_bits
    mask = (1 << L) - 1
    v = limbs & mask
    v[1:] += limbs[:-1] >> L  # now v < 2^L + 2^21: each limb passes on a carry of 0 or 1
    over = bool((limbs[-1] >> L) != 0)
    gen = v > mask
    if bool(gen.any()):  # rare: resolve 0/1 carries in parallel (carry-lookahead by cummax)
        decides = gen | (v != mask)  # a limb of exactly 2^L - 1 passes its incoming carry on
        idx = torch.arange(v.numel(), device=v.device)
        last = torch.cummax(torch.where(decides, idx, -1), 0).values
        carry_out = (last >= 0) & gen[last.clamp(min=0)]
        over = over or bool(carry_out[-1])
        v[1:] += carry_out[:-1].long()
        v &= mask
    if over:
        raise RuntimeError("carry_normalize: the sum does not fit the limbs (headroom violated)")
    return v


def _read_fields(limbs: torch.Tensor, pos: torch.Tensor, field: torch.Tensor, L: int, m: int) -> torch.Tensor:
    """Fields of ``field`` bits starting at stream bits ``pos`` (both (r,)), as 32-bit chunks (r, m)."""
    k = torch.arange(m, device=limbs.device)
    p = pos[:, None] + 32 * k
    j, off = p // L, p % L
    last = limbs.numel() - 1
    room = L - off
    a = limbs[j.clamp(max=last)] >> off
    b = (limbs[(j + 1).clamp(max=last)] & ((1 << (32 - room).clamp(min=0)) - 1)) << room.clamp(max=32)
    # bits past a field belong to the next field or to nothing: masking makes clamped reads harmless
    return (a | b) & _M32 & ((1 << (field[:, None] - 32 * k).clamp(0, 32)) - 1)


def _fields_to_words(c: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, world: int) -> torch.Tensor:
    """LongAcc words (r, 19), not canonical, of (field - W * 2^(B-1)) * 2^lo: the exact sums.

    Args:
        c: int64 (r, m) summed fields as 32-bit chunks; lo, width: (r,) windows; world: W.

    Each digit receives one piece below 2^32 and possibly the offset (below 2^(h + 32)), far
    inside the headroom det_normalize needs.
    """
    r_, m = c.shape
    dev = c.device
    q, r = (lo // 32)[:, None], (lo % 32)[:, None]
    # chunk k of the field moves to bits [32(q + k) + r, ...): split at 32 - r into two digits
    shifted = torch.zeros((r_, m + 1), dtype=torch.int64, device=dev)
    shifted[:, :m] = (c & ((1 << (32 - r)) - 1)) << r  # masked first: stays below 2^32
    shifted[:, 1:] |= c >> (32 - r)
    z = torch.zeros((r_, WORDS), dtype=torch.int64, device=dev)
    # A field's top bit is lo + F - 1 = top + h <= 575 (the plan's condition), so every piece
    # whose index gets clamped to digit 17 is zero. The status word stays 0 (no NaN/inf here).
    z.scatter_add_(1, (q + torch.arange(m + 1, device=dev)).clamp(max=NDIGITS - 1), shifted)
    bias = lo + width - 1  # bit of the offset 2^(B-1), times W
    z.scatter_add_(1, (bias // 32)[:, None], -(world << (bias % 32))[:, None])
    return z


def unpack(summed: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """The canonical summed LongAccs from the all-reduced payload.

    Args:
        summed: int64 (plan.words,), the SUM over ``plan.world`` ranks of :func:`pack` outputs.

    Returns:
        int64 (n, 19), canonical; zero for elements of all-zero blocks.
    """
    out = torch.empty((plan.n, WORDS), dtype=torch.int64, device=summed.device)
    limbs = carry_normalize(summed[: plan.fast_words], plan.limb_bits) if plan.fast_words else None
    for s, e in _row_chunks(plan.n, plan.block):
        if limbs is None:
            out[s:e].zero_()
            continue
        rows, lo, width, pos = _fast_rows(plan, s, e)
        if not lo.numel():
            out[s:e].zero_()
            continue
        c = _read_fields(limbs, pos, width + plan.head, plan.limb_bits, plan.read_chunks)
        words = det_normalize(_fields_to_words(c, lo, width, plan.world))
        if rows is None:
            out[s:e] = words
        else:
            out[s:e].zero_()
            out[s:e].index_copy_(0, rows, words)
    if plan.fallback_rows.numel():
        out[plan.fallback_rows] = det_normalize(summed[plan.fast_words :].view(-1, WORDS))
    return out
