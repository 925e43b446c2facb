"""The chunked causal kernel, and the math the causal forms share (each equals ``naive.py``).

The weight of key j for query i is w_ij = sum_d phi(q_i)_d phi(k_j)_d decay_ijd, the output
sum_j w_ij v_j / sum_j w_ij. Given features (``exp_features=False``): q and k are already
non-negative. Exponential features: q, k are logits and phi(q)_d phi(k)_d = exp(q_d + k_d) (the
softmax map: its per-query constant cancels). No raw logit is exponentiated; every factor is
exp(x - reference) <= 1:

* a state holds sum_j exp(k_jd + G_td - G_jd - r_d) [v_j, 1] on r_d, the decayed running
  maximum of k_jd + G_td - G_jd: a decay moves r, not the sums, so the largest term is 1 and a
  query reading it against M_i = max_d (q_id + G_id + r_d) has a denominator >= 1;
* fast chunks: keys decayed to the chunk's end, relative to their maximum m_d there; query i
  with exp(G_id - G_end,d) against the same M_i (also over q_id + G_id - G_end,d + m_d), so the
  intra-chunk weights are one matmul for any decay. i's terms can underflow (m set by a later
  key, a strongly decayed feature), but each dropped term is < e^-87 relative to M_i: a query
  whose denominator is >= ``SAFE_BELOW`` is exact to rounding, and the chunks holding one below
  it are recomputed in log space (``_safe_chunk_outputs``; eagerly the lost chunks' count is
  read back, compiled a ``torch.cond`` recomputes all when any is lost);
* exact chunks (``forms.py``): keys relative to their running maximum P_id = max_{j<=i} (k_jd -
  G_jd), query i against M_i = max(max_d (q_id + G_id + P_id), max_d (q_id + G_id + r_d)), its
  largest term exactly, and the pair (i, j <= i) as exp(q_id + G_id + P_id - M_i) exp(P_jd -
  P_id) exp(k_jd - G_jd - P_jd): three factors <= 1, the middle one a per-feature decay
  (``_exact_chunk_factors``). Nothing is recomputed or read back.

The shifts carry no gradient and cancel: float64 equals the explicit matrix, gradients included.

Between chunks the state obeys S_c = a_c S_{c-1} + x_c (x_c the chunk's keys decayed to its
end, a_c its total decay, both relative to r): a scan of chunk summaries (``scan.py``, also
what context parallelism exchanges). ``log_decay`` (log a_t <= 0, (b, h, n) or (b, h, n, d)) is
the forget gate; decays enter as exp(G_i - G_j), i >= j, on cumulative sums G: never above 1.

``segments`` (``segments.py``): key j is visible to query i only in i's segment. The chunked
form masks the (C x C) weights to same-segment pairs, lets a query read the state before its
chunk only when the token before the chunk is of its segment, and builds the state after a
chunk from the keys of its last segment alone (on their own maximum), carrying the earlier
state only when no segment starts in the chunk. Blindspot blocks stay counted from position 0
(``Attention._packed`` aligns segments to blocks).

The normaliser rides along as an all-ones column of v: the state is one (d x e + 1) tensor.
Half precision is computed in float32 and cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ..common import NEG_INF, append_ones, apply_key_mask, check_mask, compute_dtype, divide_by_normaliser
from ..non_finite import poisoned, quarantine, seen
from ..segments import positions_in_segment, segment_runs
from .fla import fla_causal_linear_attention
from ..kernels import check_kernel
from .forms import CHUNK_SIZE, check_form, pick_form, reads_back, scoped_form
from .recurrent import CausalState, recurrent_causal_linear_attention
from .scan import Summary, key_factors, scan, summarize

__all__ = ["causal_linear_attention"]

PER_FEATURE_SUB_CHUNK = 4  # (the sub-chunk of chunks formed pair by pair, see forms.py)


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
    """Decay per feature in chunks of C split into sub-chunks of s: for query sub-chunk I and the
    keys before it exp(G_i - G_j) = exp(G_i - R_I) exp(R_I - G_j) (R_I: the decay just before
    I), both <= 1, one matmul per sub-chunk; only the (s x s) diagonal blocks go pair by pair.
    Memory O(C (C/s + s) d) per chunk instead of O(C^2 d)."""
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
    """The exact chunks of the module docstring: (q_state, weights).

    q_logits: (…, l, d) q + G; k_logits: (…, l, d) key logits (masked keys -inf); G: (…, l, 1
    or d) log decay since the chunk's start, or None; r_read: (…, 1, d) reference of the state
    the queries read (-inf for a query that reads none). The pair factor exp(P_jd - P_id) is a
    per-feature decay of log cumulative -P (``_intra_chunk_weights``); -inf in P (before a
    feature's first key) becomes the chunk's smallest finite P there, where the key factor
    makes the product 0. With ``seg`` (…, l) run indices the running maximum restarts with each
    segment and only pairs of one segment are formed."""
    K = k_logits if G is None else k_logits - G
    with torch.no_grad():
        P = K.detach().cummax(dim=-2).values if seg is None else _segment_running_max(K.detach(), seg)
        finite = torch.isfinite(P)
        low = torch.where(finite, P, float("inf")).amin(dim=-2, keepdim=True)
        P_hat = torch.where(finite, P, torch.where(torch.isfinite(low), low, torch.zeros_like(low)))
    q_pairs, q_state = _query_factors([(q_logits, P), (q_logits, r_read)])
    return q_state, _intra_chunk_weights(q_pairs, (K - P_hat).exp(), -P_hat, sub_chunk, seg)


SAFE_BELOW = 1e-12  # a fast-form denominator below this may have lost terms to underflow


def _safe_chunk_outputs(q, k, v, G, state, r_prev, same=None, reads=None):
    """Chunks recomputed in log space (exp features): pairs l_ij = logsumexp_d (q_id + k_jd +
    G_id - G_jd), the state term a_id = q_id + G_id + r_prev_d, both against M_i = max(max_j
    l_ij, max_d a_id) over what query i sees. q, k: (N, l, d) logits (masked keys -inf); v:
    (N, l, e + 1); G: (N, l, 1 or d) or None; state: (N, d, e + 1) on r_prev (N, d); ``same``
    (N, l, l): pairs of one segment; ``reads`` (N, l): queries that read the state.
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
    """``out`` with the ``lost`` chunks replaced by ``_safe_chunk_outputs`` (each row is divided
    by its own denominator afterwards), as the module docstring says."""
    if torch.compiler.is_compiling():
        # torch.cond's branches must agree on strides, which dynamo cannot prove for a symbolic
        # chunk length: operands go in flat, with their trailing shapes on the side, and the
        # branches capture no tensor (dynamo refuses an operand aliasing a captured one)
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
    """(b, h, n): the queries whose plain sum holds a NaN (``non_finite.py``): own query, a key
    or value they see, or a decay since their segment's start. ``bad``: ``quarantine``'s flags."""
    bad_query, bad_key, bad_decay = bad[0], bad[1] | bad[2], bad[3]
    pos = torch.arange(n, device=bad_query.device)
    start = torch.zeros_like(pos) if runs is None else (pos - positions_in_segment(runs))[:, None]
    last_key = pos if blindspot_size == 1 else pos - pos % blindspot_size - 1
    hit = bad_query | seen(bad_key, last_key, start)
    return hit if bad_decay is None else hit | seen(bad_decay, pos, start)


def _non_finite_state(bad, state):
    """NaN in the state of a row that held a non-finite key, value or decay (the recurrence's
    answer, not that of the zeros it was read as)."""
    if bad is None:
        return state
    hit = (bad[1] | bad[2]).any(dim=-1)
    if bad[3] is not None:
        hit = hit | bad[3].any(dim=-1)
    return state.map_tensors(lambda t: t.masked_fill(hit.view(*hit.shape, *(1,) * (t.ndim - 2)), float("nan")))


def causal_linear_attention(q, k, v, log_decay=None, mask=None, blindspot_size=1, chunk_size=CHUNK_SIZE,
                            exp_features=False, state=None, return_state=False, segments=None, kernel="auto",
                            form=None):
    """Causal linear attention, chunk by chunk, in O(n) memory: (C x C) weights inside a chunk,
    a running state (d x e + 1 per head) between chunks. With ``blindspot_size`` B > 1 the chunk
    is the block and a query sees exactly the keys of earlier blocks.

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
            its own segment. Not with ``state`` / ``return_state``.
        kernel: 'auto', 'torch' or 'fla' (docs/kernels.md's table).
        form: how the torch kernel runs, one of ``forms.FORM_NAMES`` ('sequential',
            'parallel', 'compiled'); None: the ``forms.use_form`` scope's, else by the device
            (``forms.pick_form``). Refused beside kernel='fla'. (One token from a state is the
            recurrence, whatever the kernel.)
    Returns:
        (b, h, n, e), and the state when ``return_state``.
    """
    b, h, n, d = q.shape
    check_mask(mask, b, n)
    if blindspot_size < 1 or chunk_size < 1:
        raise ValueError("blindspot_size and chunk_size must be >= 1")
    if check_kernel(kernel) == "fla" and form is not None:
        raise ValueError(f"form names how the torch kernel runs, and kernel='fla' runs fla's: got form={form!r}")
    form = scoped_form() if check_form(form) is None else form
    if segments is not None and (state is not None or return_state):
        raise ValueError("segments cannot be combined with a state (state / return_state): a state continues one sequence")
    if state is not None and n == 1:  # decoding one token: the recurrence is the cheapest form
        out, state = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot_size, exp_features, state)
        return (out, state) if return_state else out
    if state is not None and blindspot_size > 1 and state.position % blindspot_size:
        return _continue_inside_block(q, k, v, log_decay, mask, blindspot_size, chunk_size, exp_features, state,
                                      return_state, kernel, form)

    out_dtype = q.dtype
    dtype = compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        # contiguous once: strided heads of a fused projection would be copied by every matmul
        q, k, v = q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype)
        log_decay = None if log_decay is None else log_decay.to(dtype)
        gated_backward = (not exp_features and log_decay is not None and log_decay.ndim == 3 and torch.is_grad_enabled()
                          and any(t.requires_grad for t in (q, k, v, log_decay)))
        plan = pick_form(q.device, torch.compiler.is_compiling(), kernel, form, exp_features, blindspot_size,
                         log_decay is not None and log_decay.ndim == 4, chunk_size, dtype, gated_backward)
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
        k, v, log_decay = apply_key_mask(k, v, log_decay, mask, exp_features)
        v = append_ones(v)

        blindspot = blindspot_size > 1
        # (padding c C - n: under dynamic shapes the padded length is then c C by its form)
        c = (n + C - 1) // C
        pad = c * C - n
        if blocked or pad:  # padded keys are invisible (zero features) and do not decay
            # (compiled, always: a branch on the padding would specialise dynamic shapes)
            q, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, v))
            k = F.pad(k, (0, 0, 0, pad), value=NEG_INF if exp_features else 0.0)
            if log_decay is not None:
                log_decay = F.pad(log_decay, (0, 0, 0, pad) if log_decay.ndim == 4 else (0, pad))
        # (every size given: an inferred one is a symbolic quotient torch.cond's stride check rejects)
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
            # keys decayed to their chunk's end, relative to their maximum m_c there; the end
            # enters without gradient, which reaches the state through a factor of exactly 1
            # (so no query's gradient reaches a later decay, not even by rounding)
            k_logits = k
            to_end = None if G is None else G_end.detach()[:, :, :, None] - Gd
            if segments is None:
                chunk_summary, k = summarize(k_logits, v, to_end, exp_features=True)
                k_to_end, m = k, chunk_summary.ref
            else:
                # the state keeps the last segment's keys on their own maximum (an earlier
                # segment's may be far larger); the chunk's queries read all, on the maximum of all
                chunk_summary, k_to_end = summarize(k_logits.masked_fill(~kept[..., None], NEG_INF), v, to_end,
                                                    exp_features=True)
                k, m = key_factors(k_logits, to_end, exp_features=True)
            if G is not None and G_end.requires_grad:
                chunk_summary = chunk_summary._replace(kv=chunk_summary.kv * (G_end - G_end.detach()).exp()[..., None])
        else:
            chunk_summary, k_to_end = summarize(k if kept is None else k.masked_fill(~kept[..., None], 0.0), v,
                                                None if G is None else G_end[:, :, :, None] - Gd)

        # the scan over chunks (scan.py): states[c] is the state before chunk c (for exponential
        # features relative to r_prev_c, which every query of chunk c sees), kv the state after the last
        initial = None if state is None else Summary(state.kv.to(dtype), None, None if state.ref is None
                                                     else state.ref.to(dtype))
        before, final = scan(chunk_summary._replace(log_decay=state_log_decay), initial, dim=2,
                             drops=carries is not None, algorithm=plan.scan)
        (states, _, r_prev), kv = before, final.kv

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
        out = divide_by_normaliser(out.index_select(2, torch.arange(n, device=out.device)) if blocked else out[:, :, :n])
        if bad is not None:
            out = poisoned(out, _sees_non_finite(bad, n, blindspot_size, runs))

    if not return_state:
        return out.to(out_dtype)
    # padded steps have no keys and no decay: `kv` is the state after token n - 1
    position = (state.position if state is not None else 0) + n
    ref = final.ref
    if not blindspot or n % C == 0:  # (with a blindspot: every block complete)
        state = CausalState.at_block_boundary(kv, ref, position, blindspot)
    else:
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
        state = CausalState(last, last_ref, pending, m[:, :, -1] if exp_features else None, position)
    return out.to(out_dtype), _non_finite_state(bad, state)


def _continue_inside_block(q, k, v, log_decay, mask, blindspot_size, chunk_size, exp_features, state, return_state,
                           kernel, form):
    """Continue from a state in the middle of a blindspot block: finish that block with
    the recurrence, then go on chunk by chunk from the block boundary."""
    n = q.shape[2]
    head = min(n, blindspot_size - state.position % blindspot_size)

    def part(t, sl):
        return None if t is None else t[:, :, sl] if t.ndim > 2 else t[:, sl]

    out, state = recurrent_causal_linear_attention(*(part(t, slice(0, head)) for t in (q, k, v, log_decay, mask)),
                                                   blindspot_size, exp_features, state)
    outs = [out]
    if head < n:
        out, state = causal_linear_attention(*(part(t, slice(head, n)) for t in (q, k, v, log_decay, mask)),
                                             blindspot_size, chunk_size, exp_features, state, True, kernel=kernel,
                                             form=form)
        outs.append(out)
    out = torch.cat(outs, dim=2)
    return (out, state) if return_state else out
