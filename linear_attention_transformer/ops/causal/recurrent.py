"""The causal recurrence, one token at a time: S_t = a_t S_{t-1} + k_t v_tᵀ (see ``chunk.py``
for the exponential features' references)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import (NEG_INF, _append_ones, _apply_key_mask, _check_mask, _compute_dtype, _divide, _exp_ratio,
                      _finite_or_zero, _queries_relative_to)

__all__ = ["CausalState", "causal_linear_attention_step", "recurrent_causal_linear_attention"]


class CausalState:
    """Recurrent state of causal linear attention for one layer's global heads.

    Attributes:
        kv: (b, h, d, e + 1) decayed sum of k vᵀ over the keys queries may see; the last
            column is the normaliser z.
        ref: (b, h, d) per-feature log reference of ``kv`` (exponential features only,
            -inf before any key), else None: kv holds sum_j exp(k_j - ref) v_jᵀ.
        pending, pending_ref: the same for the keys of the current unfinished blindspot
            block (None when ``blindspot_size`` is 1).
        position: number of tokens consumed so far (an int).
    Instances are never modified in place: every step returns a new one, so a caller may
    keep an old state and branch from it.
    """

    __slots__ = ("kv", "ref", "pending", "pending_ref", "position")

    def __init__(self, kv, ref=None, pending=None, pending_ref=None, position=0):
        self.kv, self.ref, self.pending, self.pending_ref, self.position = kv, ref, pending, pending_ref, position

    @classmethod
    def zeros(cls, b, h, d, e, blindspot_size=1, exp_features=False, device=None, dtype=torch.float32):
        kv = torch.zeros(b, h, d, e + 1, device=device, dtype=dtype)
        ref = torch.full((b, h, d), NEG_INF, device=device, dtype=dtype) if exp_features else None
        if blindspot_size == 1:
            return cls(kv, ref)
        return cls(kv, ref, kv.clone(), None if ref is None else ref.clone())

    def _map(self, fn):
        return CausalState(*(None if t is None else fn(t) for t in (self.kv, self.ref, self.pending, self.pending_ref)),
                           position=self.position)

    def to(self, *args, **kwargs):
        return self._map(lambda t: t.to(*args, **kwargs))

    def detach(self):
        return self._map(torch.Tensor.detach)


def _decay_factor(log_decay, like):
    """exp(log_decay) shaped to scale a (b, h, d, e) state: per head or per key feature."""
    a = log_decay.to(like.dtype).exp()
    return a[..., None, None] if a.ndim == 2 else a[..., None]


def causal_linear_attention_step(q, k, v, state: CausalState, log_decay=None, blindspot_size=1, exp_features=False):
    """One token of causal linear attention: S_t = a_t S_{t-1} + k_t v_tᵀ, out = q_t S_t / q_t z_t.

    Args:
        q, k: (b, h, d) features (logits with ``exp_features``) of the new token. v: (b, h, e).
        state: the ``CausalState`` after the previous token (``CausalState.zeros`` at the start).
        log_decay: optional (b, h) or (b, h, d), log a_t <= 0.
    Returns:
        (out (b, h, e), new state). A masked token is simply not stepped.
    """
    with torch.autocast(q.device.type, enabled=False):  # the state must not drop to half precision
        out, state = _step(q, k, v, state, log_decay, blindspot_size, exp_features)
    return out.to(q.dtype), state


def _step(q, k, v, state, log_decay, blindspot_size, exp_features):
    dtype = state.kv.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    v = _append_ones(v)
    kv, ref, pending, pending_ref = state.kv, state.ref, state.pending, state.pending_ref
    if log_decay is not None and exp_features:
        # the decay moves the references, not the sums: the largest term stays 1
        ld = log_decay.to(dtype)
        ld = ld[..., None] if ld.ndim == 2 else ld
        ref = ref + ld.detach()
        pending_ref = None if pending_ref is None else pending_ref + ld.detach()
        if ld.requires_grad:  # the references carry no gradient: a factor of exactly 1 does
            one = (ld - ld.detach()).exp()[..., None]
            kv = kv * one
            pending = None if pending is None else pending * one
    elif log_decay is not None:
        a = _decay_factor(log_decay, kv)
        kv = kv * a
        pending = None if pending is None else pending * a

    def add_key(acc, acc_ref):
        if not exp_features:
            return acc + torch.einsum("bhd,bhe->bhde", k, v), None
        new_ref = torch.maximum(acc_ref, k.detach())
        acc = acc * _exp_ratio(acc_ref, new_ref)[..., None]
        return acc + torch.einsum("bhd,bhe->bhde", (k - _finite_or_zero(new_ref)).exp(), v), new_ref

    if blindspot_size > 1:
        pending, pending_ref = add_key(pending, pending_ref)
    else:
        kv, ref = add_key(kv, ref)
    qf = _queries_relative_to(q, ref) if exp_features else q
    out = _divide(torch.einsum("bhd,bhde->bhe", qf, kv))

    position = state.position + 1
    if blindspot_size > 1 and position % blindspot_size == 0:
        kv, ref, pending, pending_ref = _complete_block(kv, ref, pending, pending_ref, exp_features)
    return out, CausalState(kv, ref, pending, pending_ref, position)


def _complete_block(kv, ref, pending, pending_ref, exp_features):
    """A blindspot block is complete: its keys (pending) become visible to the next block's
    queries. Returns the new (kv, ref, pending, pending_ref)."""
    if exp_features:
        new_ref = torch.maximum(ref, pending_ref)
        kv = kv * _exp_ratio(ref, new_ref)[..., None] + pending * _exp_ratio(pending_ref, new_ref)[..., None]
        ref, pending_ref = new_ref, torch.full_like(pending_ref, NEG_INF)
    else:
        kv = kv + pending
    return kv, ref, torch.zeros_like(pending), pending_ref


def recurrent_causal_linear_attention(
    q, k, v, log_decay=None, mask=None, blindspot_size=1, exp_features=False, state=None, segments=None
):
    """Reference for ``causal_linear_attention``: the recurrence, one token at a time.
    With ``segments`` (b, n) the state is emptied (sums 0, references -inf) at each
    segment's first token. Returns (out (b, h, n, e), state after the last token)."""
    b, h, n, d = q.shape
    _check_mask(mask, b, n)
    if state is None:
        state = CausalState.zeros(b, h, d, v.shape[-1], blindspot_size, exp_features, q.device, _compute_dtype(q))
    k, v, log_decay = _apply_key_mask(k, v, log_decay, mask, exp_features)
    starts = None if segments is None else F.pad(segments[:, 1:] != segments[:, :-1], (1, 0))
    outs = []
    for t in range(n):
        if starts is not None:
            state = _emptied(state, starts[:, t])
        ld = None if log_decay is None else log_decay[:, :, t]
        out, state = causal_linear_attention_step(
            q[:, :, t], k[:, :, t], v[:, :, t], state, ld, blindspot_size, exp_features
        )
        outs.append(out)
    return torch.stack(outs, dim=2), state


def _emptied(state, rows):
    """``state`` with the batch rows where ``rows`` (b,) is True emptied: no key seen."""
    def empty(t, value):
        return None if t is None else torch.where(rows.view(-1, *(1,) * (t.ndim - 1)), value, t)

    return CausalState(empty(state.kv, 0.0), empty(state.ref, NEG_INF), empty(state.pending, 0.0),
                       empty(state.pending_ref, NEG_INF), state.position)

