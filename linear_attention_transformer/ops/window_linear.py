"""A sliding window of softmax attention and linear attention beyond it, in one head under one
normalisation (the form LoLCATs linearizes a pretrained softmax head into).

Query i sees the last W keys, i - W < j <= i, and the sequence's first S keys (its "sinks",
j < S, StreamingLLM's), through softmax scores s_ij = q_i·k_j / sqrt(d), and every other older
key, S <= j <= i - W, through non-negative features: f(q_i)·f(k_j). One sum normalises both:

    y_i = (Σ_window e^(s_ij - m_i) v_j + Σ_older f(q_i)·f(k_j) v_j)
          / (Σ_window e^(s_ij - m_i) + Σ_older f(q_i)·f(k_j)),      m_i = max_window s_ij.

where the window holds the sinks too. m_i belongs to the function, as in LoLCATs: it sets the
window's largest weight to 1, the scale the features learn to meet, and keeps every exponential
at most 1. The sinks matter: a pretrained head often puts much of its weight on the first token,
more than bounded features can carry. Masked keys (padding) are in neither sum; a query that
sees no key gets 0.

The older part is causal linear attention over the keys delayed by W: query i reads the state
after key i - W, kv = Σ f(k_j) v_jᵀ and z = Σ f(k_j) over j >= S. A decoder keeps the first S
keys and the last W keys and values, and folds each key into (kv, z) as it leaves the window.

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


def window_linear_attention_by_position(q, k, v, fq, fk, q_positions, k_positions, window, state=None, sinks=0):
    """The explicit form. q (b, h, n, d), fq (b, h, n, F) at ``q_positions`` (n,) or (b, n);
    k (b, h, m, d), fk (b, h, m, F), v (b, h, m, e) at ``k_positions`` (m,) or (b, m); a key
    is real when its position is >= 0 (a masked one: ``cache.NO_KEY``). ``state``: (kv (b, h,
    F, e), z (b, h, F)), the features of older keys than every query's window and not among
    the first ``sinks``. -> (b, h, n, e)."""
    out_dtype, dtype = v.dtype, compute_dtype(v)
    q, k, v, fq, fk = (t.to(dtype) for t in (q, k, v, fq, fk))
    qp, kp = q_positions[..., :, None], k_positions[..., None, :]
    real = kp >= 0
    in_window = real & (kp <= qp) & ((kp > qp - window) | (kp < sinks))
    older = real & (kp <= qp - window) & (kp >= sinks)
    if in_window.ndim == 3:  # (per row: broadcast over the heads)
        in_window, older = in_window[:, None], older[:, None]
    weights = _window_weights(torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5, in_window)
    weights = weights + torch.einsum("bhif,bhjf->bhij", fq, fk) * older
    num, den = weights @ v, weights.sum(dim=-1)
    if state is not None:
        S, z = (t.to(dtype) for t in state)
        num, den = num + fq @ S, den + torch.einsum("bhif,bhf->bhi", fq, z)
    return _divide(num, den).to(out_dtype)


def naive_window_linear_attention(q, k, v, fq, fk, window, key_mask=None, sinks=0, starts=None):
    """The reference: ``key_mask`` (b, n) False for padding; column j of row r at position j -
    ``starts[r]`` ((b,) long: rows padded on the left, their sinks their first real keys),
    else at position j."""
    n = q.shape[2]
    positions = torch.arange(n, device=q.device)
    if starts is not None:
        positions = positions - starts[:, None]
    k_positions = positions if key_mask is None else torch.where(key_mask, positions, -1)
    return window_linear_attention_by_position(q, k, v, fq, fk, positions, k_positions, window, sinks=sinks)


def window_linear_attention(q, k, v, fq, fk, window, key_mask=None, sinks=0, starts=None, chunk=CHUNK):
    """The fast form of ``naive_window_linear_attention`` (same arguments) -> (b, h, n, e)."""
    out_dtype, dtype = v.dtype, compute_dtype(v)
    q, k, v, fq, fk = (t.to(dtype) for t in (q, k, v, fq, fk))
    b, n = q.shape[0], q.shape[2]
    keep = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    if sinks:  # the sinks are no older keys
        starts = torch.zeros(b, dtype=torch.long, device=q.device) if starts is None else starts
        keep = keep & (torch.arange(n, device=q.device) >= starts[:, None] + sinks)
    num, den = _window_part(q, k, v, window, key_mask, sinks, starts)
    if n > window:  # (a masked key has no features and no value)
        older_num, older_den = _older_part(fq, fk * keep[:, None, :, None], v * keep[:, None, :, None], window, chunk)
        num, den = num + older_num, den + older_den
    return _divide(num, den).to(out_dtype)


def _window_part(q, k, v, window, key_mask, sinks, starts):
    """Σ_window e^(s - m) v and Σ_window e^(s - m): blocks of w queries over the keys of their
    block and the block before (w = window, or n when shorter), and over each row's sinks."""
    b, h, n, d = q.shape
    w = min(window, n)
    pad = -n % w
    blocks = (n + pad) // w
    q_positions = torch.arange(n + pad, device=q.device).view(blocks, w, 1)
    k_positions = torch.arange(-w, n + pad, device=q.device).unfold(0, 2 * w, w)[:, None, :]  # (u, 1, 2w)
    visible = (k_positions >= 0) & (k_positions <= q_positions) & (k_positions > q_positions - window)
    if key_mask is not None:
        visible = visible & F.pad(key_mask, (w, pad), value=False).unfold(1, 2 * w, w)[:, :, None]  # (b, u, w, 2w)
    if sinks:  # each row's first ``sinks`` keys apart: seen by every later query, once
        columns = (starts[:, None] + torch.arange(sinks, device=q.device)).clamp(max=n - 1)  # (b, S)
        real = (starts[:, None] + torch.arange(sinks, device=q.device) < n)
        if key_mask is not None:
            real = real & key_mask.gather(1, columns)
        index = columns[:, None, :, None]
        sink_k, sink_v = (t.gather(2, index.expand(-1, h, -1, t.shape[-1])) for t in (k, v))
        sink_visible = real[:, None, None, :] & (columns[:, None, None, :] <= q_positions)  # (b, u, w, S)
        visible = visible & (k_positions - starts[:, None, None, None] >= sinks)
    q = F.pad(q, (0, 0, 0, pad)).unflatten(2, (blocks, w))  # (b, h, u, w, d)
    k, v = (F.pad(t, (0, 0, w, pad)).unfold(2, 2 * w, w).transpose(-1, -2) for t in (k, v))  # (b, h, u, 2w, ·)
    scores = torch.einsum("bhuid,bhujd->bhuij", q, k)
    if sinks:
        scores = torch.cat((scores, torch.einsum("bhuid,bhjd->bhuij", q, sink_k)), dim=-1)
        visible = torch.cat((visible.expand(b, *visible.shape[-3:]), sink_visible), dim=-1)
    if visible.ndim == 4:
        visible = visible[:, None]  # (b, 1, u, w, ·)
    weights = _window_weights(scores * d ** -0.5, visible)
    num = weights[..., : 2 * w] @ v
    if sinks:
        num = num + torch.einsum("bhuij,bhje->bhuie", weights[..., 2 * w :], sink_v)
    den = weights.sum(dim=-1)
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
