"""Linear attention kernels, each with the plain reference it must equal.

The attention weight of key j for query i is

    w_ij = sum_d phi(q_i)_d * phi(k_j)_d * decay_ijd

and the output is ``sum_j w_ij v_j / sum_j w_ij``. Two kinds of features:

* given features (``exp_features=False``): q and k are already non-negative (elu + 1,
  relu, a user's map);
* exponential features (``exp_features=True``): q and k are logits and
  phi(q)_d phi(k)_d = exp(q_d + k_d). This is seed 000's softmax map: the softmax over the
  query's features only adds a per-query constant, which cancels in the ratio. The kernels
  never exponentiate a raw logit: keys are taken relative to a running per-feature maximum
  r_d and each query relative to its own maximum M_i = max_d (q_id + r_d), so every factor
  is <= 1 and, without decay, sum_j w_ij >= 1 for a query that sees the key setting r:
  no overflow, and no tiny denominator to blow up the gradient. The recurrence and the
  blindspot form only read references set by keys their queries see. Inside a chunk
  (blindspot 1) r is the maximum at the chunk's end, which an earlier query may not see:
  if a later key in its chunk exceeds the keys it sees by more than ~60, its weights can
  underflow in float32 (beyond ~88 the gradient overflows, beyond ~100 the output is lost).

In the causal case the same computation has three views:

* the explicit (n x n) weight matrix             -> ``naive_causal_linear_attention``
* the recurrence S_t = a_t * S_{t-1} + k_t v_t^T  -> ``causal_linear_attention_step``
* chunks: quadratic inside a chunk of C tokens, the running state S between
  chunks                                          -> ``causal_linear_attention``

``log_decay`` (log a_t <= 0), per position (b, h, n) or per position and key feature
(b, h, n, d), is the forget gate of gated linear attention. Decays are applied as
exp(G_i - G_j) with i >= j on cumulative sums G, which never exceeds 1.

The normaliser rides along as an extra all-ones column of v, so the state carries S (d x e)
and z (d) as one (d x e+1) tensor. Half-precision inputs are computed in float32 (the
state sums up to n terms and would overflow float16) and cast back on return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = [
    "linear_attention",
    "linear_attention_summary",
    "linear_attention_readout",
    "naive_linear_attention",
    "causal_linear_attention",
    "naive_causal_linear_attention",
    "causal_linear_attention_step",
    "recurrent_causal_linear_attention",
    "CausalState",
]

NEG_INF = float("-inf")
PER_FEATURE_CHUNK, PER_FEATURE_SUB_CHUNK = 16, 4


# --------------------------------------------------------------------------- helpers


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _append_ones(v: torch.Tensor) -> torch.Tensor:
    """(…, e) -> (…, e + 1) with a last column of ones: it accumulates the normaliser."""
    return F.pad(v, (0, 1), value=1.0)


def _divide(out_aug: torch.Tensor) -> torch.Tensor:
    """Split the ones column off and divide. A query that sees no key (all masked, or the
    first blindspot block) has numerator and denominator 0, and gets 0 with zero gradient."""
    num, den = out_aug[..., :-1], out_aug[..., -1:]
    # where(), not a clamped denominator: dividing by a tiny clamp would give a gradient of
    # 1 / tiny that turns into inf and NaN further back
    seen = den > 0
    return torch.where(seen, num / torch.where(seen, den, 1.0), 0.0)


def _check_mask(mask, b, n, name="mask"):
    if mask is None:
        return
    if not torch.is_tensor(mask) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    if tuple(mask.shape) != (b, n):
        raise ValueError(f"{name} must have shape (batch, seq_len) = {(b, n)}, got {tuple(mask.shape)}")


def _apply_key_mask(k, v, log_decay, mask, exp_features):
    """Masked keys contribute nothing and do not decay the state."""
    if mask is None:
        return k, v, log_decay
    m = rearrange(mask, "b n -> b 1 n 1")
    k = k.masked_fill(~m, NEG_INF if exp_features else 0.0)
    v = v.masked_fill(~m, 0.0)
    if log_decay is not None:
        log_decay = log_decay.masked_fill(~(m if log_decay.ndim == 4 else m[..., 0]), 0.0)
    return k, v, log_decay


def _finite_or_zero(t):
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _exp_ratio(a, b):
    """exp(a - b) for references a <= b that may be -inf (no key yet): 0 when a is -inf."""
    return (a - b).exp().nan_to_num(nan=0.0)


def _queries_relative_to(q, ref):
    """exp(q_d + ref_d - M) with M = max_d (q_d + ref_d): the largest factor is exactly 1.

    q: (…, n, d) logits; ref: (…, d) or broadcastable reference of the state / keys, -inf
    for features no key has reached yet. M carries no gradient: it cancels in the ratio."""
    with torch.no_grad():
        shifted = ref - (q.detach() + ref).amax(dim=-1, keepdim=True)
        shifted = torch.where(torch.isfinite(shifted), shifted, torch.full_like(shifted, NEG_INF))
    return (q + shifted).exp()


# ----------------------------------------------------------------- non-causal (global)


def linear_attention(q, k, v, mask=None, normalize=True):
    """Non-causal linear attention, q (kᵀv), in O(n d e).

    Args:
        q: (b, h, n, d) query features.
        k: (b, h, m, d) key features (non-negative when ``normalize``).
        v: (b, h, m, e) values.
        mask: optional (b, m) bool, True for keys to attend to.
        normalize: divide by sum_j w_ij. Off for feature maps that already normalise
            (softmax over keys and over query features gives rows that sum to 1).
    Returns:
        (b, h, n, e)
    """
    return linear_attention_readout(q, linear_attention_summary(k, v, mask, normalize))


def linear_attention_summary(k, v, mask=None, normalize=True):
    """The keys and values reduced to kᵀv: (b, h, d, e), or (b, h, d, e + 1) with the
    normaliser column when ``normalize``. A decoder computes it once per context."""
    _check_mask(mask, k.shape[0], k.shape[2])
    dtype = _compute_dtype(k)
    with torch.autocast(k.device.type, enabled=False):
        k, v = k.to(dtype), v.to(dtype)
        k, v, _ = _apply_key_mask(k, v, None, mask, exp_features=False)
        if normalize:
            v = _append_ones(v)
        summary = torch.einsum("bhmd,bhme->bhde", k, v)
    return summary, normalize


def linear_attention_readout(q, summary):
    """Queries read a ``linear_attention_summary``: (b, h, n, d) -> (b, h, n, e)."""
    kv, normalize = summary
    with torch.autocast(q.device.type, enabled=False):
        out = torch.einsum("bhnd,bhde->bhne", q.to(kv.dtype), kv)
        if normalize:
            out = _divide(out)
    return out.to(q.dtype)


def naive_linear_attention(q, k, v, mask=None, normalize=True):
    """Reference for ``linear_attention``: the explicit (n x m) weight matrix."""
    w = torch.einsum("bhnd,bhmd->bhnm", q, k)
    if mask is not None:
        w = w.masked_fill(~rearrange(mask, "b m -> b 1 1 m"), 0.0)
    out = torch.einsum("bhnm,bhme->bhne", w, v)
    if normalize:
        den = w.sum(-1, keepdim=True)
        out = torch.where(den > 0, out / torch.where(den > 0, den, 1), 0)
    return out


# --------------------------------------------------------------------- causal: naive


def _visibility(n, blindspot_size, device):
    pos = torch.arange(n, device=device)
    if blindspot_size > 1:
        return (pos[None, :] // blindspot_size) < (pos[:, None] // blindspot_size)
    return pos[None, :] <= pos[:, None]


def naive_causal_linear_attention(q, k, v, log_decay=None, mask=None, blindspot_size=1, exp_features=False):
    """Reference for the causal kernels: the explicit (n x n) decayed weight matrix.

    w_ij = sum_d q_id k_jd exp(G_id - G_jd) for visible j, with G = cumsum(log_decay);
    with ``exp_features`` the product q_id k_jd is exp(q_id + k_jd), and the weights are
    formed in log space (logsumexp over d, softmax over j), which is stable by itself.
    Key j is visible to query i when j <= i, or, with ``blindspot_size`` B > 1, when j lies
    in an earlier block of B tokens than i (j // B < i // B).
    """
    b, h, n, d = q.shape
    visible = _visibility(n, blindspot_size, q.device)
    if mask is not None:
        visible = visible & rearrange(mask, "b j -> b 1 1 j")
    pair = q[:, :, :, None, :], k[:, :, None, :, :]  # (b, h, i, j, d) by broadcasting
    if log_decay is not None:
        if log_decay.ndim == 3:
            log_decay = log_decay[..., None].expand(b, h, n, d)
        if mask is not None:
            log_decay = log_decay.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), 0.0)
        G = log_decay.cumsum(dim=2)
        decay = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~visible[..., None], NEG_INF)
    else:
        decay = torch.zeros(1, dtype=q.dtype, device=q.device).masked_fill(~visible[..., None], NEG_INF)
    if exp_features:
        # invisible pairs and rows that see nothing get finite stand-ins, masked again after:
        # a logsumexp or softmax over only -inf has a NaN gradient (0 * NaN), even unused
        logits = pair[0] + pair[1] + decay.masked_fill(~visible[..., None], 0.0)
        log_w = torch.logsumexp(logits, dim=-1).masked_fill(~visible, NEG_INF)
        seen = visible.any(dim=-1, keepdim=True)
        w = log_w.masked_fill(~seen, 0.0).softmax(dim=-1).masked_fill(~seen, 0.0)  # sees nothing: 0
        return w @ v
    w = (pair[0] * pair[1] * decay.exp()).sum(-1)
    out = w @ v
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, out / torch.where(den > 0, den, 1), 0)


# ----------------------------------------------------------------- causal: recurrent


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
    if log_decay is not None:
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
        # the block is complete: its keys become visible to the next block's queries
        if exp_features:
            new_ref = torch.maximum(ref, pending_ref)
            kv = kv * _exp_ratio(ref, new_ref)[..., None] + pending * _exp_ratio(pending_ref, new_ref)[..., None]
            ref, pending_ref = new_ref, torch.full_like(pending_ref, NEG_INF)
        else:
            kv = kv + pending
        pending = torch.zeros_like(pending)
    return out, CausalState(kv, ref, pending, pending_ref, position)


def recurrent_causal_linear_attention(
    q, k, v, log_decay=None, mask=None, blindspot_size=1, exp_features=False, state=None
):
    """Reference for ``causal_linear_attention``: the recurrence, one token at a time.
    Returns (out (b, h, n, e), state after the last token)."""
    b, h, n, d = q.shape
    _check_mask(mask, b, n)
    if state is None:
        state = CausalState.zeros(b, h, d, v.shape[-1], blindspot_size, exp_features, q.device, _compute_dtype(q))
    k, v, log_decay = _apply_key_mask(k, v, log_decay, mask, exp_features)
    outs = []
    for t in range(n):
        ld = None if log_decay is None else log_decay[:, :, t]
        out, state = causal_linear_attention_step(
            q[:, :, t], k[:, :, t], v[:, :, t], state, ld, blindspot_size, exp_features
        )
        outs.append(out)
    return torch.stack(outs, dim=2), state


# --------------------------------------------------------------------- causal: chunked


def _intra_chunk_weights(q, k, G, sub_chunk):
    """w_ij inside each chunk for j <= i.  q, k: (…, C, d) factors; G: (…, C) or (…, C, d) or None."""
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if G is None:
        return (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
    if G.ndim == q.ndim - 1:  # decay per position: one (C x C) factor per chunk
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, NEG_INF)
        return (q @ k.transpose(-1, -2)) * diff.exp()
    if C % sub_chunk or C == sub_chunk:
        return _pairwise_weights(q, k, G)
    return _two_level_weights(q, k, G, sub_chunk)


def _pairwise_weights(q, k, G):
    """Decay per feature, formed pair by pair: (…, C, C, d) — only for short chunks."""
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], NEG_INF)
    # explicit products and a sum: as an einsum this becomes a batched matmul of 1 x 1 blocks
    return (diff.exp() * k[..., None, :, :] * q[..., :, None, :]).sum(-1)


def _two_level_weights(q, k, G, s):
    """Decay per feature in chunks of C split into sub-chunks of s.

    For a query sub-chunk I and the keys before it, the decay exp(G_i - G_j) factors through
    R_I, the cumulative decay just before I: exp(G_i - R_I) * exp(R_I - G_j), both <= 1, so
    those weights are one matmul per sub-chunk. Only the s x s blocks on the diagonal are
    formed pair by pair. Memory O(C (C/s + s) d) per chunk instead of O(C^2 d)."""
    C, d = q.shape[-2:]
    m = C // s
    qs, Gs = (rearrange(t, "... (m s) d -> ... m s d", s=s) for t in (q, G))
    diag = _pairwise_weights(qs, rearrange(k, "... (m s) d -> ... m s d", s=s), Gs)  # (…, m, s, s)

    R = Gs[..., :-1, -1, :]  # (…, m-1, d): decay before sub-chunk I = 1 .. m-1
    q_ref = qs[..., 1:, :, :] * (Gs[..., 1:, :, :] - R[..., None, :]).exp()  # (…, m-1, s, d)
    before = torch.arange(C, device=q.device)[None, :] < (torch.arange(1, m, device=q.device) * s)[:, None]
    to_ref = (R[..., :, None, :] - G[..., None, :, :]).masked_fill(~before[..., None], NEG_INF)
    k_ref = k[..., None, :, :] * to_ref.exp()  # (…, m-1, C, d), zero for keys not before I
    off = q_ref @ k_ref.transpose(-1, -2)  # (…, m-1, s, C)

    w = torch.cat((torch.zeros_like(off[..., :1, :, :]), off), dim=-3)  # (…, m, s, C)
    w = rearrange(w, "... m s (m2 s2) -> ... m s m2 s2", s2=s)
    eye = torch.eye(m, dtype=w.dtype, device=w.device)[:, None, :, None]
    w = w + diag[..., :, :, None, :] * eye
    return rearrange(w, "... m s m2 s2 -> ... (m s) (m2 s2)")


def _chunk_references(k, state, blindspot):
    """Per-feature log references for exponential features, (b, h, c, d) each.

    r_c: running maximum of the keys up to the end of chunk c: chunk c's keys are stored
    relative to it. rho_c: reference of the state a query of chunk c reads: r_c when the
    query also sees its own chunk, r_{c-1} (earlier chunks only) with a blindspot.
    rho has one more entry: the reference of the state after the last chunk."""
    with torch.no_grad():
        r = k.detach().amax(dim=3)
        start = None if state is None else state.ref[:, :, None]
        if start is not None:
            r = torch.cat((start, r), dim=2)
        r = r.cummax(dim=2).values
        if start is not None:
            r = r[:, :, 1:]
        if blindspot:
            before = start if start is not None else torch.full_like(r[:, :, :1], NEG_INF)
            rho = torch.cat((before, r), dim=2)
        else:
            rho = torch.cat((r, r[:, :, -1:]), dim=2)
    return r, rho


def causal_linear_attention(
    q, k, v, log_decay=None, mask=None, blindspot_size=1, chunk_size=64, exp_features=False,
    state=None, return_state=False,
):
    """Causal linear attention, chunk by chunk, in O(n) memory.

    Inside a chunk the weights are formed explicitly (C x C); between chunks a running
    state S (d x e+1 per head) carries every earlier key. No (n, d, e) tensor is made.
    With ``blindspot_size`` B > 1 the chunk is the blindspot block and only the state
    term remains: a query sees exactly the keys of earlier blocks.

    Args:
        q, k: (b, h, n, d) query / key features, or logits with ``exp_features``.
        v: (b, h, n, e).
        log_decay: optional (b, h, n) or (b, h, n, d): log a_t <= 0 of the recurrence.
        mask: optional (b, n) bool, True for real tokens (padding keys are skipped and
            do not decay the state).
        blindspot_size: B, see above. chunk_size: C when B == 1.
        exp_features: q, k are logits and the features are exp(q + k) (see module doc).
        state: optional ``CausalState`` to continue from (cached decoding).
        return_state: also return the ``CausalState`` after the last token.
    Returns:
        (b, h, n, e), and the state when ``return_state``.
    """
    b, h, n, d = q.shape
    _check_mask(mask, b, n)
    if blindspot_size < 1 or chunk_size < 1:
        raise ValueError("blindspot_size and chunk_size must be >= 1")
    if state is not None and n == 1:  # decoding one token: the recurrence is the cheapest form
        out, state = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot_size, exp_features, state)
        return (out, state) if return_state else out
    if state is not None and blindspot_size > 1 and state.position % blindspot_size:
        return _continue_inside_block(q, k, v, log_decay, mask, blindspot_size, chunk_size, exp_features, state,
                                      return_state)

    out_dtype = q.dtype
    dtype = _compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = (t.to(dtype) for t in (q, k, v))
        log_decay = None if log_decay is None else log_decay.to(dtype)
        k, v, log_decay = _apply_key_mask(k, v, log_decay, mask, exp_features)
        v = _append_ones(v)

        blindspot = blindspot_size > 1
        per_feature_decay = log_decay is not None and log_decay.ndim == 4
        # a per-feature decay is formed pair by pair inside sub-chunks (see _two_level_weights):
        # chunks of 16 in sub-chunks of 4 keep that elementwise work smallest (measured on CPU:
        # 0.6 s vs 1.4 s for chunks of 64 in 16, n=4096, 8 heads of 64, forward + backward)
        if blindspot:
            C = blindspot_size
        elif per_feature_decay:
            C = min(chunk_size, PER_FEATURE_CHUNK)
        else:
            C = chunk_size
        pad = -n % C
        if pad:  # padded keys are invisible (zero features) and do not decay
            q, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, v))
            k = F.pad(k, (0, 0, 0, pad), value=NEG_INF if exp_features else 0.0)
            if log_decay is not None:
                log_decay = F.pad(log_decay, (0, 0, 0, pad) if log_decay.ndim == 4 else (0, pad))
        q, k, v = (rearrange(t, "b h (c l) d -> b h c l d", l=C) for t in (q, k, v))

        # factors: features, or for exponential features exp(logit - reference) <= 1
        if exp_features:
            r, rho = _chunk_references(k, state, blindspot)
            k = (k - _finite_or_zero(r)[:, :, :, None]).exp()
            q = _queries_relative_to(q, rho[:, :, :-1, None])
            # entering chunk c + 1 the state moves from reference rho_c to rho_{c+1}, and
            # chunk c's own keys from r_c to rho_{c+1}
            state_rescale = _exp_ratio(rho[:, :, :-1], rho[:, :, 1:])  # (b, h, c, d)
            chunk_rescale = _exp_ratio(r, rho[:, :, 1:])

        if log_decay is None:
            G, k_to_end, chunk_decay = None, k, None
        else:
            pattern = "b h (c l) d -> b h c l d" if log_decay.ndim == 4 else "b h (c l) -> b h c l"
            G = rearrange(log_decay, pattern, l=C).cumsum(dim=3)  # decay since the chunk start
            decay_to_end = (G[:, :, :, -1:] - G).exp()  # <= 1
            k_to_end = k * (decay_to_end if G.ndim == 5 else decay_to_end[..., None])
            chunk_decay = G[:, :, :, -1].exp()
            if chunk_decay.ndim == 3:
                chunk_decay = chunk_decay[..., None]  # (b, h, c, 1 or d)

        # each chunk's own contribution to the state, decayed to the chunk's end
        kv_chunks = torch.einsum("bhcld,bhcle->bhcde", k_to_end, v)
        if exp_features:
            kv_chunks = kv_chunks * chunk_rescale[..., None]
            state_decay = state_rescale if chunk_decay is None else state_rescale * chunk_decay
        else:
            state_decay = chunk_decay

        # the scan over chunks: states[c] is the state a query of chunk c reads
        if state is None:
            kv = torch.zeros_like(kv_chunks[:, :, 0])
        else:  # move the incoming state to the reference its first readers use
            kv = state.kv.to(dtype)
            if exp_features:
                kv = kv * _exp_ratio(state.ref.to(dtype), rho[:, :, 0])[..., None]
        # (unbind once: indexing chunk c inside the loop would cost a full-size zero gradient
        # per chunk in backward, quadratic in the number of chunks)
        states = []
        decays = [None] * kv_chunks.shape[2] if state_decay is None else state_decay[..., None].unbind(2)
        for kv_c, decay_c in zip(kv_chunks.unbind(2), decays):
            states.append(kv)
            kv = kv_c + (kv if decay_c is None else kv * decay_c)
        states = torch.stack(states, dim=2)

        q_from_start = q if G is None else q * (G.exp() if G.ndim == 5 else G.exp()[..., None])
        out = torch.einsum("bhcld,bhcde->bhcle", q_from_start, states)
        if not blindspot:
            out = out + _intra_chunk_weights(q, k, G, PER_FEATURE_SUB_CHUNK) @ v

        out = _divide(rearrange(out, "b h c l e -> b h (c l) e")[:, :, :n])

    if not return_state:
        return out.to(out_dtype)
    # padded steps have no keys and no decay: `kv` is the state after token n - 1
    position = (state.position if state is not None else 0) + n
    ref = rho[:, :, -1] if exp_features else None
    if not blindspot:
        return out.to(out_dtype), CausalState(kv, ref, position=position)
    if n % C == 0:  # every block complete
        pending = torch.zeros_like(kv)
        pending_ref = torch.full_like(ref, NEG_INF) if exp_features else None
        return out.to(out_dtype), CausalState(kv, ref, pending, pending_ref, position)
    # the last block is unfinished: its keys wait in `pending`, the visible state is the
    # one the last chunk's queries read, decayed through that chunk
    last = states[:, :, -1]
    if chunk_decay is not None:
        last = last * chunk_decay[:, :, -1, :, None]
    pending = torch.einsum("bhld,bhle->bhde", k_to_end[:, :, -1], v[:, :, -1])
    return out.to(out_dtype), CausalState(
        last, rho[:, :, -2] if exp_features else None, pending, r[:, :, -1] if exp_features else None, position
    )


def _continue_inside_block(q, k, v, log_decay, mask, blindspot_size, chunk_size, exp_features, state, return_state):
    """Continue from a state in the middle of a blindspot block: finish that block with
    the recurrence, then go on chunk by chunk from the block boundary."""
    n = q.shape[2]
    head = min(n, blindspot_size - state.position % blindspot_size)

    def part(t, sl):
        return None if t is None else t[:, :, sl] if t.ndim > 2 else t[:, sl]

    first = slice(0, head)
    out, state = recurrent_causal_linear_attention(
        *(part(t, first) for t in (q, k, v, log_decay)), mask=None if mask is None else mask[:, first],
        blindspot_size=blindspot_size, exp_features=exp_features, state=state,
    )
    outs = [out]
    if head < n:
        rest = slice(head, n)
        out, state = causal_linear_attention(
            *(part(t, rest) for t in (q, k, v, log_decay)), mask=None if mask is None else mask[:, rest],
            blindspot_size=blindspot_size, chunk_size=chunk_size, exp_features=exp_features, state=state,
            return_state=True,
        )
        outs.append(out)
    out = torch.cat(outs, dim=2)
    return (out, state) if return_state else out
