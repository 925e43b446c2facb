"""Linear attention kernels, each with the plain reference it must equal.

Every function here works on *features*: queries and keys that a feature map has
already made non-negative (see ``feature_maps.py``). The attention weight of key j
for query i is

    w_ij = sum_d q_id * k_jd * decay_ijd

and the output is ``sum_j w_ij v_j / sum_j w_ij`` (or the unnormalised sum where
the feature map already normalises, as seed 000's softmax map does without a
causal mask).

In the causal case the same computation has three views:

* the explicit (n x n) weight matrix            -> ``naive_causal_linear_attention``
* the recurrence S_t = a_t * S_{t-1} + k_t v_t^T -> ``causal_linear_attention_step``
* chunks: quadratic inside a chunk of C tokens, the running state S between
  chunks                                         -> ``causal_linear_attention``

``log_decay`` (log a_t <= 0) is per position (b, h, n) or per position and key
feature (b, h, n, d). It serves both the forget gate of gated linear attention and
the running-max stabiliser of the exponential feature map, which is a scalar decay
in disguise (see ``feature_maps.exp_keys_with_running_max``). All decays are applied
as exp(G_i - G_j) with i >= j on cumulative sums G, which never exceeds 1: there is
no exp of a large positive number anywhere.

The normaliser rides along as an extra all-ones column of v, so the state carries
S (d x e) and z (d) as one (d x e+1) tensor.

Half-precision inputs are computed in float32 (the running state sums up to n
terms and would overflow float16) and cast back on return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = [
    "linear_attention",
    "naive_linear_attention",
    "causal_linear_attention",
    "naive_causal_linear_attention",
    "causal_linear_attention_step",
    "recurrent_causal_linear_attention",
    "CausalState",
]


# --------------------------------------------------------------------------- helpers


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _append_ones(v: torch.Tensor) -> torch.Tensor:
    """(…, e) -> (…, e + 1) with a last column of ones: it accumulates the normaliser."""
    return F.pad(v, (0, 1), value=1.0)


def _divide(out_aug: torch.Tensor) -> torch.Tensor:
    """Split the ones column off and divide. A query that sees no key (all masked, or the
    first blindspot block) has numerator and denominator 0, and gets 0 with a zero gradient
    (dividing by a clamped tiny denominator instead gives a gradient of 1 / tiny that turns
    into inf and NaN further back)."""
    num, den = out_aug[..., :-1], out_aug[..., -1:]
    seen = den > 0
    return torch.where(seen, num / torch.where(seen, den, 1.0), 0.0)


def _apply_key_mask(k, v, log_decay, mask):
    """Masked keys contribute nothing and do not decay the state."""
    if mask is None:
        return k, v, log_decay
    m = rearrange(mask, "b n -> b 1 n 1")
    k = k.masked_fill(~m, 0.0)
    v = v.masked_fill(~m, 0.0)
    if log_decay is not None:
        lm = m if log_decay.ndim == 4 else m[..., 0]
        log_decay = log_decay.masked_fill(~lm, 0.0)
    return k, v, log_decay


def _check_mask(mask, b, n, name="mask"):
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}")
    if tuple(mask.shape) != (b, n):
        raise ValueError(f"{name} must have shape (batch, seq_len) = {(b, n)}, got {tuple(mask.shape)}")


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
    _check_mask(mask, k.shape[0], k.shape[2])
    out_dtype = q.dtype
    dtype = _compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = (t.to(dtype) for t in (q, k, v))
        k, v, _ = _apply_key_mask(k, v, None, mask)
        if normalize:
            v = _append_ones(v)
        context = torch.einsum("bhmd,bhme->bhde", k, v)
        out = torch.einsum("bhnd,bhde->bhne", q, context)
        if normalize:
            out = _divide(out)
    return out.to(out_dtype)


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


def naive_causal_linear_attention(q, k, v, log_decay=None, mask=None, blindspot_size=1):
    """Reference for the causal kernels: the explicit (n x n) decayed weight matrix.

    w_ij = sum_d q_id k_jd exp(G_id - G_jd) for visible j, with G = cumsum(log_decay).
    Key j is visible to query i when j <= i, or, with ``blindspot_size`` B > 1, when
    j lies in an earlier block of B tokens than i (j // B < i // B).
    """
    b, h, n, d = q.shape
    pos = torch.arange(n, device=q.device)
    if blindspot_size > 1:
        visible = (pos[None, :] // blindspot_size) < (pos[:, None] // blindspot_size)
    else:
        visible = pos[None, :] <= pos[:, None]
    if mask is not None:
        visible = visible & rearrange(mask, "b j -> b 1 1 j")
    if log_decay is None:
        w = torch.einsum("bhid,bhjd->bhij", q, k)
    else:
        if log_decay.ndim == 3:
            log_decay = log_decay[..., None].expand(b, h, n, d)
        if mask is not None:
            log_decay = log_decay.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), 0.0)
        G = log_decay.cumsum(dim=2)
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # (b, h, i, j, d)
        diff = diff.masked_fill(~visible[..., None], float("-inf"))
        w = torch.einsum("bhid,bhjd,bhijd->bhij", q, k, diff.exp())
    w = w.masked_fill(~visible, 0.0)
    out = torch.einsum("bhij,bhje->bhie", w, v)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, out / torch.where(den > 0, den, 1), 0)


# ----------------------------------------------------------------- causal: recurrent


class CausalState:
    """Recurrent state of causal linear attention for one layer's global heads.

    Attributes:
        kv: (b, h, d, e + 1) sum of decayed k vᵀ over the keys a query may see; the last
            column is the normaliser z.
        pending: (b, h, d, e + 1) keys of the current unfinished blindspot block, or None
            when ``blindspot_size`` is 1.
        position: number of tokens consumed so far (an int).
    Instances are never modified in place: every step returns a new one.
    """

    __slots__ = ("kv", "pending", "position")

    def __init__(self, kv, pending=None, position=0):
        self.kv, self.pending, self.position = kv, pending, position

    @classmethod
    def zeros(cls, b, h, d, e, blindspot_size=1, device=None, dtype=torch.float32):
        kv = torch.zeros(b, h, d, e + 1, device=device, dtype=dtype)
        return cls(kv, kv.clone() if blindspot_size > 1 else None, 0)

    def to(self, *args, **kwargs):
        return CausalState(
            self.kv.to(*args, **kwargs),
            None if self.pending is None else self.pending.to(*args, **kwargs),
            self.position,
        )


def causal_linear_attention_step(q, k, v, state: CausalState, log_decay=None, blindspot_size=1):
    """One token of causal linear attention: S_t = a_t S_{t-1} + k_t v_tᵀ, out = q_t S_t / q_t z_t.

    Args:
        q, k: (b, h, d) features of the new token. v: (b, h, e).
        state: the ``CausalState`` after the previous token.
        log_decay: optional (b, h) or (b, h, d), log a_t <= 0.
    Returns:
        (out (b, h, e), new state)
    """
    out_dtype = q.dtype
    with torch.autocast(q.device.type, enabled=False):  # the state must not drop to half precision
        dtype = state.kv.dtype
        q, k, v = (t.to(dtype) for t in (q, k, v))
        kv, pending = state.kv, state.pending
        if log_decay is not None:
            a = log_decay.to(dtype).exp()
            a = a[..., None, None] if a.ndim == 2 else a[..., None]
            kv = kv * a
            pending = None if pending is None else pending * a
        new = torch.einsum("bhd,bhe->bhde", k, _append_ones(v))
        if blindspot_size > 1:
            pending = pending + new
        else:
            kv = kv + new
        out = _divide(torch.einsum("bhd,bhde->bhe", q, kv))
        position = state.position + 1
        if blindspot_size > 1 and position % blindspot_size == 0:
            # the block is complete: its keys become visible to the next block's queries
            kv, pending = kv + pending, torch.zeros_like(pending)
    return out.to(out_dtype), CausalState(kv, pending, position)


def recurrent_causal_linear_attention(q, k, v, log_decay=None, mask=None, blindspot_size=1, state=None):
    """Reference for ``causal_linear_attention``: the recurrence, one token at a time."""
    b, h, n, d = q.shape
    _check_mask(mask, b, n)
    k, v, log_decay = _apply_key_mask(k, v, log_decay, mask)
    if state is None:
        state = CausalState.zeros(b, h, d, v.shape[-1], blindspot_size, q.device, _compute_dtype(q))
    outs = []
    for t in range(n):
        ld = None if log_decay is None else log_decay[:, :, t]
        out, state = causal_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, ld, blindspot_size)
        outs.append(out)
    return torch.stack(outs, dim=2), state


# --------------------------------------------------------------------- causal: chunked


def _intra_chunk_weights(q, k, G):
    """w_ij inside each chunk for j <= i.  q, k: (…, C, d); G: (…, C) or (…, C, d) or None."""
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if G is None:
        return (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
    if G.ndim == q.ndim - 1:  # scalar decay per position: a (C x C) factor per chunk
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf"))
        return (q @ k.transpose(-1, -2)) * diff.exp()
    # per-feature decay: the factor differs per feature, so form it pairwise (C x C x d)
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    return torch.einsum("...id,...jd,...ijd->...ij", q, k, diff.exp())


def causal_linear_attention(
    q, k, v, log_decay=None, mask=None, blindspot_size=1, chunk_size=64, state=None, return_state=False
):
    """Causal linear attention, chunk by chunk, in O(n) memory.

    Inside a chunk the weights are formed explicitly (C x C); between chunks a running
    state S (d x e+1 per head) carries every earlier key. No (n, d, e) tensor is made.
    With ``blindspot_size`` B > 1 the chunk is the blindspot block and only the state
    term remains: a query sees exactly the keys of earlier blocks.

    Args:
        q, k: (b, h, n, d) query / key features. v: (b, h, n, e).
        log_decay: optional (b, h, n) or (b, h, n, d): log a_t <= 0 of the recurrence.
        mask: optional (b, n) bool, True for real tokens (padding keys are skipped and
            do not decay the state).
        blindspot_size: B, see above. chunk_size: C when B == 1.
        state: optional ``CausalState`` to continue from (cached decoding).
        return_state: also return the ``CausalState`` after the last token.
    Returns:
        (b, h, n, e), and the state when ``return_state``.
    """
    b, h, n, d = q.shape
    _check_mask(mask, b, n)
    if blindspot_size < 1 or chunk_size < 1:
        raise ValueError("blindspot_size and chunk_size must be >= 1")
    if state is not None and blindspot_size > 1 and state.position % blindspot_size:
        # continuing inside an unfinished block: finish it with the recurrence, then chunk
        head = min(n, blindspot_size - state.position % blindspot_size)
        parts = [slice(0, head), slice(head, n)]
        outs = []
        for i, sl in enumerate(parts):
            if sl.start == sl.stop:
                continue
            args = [t[:, :, sl] for t in (q, k, v)]
            args += [None if log_decay is None else log_decay[:, :, sl], None if mask is None else mask[:, sl]]
            if i == 0:
                out, state = recurrent_causal_linear_attention(*args, blindspot_size=blindspot_size, state=state)
            else:
                out, state = causal_linear_attention(
                    *args, blindspot_size=blindspot_size, chunk_size=chunk_size, state=state, return_state=True
                )
            outs.append(out)
        out = torch.cat(outs, dim=2)
        return (out, state) if return_state else out

    out_dtype = q.dtype
    dtype = _compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = (t.to(dtype) for t in (q, k, v))
        log_decay = None if log_decay is None else log_decay.to(dtype)
        k, v, log_decay = _apply_key_mask(k, v, log_decay, mask)
        v = _append_ones(v)

        C = blindspot_size if blindspot_size > 1 else chunk_size
        pad = -n % C
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            if log_decay is not None:
                log_decay = F.pad(log_decay, (0, 0, 0, pad) if log_decay.ndim == 4 else (0, pad))
        q, k, v = (rearrange(t, "b h (c l) d -> b h c l d", l=C) for t in (q, k, v))

        if log_decay is None:
            G = None
            k_to_end = k
        else:
            pattern = "b h (c l) d -> b h c l d" if log_decay.ndim == 4 else "b h (c l) -> b h c l"
            G = rearrange(log_decay, pattern, l=C).cumsum(dim=3)  # decay from chunk start
            G_end = G[:, :, :, -1:]
            decay_to_end = (G_end - G).exp()  # <= 1
            k_to_end = k * (decay_to_end if G.ndim == 5 else decay_to_end[..., None])

        # each chunk's own contribution to the state, decayed to the chunk's end
        kv_chunks = torch.einsum("bhcld,bhcle->bhcde", k_to_end, v)

        # scan over chunks: S_c = state before chunk c
        kv = state.kv.to(dtype) if state is not None else torch.zeros_like(kv_chunks[:, :, 0])
        chunk_decay = None if G is None else G[:, :, :, -1].exp()  # (b, h, c) or (b, h, c, d)
        states = []
        for c in range(kv_chunks.shape[2]):
            states.append(kv)
            if chunk_decay is None:
                kv = kv + kv_chunks[:, :, c]
            else:
                a = chunk_decay[:, :, c]
                kv = kv * (a[..., None] if a.ndim == 3 else a[..., None, None]) + kv_chunks[:, :, c]
        states = torch.stack(states, dim=2)

        q_from_start = q if G is None else q * (G.exp() if G.ndim == 5 else G.exp()[..., None])
        out = torch.einsum("bhcld,bhcde->bhcle", q_from_start, states)
        if blindspot_size == 1:
            out = out + _intra_chunk_weights(q, k, G) @ v

        out = _divide(rearrange(out, "b h c l e -> b h (c l) e")[:, :, :n])

    if not return_state:
        return out.to(out_dtype)
    # padded steps have zero keys and no decay, so they leave the state as it was
    position = (state.position if state is not None else 0) + n
    pending = None
    if blindspot_size > 1:
        if n % C:  # the last block is unfinished: its keys wait in `pending`
            kv = states[:, :, -1]
            if chunk_decay is not None:
                a = chunk_decay[:, :, -1]
                kv = kv * (a[..., None] if a.ndim == 3 else a[..., None, None])
            pending = kv_chunks[:, :, -1]
        else:
            pending = torch.zeros_like(kv)
    return out.to(out_dtype), CausalState(kv, pending, position)
