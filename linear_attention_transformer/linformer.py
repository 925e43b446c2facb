"""Linformer self-attention (Wang et al. 2020, "Self-Attention with Linear Complexity").

Keys and values are projected along the *sequence* from ``seq_len`` positions down to
``k`` learned mixtures of positions, by matrices E (keys) and F (values) of shape
(seq_len, k). Queries then attend with ordinary scaled dot-product softmax attention to
those k projected keys, in O(n k) instead of O(n^2):

    K' = Eᵀ (X W_k),   V' = Fᵀ (X W_v),   out = softmax(Q K'ᵀ / sqrt(d)) V'

It is not causal (every projected key mixes all positions) and it is tied to a maximal
length ``seq_len``. A shorter key/value sequence of length m < seq_len behaves exactly as
if it were zero-padded to ``seq_len``: zero rows contribute nothing to Eᵀ X, so only the
first m rows of E and F are used. Masked key/value positions are zeroed before the
projection, which makes them contribute nothing as well.

E and F are learned and Xavier-initialised, as the Linformer authors did; how many there are
is ``parameter_sharing`` (the paper's section 4; docs/layers.md, "Linformer").

The projections along the sequence and W_k, W_v are linear and bias-free, so they commute:
positions are mixed first (Eᵀ X, O(m k dim)), once for keys and values with ``share_kv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Optional

import torch
from einops import rearrange
from torch import nn

from .attention import resolve_heads
from .ops.common import check_bool, check_float_tensor, check_int, check_mask

__all__ = ["LinformerSettings", "LinformerContextSettings", "LinformerSelfAttention", "linformer_layers"]


def _check_features(name, t, dim):
    check_float_tensor(name, t)
    if t.ndim != 3:
        raise ValueError(f"{name} must have shape (batch, length, dim), got {tuple(t.shape)}")
    if t.shape[-1] != dim:
        raise ValueError(f"{name} must have feature size dim = {dim}, got {t.shape[-1]}")


SHARING = ("none", "headwise", "kv", "layerwise")


@dataclass(frozen=True)
class LinformerSettings:
    """Use Linformer self-attention in every layer (non-causal), projecting from the model's
    ``max_seq_len``.

    Args:
        k: number of positions keys and values are projected down to (in the first layer).
        one_kv_head: a single key/value head shared by all query heads.
        share_kv: the same sequence projection for keys and values (F = E).
        parameter_sharing: 'none' | 'headwise' (default) | 'kv' | 'layerwise', see above.
        k_reduce_by_layer: layer l (from 0) projects to max(1, k - l * k_reduce_by_layer).
    """

    k: int = 256
    one_kv_head: bool = False
    share_kv: bool = False
    parameter_sharing: str = "headwise"
    k_reduce_by_layer: int = 0

    def __post_init__(self):
        check_int("k", self.k)
        check_bool("one_kv_head", self.one_kv_head)
        check_bool("share_kv", self.share_kv)
        if self.parameter_sharing not in SHARING:
            raise ValueError(f"parameter_sharing must be one of {SHARING}, got {self.parameter_sharing!r}")
        check_int("k_reduce_by_layer", self.k_reduce_by_layer, minimum=0)
        if self.k_reduce_by_layer and self.parameter_sharing == "layerwise":
            raise ValueError("k_reduce_by_layer > 0 with parameter_sharing='layerwise': one projection for every "
                             "layer has one k")


def _check_context_settings(self):
    check_int("seq_len", self.seq_len)
    LinformerSettings.__post_init__(self)


# ``LinformerSettings``' fields after a first one, seq_len (positional, as upstream's named tuple)
LinformerContextSettings = make_dataclass(
    "LinformerContextSettings",
    [("seq_len", int), *((f.name, f.type, field(default=f.default)) for f in fields(LinformerSettings))],
    frozen=True, namespace={"__post_init__": _check_context_settings, "__module__": __name__, "__doc__": (
        "Use Linformer for the attention to a context (encoder output) of length <= ``seq_len`` (the "
        "length projected from); the other fields as ``LinformerSettings``.")},
)


class LinformerSelfAttention(nn.Module):
    """Multi-head attention whose keys and values are projected along the sequence to length k.

    Args:
        dim: feature size of x, of the context and of the output.
        seq_len: maximal key/value length (x's without context, else the context's).
        k: projected length (>= 1). heads, dim_head (default dim // heads): the query heads.
        one_kv_head: one key/value head shared by all query heads.
        share_kv: one sequence projection for keys and values (F = E; to_k, to_v stay two).
        dropout: on the attention weights.
        per_head: a sequence projection per key/value head (parameter_sharing 'none').
        projection: an existing (seq_len, k) parameter as E = F (parameter_sharing
            'layerwise'); implies ``share_kv``.
        bias: a bias on ``to_out``.
    Parameters: to_q, to_k, to_v (no bias), to_out; proj_k (E) and proj_v (F, absent with
    ``share_kv``): (seq_len, k), or (kv_heads, seq_len, k) ``per_head``, Xavier-uniform.

    Shapes (forward):
        x: (b, n, dim). Without context n <= seq_len; with context n is free.
        context: optional (b, m, dim), m <= seq_len: keys and values come from it.
        input_mask: optional bool (b, n), True for real tokens: masks the keys/values taken
            from x (refused with a context: mask those with context_mask).
        context_mask: optional bool (b, m), True for real context positions; only with context.
        returns: (b, n, dim).
    Logits and softmax are computed in at least float32 (also under autocast).
    """

    def __init__(self, dim: int, seq_len: int, k: int = 256, heads: int = 8, dim_head: Optional[int] = None,
                 one_kv_head: bool = False, share_kv: bool = False, dropout: float = 0.0, per_head: bool = False,
                 projection: Optional[nn.Parameter] = None, bias: bool = True):
        super().__init__()
        for name, value in (("dim", dim), ("seq_len", seq_len), ("k", k), ("heads", heads)):
            check_int(name, value)
        dim_head, kv_heads = resolve_heads(dim, heads, dim_head, one_kv_head=one_kv_head)
        for name, value in (("one_kv_head", one_kv_head), ("share_kv", share_kv), ("per_head", per_head)):
            check_bool(name, value)
        if projection is not None and (per_head or tuple(projection.shape) != (seq_len, k)):
            raise ValueError(f"projection must be a ({seq_len}, {k}) parameter, used without per_head")
        share_kv = share_kv or projection is not None
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")

        self.dim, self.seq_len, self.k = dim, seq_len, k
        self.heads, self.dim_head, self.kv_heads = heads, dim_head, kv_heads
        self.one_kv_head, self.share_kv = one_kv_head, share_kv

        inner, kv_inner = heads * dim_head, kv_heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, kv_inner, bias=False)
        self.to_v = nn.Linear(dim, kv_inner, bias=False)
        shape = (self.kv_heads, seq_len, k) if per_head else (seq_len, k)
        self.proj_k = projection if projection is not None else nn.Parameter(_xavier(torch.empty(shape)))
        self.proj_v = None if share_kv else nn.Parameter(_xavier(torch.empty(shape)))
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner, dim, bias=bias)

    @classmethod
    def from_settings(cls, dim, seq_len, settings, heads=8, dim_head=None, dropout=0.0):
        """Build from a ``LinformerSettings`` (give the model's max_seq_len as ``seq_len``) or a
        ``LinformerContextSettings`` (its own ``seq_len`` wins; pass ``seq_len=None``)."""
        return linformer_layers(settings, dim, seq_len, 1, heads=heads, dim_head=dim_head, attn_dropout=dropout)[0]

    def extra_repr(self):
        return (f"dim={self.dim}, seq_len={self.seq_len}, k={self.k}, heads={self.heads}, dim_head={self.dim_head}, "
                f"one_kv_head={self.one_kv_head}, share_kv={self.share_kv}")

    @staticmethod
    def _mix(kv_input, proj):
        """Eᵀ X: (b, m, dim) -> (b, k, dim), or (b, kv_heads, k, dim) with a projection per head."""
        m = kv_input.shape[1]
        if proj.ndim == 2:
            return torch.einsum("bmd,mk->bkd", kv_input, proj[:m].to(kv_input.dtype))
        return torch.einsum("bmd,hmk->bhkd", kv_input, proj[:, :m].to(kv_input.dtype))

    def _heads(self, mixed, linear):
        """The feature projection of mixed positions, as (b, kv_heads, k, dim_head)."""
        if mixed.ndim == 3:
            return rearrange(linear(mixed), "b k (h d) -> b h k d", h=self.kv_heads)
        weight = rearrange(linear.weight, "(h e) d -> h e d", h=self.kv_heads)
        return torch.einsum("bhkd,hed->bhke", mixed, weight)

    def forward(self, x, context=None, input_mask=None, context_mask=None):
        _check_features("x", x, self.dim)
        b, n, _ = x.shape
        check_mask(input_mask, b, n, "input_mask")
        if context is None:
            if context_mask is not None:
                raise ValueError("context_mask was given without context")
            if n > self.seq_len:
                raise ValueError(f"x has length {n}, longer than seq_len = {self.seq_len}")
            kv_input, kv_mask = x, input_mask
        else:
            _check_features("context", context, self.dim)
            if input_mask is not None:  # it would mark which of x's tokens are keys: here none are
                raise ValueError("input_mask is not read with a context: the keys come from the context "
                                 "(mask them with context_mask)")
            if context.shape[0] != b:
                raise ValueError(f"context has batch size {context.shape[0]}, x has {b}")
            if context.shape[1] > self.seq_len:
                raise ValueError(f"context has length {context.shape[1]}, longer than seq_len = {self.seq_len}")
            check_mask(context_mask, b, context.shape[1], "context_mask")
            kv_input, kv_mask = context, context_mask

        if kv_mask is not None:
            kv_input = kv_input.masked_fill(~rearrange(kv_mask, "b m -> b m 1"), 0.0)

        # project along the sequence first (the module docstring)
        mixed_k = self._mix(kv_input, self.proj_k)
        mixed_v = mixed_k if self.proj_v is None else self._mix(kv_input, self.proj_v)

        q = rearrange(self.to_q(x), "b n (h d) -> b h n d", h=self.heads)
        keys, values = self._heads(mixed_k, self.to_k), self._heads(mixed_v, self.to_v)

        out_dtype = values.dtype
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            q, keys, values = (t.to(dtype) for t in (q, keys, values))
            # a single kv head broadcasts over the query heads
            logits = (q * self.dim_head**-0.5) @ keys.transpose(-1, -2)  # (b, h, n, k)
            attn = self.dropout(logits.softmax(dim=-1))
            out = attn @ values  # (b, h, n, d)
        out = rearrange(out.to(out_dtype), "b h n d -> b n (h d)")
        return self.to_out(out)


def linformer_layers(settings, dim, seq_len, depth, heads=8, dim_head=None, attn_dropout=0.0, bias=True):
    """The ``depth`` ``LinformerSelfAttention`` layers of a model (its keyword arguments:
    exactly the model options a Linformer layer honours), from ``LinformerSettings`` (keys and
    values from the layer's input, of length <= ``seq_len``, the model's max_seq_len) or
    ``LinformerContextSettings`` (from a context of length <= ``settings.seq_len``)."""
    if isinstance(settings, LinformerContextSettings):
        seq_len = settings.seq_len
    elif not isinstance(settings, LinformerSettings):
        raise TypeError(f"settings must be LinformerSettings or LinformerContextSettings, got {type(settings).__name__}")
    sharing = settings.parameter_sharing
    shared = nn.Parameter(_xavier(torch.empty(seq_len, settings.k))) if sharing == "layerwise" else None
    return [LinformerSelfAttention(dim, seq_len, k=max(1, settings.k - layer * settings.k_reduce_by_layer), heads=heads,
                                   dim_head=dim_head, one_kv_head=settings.one_kv_head,
                                   share_kv=settings.share_kv or sharing == "kv", dropout=attn_dropout,
                                   per_head=sharing == "none", projection=shared, bias=bias)
            for layer in range(depth)]


def _xavier(t):
    """Xavier-uniform for a (seq_len, k) projection, or for each of a stack of them."""
    for matrix in t.view(-1, *t.shape[-2:]):
        nn.init.xavier_uniform_(matrix)
    return t
