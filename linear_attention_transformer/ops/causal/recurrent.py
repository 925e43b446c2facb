"""The causal recurrence, one token at a time: S_t = a_t S_{t-1} + k_t v_tᵀ, on one state,
``CausalState``, by one step, ``CausalState.step`` (the math of the references: ``chunk.py``).

The step writes in place into the state's fixed-shape buffers: a decoder steps its own state
with nothing allocated that outlives the step, nothing read back to the host, one traced
graph. A blindspot block's join is scaled by flags (``join_flags``) that leave every buffer
bit for bit as it was except at the block's last position. ``causal_linear_attention_step`` steps a copy instead (a new
state per token, differentiable, masked keys allowed); over a sequence,
``recurrent_causal_linear_attention``, it is the judge the chunked forms are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import NEG_INF, apply_key_mask, check_mask, compute_dtype
from .scan import join_factors

__all__ = ["CausalState", "causal_linear_attention_step", "recurrent_causal_linear_attention"]


class CausalState:
    """The recurrent state of one layer's global heads.

    Attributes:
        kv: (b, h, d, e + 1) decayed sum of k vᵀ over the keys queries may see; the last
            column is the normaliser z.
        ref: (b, h, d) per-feature log reference of ``kv`` (exponential features only, -inf
            before any key), else None: kv holds sum_j exp(k_j - ref) v_jᵀ.
        pending, pending_ref: the same for the keys of the current unfinished blindspot block
            (None when ``blindspot_size`` is 1). After an in-place join, pending keeps its old
            sums under a reference of -inf (the next key's rescale, by 0, empties it).
        position: tokens consumed (an int), counted by ``causal_linear_attention_step``;
            ``step`` leaves the count to its caller (a decoder's cache position).
    ``causal_linear_attention_step`` never modifies a state: a caller may keep one and branch.
    """

    fields = ("kv", "ref", "pending", "pending_ref")
    __slots__ = fields + ("position",)

    def __init__(self, kv, ref=None, pending=None, pending_ref=None, position=0):
        self.kv, self.ref, self.pending, self.pending_ref, self.position = kv, ref, pending, pending_ref, position

    @classmethod
    def zeros(cls, b, h, d, e, blindspot_size=1, exp_features=False, device=None, dtype=torch.float32):
        kv = torch.zeros(b, h, d, e + 1, device=device, dtype=dtype)
        ref = torch.full((b, h, d), NEG_INF, device=device, dtype=dtype) if exp_features else None
        if blindspot_size == 1:
            return cls(kv, ref)
        return cls(kv, ref, kv.clone(), None if ref is None else ref.clone())

    @classmethod
    def at_block_boundary(cls, kv, ref, position, blindspot=False):
        """The state holding ``kv`` on ``ref`` after ``position`` tokens, with a blindspot's
        pending block empty (nothing seen of the next block yet)."""
        if not blindspot:
            return cls(kv, ref, position=position)
        return cls(kv, ref, torch.zeros_like(kv), None if ref is None else torch.full_like(ref, NEG_INF), position)

    def buffers(self, all_fields=False):
        fields = [getattr(self, name) for name in self.fields]
        return fields if all_fields else [t for t in fields if t is not None]

    def map_tensors(self, fn):
        """A state of ``fn`` applied to each of this one's tensors (its position kept)."""
        kv, ref, pending, pending_ref = (None if t is None else fn(t) for t in self.buffers(True))
        return CausalState(kv, ref, pending, pending_ref, self.position)

    def to(self, *args, **kwargs):
        return self.map_tensors(lambda t: t.to(*args, **kwargs))

    def detach(self):
        return self.map_tensors(torch.Tensor.detach)

    def as_causal_state(self, position):
        """New tensors: the state after ``position`` tokens (what ``causal_linear_attention``
        continues from)."""
        pending, pending_ref = self.pending, self.pending_ref
        if pending_ref is not None:  # (sums under -inf stand for nothing)
            pending = torch.where(torch.isfinite(pending_ref)[..., None], pending, 0.0)
        clone = (lambda t: None if t is None else t.clone())  # noqa: E731
        return CausalState(self.kv.clone(), clone(self.ref), clone(pending), clone(pending_ref), position)

    def load(self, state):
        """Copy ``state``'s sums into the buffers."""
        for buffer, value in zip(self.buffers(True), state.buffers(True)):
            if buffer is not None:
                buffer.copy_(value)

    def step(self, q, k, v, log_decay=None, where=None, all_seen=False, masked_keys=False):
        """One token in place: q, k (b, h, d) (logits with exponential features), v (b, h, e)
        in the state's dtype, log_decay None, (b, h) or (b, h, d); ``where``: the position's
        ``join_flags`` (None: no join now); ``all_seen``: as ``read_state``; ``masked_keys``: k
        may be a masked key (-inf), which needs ``join_factors``' guard (a decoder's keys are
        real). Returns out (b, h, e). Differentiable on tensors of their own
        (``causal_linear_attention_step`` steps a copy)."""
        kv, ref, pending, pending_ref = self.kv, self.ref, self.pending, self.pending_ref
        exp_features, blindspot = ref is not None, pending is not None
        v1 = F.pad(v, (0, 1), value=1.0)[:, :, None, :]  # (the ones column accumulates the normaliser)
        if log_decay is not None:
            ld = log_decay[..., None] if log_decay.ndim == 2 else log_decay  # (b, h, 1 or d)
            if exp_features:  # the decay moves the references, not the sums
                ref.add_(ld)
                if blindspot:
                    pending_ref.add_(ld)
            else:
                a = ld.exp()[..., None]
                kv.mul_(a)
                if blindspot:
                    pending.mul_(a)
        acc, acc_ref = (pending, pending_ref) if blindspot else (kv, ref)
        if exp_features:  # a key moves the reference to max(ref, k) (``join_factors``)
            new_ref, acc_factor, key_factor = join_factors(acc_ref, k, other_finite=not masked_keys)
            acc.mul_(acc_factor[..., None]).addcmul_(key_factor[..., None], v1)
            acc_ref.copy_(new_ref)
        else:
            acc.addcmul_(k[..., None], v1)
        out = read_state(q, kv, ref, all_seen)
        if blindspot and where is not None:
            self._join(*where)
        return out

    def _join(self, a, b):
        """The blindspot block's keys join the state when (a, b) = (1, 0) (log: (0, -inf)), and
        (0, 1) ((-inf, 0)) leaves both exactly as they were."""
        kv, ref, pending, pending_ref = self.kv, self.ref, self.pending, self.pending_ref
        if ref is None:
            kv.addcmul_(pending, a)
            pending.mul_(b)
            return
        new_ref, kv_factor, pending_factor = join_factors(ref, pending_ref + a)  # (-inf unless the block joins now)
        kv.mul_(kv_factor[..., None]).addcmul_(pending, pending_factor[..., None])
        ref.copy_(new_ref)
        pending_ref.add_(b)


def causal_linear_attention_step(q, k, v, state: CausalState, log_decay=None, blindspot_size=1, exp_features=False):
    """One token of causal linear attention: S_t = a_t S_{t-1} + k_t v_tᵀ, out = q_t S_t / q_t z_t.

    Args:
        q, k: (b, h, d) features (logits with ``exp_features``) of the new token. v: (b, h, e).
        state: the ``CausalState`` after the previous token (``CausalState.zeros`` at the start).
        log_decay: optional (b, h) or (b, h, d), log a_t <= 0.
    Returns:
        (out (b, h, e), new state): ``CausalState.step`` on a copy of ``state``, differentiable.
        A masked token is simply not stepped; a masked key (-inf, or 0 with given features) is
        allowed.
    """
    layout = (state.ref is not None, state.pending is not None)
    if layout != (exp_features, blindspot_size > 1):
        raise ValueError("state must be a CausalState of these exp_features and blindspot_size (CausalState.zeros, "
                         "or a decoder's state.as_causal_state)")
    new = state.map_tensors(torch.clone)
    new.position = state.position + 1
    out_dtype, dtype = q.dtype, new.kv.dtype
    with torch.autocast(q.device.type, enabled=False):  # the state must not drop to half precision
        q, k, v = (t.to(dtype) for t in (q, k, v))
        log_decay = None if log_decay is None else log_decay.to(dtype)
        out = new.step(q, k, v, log_decay, masked_keys=True)
        if blindspot_size > 1:
            zero = new.kv.new_zeros(())
            where = join_flags(state.position, blindspot_size, exp_features, zero, zero + NEG_INF)
            if where is not None:  # joined on copies: the read keeps its tensors for backward
                new = new.map_tensors(torch.clone)
                new._join(*where)
    return out.to(out_dtype), new


def recurrent_causal_linear_attention(q, k, v, log_decay=None, mask=None, blindspot_size=1, exp_features=False,
                                      state=None, segments=None):
    """Reference for ``causal_linear_attention``: the recurrence, one token at a time.
    With ``segments`` (b, n) the state is emptied (sums 0, references -inf) at each
    segment's first token. Returns (out (b, h, n, e), state after the last token)."""
    b, h, n, d = q.shape
    check_mask(mask, b, n)
    if state is None:
        state = CausalState.zeros(b, h, d, v.shape[-1], blindspot_size, exp_features, q.device, compute_dtype(q))
    k, v, log_decay = apply_key_mask(k, v, log_decay, mask, exp_features)
    starts = None if segments is None else F.pad(segments[:, 1:] != segments[:, :-1], (1, 0))
    outs = []
    for t in range(n):
        if starts is not None:
            state = _emptied(state, starts[:, t])
        ld = None if log_decay is None else log_decay[:, :, t]
        out, state = causal_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, ld, blindspot_size,
                                                  exp_features)
        outs.append(out)
    return torch.stack(outs, dim=2), state


def _emptied(state, rows):
    """``state`` with the batch rows where ``rows`` (b,) is True emptied: no key seen."""
    def empty(t, value):
        return None if t is None else torch.where(rows.view(-1, *(1,) * (t.ndim - 1)), value, t)

    return CausalState(empty(state.kv, 0.0), empty(state.ref, NEG_INF), empty(state.pending, 0.0),
                       empty(state.pending_ref, NEG_INF), state.position)


def join_flags(p, blindspot_size, exp_features, zero, hidden):
    """Whether the token at position p completes its blindspot block, as the factors
    ``CausalState.step`` joins with: (flag, 1 - flag) with given features, (log flag, log(1 -
    flag)) (0 or -inf) with exponential ones; ``zero``, ``hidden``: 0 and -inf in the state's
    dtype. p a long tensor, or an int: then None where the block goes on."""
    if isinstance(p, int):
        if (p + 1) % blindspot_size:
            return None
        return (zero, hidden) if exp_features else (1 - zero, zero)
    completes = torch.remainder(p + 1, blindspot_size) == 0
    if exp_features:
        return torch.where(completes, zero, hidden), torch.where(completes, hidden, zero)
    flag = completes.to(zero.dtype)
    return flag, 1 - flag


def read_state(q, kv, ref, all_seen=False):
    """A query reads a state (the numbers of ``queries_relative_to`` and ``divide_by_normaliser``):
    q (b, h, d), kv (b, h, d, e + 1) on ref (b, h, d) (None: given features) -> (b, h, e); 0 for
    a row before any key.
    ``all_seen``: the caller knows every row has seen a key (the factors are then a softmax,
    and the guards are left out). Products and sums, not a batched matmul: see
    ``windowed_attention_step``."""
    if ref is None:
        num = (q[..., None] * kv).sum(dim=-2)
    elif all_seen:
        num = (torch.softmax(q + ref, dim=-1)[..., None] * kv).sum(dim=-2)
        return num[..., :-1] / num[..., -1:]
    else:
        logits = q + ref
        # a row before any key: ref and top are -inf; a finite top gives 0 / 0, read as 0
        top = logits.amax(dim=-1, keepdim=True).clamp(min=-torch.finfo(logits.dtype).max)
        num = ((logits - top).exp()[..., None] * kv).sum(dim=-2)
    # (a denominator may be just below 1 where a prefill's reference is rounded: only 0 is guarded)
    den = num[..., -1:]
    return num[..., :-1] / torch.where(den > 0, den, 1.0)
