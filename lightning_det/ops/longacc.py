"""Exact long-accumulator ops: thin, checked wrappers over the compiled ``ldet`` kernels.

``LongAcc`` is a plain ``torch.int64`` tensor with a trailing dimension of 19 words: 18 signed
radix-2^32 digits (value = sum_i d_i * 2^(32 i - 298)) and one status word counting NaN, +inf and
-inf contributions. Ops return it in canonical (normalized) form, so equal values have equal
bytes. Adding LongAccs word by word (``det_combine``, an int64 SUM all-reduce) is exact. The
format is profile ``ldet-v1``; ``csrc/longacc.h`` documents it, with the headroom bounds and the
IEEE rules.

All ops dispatch on the device of their inputs (CPU always; CUDA where the CUDA kernels were
built) and give the same bytes on both.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
from typing import Iterable, Iterator, Optional, Sequence

import torch

from .. import _build
from .args import as_index
from ..profile import COMBINE_MAX, WORDS
from ._registry import ldet as _ops

__all__ = [
    "LongAcc",
    "det_gemm",
    "det_gemm_partial",
    "det_combine",
    "det_finalize",
    "det_normalize",
    "GemmPlan",
    "explain_gemm",
    "gemm_path",
    "last_gemm_plan",
    "last_fp64_counts",
    "last_slices_plan",
    "scatter_sum_digits",
    "to_digits",
]

LongAcc = torch.Tensor  # int64, shape (..., 19); see the module docstring

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type == "cuda" and not _build.cuda_built():
        raise RuntimeError(
            f"{name}: is on {t.device}, but lightning_det was built without its CUDA kernels "
            "(torch has no CUDA, nvcc was not found, or LIGHTNING_DET_NO_CUDA=1)."
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got device {t.device}")


def _check_float(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    _check_device(t, name)


def check_acc(acc, name: str = "acc") -> None:
    """Raises unless ``acc`` is a LongAcc: int64 with a trailing dimension of 19."""
    if not isinstance(acc, torch.Tensor):
        raise TypeError(f"{name}: expected a LongAcc (int64 tensor), got {type(acc).__name__}")
    if acc.dtype != torch.int64:
        raise TypeError(f"{name}: expected a LongAcc of dtype torch.int64, got {acc.dtype}")
    if acc.dim() < 1 or acc.shape[-1] != WORDS:
        raise ValueError(
            f"{name}: expected a LongAcc with a trailing dimension of {WORDS} words, got shape "
            f"{tuple(acc.shape)}"
        )
    _check_device(acc, name)


def _gemm_args(x, w, bias):
    _check_float(x, "x")
    _check_float(w, "w")
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D (N, K) tensor in nn.Linear layout, got shape {tuple(w.shape)}")
    if x.dim() < 1:
        raise ValueError(f"x: expected shape (..., K) with at least one dimension, got shape {tuple(x.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"w: expected K = {x.shape[-1]} columns to match x's last dimension, got w of shape "
            f"{tuple(w.shape)} (x is {tuple(x.shape)})"
        )
    if w.device != x.device:
        raise ValueError(f"w: expected device {x.device} to match x, got {w.device}")
    if bias is not None:
        _check_float(bias, "bias")
        if bias.shape != (w.shape[0],):
            raise ValueError(f"bias: expected shape ({w.shape[0]},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias: expected device {x.device} to match x, got {bias.device}")
    lead = tuple(x.shape[:-1])
    rows = 1
    for d in lead:
        rows *= d
    return x.reshape(rows, x.shape[-1]), lead


def det_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: torch.dtype = torch.float32,
    plans="default",
    route: Optional[str] = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)``: the exact sum of exact products, rounded once to nearest-even.

    Args:
        x: (..., K) float32 / bfloat16 / float16.
        w: (N, K) in ``nn.Linear`` layout, float32 / bfloat16 / float16.
        bias: optional (N,), added inside the accumulator before the one rounding.
        out_dtype: float32 (default), bfloat16 or float16; rounded straight to it.
        plans: how the integer-slice route plans this call: ``"default"``, ``"cached"``,
            ``"sync"`` or ``(slices_x, slices_w)`` (see ``_plans_arg``). The bytes never depend
            on it; det_ddp passes its ``gemm_plans`` mode through the step state.
        route: the exact route, as :func:`gemm_path` names them (``None``: the enclosing
            ``gemm_path`` block's, else ``"auto"``). The bytes never depend on it either;
            :func:`explain_gemm` says which route ``"auto"`` takes and why.

    Returns:
        (..., N) tensor of ``out_dtype``. Row i does not depend on the other rows, K-splits,
        tiling, thread count or device.
    """
    x2, lead = _gemm_args(x, w, bias)
    if out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}")
    y = _ops().gemm(x2, w, bias, out_dtype, _plans_arg(plans, route))
    return y.reshape(*lead, w.shape[0])


def det_bmm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    plans="default",
    route: Optional[str] = None,
) -> torch.Tensor:
    """``a @ b.transpose(-1, -2)`` slice by slice: every slice's exact sums, rounded once.

    Args:
        a: (..., M, K) float32 / bfloat16 / float16.
        b: (..., N, K), the same leading dimensions as ``a`` (``b`` holds its rows as
            :func:`det_gemm`'s ``w`` does).
        out_dtype: float32 (default), bfloat16 or float16; rounded straight to it.
        plans, route: as :func:`det_gemm`'s. On CUDA, ``"auto"`` and ``"kernel"`` run every
            slice in one launch of the long-accumulator kernel; other routes run slice by slice.

    Returns:
        (..., M, N) tensor of ``out_dtype``: slice ``i`` is ``det_gemm(a[i], b[i])`` byte for
        byte, whatever the other slices and their number.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name}: expected shape (..., rows, K) with at least 2 dimensions, got {tuple(t.shape)}")
    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"b: expected shape (..., N, K) with leading dims {tuple(a.shape[:-2])} and K = {a.shape[-1]} "
                         f"to match a, got {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"b: expected device {a.device} to match a, got {b.device}")
    if out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}")
    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-2]
    slices = math.prod(lead)
    y = _ops().gemm_batched(a.reshape(slices, m, k), b.reshape(slices, n, k), out_dtype, _plans_arg(plans, route))
    return y.reshape(*lead, m, n)


_ROUTES = {"auto": 0, "kernel": 1, "slices": 2, "slices_diagonals": 3, "slices_crt": 4, "fp64": 5}

# The route of the enclosing gemm_path block, read once per call by _plans_arg and passed to the
# op as an argument. A ContextVar: scoped to the block and to its own thread / asyncio task, so
# one thread's block never routes another thread's GEMMs.
_ROUTE_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar("lightning_det_gemm_route", default="auto")


def _route_name(route) -> str:
    if route is None:
        return _ROUTE_SCOPE.get()
    if not isinstance(route, str) or route not in _ROUTES:
        raise ValueError(f"route: expected one of {sorted(_ROUTES)}, got {route!r}")
    return route


@contextlib.contextmanager
def gemm_path(path: str) -> Iterator[None]:
    """Routes the exact GEMMs called inside the ``with`` block (det_gemm, det_gemm_partial and
    the modules built on them) through one exact path, in this thread (or asyncio task) only.

    The route reaches the compiled op as an argument of each call (``route=`` of
    :func:`det_gemm` passes it directly); nothing process-wide is set.

    Args:
        path: ``"auto"`` (the default outside any block: the planner's cheapest route for the
            call's device, dtypes and shape, csrc/gemm_plan.h; :func:`explain_gemm` says which
            and why), ``"kernel"`` (the long-accumulator kernel only) or ``"slices"`` (int8 slice
            GEMMs whenever the inputs allow; rows they cannot hold exactly still go to the
            kernel), ``"slices_diagonals"`` / ``"slices_crt"`` (the slices, their products formed
            by one GEMM per diagonal of slice pairs, or by one GEMM per modulus of a residue number
            system (Chinese remainder theorem) where the moduli cover the products;
            :func:`last_slices_plan` says which ran), ``"fp64"`` (rounded outputs from one fp64
            GEMM whose proven error bound decides each output's rounding; the few it cannot
            decide are recomputed from the operands, csrc/fp64_bound.h; digits outputs then go as
            under "auto": :func:`last_fp64_counts`).

    Every path returns the same bytes (the exact sum rounded once); the switch exists so tests and
    benchmarks can compare them.
    """
    if not isinstance(path, str) or path not in _ROUTES:
        raise ValueError(f"path: expected one of {sorted(_ROUTES)}, got {path!r}")
    token = _ROUTE_SCOPE.set(path)
    try:
        yield
    finally:
        _ROUTE_SCOPE.reset(token)


_GUESS_MODES = {"default": -1, "cached": -2, "sync": 0}
_SLICE_MAX = 8  # csrc/int_slices.h kSliceMax


def _plans_arg(plans, route=None) -> list:
    """The ops' ``options`` argument ``[plan_x, plan_w, route]``: how the integer-slice route
    plans one GEMM, and the route (``route`` as :func:`det_gemm`'s; ``None``: the enclosing
    :func:`gemm_path` block's, else auto).

    The plan (int8 slices per value of x and of w) comes from both operands' row summaries, which
    live on the operands' device: reading them synchronizes the host with the GPU once per GEMM.
    With a *guessed* plan the GEMM reads no summary: rows that need more slices than guessed are
    recomputed on the device straight from the operands, and the 128-bit combine checks its
    proof there, so the bytes are the same under every value (csrc/int_slices_host.h, "Guessed
    plans").

    ``plans``: ``"default"`` (the device's default: plans from the summaries, on the CPU and on
    CUDA), ``"cached"`` (a call takes the largest plan of the last few calls with the same
    shapes, dtypes and device, after a first call that plans from its summaries), ``"sync"``
    (the call plans from its own summaries), or a tuple ``(slices_x, slices_w)`` of ints in
    [1, 8]: that guess (tests: guesses too small and too large).
    """
    code = _ROUTES[_route_name(route)]
    if isinstance(plans, tuple):
        ok = len(plans) == 2 and all(type(v) is int and 1 <= v <= _SLICE_MAX for v in plans)
        if not ok:
            raise ValueError(f"plans: expected a tuple of two slice counts in [1, {_SLICE_MAX}], got {plans!r}")
        return [*plans, code]
    if isinstance(plans, str) and plans in _GUESS_MODES:
        return [_GUESS_MODES[plans]] * 2 + [code]
    raise ValueError(f"plans: expected one of {sorted(_GUESS_MODES)} or a tuple (slices_x, slices_w), got {plans!r}")


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """Which exact route a GEMM takes and why (csrc/gemm_plan.h, the one planner).

    ``route`` is ``"kernel"``, ``"slices"`` or ``"fp64"``; ``route_reason`` says why (forced, or
    auto's least cost from the cost table, ``cost_*`` and ``cost_source``; the slices may hand a
    call with a wide exponent spread back to the kernel); ``fallback`` what handles what the
    route cannot. For the slices: ``slices_x`` / ``slices_w`` (int8 digits per value),
    ``moduli`` (CRT moduli; 0: one GEMM per diagonal of slice pairs), ``way_reason`` and
    ``counts_reason``, ``residues_*``, ``kernel_rows_*`` (rows left to the kernel), K- and
    N-chunks, and ``fields["slices_transposed"]`` (a rounded call ran as C^T = w x^T, x's rows
    in chunks: a tall x would leave w's chunks narrow). ``fields`` holds every field the planner
    printed.
    """

    route: str
    route_reason: str
    fallback: str
    device: str
    inputs: str
    output: str
    slices_x: int
    slices_w: int
    moduli: int
    way_reason: str
    counts_reason: str
    fields: dict

    @property
    def slices_way(self) -> Optional[str]:
        """``"crt"`` or ``"diagonals"`` when the route is the slices, else None."""
        if self.route != "slices":
            return None
        return "crt" if self.moduli > 0 else "diagonals"


def _plan_from_json(text: str) -> GemmPlan:
    d = json.loads(text)
    names = [f.name for f in dataclasses.fields(GemmPlan) if f.name != "fields"]
    return GemmPlan(**{k: d[k] for k in names}, fields=d)


def explain_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    output: str = "rounded",
    plans="default",
    route: Optional[str] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> GemmPlan:
    """The plan :func:`det_gemm` (``output="rounded"``) or :func:`det_gemm_partial`
    (``output="digits"``) would run for these operands without a bias, with the reason for every
    choice.

    Runs the planner only; for the slices it also reads both operands' row summaries (their
    exponent ranges, one pass over the data), as the call itself would. With ``plans="cached"``
    a call may take larger slice counts than shown (a guess); never different bytes.

    Args:
        x: (..., K), w: (N, K), as :func:`det_gemm`'s.
        output: ``"rounded"`` or ``"digits"``.
        plans, route: as :func:`det_gemm`'s.
        out_dtype: the rounded outputs' dtype, as :func:`det_gemm`'s (None: float32); the route
            may depend on it (``fields["out16"]``).
    """
    x2, _ = _gemm_args(x, w, None)
    _check_output(output, out_dtype)
    return _plan_from_json(_ops().explain_gemm(x2, w, output == "digits", _plans_arg(plans, route), out_dtype))


def _check_output(output: str, out_dtype) -> None:
    if output not in ("rounded", "digits"):
        raise ValueError(f"output: expected 'rounded' or 'digits', got {output!r}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, got {out_dtype!r}")
    if output == "digits" and out_dtype is not None:
        raise ValueError(f"out_dtype: digits outputs are not rounded, expected None, got {out_dtype}")


_PLAN_DEVICES = ("cpu", "cpu-avx512", "cuda")


def plan_gemm(M: int, N: int, K: int, dtype: torch.dtype = torch.float32, *, w_dtype: Optional[torch.dtype] = None,
              device: str = "cpu", output: str = "rounded", route: Optional[str] = None,
              out_dtype: Optional[torch.dtype] = None) -> GemmPlan:
    """The route a det_gemm (``output="rounded"``) or det_gemm_partial (``output="digits"``) of
    x (M, K) by w (N, K) starts on, from the shape, the dtypes, the device class and the route
    alone: the planner's first stage (csrc/gemm_plan.h, ``plan_gemm``), a pure function of its
    arguments, so any machine can ask what a GPU would choose.

    The cost table decides it (``cost_*``, ``cost_source``). What depends on the data is not
    planned here: a wide exponent spread may send the kernel's or the slices' calls to the fp64
    route, and the slices' counts come from the operands (:func:`explain_gemm` runs those
    stages on real operands; :func:`last_gemm_plan` shows what ran).

    Args:
        M, N, K: the GEMM's sizes (>= 0).
        dtype: x's dtype (float32, bfloat16 or float16); ``w_dtype``: w's (default: x's).
        device: the device class, ``"cpu"`` (without the AVX-512 slice forms), ``"cpu-avx512"`` or
            ``"cuda"``.
        output: ``"rounded"`` or ``"digits"``; ``out_dtype``: the rounded outputs' dtype (None:
            float32): on CUDA, 16-bit inputs rounded to 16 bits take their own cost rows.
        route: as :func:`det_gemm`'s (None: the enclosing :func:`gemm_path` block's, else auto).
    """
    sizes = [as_index(v) for v in (M, N, K)]
    if any(v is None or v < 0 for v in sizes):
        raise ValueError(f"M, N, K: expected integers >= 0, got {(M, N, K)!r}")
    w_dtype = dtype if w_dtype is None else w_dtype
    for name, t in (("dtype", dtype), ("w_dtype", w_dtype)):
        if t not in _FLOATS:
            raise TypeError(f"{name}: expected torch.float32, torch.bfloat16 or torch.float16, got {t!r}")
    if device not in _PLAN_DEVICES:
        raise ValueError(f"device: expected one of {list(_PLAN_DEVICES)}, got {device!r}")
    _check_output(output, out_dtype)
    return _plan_from_json(_ops().plan_gemm_shape(*sizes, dtype, w_dtype, device, output == "digits",
                                                  _plans_arg("default", route), out_dtype))


def last_gemm_plan() -> GemmPlan:
    """The plan this thread's last det_gemm / det_gemm_partial ran, as executed (the slices'
    counts included); the same fields as :func:`explain_gemm`'s. For tests and benchmarks."""
    return _plan_from_json(_ops().last_gemm_plan())


def last_slices_plan() -> dict:
    """How this thread's last det_gemm / det_gemm_partial on the integer slices was cut.

    Returns a dict: ``slices_x``, ``slices_w`` (int8 digits per value of x and of w),
    ``residues_x``, ``residues_w`` (values kept out of the digits, whose products the combine adds
    exactly, csrc/int_slices.h), ``kernel_rows_x``, ``kernel_rows_w`` (rows left to the
    long-accumulator kernel) and ``moduli`` (int8 GEMMs of the CRT route, csrc/crt.h; 0: one
    GEMM per diagonal of slice pairs). All zeros before any such call; -1 for the four counts after a
    guessed plan (a ``plans`` argument other than "sync"), which does not wait for them. For tests and benchmarks:
    the bytes of a result never depend on it.
    """
    keys = ("slices_x", "slices_w", "residues_x", "residues_w", "kernel_rows_x", "kernel_rows_w", "moduli")
    return dict(zip(keys, (int(v) for v in _ops().last_slices_plan())))


def last_fp64_counts() -> dict:
    """How this thread's last rounded det_gemm on the fp64 route went (csrc/fp64_bound.h).

    Returns a dict: ``undecided`` (outputs whose rounding the fp64 GEMM's error bound could not
    decide, recomputed from the operands by an fp64 sum of known depth) and ``exact`` (of those,
    the ones that sum could not decide and no certificate proved it exact either, left to the long
    accumulator). Zeros when this thread's last rounded det_gemm took another route.
    Reading it waits for the GPU. For tests and benchmarks: the bytes never depend on it.
    """
    return dict(zip(("undecided", "exact"), (int(v) for v in _ops().last_fp64_counts())))


def det_gemm_partial(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *, plans="default",
    route: Optional[str] = None, _norm_interval: int = 0
) -> LongAcc:
    """The unrounded ``x @ w.T (+ bias)`` as canonical digits.

    Args:
        x: (..., K), w: (N, K), bias: optional (N,); float32 / bfloat16 / float16.
        plans, route: as :func:`det_gemm`'s.

    Returns:
        LongAcc of shape (..., N, 19), int64. Combine partials over any K-split with
        :func:`det_combine`, round with :func:`det_finalize`.
    """
    x2, lead = _gemm_args(x, w, bias)
    if _norm_interval < 0:
        raise ValueError(f"_norm_interval: expected >= 0, got {_norm_interval}")
    acc = _ops().gemm_partial(x2, w, bias, _norm_interval, _plans_arg(plans, route))
    return acc.reshape(*lead, w.shape[0], WORDS)


def det_normalize(acc: LongAcc) -> LongAcc:
    """Canonical form of a LongAcc (carry propagation), for any int64 words; a value beyond the
    format's range becomes +-inf (csrc/longacc.h, "Range")."""
    check_acc(acc)
    return _ops().normalize(acc)


def det_combine(accs: Sequence[LongAcc] | Iterable[LongAcc]) -> LongAcc:
    """Exact sum of LongAccs of one shape (e.g. partials over K-shards), canonical.

    Args:
        accs: a non-empty sequence of int64 (..., 19) tensors of the same shape and device,
            any number of them, canonical or not.

    The result is the same for any order and grouping of ``accs``. A sum out of the format's
    range (csrc/longacc.h) is +-inf, as is any input out of range.
    """
    accs = list(accs)
    if not accs:
        raise ValueError("accs: expected at least one LongAcc, got an empty sequence")
    checked = set()  # det_combine([acc] * n) checks acc once
    for i, a in enumerate(accs):
        if id(a) in checked:
            continue
        check_acc(a, f"accs[{i}]")
        if a.shape != accs[0].shape:
            raise ValueError(f"accs[{i}]: expected shape {tuple(accs[0].shape)} like accs[0], got {tuple(a.shape)}")
        if a.device != accs[0].device:
            raise ValueError(f"accs[{i}]: expected device {accs[0].device} like accs[0], got {a.device}")
        checked.add(id(a))
    # Inputs are normalized first (canonical inputs are unchanged; any others, out-of-range ones
    # included, become canonical), then added onto the canonical total, which is normalized
    # after every COMBINE_MAX - 1 inputs: no sum crosses a headroom bound of longacc.h. A run
    # of one tensor repeated m times adds m times its canonical words (exact integers).
    ops = _ops()
    total, pending = ops.normalize(accs[0]), 0
    for a, count in _runs(accs[1:]):
        canon = ops.normalize(a)
        while count:
            m = min(count, COMBINE_MAX - 1 - pending)
            total = total + (canon if m == 1 else canon * m)
            count, pending = count - m, pending + m
            if pending == COMBINE_MAX - 1:
                total, pending = ops.normalize(total), 0
    return ops.normalize(total) if pending else total


def _runs(accs: list) -> list:
    """[tensor, count] for each run of consecutive identical tensor objects."""
    runs: list = []
    for a in accs:
        if runs and runs[-1][0] is a:
            runs[-1][1] += 1
        else:
            runs.append([a, 1])
    return runs


def det_finalize(acc: LongAcc, dtype: torch.dtype = torch.float32, *, scale_exp: int = 0) -> torch.Tensor:
    """Rounds a LongAcc (times ``2**scale_exp``) once, to nearest-even, to ``dtype``.

    Args:
        acc: int64 (..., 19).
        dtype: torch.float32 (default), torch.bfloat16 or torch.float16.
        scale_exp: integer in [-64, 0]; the exact value is divided by ``2**-scale_exp`` before
            the one rounding (a mean over a power-of-two count without a second rounding).

    Returns:
        (...) tensor of ``dtype``. NaN if any NaN, inf x 0 or +inf with -inf went in; +-inf for
        same-signed infinities or a finite sum beyond the format's range; exact zero is +0.0.
    """
    check_acc(acc)
    if dtype not in _FLOATS:
        raise TypeError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    exp = as_index(scale_exp)  # Python or NumPy integer
    if exp is None or not -64 <= exp <= 0:
        raise ValueError(f"scale_exp: expected an integer in [-64, 0], got {scale_exp!r}")
    return _ops().finalize(acc, dtype, exp)


def to_digits(x: torch.Tensor) -> LongAcc:
    """Exact LongAcc of every element of ``x`` (float32 / bfloat16 / float16): shape (..., 19)."""
    _check_float(x, "x")
    return _ops().to_digits(x)


def scatter_sum_digits(a: torch.Tensor, index: torch.Tensor, n_out: int) -> LongAcc:
    """Exact sums of the rows of ``a`` grouped by ``index``, as canonical digits.

    ``out[g, j]`` = the exact sum of ``a[r, j]`` over the rows ``r`` with ``index[r] == g``
    (an embedding's weight gradient, a segment sum). Exact, so the row order, the batch split
    and the device never show in the bytes; no ``(R, W, 19)`` temporary is made.

    Args:
        a: (R, W) float32 / bfloat16 / float16.
        index: (R,) int64, every value in ``[0, n_out)`` (on CUDA checked by a device-side assert).
        n_out: number of output rows (>= 0).

    Returns:
        LongAcc (n_out, W, 19), canonical; rows that no index names are exact zeros.
    """
    _check_float(a, "a")
    _check_device(a, "a")
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64:
        raise TypeError(f"index: expected an int64 torch.Tensor, got {getattr(index, 'dtype', type(index).__name__)}")
    if not isinstance(n_out, int) or n_out < 0:
        raise ValueError(f"n_out: expected an integer >= 0, got {n_out!r}")
    if a.dim() != 2:
        raise ValueError(f"a: expected a 2-D (rows, width) tensor, got shape {tuple(a.shape)}")
    if index.dim() != 1 or index.shape[0] != a.shape[0]:
        raise ValueError(f"index: expected shape ({a.shape[0]},) (one per row of a), got {tuple(index.shape)}")
    if index.device != a.device:
        raise ValueError(f"index: expected device {a.device} like a, got {index.device}")
    if index.device.type == "cpu" and index.numel() and (int(index.min()) < 0 or int(index.max()) >= n_out):
        bad = int(index[(index < 0) | (index >= n_out)][0])
        raise ValueError(f"index: expected values in [0, {n_out}), got {bad}")
    return _ops().scatter_sum(a, index, n_out)
