"""nn.MultiheadAttention and PyTorch's Transformer layers with exact arithmetic.

:class:`DetMultiheadAttention` is a subclass of ``nn.MultiheadAttention`` with the same
constructor, Parameters and ``state_dict`` keys (``in_proj_weight``, ``in_proj_bias``, or
``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when kdim/vdim differ from embed_dim, and
``out_proj.weight``/``out_proj.bias``), so checkpoints move both ways. det_transform swaps an
``nn.MultiheadAttention`` into it in place (``out_proj``, a ``NonDynamicallyQuantizableLinear``,
becomes a DetLinear). Its forward has ``nn.MultiheadAttention.forward``'s signature and semantics
(batch_first either way, unbatched inputs, ``key_padding_mask`` and ``attn_mask`` bool or float,
``is_causal``, ``need_weights`` with ``average_attn_weights``, ``add_zero_attn``, bias on or off):

- the input projections are exact GEMMs with the bias inside the accumulator, rounded once per
  element; when query, key and value are one tensor (self-attention), its gradient is one exact sum
  over all three projections, rounded once; dW and db are exact sums over every row (digits in
  digit mode, as DetLinear's);
- the attention is the fused deterministic attention
  (:func:`~lightning_det.nn.det_scaled_dot_product_attention`) on the (N, H, L, E/H) heads with
  PyTorch's merged mask (key padding and attn_mask as one float mask, or the causal mask), and
  ``dropout_p = self.dropout`` in training with a keyed mask (:mod:`.dropout`);
- the weights, when asked for, are the kernel's own (``attention_probs`` of the same call: the
  values its output was formed from), after dropout as PyTorch returns them; the average over
  heads is an exact sum divided by the head count;
- the output projection is ``out_proj`` (a DetLinear).

Not supported: ``add_bias_kv=True`` (bias_k and bias_v are broadcast over the batch, so their
gradient would be a float sum over it); det_transform raises naming it.

:class:`DetTransformerEncoderLayer`, :class:`DetTransformerEncoder` and
:class:`DetTransformerDecoderLayer` are the PyTorch classes without their inference fast path
(``torch._transformer_encoder_layer_fwd`` and nested tensors, which would compute with the raw
weights outside the exact modules, in eval or under no_grad); their ``"gelu"`` activation
function becomes :func:`~lightning_det.nn.det_gelu`. Everything else is the PyTorch code path.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len

from ..ops import det_finalize, det_gemm, det_gemm_partial
from ..ops.trust import trusted_fn
from ..ops.attention import AttentionDropout, attention_probs
from ..ops.dropout import dropout_multiplier
from .attention import fused_attention
from .conv1d import _float_dtype
from .conv1d import _param_grad as _contribute
from .dropout import FUNCTIONAL_SITE, dropout_key
from .functional import det_col_sums, det_gelu, det_row_sums, div_by_count
from .linear import DetLinear
from .step_state import StepState

__all__ = [
    "DetMultiheadAttention", "DetTransformerEncoderLayer", "DetTransformerEncoder", "DetTransformerDecoderLayer",
    "TRANSFORMER_SWAPS",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _DetInProjection(torch.autograd.Function):
    """q, k, v = x_i @ W_i^T + b_i for the three slots; W_i slices of one packed weight or three."""

    @staticmethod
    @trusted_fn
    def forward(ctx, xq, xk, xv, w0, w1, w2, bias, leaders, state, plans):
        xs = (xq, xk, xv)
        packed = w1 is None
        e = w0.shape[0] // 3 if packed else w0.shape[0]
        ws = tuple(w0[i * e:(i + 1) * e] for i in range(3)) if packed else (w0, w1, w2)
        bs = (None,) * 3 if bias is None else tuple(bias[i * e:(i + 1) * e] for i in range(3))
        outs = tuple(det_gemm(x, w, b, out_dtype=_float_dtype(x.dtype), plans=plans) for x, w, b in zip(xs, ws, bs))
        ctx.save_for_backward(xq, xk, xv)
        ctx.params = (w0, w1, w2, bias)  # the state keys gradients by the Parameter objects
        ctx.ws, ctx.e, ctx.packed, ctx.leaders, ctx.state, ctx.plans = ws, e, packed, leaders, state, plans
        return outs

    @staticmethod
    @trusted_fn
    def backward(ctx, gq, gk, gv):
        xs = ctx.saved_tensors
        gs = (gq, gk, gv)
        ws, state, plans = ctx.ws, ctx.state, ctx.plans
        w0, w1, w2, bias = ctx.params
        gx = [None, None, None]
        for lead in sorted(set(ctx.leaders)):
            if not ctx.needs_input_grad[lead]:
                continue
            slots = [i for i in range(3) if ctx.leaders[i] == lead]
            # a tensor used as several of query/key/value: one exact sum over all its projections
            g = torch.cat([gs[i] for i in slots], dim=1) if len(slots) > 1 else gs[lead]
            w = torch.cat([ws[i] for i in slots], dim=0) if len(slots) > 1 else ws[lead]
            gx[lead] = det_gemm(g, w.t(), out_dtype=_float_dtype(xs[lead].dtype), plans=plans)
        pairs = [(gs[i].t(), xs[i].t()) for i in range(3)]
        gw = [None, None, None]
        if ctx.packed:
            if ctx.needs_input_grad[3]:
                w_dtype = _float_dtype(w0.dtype)
                gw[0] = _contribute(
                    state, w0, lambda: torch.cat([det_gemm_partial(g, x, plans=plans) for g, x in pairs]),
                    lambda: torch.cat([det_gemm(g, x, out_dtype=w_dtype, plans=plans) for g, x in pairs]))
        else:
            for i, w in enumerate((w0, w1, w2)):
                if ctx.needs_input_grad[3 + i]:
                    g, x = pairs[i]
                    dt = _float_dtype(w.dtype)
                    gw[i] = _contribute(state, w, lambda g=g, x=x: det_gemm_partial(g, x, plans=plans),
                                        lambda g=g, x=x, dt=dt: det_gemm(g, x, out_dtype=dt, plans=plans))
        gb = None
        if bias is not None and ctx.needs_input_grad[6]:
            digits = lambda: torch.cat([det_col_sums(g) for g in gs])  # noqa: E731
            gb = _contribute(state, bias, digits, lambda: det_finalize(digits(), _float_dtype(bias.dtype)))
        return gx[0], gx[1], gx[2], gw[0], gw[1], gw[2], gb, None, None, None


class _DetHeadMean(torch.autograd.Function):
    """(N, H, L, S) -> (N, L, S): round(exact sum over heads) / H."""

    @staticmethod
    @trusted_fn
    def forward(ctx, w):
        n, h, l, s = w.shape
        rows = w.float().permute(0, 2, 3, 1).reshape(n * l * s, h)
        ctx.h = h
        return div_by_count(det_finalize(det_row_sums(rows)).reshape(n, l, s), h).to(w.dtype)

    @staticmethod
    @trusted_fn
    def backward(ctx, g):
        return div_by_count(g, ctx.h).unsqueeze(1).expand(g.shape[0], ctx.h, *g.shape[1:]).contiguous()


class DetMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with exact projections and det attention (module docstring).

    Args: as ``nn.MultiheadAttention`` (``add_bias_kv`` must be False). Shapes and returns: as
    ``nn.MultiheadAttention.forward``; float32, bfloat16 or float16 inputs.
    """

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_mha_options(self)
        self.out_proj.__class__ = DetLinear

    @classmethod
    def from_mha(cls, module: nn.MultiheadAttention) -> "DetMultiheadAttention":
        """Turns an ``nn.MultiheadAttention`` into a DetMultiheadAttention in place (same Parameters)."""
        check_mha_options(module)
        module.__class__ = cls
        if type(module.out_proj) is not DetLinear and isinstance(module.out_proj, nn.Linear):
            if type(module.out_proj).forward is nn.Linear.forward:
                module.out_proj.__class__ = DetLinear
        return module

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS:
                raise TypeError(f"{name}: expected a float32/bfloat16/float16 tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.is_nested:
                raise ValueError(f"{name}: nested tensors are not supported by DetMultiheadAttention; pass a padded "
                                 "tensor and key_padding_mask")
        batched = query.dim() == 3
        want = 3 if batched else 2
        for name, t in (("key", key), ("value", value)):
            if t.dim() != want:
                raise ValueError(f"{name}: expected a {want}-D tensor like query {tuple(query.shape)}, "
                                 f"got shape {tuple(t.shape)}")
        if query.dim() not in (2, 3):
            raise ValueError(f"query: expected (L, E) or a batched 3-D tensor, got shape {tuple(query.shape)}")
        leaders = (0, 0 if key is query else 1, 0 if value is query else (1 if value is key else 2))

        # to (N, L, E) internally
        def batch_major(t):
            if not batched:
                return t.unsqueeze(0)
            return t if self.batch_first else t.transpose(0, 1)

        q_in, k_in, v_in = batch_major(query), batch_major(key), batch_major(value)
        n, tgt, e = q_in.shape
        src = k_in.shape[1]
        if e != self.embed_dim:
            raise ValueError(f"query: expected last dimension embed_dim={self.embed_dim}, "
                             f"got shape {tuple(query.shape)}")
        if k_in.shape[:2] != v_in.shape[:2] or k_in.shape[0] != n:
            raise ValueError(f"key, value: expected the batch of query and one sequence length, got shapes "
                             f"{tuple(key.shape)} and {tuple(value.shape)} for query {tuple(query.shape)}")
        if k_in.shape[2] != self.kdim or v_in.shape[2] != self.vdim:
            raise ValueError(f"key, value: expected last dimensions kdim={self.kdim}, vdim={self.vdim}, got "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)

        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("attn_mask: need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention); "
                               "nn.Transformer.generate_square_subsequent_mask makes one")
        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None if causal else F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                                     other_name="", target_type=query.dtype, check_other=False)
        h, hd = self.num_heads, self.head_dim
        mask = self._merge(mask, key_padding_mask, n, tgt, src)

        state = self.step_state
        if state is not None:
            state.note_forward_use(self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
                                   self.in_proj_bias)
        plans = "default" if state is None else state.plans
        w = (self.in_proj_weight, None, None) if self._qkv_same_embed_dim else (
            self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        flat = [q_in.reshape(n * tgt, e)]
        flat.append(flat[0] if leaders[1] == 0 else k_in.reshape(n * src, self.kdim))
        flat.append(flat[leaders[2]] if leaders[2] < 2 else v_in.reshape(n * src, self.vdim))
        q, k, v = _DetInProjection.apply(*flat, *w, self.in_proj_bias, leaders, state, plans)
        q = q.view(n, tgt, h, hd).transpose(1, 2)
        k = k.view(n, src, h, hd).transpose(1, 2)
        v = v.view(n, src, h, hd).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, h, 1, hd)], dim=2)
            v = torch.cat([v, v.new_zeros(n, h, 1, hd)], dim=2)
            if mask is not None:
                mask = F.pad(mask, (0, 1))
            src += 1
        dropout_p = self.dropout if self.training else 0.0
        # attention dropout: a keyed mask over (sample, head, query, key), like F.dropout's call sites
        dkey = None if dropout_p == 0 else dropout_key(state, FUNCTIONAL_SITE, True, "nn.MultiheadAttention(dropout > 0)")
        scale = 1.0 / math.sqrt(hd)
        dropout = None if dkey is None else AttentionDropout(float(dropout_p), dkey)
        out, stats = fused_attention(q, k, v, mask, scale, causal, dropout)
        out = self.out_proj(out.transpose(1, 2).reshape(n, tgt, e))
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = self._weights(q, k, stats, mask, scale, dropout)
        if average_attn_weights:
            weights = _DetHeadMean.apply(weights)
        return out, (weights if batched else weights.squeeze(0))

    def _merge(self, mask, key_padding_mask, n, tgt, src) -> Optional[torch.Tensor]:
        """PyTorch's merged float mask, (1 or N, 1 or H, L, S), or None."""
        h = self.num_heads
        if mask is not None:
            if mask.dim() == 2:
                if tuple(mask.shape) != (tgt, src):
                    raise ValueError(f"attn_mask: expected a 2-D shape {(tgt, src)}, got {tuple(mask.shape)}")
                mask = mask.view(1, 1, tgt, src)
            elif mask.dim() == 3:
                if tuple(mask.shape) != (n * h, tgt, src):
                    raise ValueError(f"attn_mask: expected a 3-D shape {(n * h, tgt, src)}, got {tuple(mask.shape)}")
                mask = mask.view(n, h, tgt, src)
            else:
                raise ValueError(f"attn_mask: expected 2 or 3 dimensions, got shape {tuple(mask.shape)}")
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (n, src):
                raise ValueError(f"key_padding_mask: expected shape {(n, src)}, got {tuple(key_padding_mask.shape)}")
            kpm = key_padding_mask.view(n, 1, 1, src)
            mask = kpm if mask is None else mask + kpm
        return mask

    @staticmethod
    def _weights(q, k, stats, mask, scale, dropout) -> torch.Tensor:
        """The attention weights (N, H, L, S) of q's dtype: the kernel's own, after dropout as
        nn.MultiheadAttention returns them."""
        with torch.no_grad():
            p = attention_probs(q, k, stats, mask, scale, False)
            if dropout is not None:
                p = p * dropout_multiplier(p.view(p.shape[0], -1), dropout.p, dropout.key).view(p.shape)
        return p.to(q.dtype)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, exact=True"


def check_mha_options(module: nn.MultiheadAttention) -> None:
    """Raises for the options DetMultiheadAttention does not cover, naming the option and the fix."""
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError("add_bias_kv: DetMultiheadAttention does not support add_bias_kv=True (bias_k/bias_v are "
                         "broadcast over the batch, so their gradient would be a float sum over it); construct "
                         "nn.MultiheadAttention without it, or leave the module out with det_transform's filter_fn")


def _canonical(mask, name, other, other_name, dtype, check_other=True):
    return F._canonical_mask(mask=mask, mask_name=name, other_type=F._none_or_dtype(other) if check_other else None,
                             other_name=other_name, target_type=dtype, check_other=check_other)


class DetTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` without the fast path: always the module-by-module code, so
    self_attn (DetMultiheadAttention), the DetLinear and DetLayerNorm children run their exact
    arithmetic, in training, eval and under no_grad alike."""

    def forward(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None,
                src_key_padding_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        src_key_padding_mask = _canonical(src_key_padding_mask, "src_key_padding_mask", src_mask, "src_mask", src.dtype)
        src_mask = _canonical(src_mask, "src_mask", None, "", src.dtype, check_other=False)
        if src.is_nested:
            raise ValueError("src: nested tensors are not supported by the det layers; pass a padded tensor and "
                             "src_key_padding_mask")
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x


class DetTransformerEncoder(nn.TransformerEncoder):
    """``nn.TransformerEncoder`` that never converts to nested tensors (its inference fast path)."""

    def forward(self, src: torch.Tensor, mask: Optional[torch.Tensor] = None,
                src_key_padding_mask: Optional[torch.Tensor] = None, is_causal: Optional[bool] = None) -> torch.Tensor:
        src_key_padding_mask = _canonical(src_key_padding_mask, "src_key_padding_mask", mask, "mask", src.dtype)
        mask = _canonical(mask, "mask", None, "", src.dtype, check_other=False)
        first = self.layers[0]
        batch_first = getattr(getattr(first, "self_attn", None), "batch_first", False)
        is_causal = _detect_is_causal_mask(mask, is_causal, _get_seq_len(src, batch_first))
        out = src
        for mod in self.layers:
            out = mod(out, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
        return out if self.norm is None else self.norm(out)


class DetTransformerDecoderLayer(nn.TransformerDecoderLayer):
    """``nn.TransformerDecoderLayer`` (which has no fast path) whose ``"gelu"`` activation is det_gelu."""


def _det_activation(layer: nn.Module) -> None:
    if layer.activation is F.gelu:
        layer.activation = det_gelu


def _swap_layer(target: type):
    def factory(module: nn.Module) -> nn.Module:
        _det_activation(module)
        module.__class__ = target
        return module

    return factory


def _swap_encoder(module: nn.Module) -> nn.Module:
    module.use_nested_tensor = False
    module.__class__ = DetTransformerEncoder
    return module


#: PyTorch class -> factory(module) that turns it into its Det class in place (det_transform).
TRANSFORMER_SWAPS = {
    nn.MultiheadAttention: DetMultiheadAttention.from_mha,
    nn.TransformerEncoderLayer: _swap_layer(DetTransformerEncoderLayer),
    nn.TransformerDecoderLayer: _swap_layer(DetTransformerDecoderLayer),
    nn.TransformerEncoder: _swap_encoder,
}
