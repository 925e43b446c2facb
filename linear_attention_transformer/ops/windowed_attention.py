"""Causal windowed softmax attention by absolute position: what a local head computes.

``local_attention.LocalAttention`` (look_backward=1) splits the sequence into windows of w
tokens; a query in window u sees the keys of windows u - 1 and u up to itself. Written by
positions: key j is visible to query i when j <= i and j // w >= i // w - 1. The model's
full forward uses ``LocalAttention``; cached decoding, which holds only the last keys, uses
this function, and the tests hold the two equal.
"""

from __future__ import annotations

import torch
from einops import rearrange


def causal_windowed_attention(q, k, v, q_positions, k_positions, window, key_mask=None):
    """Args:
        q: (b, h, n, d) queries at absolute positions ``q_positions`` (n,).
        k, v: (b, h, m, d) keys/values at absolute positions ``k_positions`` (m,).
        window: w. key_mask: optional (b, m) bool, True for real keys.
    Returns:
        (b, h, n, d)
    """
    sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
    qp, kp = q_positions[:, None], k_positions[None, :]
    visible = (kp <= qp) & (kp // window >= qp // window - 1)
    if key_mask is not None:
        visible = visible & rearrange(key_mask, "b j -> b 1 1 j")
    return _softmax_attend(sim, visible, v)


def causal_windowed_attention_last(q, k, v, key_mask=None):
    """The same for one query whose window holds exactly the keys given (what a decoder's
    cache keeps): only the padding mask is left to apply. q (b, h, 1, d) -> (b, h, 1, d)."""
    sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
    visible = None if key_mask is None else rearrange(key_mask, "b j -> b 1 1 j")
    return _softmax_attend(sim, visible, v)


def _softmax_attend(sim, visible, v):
    if visible is None:
        return sim.softmax(dim=-1) @ v
    # the most negative finite value, as LocalAttention uses: a row with no visible key stays finite
    sim = sim.masked_fill(~visible, -torch.finfo(sim.dtype).max)
    return sim.softmax(dim=-1) @ v
