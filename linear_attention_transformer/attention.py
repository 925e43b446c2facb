"""Attention layers: global linear heads, Q(KᵀV), side by side with local windowed softmax heads.

Seed 000's layer: of ``heads`` heads, the first ``n_local_attn_heads`` attend with an exact
softmax inside a sliding window (``local_attention.LocalAttention``: each window of w tokens
looks at itself and the window before), the others attend to the whole sequence with linear
attention (``ops``). Local heads see the neighbourhood sharply, global heads see everything
at a cost linear in n.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from local_attention import LocalAttention
from torch import nn

from .ops import FeatureMap, causal_linear_attention, linear_attention
from .positional import apply_rotary


def resolve_heads(dim, heads, dim_head=None, kv_heads=None, one_kv_head=False):
    """Check the head arithmetic once, with errors that name the argument.
    Returns (dim_head, kv_heads)."""
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if dim_head is None:
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}) when dim_head is not given")
        dim_head = dim // heads
    if not isinstance(dim_head, int) or dim_head < 1:
        raise ValueError(f"dim_head must be a positive int, got {dim_head!r}")
    if one_kv_head:
        if kv_heads not in (None, 1):
            raise ValueError(f"one_kv_head=True means kv_heads=1, got kv_heads={kv_heads}")
        kv_heads = 1
    kv_heads = heads if kv_heads is None else kv_heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads!r}) must be a positive int that divides heads ({heads})")
    return dim_head, kv_heads


def check_mask(mask, x, name):
    if mask is None:
        return
    if not torch.is_tensor(mask) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor")
    if tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{name} must have shape {tuple(x.shape[:2])} (batch, seq_len), got {tuple(mask.shape)}")


def _pad_to_multiple(t, multiple, dim, value=0.0):
    pad = -t.shape[dim] % multiple
    if not pad:
        return t
    widths = [0, 0] * (t.ndim - 1 - (dim % t.ndim)) + [0, pad]
    return F.pad(t, widths, value=value)


class Attention(nn.Module):
    """Multi-head attention with global linear heads and local softmax heads.

    Args:
        dim: model width.
        heads: number of query heads. dim_head: size of each (default dim // heads).
        causal: each position attends only to itself and the past.
        n_local_attn_heads: how many of the heads are local windowed softmax heads.
        local_attn_window_size: w; a local head sees its window of w tokens and the one before.
        blindspot_size: B; causal global heads see only keys in earlier blocks of B tokens
            (to pair with local heads, which cover the rest). 1 = every key j <= i.
        kv_heads: number of key/value heads, shared by groups of query heads.
            one_kv_head=True means kv_heads=1.
        feature_map: 'softmax' (default), 'elu', 'relu' or a callable, for global heads.
        attn_dropout: dropout on the attention output of every head, before the output projection.
        dropout: dropout on the layer output.
        receives_context: keys and values come from ``context`` (cross-attention); all
            heads are then global and non-causal with respect to the context.
        chunk_size: chunk length of the causal linear attention kernel.
    Shapes:
        x (b, n, dim); input_mask (b, n) bool; context (b, m, dim); context_mask (b, m) bool;
        rotary: (cos, sin) of the positions, each (n, dim_head). Returns (b, n, dim).
    """

    def __init__(
        self,
        dim,
        heads=8,
        dim_head=None,
        causal=False,
        n_local_attn_heads=0,
        local_attn_window_size=128,
        blindspot_size=1,
        kv_heads=None,
        one_kv_head=False,
        feature_map="softmax",
        attn_dropout=0.0,
        dropout=0.0,
        receives_context=False,
        chunk_size=64,
    ):
        super().__init__()
        dim_head, kv_heads = resolve_heads(dim, heads, dim_head, kv_heads, one_kv_head)
        if not 0 <= n_local_attn_heads <= heads:
            raise ValueError(f"n_local_attn_heads ({n_local_attn_heads}) must be between 0 and heads ({heads})")
        if receives_context and n_local_attn_heads:
            raise ValueError("a layer with receives_context=True has no local heads (n_local_attn_heads must be 0)")
        if n_local_attn_heads and (not isinstance(local_attn_window_size, int) or local_attn_window_size < 1):
            raise ValueError(f"local_attn_window_size must be a positive int, got {local_attn_window_size!r}")
        if not isinstance(blindspot_size, int) or blindspot_size < 1:
            raise ValueError(f"blindspot_size must be a positive int, got {blindspot_size!r}")

        self.dim, self.heads, self.dim_head, self.kv_heads = dim, heads, dim_head, kv_heads
        self.causal = causal and not receives_context
        self.receives_context = receives_context
        self.n_local = n_local_attn_heads
        self.window = local_attn_window_size
        self.blindspot_size = blindspot_size
        self.chunk_size = chunk_size
        self.feature_map = FeatureMap(feature_map)

        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.dropout = nn.Dropout(dropout)
        self.local_attn = None
        if self.n_local:
            # positions come from the model (rotary / absolute / axial), not from inside the window
            self.local_attn = LocalAttention(
                window_size=local_attn_window_size, causal=self.causal, look_backward=1,
                look_forward=0 if self.causal else 1, use_rotary_pos_emb=False,
            )

    # ------------------------------------------------------------------ pieces

    def project(self, x, source):
        """Queries from x, keys/values from source, as (b, heads, n, dim_head) each."""
        q = rearrange(self.to_q(x), "b n (h d) -> b h n d", h=self.heads)
        k, v = rearrange(self.to_kv(source), "b n (two h d) -> two b h n d", two=2, h=self.kv_heads)
        if self.kv_heads != self.heads:
            k, v = (repeat(t, "b g n d -> b (g r) n d", r=self.heads // self.kv_heads) for t in (k, v))
        return q, k, v

    def local_heads(self, q, k, v, mask):
        """Windowed softmax attention; pads to a multiple of the window and masks the padding."""
        n = q.shape[2]
        if n % self.window and (mask is not None or not self.causal):
            mask = torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device) if mask is None else mask
            mask = _pad_to_multiple(mask, self.window, dim=1, value=False)
        q, k, v = (_pad_to_multiple(t, self.window, dim=2) for t in (q, k, v))
        out = self.local_attn(q, k, v, mask=mask)
        return out[:, :, :n]

    def global_heads(self, q, k, v, mask):
        fm = self.feature_map
        q = fm.queries(q)
        if self.causal:
            k, log_decay, _ = fm.causal_keys(k, mask)
            return causal_linear_attention(
                q, k, v, log_decay, mask, blindspot_size=self.blindspot_size, chunk_size=self.chunk_size
            )
        k, normalize = fm.noncausal_keys(k, mask)
        return linear_attention(q, k, v, mask, normalize=normalize)

    # ------------------------------------------------------------------ forward

    def forward(self, x, input_mask=None, context=None, context_mask=None, rotary=None, **kwargs):
        if x.ndim != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (batch, seq_len, {self.dim}), got {tuple(x.shape)}")
        check_mask(input_mask, x, "input_mask")
        if self.receives_context:
            if context is None:
                raise ValueError("this layer has receives_context=True: pass context=(batch, ctx_len, dim)")
            if context.ndim != 3 or context.shape[-1] != self.dim or context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context must have shape ({x.shape[0]}, ctx_len, {self.dim}), got {tuple(context.shape)}"
                )
            check_mask(context_mask, context, "context_mask")
            source, key_mask = context, context_mask
        else:
            source, key_mask = x, input_mask

        q, k, v = self.project(x, source)
        if rotary is not None and not self.receives_context:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)

        outs = []
        if self.n_local:
            sl = slice(0, self.n_local)
            outs.append(self.local_heads(q[:, sl], k[:, sl], v[:, sl], key_mask))
        if self.n_local < self.heads:
            sl = slice(self.n_local, self.heads)
            outs.append(self.global_heads(q[:, sl], k[:, sl], v[:, sl], key_mask))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        out = rearrange(self.attn_dropout(out), "b h n d -> b n (h d)")
        return self.dropout(self.to_out(out))


class LinearSelfAttention(Attention):
    """Global linear self-attention on its own, to drop into any model (seed 001).

    Args:
        dim: model width. heads: query heads. causal: autoregressive.
        dim_head: size of each head (default dim // heads).
        kv_heads / one_kv_head: shared key/value heads.
        feature_map: 'softmax', 'elu', 'relu' or a callable; ``psi_fn`` is seed 001's name for
            a callable feature map and is accepted as such.
        dropout: dropout on the attention output (before the output projection).
        blindspot_size: see ``Attention``.
    Shapes: x (b, n, dim), input_mask (b, n) bool -> (b, n, dim).
    """

    def __init__(
        self, dim, heads=8, causal=False, dim_head=None, kv_heads=None, one_kv_head=False,
        feature_map="softmax", psi_fn=None, dropout=0.0, blindspot_size=1, chunk_size=64,
    ):
        if psi_fn is not None:
            if feature_map != "softmax":
                raise ValueError("give either feature_map or psi_fn, not both")
            if not callable(psi_fn):
                raise TypeError("psi_fn must be callable")
            feature_map = psi_fn
        super().__init__(
            dim, heads=heads, dim_head=dim_head, causal=causal, kv_heads=kv_heads, one_kv_head=one_kv_head,
            feature_map=feature_map, attn_dropout=dropout, blindspot_size=blindspot_size, chunk_size=chunk_size,
        )
