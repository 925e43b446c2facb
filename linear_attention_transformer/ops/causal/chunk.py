"""The chunked causal kernel, and the math that the causal forms share (``__init__.py`` lists
the forms; each equals ``naive.py``'s explicit matrix).

The attention weight of key j for query i is

    w_ij = sum_d phi(q_i)_d * phi(k_j)_d * decay_ijd

and the output is ``sum_j w_ij v_j / sum_j w_ij``. Two kinds of features:

* given features (``exp_features=False``): q and k are already non-negative (elu + 1,
  relu, a user's map);
* exponential features (``exp_features=True``): q and k are logits and
  phi(q)_d phi(k)_d = exp(q_d + k_d). This is the default softmax map: the softmax over the
  query's features only adds a per-query constant, which cancels in the ratio. The kernels
  never exponentiate a raw logit; every factor is exp(x - reference) <= 1:

  - a state (the recurrence's, and the chunked form's between chunks) holds
    sum_j exp(k_jd + G_td - G_jd - r_d) [v_j, 1] on r_d, the *decayed* running maximum
    max_j (k_jd + G_td - G_jd): a decay moves r, not the sums, so the largest term stays 1
    and a query reading it against M_i = max_d (q_id + G_id + r_d) has a denominator >= 1,
    whatever the logits' size and the decays. Every state a query reads was set by keys it
    sees.
  - inside a chunk (fast form) keys are taken decayed to the chunk's end, relative to their
    maximum m_d there, and query i with exp(G_id - G_end,d) against the same shift M_i (now
    also over q_id + G_id - G_end,d + m_d): the intra-chunk weights are one plain matmul for
    any decay. m may be set by a key after i, or the factors may be large for a strongly
    decayed feature: then i's terms are all far below M_i and can underflow.
  - the safe form: each term the fast form drops is < e^-87 relative to M_i (a product of
    factors <= 1 underflows only if it is that small), so a query whose computed
    denominator is >= ``SAFE_BELOW`` (1e-12) is exact to rounding. Chunks holding a query
    below it (and which sees some key) are recomputed: the state term as logits
    a_id = q_id + G_id + r_d, the chunk's pairs as l_ij = logsumexp_d (q_id + k_jd + G_id -
    G_jd), both against M_i = max(max_d a_id, max_j l_ij) over what i sees, so that i's
    largest term is exactly 1. Only those chunks pay for the (C x C x d) pairs. Under
    torch.compile the choice is a ``torch.cond`` (no graph break): when any chunk is lost,
    all are recomputed and the lost ones selected. Eagerly the lost chunks' count is read
    back: one host sync per call.
  - the exact chunks (``forms.py``: every device but the CPU) need no recompute, so
    nothing is decided and nothing read back: inside a chunk keys are taken relative to
    their running maximum P_id = max_{j <= i} (k_jd - G_jd), query i against
    M_i = max(max_d (q_id + G_id + P_id), max_d (q_id + G_id + r_d)), which is exactly its
    largest term, and the pair (i, j <= i) as exp(q_id + G_id + P_id - M_i) exp(P_jd - P_id)
    exp(k_jd - G_jd - P_jd): three factors <= 1, the middle one a per-feature decay with log
    cumulative -P (``_exact_chunk_factors``), formed like a per-feature gate's weights (chunks
    of 16 in sub-chunks of 4). Exact by construction at any spread; on the CPU that sub-chunk
    work costs more than the fast form plus its (rare) recompute (measured: ``forms.py``), so
    the CPU keeps those. With
    segments the running maxima restart at each segment's first token (a log-depth segmented
    maximum) and the factors through a sub-chunk's reference are kept only for pairs whose
    segment holds that reference (every pair of one segment does).

  So the chunked form, the recurrence and the blindspot form are exact at any logit spread
  (float64 equal to the explicit matrix, float32 within the rounding of its logits),
  gradients included: the shifts carry no gradient, they cancel.

Chunks: quadratic inside a chunk of C tokens, the running state S between chunks. Between
chunks the state obeys S_c = a_c S_{c-1} + x_c (x_c the chunk's keys decayed to its end,
``scan.summarize``; a_c its total decay; for exponential features both relative to the
references r, see above). That is a scan of chunk summaries under one associative operator
(``scan.py``, also what context parallelism exchanges): a loop over the chunks, a
work-efficient log-depth scan whose backward is the reverse scan (launches grow as log n, not
n; with the exact chunks above, no host sync in forward or backward, segments included), or
``blocked_linear_scan``, a graph whose size does not depend on n (under ``torch.compile``:
one compile serves every length). Which runs where, and why: ``forms.py``.

``log_decay`` (log a_t <= 0), per position (b, h, n) or per position and key feature
(b, h, n, d), is the forget gate of gated linear attention. Decays are applied as
exp(G_i - G_j) with i >= j on cumulative sums G, which never exceeds 1 (for exponential
features folded into the logits, see above; for given features formed pair by pair in
sub-chunks when per feature).

Packed sequences (``segments``, ``segments.py``): key j is visible to query i only in i's
segment. The explicit matrix masks the pairs; the recurrence empties its state (sums 0,
references -inf) at a segment's first token; the chunked form masks the (C x C) weights
to same-segment pairs (valid for every weight form: they are formed, then masked), lets a
query read the state before its chunk only when the token before the chunk is of its
segment, and builds the state after a chunk from the keys of the chunk's last segment
alone, carrying the earlier state only when no segment starts in the chunk. For exponential
features those kept keys get their own maximum as reference (an earlier segment's keys in
the chunk may be far larger), the decayed running maximum restarts with the segment, and a
query of a new segment reads the state against a reference of -inf (factor 0). The safe
recompute takes the same masks. Blindspot blocks stay counted from position 0 here; the
attention layer aligns segments to blocks (``Attention._packed``).

The normaliser rides along as an extra all-ones column of v, so the state carries S (d x e)
and z (d) as one (d x e+1) tensor. Half-precision inputs are computed in float32 (the
state sums up to n terms and would overflow float16) and cast back on return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ..common import NEG_INF, _append_ones, _apply_key_mask, _check_mask, _compute_dtype, _divide
from ..non_finite import poisoned, quarantine, seen
from ..segments import positions_in_segment, segment_runs
from .fla import fla_causal_linear_attention
from .forms import CHUNK_SIZE, check_form, pick_form, reads_back, scoped_form
from .recurrent import CausalState, recurrent_causal_linear_attention
from .scan import (blocked_linear_scan, key_factors, linear_scan, linear_terms, references, sequential_linear_scan,
                   summarize)

__all__ = ["causal_linear_attention"]

PER_FEATURE_SUB_CHUNK = 4  # (the sub-chunk of chunks formed pair by pair, see forms.py)


# --------------------------------------------------------------------- causal: chunked


def _intra_chunk_weights(q, k, G, sub_chunk, seg=None):
    """w_ij inside each chunk for j <= i.  q, k: (…, C, d) factors; G: (…, C) or (…, C, d) or None.
    seg: optional (…, C) run index; a per-feature G then only has to be non-increasing inside
    each segment (the pairs across segments are dropped before any factor is formed, and must
    be masked by the caller)."""
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if G is None:  # (in place: the fresh product is not needed for backward)
        return (q @ k.transpose(-1, -2)).masked_fill_(~causal, 0.0)
    if G.ndim == q.ndim - 1:  # decay per position: one (C x C) factor per chunk
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, NEG_INF)
        return (q @ k.transpose(-1, -2)) * diff.exp()
    if C % sub_chunk or C == sub_chunk:
        return _pairwise_weights(q, k, G, seg)
    return _two_level_weights(q, k, G, sub_chunk, seg)


def _pairwise_weights(q, k, G, seg=None):
    """Decay per feature, formed pair by pair: (…, C, C, d) — only for short chunks."""
    C = q.shape[-2]
    visible = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if seg is not None:
        visible = visible & (seg[..., :, None] == seg[..., None, :])
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~visible[..., None], NEG_INF)
    # explicit products and a sum: as an einsum this becomes a batched matmul of 1 x 1 blocks
    return (diff.exp() * k[..., None, :, :] * q[..., :, None, :]).sum(-1)


def _two_level_weights(q, k, G, s, seg=None):
    """Decay per feature in chunks of C split into sub-chunks of s.

    For a query sub-chunk I and the keys before it, the decay exp(G_i - G_j) factors through
    R_I, the cumulative decay just before I: exp(G_i - R_I) * exp(R_I - G_j), both <= 1, so
    those weights are one matmul per sub-chunk. Only the s x s blocks on the diagonal are
    formed pair by pair. Memory O(C (C/s + s) d) per chunk instead of O(C^2 d)."""
    C, d = q.shape[-2:]
    m = C // s
    qs, Gs = (rearrange(t, "... (m s) d -> ... m s d", s=s) for t in (q, G))
    segs = None if seg is None else rearrange(seg, "... (m s) -> ... m s", s=s)
    diag = _pairwise_weights(qs, rearrange(k, "... (m s) d -> ... m s d", s=s), Gs, segs)  # (…, m, s, s)

    R = Gs[..., :-1, -1, :]  # (…, m-1, d): decay before sub-chunk I = 1 .. m-1
    to_query = Gs[..., 1:, :, :] - R[..., None, :]
    before = torch.arange(C, device=q.device)[None, :] < (torch.arange(1, m, device=q.device) * s)[:, None]
    if seg is not None:
        # a pair of one segment has the token before I (R's position) in that segment too: the
        # factors through R are kept only there (elsewhere they may exceed 1, the pair is dropped)
        seg_R = segs[..., :-1, -1]  # (…, m-1)
        to_query = to_query.masked_fill(~(segs[..., 1:, :] == seg_R[..., None])[..., None], NEG_INF)
        before = before & (seg[..., None, :] == seg_R[..., :, None])
    q_ref = qs[..., 1:, :, :] * to_query.exp()  # (…, m-1, s, d)
    to_ref = (R[..., :, None, :] - G[..., None, :, :]).masked_fill(~before[..., None], NEG_INF)
    k_ref = k[..., None, :, :] * to_ref.exp()  # (…, m-1, C, d), zero for keys not before I
    off = q_ref @ k_ref.transpose(-1, -2)  # (…, m-1, s, C)

    w = torch.cat((torch.zeros_like(off[..., :1, :, :]), off), dim=-3)  # (…, m, s, C)
    w = rearrange(w, "... m s (m2 s2) -> ... m s m2 s2", s2=s)
    eye = torch.eye(m, dtype=w.dtype, device=w.device)[:, None, :, None]
    w = w + diag[..., :, :, None, :] * eye
    return rearrange(w, "... m s m2 s2 -> ... (m s) (m2 s2)")


def _query_factors(parts):
    """Each query against one shift M_i = max over its parts and features of q_id + ref_d.

    parts: list of (logits (…, l, d) with gradient, reference (…, 1 or l, d) without); returns
    exp(logits + ref - M) for each, every factor <= 1. M carries no gradient: it cancels."""
    with torch.no_grad():
        M = (parts[0][0].detach() + parts[0][1]).amax(dim=-1, keepdim=True)
        for x, ref in parts[1:]:
            M = torch.maximum(M, (x.detach() + ref).amax(dim=-1, keepdim=True))
        # a query with every reference at -inf (no key yet): any finite M gives its factors 0
        M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    return [(x + (ref - M)).exp() for x, ref in parts]


def _segment_running_max(x, seg):
    """max_{j <= i, j in i's segment} x_j along the chunk: x (…, l, d), seg (…, l) run index
    (non-decreasing). Log-depth: after the step of offset s, position i holds the maximum over
    the last 2s positions of its segment."""
    l, s = x.shape[-2], 1
    while s < l:
        joined = (seg[..., s:] == seg[..., :-s])[..., None]  # i and i - s in one segment
        step = torch.where(joined, torch.maximum(x[..., s:, :], x[..., :-s, :]), x[..., s:, :])
        x = torch.cat((x[..., :s, :], step), dim=-2)
        s *= 2
    return x


def _exact_chunk_factors(q_logits, k_logits, G, r_read, sub_chunk, seg=None):
    """Exponential features inside a chunk with nothing lost to underflow (the parallel form).

    q_logits: (…, l, d) q + G; k_logits: (…, l, d) raw key logits (masked keys -inf); G:
    (…, l, 1 or d) log decay since the chunk's start, or None; r_read: (…, 1, d) reference of
    the state the chunk's queries read. With K_jd = k_jd - G_jd and its running maximum
    P_id = max_{j <= i} K_jd, query i's shift M_i = max(max_d (q_id + G_id + P_id),
    max_d (q_id + G_id + r_read_d)) is exactly its largest term, and its pair (i, j <= i)
    factors as

        exp(q_id + G_id + P_id - M_i) * exp(P_jd - P_id) * exp(K_jd - P_jd),

    every factor <= 1: the middle one is a per-feature decay with log cumulative -P, so the
    weights are ``_intra_chunk_weights``' per-feature form. (-inf in P, before a feature's
    first key, becomes the chunk's smallest finite P in the last two factors, whose product
    is then 0 by the third, and stays -inf in the first.) With ``seg`` (…, l), the run index
    of each position, the running maximum restarts with each segment and the weights hold
    only pairs of one segment (r_read is then -inf for queries that read no state).
    Returns (q_state, weights)."""
    K = k_logits if G is None else k_logits - G
    with torch.no_grad():
        P = K.detach().cummax(dim=-2).values if seg is None else _segment_running_max(K.detach(), seg)
        finite = torch.isfinite(P)
        low = torch.where(finite, P, float("inf")).amin(dim=-2, keepdim=True)
        P_hat = torch.where(finite, P, torch.where(torch.isfinite(low), low, torch.zeros_like(low)))
        q_detached = q_logits.detach()
        M = torch.maximum((q_detached + P).amax(dim=-1, keepdim=True),
                          (q_detached + r_read).amax(dim=-1, keepdim=True))
        M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))  # sees nothing: all terms 0
    q_pairs = (q_logits + (P - M)).exp()
    q_state = (q_logits + (r_read - M)).exp()
    weights = _intra_chunk_weights(q_pairs, (K - P_hat).exp(), -P_hat, sub_chunk, seg)
    return q_state, weights


# A query whose fast-form denominator (relative to its shift M_i) is below this has lost
# weight to underflow: each lost term is < e^-87 relative to M_i, so above it the result is
# exact to float32 rounding, and 1 / den keeps the gradient far from overflow.
SAFE_BELOW = 1e-12


def _safe_chunk_outputs(q, k, v, G, state, r_prev, same=None, reads=None):
    """Chunks recomputed with a per-query shift over the keys the query sees (exp features).

    q, k: (N, l, d) logits (masked keys -inf in every feature); v: (N, l, e + 1);
    G: (N, l, 1 or d) log decay since the chunk's start, or None; state: (N, d, e + 1) the
    state before the chunk, relative to r_prev: (N, d).
    Intra-chunk weights are formed pair by pair in log space, l_ij = logsumexp_d (q_id + k_jd
    + G_id - G_jd), the state term as logits a_id = q_id + G_id + r_prev_d against its
    content; M_i = max(max_j l_ij, max_d a_id) over what query i sees, so its largest term
    is 1 and nothing it depends on underflows. With segments, ``same`` (N, l, l) says which
    pairs share a segment and ``reads`` (N, l) which queries read the state.
    Returns (N, l, e + 1), rows relative to M_i."""
    l = q.shape[-2]
    causal = torch.ones(l, l, dtype=torch.bool, device=q.device).tril()
    real = torch.isfinite(k).any(dim=-1)  # (N, l)
    visible = causal & real[:, None, :]
    if same is not None:
        visible = visible & same
    # finite stand-ins for masked keys: a logsumexp over -inf only has a NaN gradient
    logits = q[:, :, None, :] + torch.where(torch.isfinite(k), k, torch.zeros_like(k))[:, None, :, :]
    state_logits = q + r_prev[:, None, :]
    if G is not None:
        logits = logits + (G[:, :, None, :] - G[:, None, :, :])
        state_logits = state_logits + G
    if reads is not None:
        state_logits = state_logits.masked_fill(~reads[..., None], NEG_INF)
    log_w = torch.logsumexp(logits, dim=-1).masked_fill(~visible, NEG_INF)  # (N, i, j)
    with torch.no_grad():
        M = torch.maximum(log_w.amax(dim=-1), state_logits.amax(dim=-1))[..., None]
        M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))  # sees nothing: all terms 0
    return (log_w - M).exp() @ v + (state_logits - M).exp() @ state


def _lost_to_underflow(den, mask, state, n, runs=None):
    """(b, h, c) bool: chunks with a real query whose fast-form denominator is below
    ``SAFE_BELOW`` although it sees a key (den: (b, h, c, l), the ones column)."""
    with torch.no_grad():
        b, h, c, l = den.shape
        lost = den < SAFE_BELOW
        real = torch.arange(c * l, device=den.device) < n  # padded queries are dropped anyway
        if mask is not None and runs is not None:  # a real key of its own segment so far
            last_real = torch.where(mask, runs, -1).cummax(dim=1).values
            real = real & F.pad(last_real == runs, (0, c * l - n))[:, None]
        elif mask is not None:  # a query before any real key (and no state) rightly gets 0
            seen = F.pad(mask, (0, c * l - n)).cumsum(dim=1)[:, None] > 0  # (b, 1, c l)
            if state is not None:
                seen = seen | torch.isfinite(state.ref).any(dim=-1)[..., None]
            real = real & seen
        return (lost & real.view(*real.shape[:-1], c, l)).any(dim=-1)


def _recompute_chunks(out, lost, q, k, v, G, states, r_prev, same=None, reads=None):
    """``out`` with the ``lost`` chunks replaced by ``_safe_chunk_outputs`` (each row is
    divided by its own denominator afterwards, so the two forms' shifts may differ).

    Eagerly only the lost chunks are gathered and recomputed (their count is read back: a
    sync, usually of an all-False mask). Under torch.compile the branch is a ``torch.cond``
    (no graph break): when some chunk is lost every chunk is recomputed and the lost ones
    selected, otherwise nothing is."""
    if torch.compiler.is_compiling():
        # The branches' outputs, and in backward their gradients for every operand, must agree
        # on strides, which dynamo checks as products of the sizes; under dynamic shapes the
        # chunk length is a symbolic quotient it cannot simplify. So every operand goes in (and
        # the result comes out) flat and contiguous, each with its chunks' trailing shape on the
        # side. The branches close over no tensor (dynamo would lift a captured tensor as an
        # operand aliasing the one passed, which it refuses).
        shape = out.shape
        b, h, c = lost.shape
        operands = (q, k, v, G, states, r_prev, same, reads)
        trailing = [None if t is None else tuple(t.shape[3:]) for t in operands]
        given = [t.expand(b, h, c, *t.shape[3:]).reshape(-1) for t in operands if t is not None]

        def recompute_all(out, lost, *given):
            it = iter(given)
            flat = [None if rest is None else next(it).view(-1, *rest) for rest in trailing]
            recomputed = _safe_chunk_outputs(*flat).reshape(-1)
            return torch.where(lost.repeat_interleave(out.shape[0] // lost.shape[0]), recomputed, out)

        def keep(out, lost, *given):
            return out.clone()

        return torch.cond(lost.any(), recompute_all, keep, (out.reshape(-1), lost.reshape(-1), *given)).view(shape)
    where = lost.nonzero(as_tuple=True)
    if where[0].numel() == 0:
        return out
    picked = [None if t is None else t.expand(*lost.shape, *t.shape[3:])[where]
              for t in (q, k, v, G, states, r_prev, same, reads)]
    return out.index_put(where, _safe_chunk_outputs(*picked))


def _sees_non_finite(bad, n, blindspot_size, runs):
    """(b, h, n): the queries whose output the plain sum makes NaN (``non_finite.py``): their
    own query, a key or value they see (earlier blocks with a blindspot, else at or before
    them), or a decay since their segment's start. ``bad``: the (query, key or value, decay)
    flags of ``quarantine``."""
    bad_query, bad_key, bad_decay = bad[0], bad[1] | bad[2], bad[3]
    pos = torch.arange(n, device=bad_query.device)
    start = torch.zeros_like(pos) if runs is None else (pos - positions_in_segment(runs))[:, None]
    last_key = pos if blindspot_size == 1 else pos - pos % blindspot_size - 1
    hit = bad_query | seen(bad_key, last_key, start)
    return hit if bad_decay is None else hit | seen(bad_decay, pos, start)


def _non_finite_state(bad, state):
    """The state after a row that held a non-finite key, value or decay is NaN, the
    recurrence's own answer, not the state of the zeros it was read as: a decode continuing
    from it must not silently differ from the full forward."""
    if bad is None:
        return state
    hit = (bad[1] | bad[2]).any(dim=-1)
    if bad[3] is not None:
        hit = hit | bad[3].any(dim=-1)
    return state._map(lambda t: t.masked_fill(hit.view(*hit.shape, *(1,) * (t.ndim - 2)), float("nan")))


def causal_linear_attention(
    q, k, v, log_decay=None, mask=None, blindspot_size=1, chunk_size=CHUNK_SIZE, exp_features=False,
    state=None, return_state=False, segments=None, form=None,
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
        segments: optional (b, n) segment ids (``segments.py``): a query sees only keys of
            its own segment, as in ``naive_causal_linear_attention``. Inside a chunk the
            weights are masked to same-segment pairs; a query reads the state before its
            chunk only when the token before the chunk is of its segment; the state after a
            chunk keeps the keys of the chunk's last segment (on a reference over those keys
            alone) and carries the earlier state only when no segment starts in the chunk.
            Not with ``state`` / ``return_state``.
        form: the form that computes it, one of ``forms.FORM_NAMES`` ('auto': by the
            device, ``forms.pick_form``); None: the ``forms.use_form`` scope's, else 'auto'.
            (One token from a state is the recurrence, whatever the form.)
    Returns:
        (b, h, n, e), and the state when ``return_state``.
    """
    b, h, n, d = q.shape
    _check_mask(mask, b, n)
    if blindspot_size < 1 or chunk_size < 1:
        raise ValueError("blindspot_size and chunk_size must be >= 1")
    if form is None:
        form = scoped_form()
    check_form(form)
    if segments is not None and (state is not None or return_state):
        raise ValueError("segments cannot be combined with a state (state / return_state): a state continues one sequence")
    if state is not None and n == 1:  # decoding one token: the recurrence is the cheapest form
        out, state = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot_size, exp_features, state)
        return (out, state) if return_state else out
    if state is not None and blindspot_size > 1 and state.position % blindspot_size:
        return _continue_inside_block(q, k, v, log_decay, mask, blindspot_size, chunk_size, exp_features, state,
                                      return_state, form)

    out_dtype = q.dtype
    dtype = _compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        # q and k contiguous once: heads split off a fused projection are strided views, and
        # every elementwise result keeps that layout, so each batched matmul below would copy
        # its operand again (forward and backward). v is copied by _append_ones anyway.
        q, k, v = q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype)
        log_decay = None if log_decay is None else log_decay.to(dtype)
        plan = pick_form(q.device, torch.compiler.is_compiling(), form, exp_features, blindspot_size,
                         log_decay is not None and log_decay.ndim == 4, chunk_size, dtype)
        blocked, exact_chunks, C = plan.scan == "blocked", plan.exact_chunks, plan.chunk
        real = None if mask is None else rearrange(mask, "b n -> b 1 n")
        (q, k, v, log_decay), bad = quarantine((q, k, v, log_decay), reads_back(plan), real)
        if plan.scan == "fla":  # flash-linear-attention's kernels (fla.py); non-finite inputs as below
            out = fla_causal_linear_attention(q, k, v, log_decay, mask, blindspot_size, exp_features, state,
                                              return_state, segments)
            out, last = out if return_state else (out, None)
            if bad is not None:
                out = poisoned(out, _sees_non_finite(bad, n, blindspot_size,
                                                     None if segments is None else segment_runs(segments)))
            return (out.to(out_dtype), _non_finite_state(bad, last)) if return_state else out.to(out_dtype)
        k, v, log_decay = _apply_key_mask(k, v, log_decay, mask, exp_features)
        v = _append_ones(v)

        blindspot = blindspot_size > 1
        # (the padding as c C - n: under dynamic shapes the padded length is then c C by its
        # very form, and splitting it into (c, C) gives exactly C again)
        c = (n + C - 1) // C
        pad = c * C - n
        if blocked or pad:  # padded keys are invisible (zero features) and do not decay
            # (compiled, always: a branch on the padding would specialise dynamic shapes)
            q, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, v))
            k = F.pad(k, (0, 0, 0, pad), value=NEG_INF if exp_features else 0.0)
            if log_decay is not None:
                log_decay = F.pad(log_decay, (0, 0, 0, pad) if log_decay.ndim == 4 else (0, pad))
        # (every size given: under dynamic shapes an inferred size (-1, einops) makes the chunk
        # length a symbolic quotient instead of C, which torch.cond's stride check cannot simplify)
        q, k, v = (t.view(b, h, c, C, t.shape[-1]) for t in (q, k, v))
        runs = same = reads = kept = carries = None
        if segments is not None:
            runs = segment_runs(segments)
            # padded positions join the last segment: they hold no key, and their queries are dropped
            seg = torch.cat((runs, runs[:, -1:].expand(b, pad)), dim=1).view(b, 1, c, C)
            last = seg[..., -1]  # (b, 1, c): the segment that the state after chunk c belongs to
            before = F.pad(last[..., :-1], (1, 0), value=-1)  # the segment of the token before chunk c
            same = seg[..., :, None] == seg[..., None, :]  # (b, 1, c, l, l)
            reads = seg == before[..., None]  # (b, 1, c, l): the query reads the state before its chunk
            kept = seg == last[..., None]  # (b, 1, c, l): the key enters the state after its chunk
            carries = last == before  # (b, 1, c): no segment starts in chunk c

        if log_decay is None:
            G = Gd = G_end = None
        else:
            G = log_decay.view(b, h, c, C, *log_decay.shape[3:]).cumsum(dim=3)  # decay since the chunk start
            Gd = G if G.ndim == 5 else G[..., None]  # (b, h, c, l, 1 or d)
            G_end = Gd[:, :, :, -1]  # (b, h, c, 1 or d): the chunk's total log decay
        # the log decay of the state across chunk c: -inf where a segment starts in it (drops it)
        state_log_decay = G_end
        if carries is not None:
            state_log_decay = (torch.zeros(b, 1, carries.shape[-1], 1, dtype=dtype, device=q.device)
                               if G_end is None else G_end).masked_fill(~carries[..., None], NEG_INF)

        if exp_features:
            # keys decayed to their chunk's end, relative to their maximum m_c there: one
            # factor <= 1 serves the state and the queries of the chunk. The state after
            # chunk c lives on the decayed running maximum r_c, so its largest term is 1.
            # (the chunk's end enters the keys and queries without gradient, and the chunk's
            # contribution to the state through a factor of exactly 1 that carries it: then
            # no gradient of a query reaches a later decay, not even by rounding)
            k_logits = k
            to_end = None if G is None else G_end.detach()[:, :, :, None] - Gd
            if segments is None:
                chunk_summary, k = summarize(k_logits, v, to_end, exp_features=True)
                k_to_end, m = k, chunk_summary.ref
            else:
                # the state keeps only the last segment's keys: on their own maximum, as an
                # earlier segment's keys in the chunk may be far larger (and would underflow them);
                # the chunk's queries read all of its keys, relative to the maximum of all
                chunk_summary, k_to_end = summarize(k_logits.masked_fill(~kept[..., None], NEG_INF), v, to_end,
                                                    exp_features=True)
                k, m = key_factors(k_logits, to_end, exp_features=True)
            m_kept = chunk_summary.ref
            r_prev, r = references(m_kept, state_log_decay, None if state is None else state.ref.to(dtype), 2,
                                   drops=carries is not None, blocked=blocked)
            state_decay, chunk_scale = linear_terms(state_log_decay, m_kept, r_prev, r, log=blocked)
            if G is not None and G_end.requires_grad:
                chunk_scale = chunk_scale * (G_end - G_end.detach()).exp()
        else:
            chunk_summary, k_to_end = summarize(k if kept is None else k.masked_fill(~kept[..., None], 0.0), v,
                                                None if G is None else G_end[:, :, :, None] - Gd)
            chunk_scale = None
            state_decay, _ = linear_terms(state_log_decay, None, None, None, log=blocked)

        # each chunk's own contribution to the state, decayed to the chunk's end
        kv_chunks = chunk_summary.kv
        if chunk_scale is not None:
            kv_chunks = kv_chunks * chunk_scale[..., None]

        # the scan over chunks: states[c] is the state before chunk c (for exponential
        # features relative to r_prev_c, which every query of chunk c sees), kv the state after
        # the last. S_c = a_c S_{c-1} + x_c as a log-depth scan, a loop, or in blocks (then
        # state_decay holds log a_c; scan.py)
        start = None if state is None else state.kv.to(dtype)
        scan_states = {"loop": sequential_linear_scan, "log_depth": linear_scan,
                       "blocked": blocked_linear_scan}[plan.scan]
        states, kv = scan_states(None if state_decay is None else state_decay[..., None], kv_chunks, start, 2)

        if exp_features:
            # query i of chunk c reads the state with the decay G_i since the chunk's start,
            # and its chunk's keys with exp(G_i - G_end) (>= 1) from their end: both under
            # one shift M_i, so the intra-chunk weights are one plain matmul for any decay
            q_logits = q if G is None else q + Gd
            r_read = r_prev[:, :, :, None]
            if reads is not None:  # a query of a new segment reads no state: -inf, factor 0
                r_read = torch.where(reads[..., None], r_read, NEG_INF)
            if exact_chunks:
                q_state, weights = _exact_chunk_factors(q_logits, k_logits, Gd, r_read, PER_FEATURE_SUB_CHUNK,
                                                        None if segments is None else seg)
            else:
                parts = [(q_logits, r_read)]
                if not blindspot:
                    parts.append((q_logits, (m if G is None else m - G_end.detach())[:, :, :, None]))
                q_state, *q_intra = _query_factors(parts)
        else:
            q_state = q if G is None else q * Gd.exp()
            if reads is not None:
                q_state = q_state.masked_fill(~reads[..., None], 0.0)
            q_intra = [q]
        out = q_state @ states  # (a matmul keeps the chunk length C exact under dynamic shapes)
        if not blindspot:
            if not exact_chunks:
                weights = _intra_chunk_weights(q_intra[0], k, None if exp_features else G, PER_FEATURE_SUB_CHUNK)
            if same is not None:  # any weight form may be masked afterwards: pairs across segments
                weights = weights.masked_fill(~same, 0.0)
            out = out + weights @ v
            if exp_features and not exact_chunks:
                lost = _lost_to_underflow(out[..., -1], mask, state, n, runs)
                out = _recompute_chunks(out, lost, q, k_logits, v, Gd, states, r_prev, same, reads)

        out = out.flatten(2, 3)
        # (compiled, a fresh tensor of the n real positions, not a view of the padded ones: its
        # layout would make dynamic shapes guard on whether n is a multiple of C)
        out = _divide(out.index_select(2, torch.arange(n, device=out.device)) if blocked else out[:, :, :n])
        if bad is not None:
            out = poisoned(out, _sees_non_finite(bad, n, blindspot_size, runs))

    if not return_state:
        return out.to(out_dtype)
    # padded steps have no keys and no decay: `kv` is the state after token n - 1
    position = (state.position if state is not None else 0) + n
    ref = r[:, :, -1] if exp_features else None
    if not blindspot:
        return out.to(out_dtype), _non_finite_state(bad, CausalState(kv, ref, position=position))
    if n % C == 0:  # every block complete
        pending = torch.zeros_like(kv)
        pending_ref = torch.full_like(ref, NEG_INF) if exp_features else None
        return out.to(out_dtype), _non_finite_state(bad, CausalState(kv, ref, pending, pending_ref, position))
    # the last block is unfinished: its keys wait in `pending`, the visible state is the
    # one the last chunk's queries read, decayed through that chunk
    last, last_ref = states[:, :, -1], None
    pending = torch.einsum("bhld,bhle->bhde", k_to_end[:, :, -1], v[:, :, -1])
    if exp_features and G is not None:
        last_ref = r_prev[:, :, -1] + G_end[:, :, -1].detach()
        one = (G_end[:, :, -1] - G_end[:, :, -1].detach()).exp()[..., None]  # carries the gradient
        last, pending = last * one, pending * one
    elif exp_features:
        last_ref = r_prev[:, :, -1]
    elif G is not None:
        last = last * G_end[:, :, -1, :, None].exp()
    return out.to(out_dtype), _non_finite_state(bad, CausalState(
        last, last_ref, pending, m[:, :, -1] if exp_features else None, position
    ))


def _continue_inside_block(q, k, v, log_decay, mask, blindspot_size, chunk_size, exp_features, state, return_state,
                           form):
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
            return_state=True, form=form,
        )
        outs.append(out)
    out = torch.cat(outs, dim=2)
    return (out, state) if return_state else out
