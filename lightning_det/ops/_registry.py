"""The one bridge to the compiled ``ldet`` library: loading it, and every Python-side registration.

``ldet()`` builds/loads the core on first use and returns ``torch.ops.ldet``; the wrappers in
this package call the kernels through it. :func:`register` adds what the C++ schemas cannot
carry: a fake (meta) implementation per op, so ``torch.compile`` and fake-tensor tracing know
each output's shape and dtype, and the autograd formulas of ``ldet::gemm`` and ``ldet::act``.
It runs once, when the core loads (``_build.on_load``), so importing lightning_det never
triggers a build. It also checks that the compiled digit layout and profile match
:mod:`lightning_det.profile`.
"""
from __future__ import annotations

import torch

from .. import _build
from ..profile import LSB_EXP, NDIGITS, PROFILE, STATUS_BITS, WORDS

__all__ = ["ldet", "register"]


def ldet():
    """``torch.ops.ldet``, after building/loading the compiled core if needed."""
    _build.load()
    return torch.ops.ldet


def _register_longacc(lib: str) -> None:
    @torch.library.register_fake(lib + "gemm_partial")
    def _(x, w, bias=None, norm_interval=0, options=(-1, -1, 0)):
        return x.new_empty((x.shape[0], w.shape[0], WORDS), dtype=torch.int64)

    @torch.library.register_fake(lib + "gemm")
    def _(x, w, bias=None, out_dtype=None, options=(-1, -1, 0)):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype or torch.float32)

    @torch.library.register_fake(lib + "gemm_batched")
    def _(x, w, out_dtype=None, options=(-1, -1, 0)):
        return x.new_empty((x.shape[0], x.shape[1], w.shape[1]), dtype=out_dtype or torch.float32)

    @torch.library.register_fake(lib + "normalize")
    def _(acc):
        return torch.empty_like(acc)

    @torch.library.register_fake(lib + "finalize")
    def _(acc, dtype, scale_exp=0):
        return acc.new_empty(acc.shape[:-1], dtype=dtype)

    @torch.library.register_fake(lib + "to_digits")
    def _(x):
        return x.new_empty((*x.shape, WORDS), dtype=torch.int64)

    @torch.library.register_fake(lib + "scatter_sum")
    def _(a, index, n_out):
        return a.new_empty((n_out, a.shape[1], WORDS), dtype=torch.int64)

    from .linear import linear_backward  # the one exact-linear autograd formula, DetLinear's too

    def _gemm_setup(ctx, inputs, output):
        x, w, bias, out_dtype, plans = inputs
        ctx.save_for_backward(x, w, bias)
        ctx.plans = list(plans)

    def _gemm_backward(ctx, grad):
        x, w, bias = ctx.saved_tensors
        gx, gw, gb = linear_backward(grad, x, w, bias, ctx.needs_input_grad, ctx.plans)
        return gx, gw, gb, None, None

    torch.library.register_autograd(lib + "gemm", _gemm_backward, setup_context=_gemm_setup)


def _register_elementwise(lib: str) -> None:
    @torch.library.register_fake(lib + "act")
    def _(x, kind):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "act_backward")
    def _(grad, x, kind):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "act_fp64")
    def _(x, kind, grad=None):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "dot_rows")
    def _(a, b=None):
        return a.new_empty((a.shape[0], WORDS), dtype=torch.int64)

    @torch.library.register_fake(lib + "dot_cols")
    def _(a, b=None):
        return a.new_empty((a.shape[1], WORDS), dtype=torch.int64)

    @torch.library.register_fake(lib + "ce_row_loss")
    def _(m, picked, t_minus):
        return torch.empty_like(m)

    def _act_setup(ctx, inputs, output):
        x, kind = inputs
        ctx.save_for_backward(x)
        ctx.kind = kind

    def _act_backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.ldet.act_backward(grad.contiguous(), x, ctx.kind), None

    torch.library.register_autograd(lib + "act", _act_backward, setup_context=_act_setup)


def _register_norm(lib: str) -> None:
    @torch.library.register_fake(lib + "norm_forward")
    def _(x, weight, bias, eps, rms):
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                x.new_empty(x.shape, dtype=torch.float32), x.new_empty((x.shape[0],), dtype=torch.float32))

    @torch.library.register_fake(lib + "norm_backward")
    def _(gy, xhat, rstd, weight, rms, out_dtype):
        return gy.new_empty(gy.shape, dtype=out_dtype)


def _register_optim(lib: str) -> None:
    @torch.library.register_fake(lib + "sr_round_bf16")
    def _(x, seed, step, base_index):
        return torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "adamw_sr_step")
    def _(param, grad, exp_avg, exp_avg_sq, *args):
        return None


def _register_dropout(lib: str) -> None:
    @torch.library.register_fake(lib + "dropout_mask")
    def _(x, batch_dim, threshold, seed, step, offset, site):
        return torch.empty(x.shape, dtype=torch.bool, device=x.device)


def _register_attention(lib: str) -> None:
    @torch.library.register_fake(lib + "attention_fwd")
    def _(q, k, v, mask, scale, causal, dropout, dropout_mult):
        b, h, lq, _ = q.shape
        return (q.new_empty((b, h, lq, v.shape[3]), dtype=torch.float32),
                q.new_empty((b, h, lq, 2), dtype=torch.float32))

    @torch.library.register_fake(lib + "attention_bwd")
    def _(dout, q, k, v, o, stats, mask, scale, causal, dropout, dropout_mult):
        return (q.new_empty(q.shape, dtype=torch.float32), k.new_empty(k.shape, dtype=torch.float32),
                v.new_empty(v.shape, dtype=torch.float32))

    @torch.library.register_fake(lib + "attention_probs")
    def _(q, k, stats, mask, scale, causal):
        return q.new_empty((*q.shape[:3], k.shape[2]), dtype=torch.float32)


def _register_digest(lib: str) -> None:
    from .digest import CHUNK_BYTES

    @torch.library.register_fake(lib + "digest_chunks")
    def _(self):  # noqa: ANN001 - torch.library signature
        nbytes = self.numel() * self.element_size()
        return self.new_empty(((nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES,), dtype=torch.long)

    @torch.library.register_fake(lib + "digest_chunks_many")
    def _(tensors):  # noqa: ANN001 - torch.library signature
        total = sum((t.numel() * t.element_size() + CHUNK_BYTES - 1) // CHUNK_BYTES for t in tensors)
        return tensors[0].new_empty((total,), dtype=torch.long)


def _check_layout() -> None:
    layout = list(torch.ops.ldet.layout())
    expected = [NDIGITS, WORDS, LSB_EXP, STATUS_BITS]
    if layout[:4] != expected or torch.ops.ldet.profile() != PROFILE:
        raise _build.ExtensionError(
            f"compiled core layout {layout} / profile {torch.ops.ldet.profile()!r} does not match "
            f"the Python side {expected} / {PROFILE!r}: the build cache is stale; delete it"
        )


def register() -> None:
    """Every ``register_fake`` / ``register_autograd`` of the ldet ops, then the layout check.

    Called once by ``_build.load`` (the C++ schemas must exist first).
    """
    lib = "ldet::"
    _register_longacc(lib)
    _register_elementwise(lib)
    _register_norm(lib)
    _register_optim(lib)
    _register_digest(lib)
    _register_dropout(lib)
    _register_attention(lib)
    _check_layout()


_build.on_load(register)
