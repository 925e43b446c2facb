"""A sliding window of softmax attention and linear attention beyond it, in one head under one
normalisation (the form LoLCATs linearizes a pretrained softmax head into).

Query i sees the last W keys, i - W < j <= i, through softmax scores s_ij = q_i·k_j / sqrt(d),
and every older key, j <= i - W, through non-negative features: f(q_i)·f(k_j). One sum
normalises both:

    y_i = (Σ_window e^(s_ij - m_i) v_j + Σ_older f(q_i)·f(k_j) v_j)
          / (Σ_window e^(s_ij - m_i) + Σ_older f(q_i)·f(k_j)),      m_i = max_window s_ij.

m_i belongs to the function, as in LoLCATs: it sets the window's largest weight to 1, the scale
the features learn to meet, and keeps every exponential at most 1. Masked keys (padding) are in
neither sum; a query that sees no key gets 0.

The older part is causal linear attention over the keys delayed by W: query i reads the state
after key i - W, S = Σ f(k_j) v_jᵀ and z = Σ f(k_j). A decoder keeps the last W keys and values
in a ring and folds each key into (S, z) as it leaves the ring.

* ``window_linear_attention_by_position``: the explicit form, O(n m), keys at any positions
  (a continued sequence: the ring's keys, then the new ones) after a state of older keys;
  ``naive_window_linear_attention`` is it over positions 0 .. n - 1: the reference.
* ``window_linear_attention``: the window by blocks of W queries over the 2W keys around them,
  the older keys by chunks: O(n W d + n F e).
* ``window_linear_attention_step``: one query over the ring and the state.

Everything is computed in at least float32 (``compute_dtype``) and returned in v's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import compute_dtype

# the older keys' chunk length in ``window_linear_attention``
CHUNK = 64


def _divide(num, den):
    """num / den, 0 where nothing was seen (den == 0)."""
    seen = den > 0
    return torch.where(seen[..., None], num / torch.where(seen, den, 1.0)[..., None], 0.0)


def _window_weights(scores, visible):
    """e^(s - m) where visible, 0 elsewhere; m the row's largest visible score (0 for a row
    with none, whose weights are all 0)."""
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    return torch.exp(scores - top).masked_fill(~visible, 0.0)


def window_linear_attention_by_position(q, k, v, fq, fk, q_positions, k_positions, window, state=None):
    """The explicit form. q (b, h, n, d), fq (b, h, n, F) at ``q_positions`` (n,) or (b, n);
    k (b, h, m, d), fk (b, h, m, F), v (b, h, m, e) at ``k_positions`` (m,) or (b, m), a masked
    key at a position below every query's reach (``cache.NO_KEY``) or lifted out by giving it
    none: a key is real when its position is >= 0. ``state``: (S (b, h, F, e), z (b, h, F)),
    the features of keys older than every query's window. -> (b, h, n, e)."""
    out_dtype, dtype = v.dtype, compute_dtype(v)
    q, k, v, fq, fk = (t.to(dtype) for t in (q, k, v, fq, fk))
    qp, kp = q_positions[..., :, None], k_positions[..., None, :]
    real = kp >= 0
    in_window = real & (kp <= qp) & (kp > qp - window)
    older = real & (kp <= qp - window)
    if in_window.ndim == 3:  # (per row: broadcast over the heads)
        in_window, older = in_window[:, None], older[:, None]
    weights = _window_weights(torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5, in_window)
    weights = weights + torch.einsum("bhif,bhjf->bhij", fq, fk) * older
    num, den = weights @ v, weights.sum(dim=-1)
    if state is not None:
        S, z = (t.to(dtype) for t in state)
        num, den = num + fq @ S, den + torch.einsum("bhif,bhf->bhi", fq, z)
    return _divide(num, den).to(out_dtype)


def naive_window_linear_attention(q, k, v, fq, fk, window, key_mask=None):
    """The reference over positions 0 .. n - 1; ``key_mask`` (b, n): False for padding."""
    n = q.shape[2]
    positions = torch.arange(n, device=q.device)
    k_positions = positions if key_mask is None else torch.where(key_mask, positions, -1)
    return window_linear_attention_by_position(q, k, v, fq, fk, positions, k_positions, window)


def window_linear_attention(q, k, v, fq, fk, window, key_mask=None, chunk=CHUNK):
    """The fast form of ``naive_window_linear_attention`` (same arguments) -> (b, h, n, e)."""
    out_dtype, dtype = v.dtype, compute_dtype(v)
    q, k, v, fq, fk = (t.to(dtype) for t in (q, k, v, fq, fk))
    b, h, n, _ = q.shape
    if key_mask is not None:  # a masked key has no features, no value and no place in a window
        fk, v = fk * key_mask[:, None, :, None], v * key_mask[:, None, :, None]
    num, den = _window_part(q, k, v, window, key_mask)
    if n > window:
        older_num, older_den = _older_part(fq, fk, v, window, chunk)
        num, den = num + older_num, den + older_den
    return _divide(num, den).to(out_dtype)


def _window_part(q, k, v, window, key_mask):
    """Σ_window e^(s - m) v and Σ_window e^(s - m): blocks of w queries over the keys of their
    block and the block before (w = window, or n when shorter)."""
    b, h, n, d = q.shape
    w = min(window, n)
    pad = -n % w
    blocks = (n + pad) // w
    q = F.pad(q, (0, 0, 0, pad)).unflatten(2, (blocks, w))  # (b, h, u, w, d)
    k, v = (F.pad(t, (0, 0, w, pad)).unfold(2, 2 * w, w).transpose(-1, -2) for t in (k, v))  # (b, h, u, 2w, ·)
    q_positions = torch.arange(n + pad, device=q.device).view(blocks, w, 1)
    k_positions = torch.arange(-w, n + pad, device=q.device).unfold(0, 2 * w, w)[:, None, :]  # (u, 1, 2w)
    visible = (k_positions >= 0) & (k_positions <= q_positions) & (k_positions > q_positions - window)
    if key_mask is not None:
        visible = visible & F.pad(key_mask, (w, pad), value=False).unfold(1, 2 * w, w)[:, :, None]
        visible = visible[:, None]  # (b, 1, u, w, 2w)
    weights = _window_weights(torch.einsum("bhuid,bhujd->bhuij", q, k) * d ** -0.5, visible)
    num, den = weights @ v, weights.sum(dim=-1)
    return num.flatten(2, 3)[:, :, :n], den.flatten(2, 3)[:, :, :n]


def _older_part(fq, fk, v, window, chunk):
    """Σ_older f(q)·f(k) v and Σ_older f(q)·f(k): causal linear attention over the keys and
    values delayed by ``window``, by chunks (within a chunk its masked product, across chunks
    the state before it)."""
    b, h, n, _ = fq.shape
    fk, v = (F.pad(t, (0, 0, window, 0))[:, :, :n] for t in (fk, v))  # key j now sits at j + window
    pad = -n % chunk
    fq, fk, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for t in (fq, fk, v))  # (b, h, c, C, ·)
    kv = fk.transpose(-1, -2) @ v  # (b, h, c, F, e)
    z = fk.sum(dim=-2)  # (b, h, c, F)
    kv_before, z_before = kv.cumsum(dim=2) - kv, z.cumsum(dim=2) - z
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=fq.device).tril()
    scores = (fq @ fk.transpose(-1, -2)) * causal
    num = fq @ kv_before + scores @ v
    den = (fq * z_before[..., None, :]).sum(dim=-1) + scores.sum(dim=-1)
    return num.flatten(2, 3)[:, :, :n], den.flatten(2, 3)[:, :, :n]


def window_linear_attention_step(q, keys, values, bias, fq, kv, z):
    """One query per row: q (b, h, d) over the ring's keys and values (b, h, slots, d / e),
    ``bias`` (b or 1, 1, slots) 0 where the key is in the query's window, -inf elsewhere (the
    query's own key among them), and the state of the older keys, kv (b, h, F, e) and z (b, h,
    F), read through fq (b, h, F) -> (b, h, e). In the dtype of the state."""
    scores = (q[:, :, None] * keys).sum(dim=-1) * q.shape[-1] ** -0.5 + bias
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    num = (weights[..., None] * values).sum(dim=-2) + (fq[..., None] * kv).sum(dim=-2)
    den = weights.sum(dim=-1) + (fq * z).sum(dim=-1)
    return num / den[..., None]
