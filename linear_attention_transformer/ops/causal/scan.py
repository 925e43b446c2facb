"""Chunk summaries and the one operator that combines them.

A span of tokens (a chunk, or the slice of one context-parallel process) is summarised by
``Summary(kv, log_decay, ref)``: ``kv`` (…, d, e) the state the span adds, its keys decayed to
the span's end; ``log_decay`` (…, 1 or d) its total log decay g <= 0 (-inf: the span drops the
state before it, a segment starts in it; None: no decay); ``ref`` (…, d) for exponential
features the per-feature log reference of kv (kv = sum_j exp(k_j - ref) [v_j, 1]; -inf where
no key), None for given features. Span 1 then span 2 is

    (S1, g1, r1) ∘ (S2, g2, r2) = (S1 exp(r1 + g2 - r) + S2 exp(r2 - r),  g1 + g2,  r)
                                   with r = max(r1 + g2, r2)

(given features: no r, S = S1 exp(g2) + S2): associative, every factor <= 1, identity
(0, 0, -inf). ``combine`` is that operator; ``scan`` folds it over c spans in O(log c) tensor
operations:

1. the references r_c = max(r_{c-1} + g_c, m_c) (m_c the span's own ``ref``) are a scan in the
   (max, +) semiring, without gradient; without drops in O(1): r_c = T_c + max(r_start,
   max_{c' <= c} m_c' - T_c'), T = cumsum(g) (T's rounding only moves the largest factor);
2. relative to them S_c = a_c S_{c-1} + x_c, a_c = exp(r_{c-1} + g_c - r_c), x_c = kv_c
   exp(m_c - r_c): a scan in the (+, x) semiring (``linear_scan``).

``_scan`` is both, over a semiring: the work-efficient (Blelloch) form, neighbours combined
into pairs, the pairs scanned recursively, each pair's first element filled in after; ~2x the
loop's work at depth log2 c. ``linear_scan``'s backward is the reverse scan lambda_c = dS_c +
a_{c+1} lambda_{c+1}, dx_c = lambda_c, da_c = sum(lambda_c S_{c-1}). ``blocked_linear_scan``
is the same recurrence in a graph whose size does not depend on c (torch.compile), and
``sequential_linear_scan`` the loop.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..common import NEG_INF, exp_ratio, log_ratio

__all__ = ["ALGORITHMS", "Summary", "summarize", "key_factors", "combine", "common_reference", "join_factors", "scan",
           "references", "linear_scan", "sequential_linear_scan", "blocked_linear_scan"]


class Summary(NamedTuple):
    """A span's state contribution (the module docstring); a span axis is the same axis of all three."""

    kv: torch.Tensor
    log_decay: Optional[torch.Tensor] = None
    ref: Optional[torch.Tensor] = None


def summarize(k, v, to_end=None, total=None, exp_features=False):
    """The ``Summary`` of spans of keys from a zero start: k (…, l, d) features, or logits with
    ``exp_features`` (a key that must not enter: 0, or -inf); v (…, l, E) with the normaliser
    column; ``to_end`` (…, l, 1 or d) the log decay from each key to its span's end; ``total``
    (…, 1 or d) the spans' log decay. Returns (Summary(kv (…, d, E), total, ref (…, d) or None),
    the keys' factors (…, l, d): k decayed to the end, or exp(k + to_end - ref))."""
    factors, ref = key_factors(k, to_end, exp_features)
    return Summary(torch.einsum("...ld,...le->...de", factors, v), total, ref), factors


def key_factors(k, to_end=None, exp_features=False):
    """``summarize``'s keys decayed to their span's end: (factors (…, l, d), ref (…, d), their
    per-feature maximum without gradient, -inf where no key; None for given features)."""
    if not exp_features:
        return (k if to_end is None else k * to_end.exp()), None
    k_end = k if to_end is None else k + to_end
    with torch.no_grad():
        ref = k_end.detach().amax(dim=-2)
    return exp_ratio(k_end, ref.unsqueeze(-2)), ref


def combine(earlier: Summary, later: Summary) -> Summary:
    """The summary of span ``earlier`` followed by span ``later`` (the operator of the module
    docstring; associative, identity (0, 0, -inf)). Tensors broadcast."""
    if (earlier.ref is None) != (later.ref is None):
        raise ValueError("combine: both summaries need a ref (exponential features) or neither")
    g = later.log_decay
    if earlier.log_decay is None:
        total = g
    else:
        total = earlier.log_decay if g is None else earlier.log_decay + g
    if earlier.ref is None:
        carried = earlier.kv if g is None else earlier.kv * g.exp()[..., None]
        return Summary(carried + later.kv, total, None)
    r, a, b = join_factors(earlier.ref if g is None else earlier.ref + g, later.ref)  # g carries the gradient
    return Summary(earlier.kv * a[..., None] + later.kv * b[..., None], total, r)


def common_reference(*refs):
    """The log reference that sums held under ``refs`` (broadcastable; -inf: nothing yet) join
    under: their maximum, without gradient (-inf where all are -inf)."""
    new_ref = refs[0]
    for ref in refs[1:]:
        new_ref = torch.maximum(new_ref, ref)
    return new_ref.detach() if new_ref.requires_grad else new_ref  # (a decoding step skips the detach)


def join_factors(ref, other_ref, other_finite=False):
    """Two sums held under log references ``ref`` and ``other_ref`` brought to their common one:
    (new_ref, exp(ref - new_ref), exp(other_ref - new_ref)), factors <= 1, 0 for a reference of
    -inf, the gradient through the factors only. ``other_finite``: the caller knows other_ref
    is finite (a real key), and ``exp_ratio``'s guard is left out (a decoding step's cost)."""
    new_ref = common_reference(ref, other_ref)
    if other_finite:
        return new_ref, (ref - new_ref).exp(), (other_ref - new_ref).exp()
    return new_ref, exp_ratio(ref, new_ref), exp_ratio(other_ref, new_ref)


def _check_summary(s: Summary, name: str, dim: int | None):
    if not isinstance(s, Summary):
        raise TypeError(f"{name} must be a Summary, got {type(s).__name__}")
    if not torch.is_tensor(s.kv) or s.kv.ndim < 2:
        raise TypeError(f"{name}.kv must be a tensor of at least 2 dimensions (…, d, e)")
    for field in ("log_decay", "ref"):
        t = getattr(s, field)
        if t is not None and (not torch.is_tensor(t) or t.ndim != s.kv.ndim - 1):
            raise ValueError(f"{name}.{field} must be a tensor of kv's dimensions less the last (…, d), "
                             f"got {getattr(t, 'shape', type(t))}")
    if dim is not None and not 0 <= dim < s.kv.ndim - 2:
        raise ValueError(f"dim must index a span axis before kv's last two, got {dim} for kv of {s.kv.ndim} dims")


def scan(summaries: Summary, initial: Optional[Summary] = None, dim: int = 0, drops: bool = True,
         algorithm: str = "log_depth"):
    """``combine`` folded over the spans along ``dim`` (before kv's last two), after ``initial``
    (None: nothing). ``drops``: whether some log_decay may be -inf; False lets the references
    take their O(1) form, which takes a -inf as a decay of -1e4. ``algorithm``: one of
    ``ALGORITHMS``, the linear scan: 'log_depth' (``linear_scan``), 'loop'
    (``sequential_linear_scan``) or 'blocked' (``blocked_linear_scan``, the references too).
    Returns (before, final): the summary of everything before each span (``before.log_decay``
    not formed: None) and of everything."""
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, got {algorithm!r}")
    _check_summary(summaries, "summaries", dim)
    if initial is not None:
        _check_summary(initial, "initial", None)
        if (initial.ref is None) != (summaries.ref is None):
            raise ValueError("initial must have a ref exactly when the summaries do")
    kv, g, m = summaries
    start = None if initial is None else initial.kv
    total = None if initial is None else initial.log_decay
    if g is not None:
        total = g.sum(dim) if total is None else g.sum(dim) + total
    blocked = algorithm == "blocked"  # (its scan takes log a_c: -inf where a_c is 0)
    a, r_prev, r = (g if blocked or g is None else g.exp()), None, None
    if m is not None:  # step 2 of the module docstring; the gradient reaches g through a
        r_prev, r = references(m, g, None if initial is None else initial.ref, dim, drops, blocked)
        a = (log_ratio if blocked else exp_ratio)(r_prev if g is None else r_prev + g, r)
        kv = kv * exp_ratio(m, r).unsqueeze(-1)
    a = None if a is None else a.unsqueeze(-1)
    before, final = ALGORITHMS[algorithm](a, kv, start, dim)
    return Summary(before, None, r_prev), Summary(final, total, None if r is None else r.select(dim, -1))


def references(m, log_decay, start, dim, drops=True, blocked=False):
    """(r_prev, r) along ``dim``, without gradient: step 1 of the module docstring (r_prev_c =
    r_{c-1}; ``start``, or -inf, before the first). m (…, c, d); log_decay (…, c, 1 or d) or
    None. ``blocked``: the (max, +) scan in ``_blocked_scan``'s form."""
    with torch.no_grad():
        m = m.detach()
        if start is None:
            start = torch.full_like(m.select(dim, 0), NEG_INF)
        start = torch.broadcast_to(start.detach(), m.select(dim, 0).shape).unsqueeze(dim)
        if log_decay is None:
            r = torch.cat((start, m), dim=dim).cummax(dim=dim).values.narrow(dim, 1, m.shape[dim])
        elif not drops:
            # T's rounding and the clamp (a decay of exp(-1e4) per span is a complete reset)
            # change nothing but where the largest factor lies
            T = torch.broadcast_to(log_decay.detach().clamp(min=-1e4).cumsum(dim=dim), m.shape)
            rel = torch.cat((start, m - T), dim=dim).cummax(dim=dim).values.narrow(dim, 1, m.shape[dim])
            r = T + rel
        elif blocked:
            r, _ = _blocked_scan(MAX_PLUS, log_decay.detach().unsqueeze(-1), m.unsqueeze(-1),
                                 start.squeeze(dim).unsqueeze(-1), dim, inclusive=True)
            r = r.squeeze(-1)
        else:
            r, _ = _scan(MAX_PLUS, log_decay.detach(), m, start.squeeze(dim), dim)
        if blocked:
            r_prev = _first(torch.cat((start, r), dim=dim), dim, m.shape[dim])
        else:
            r_prev = torch.cat((start, r.narrow(dim, 0, m.shape[dim] - 1)), dim=dim)
    return r_prev, r


class _Semiring(NamedTuple):
    times: object  # a1 ⊗ a2
    fma: object  # x ⊕ a ⊗ s
    one: float
    zero: float


LINEAR = _Semiring(torch.mul, lambda x, a, s: torch.addcmul(x, a, s), 1.0, 0.0)
MAX_PLUS = _Semiring(torch.add, lambda x, a, s: torch.maximum(x, a + s), 0.0, NEG_INF)


def _scan(sr, a, x, initial, dim, reverse=False, exclusive=False):
    """S_j = x_j ⊕ a_j ⊗ S_{j-1} (``reverse``: S_{j+1}), starting from ``initial`` (x's shape
    without ``dim``; broadcasting allowed). a broadcasts against x and has x's size along
    ``dim``. Returns (S, last): S inclusive, or with ``exclusive`` the state before each
    element; last the state after all of them."""
    c = x.shape[dim]
    init = initial.unsqueeze(dim)
    if c == 1:
        last = sr.fma(x, a, init)
        return (init.expand_as(last).clone() if exclusive else last), last.squeeze(dim)
    odd = c % 2
    if odd:  # the identity at the end (processed last forwards, first backwards)
        a, x = _pad_axis(a, dim, 0, 1, sr.one), _pad_axis(x, dim, 0, 1, sr.zero)
    pa, px = a.unflatten(dim, (-1, 2)), x.unflatten(dim, (-1, 2))
    first, second = (1, 0) if reverse else (0, 1)  # the order in which a pair is applied
    a0, a1 = pa.select(dim + 1, first), pa.select(dim + 1, second)
    x0, x1 = px.select(dim + 1, first), px.select(dim + 1, second)
    pair_a = sr.times(a1, a0)
    pair_x = sr.fma(x1, a1, x0)
    after, last = _scan(sr, pair_a, pair_x, initial, dim, reverse)  # the state after each pair
    p = after.shape[dim]
    if reverse:
        before = torch.cat((after.narrow(dim, 1, p - 1), init.expand_as(after.narrow(dim, 0, 1))), dim=dim)
    else:
        before = torch.cat((init.expand_as(after.narrow(dim, 0, 1)), after.narrow(dim, 0, p - 1)), dim=dim)
    mid = sr.fma(x0, a0, before)  # the state after the pair's first element
    if exclusive:
        seq = (mid, before) if reverse else (before, mid)
    else:
        seq = (after, mid) if reverse else (mid, after)
    out = torch.stack(seq, dim=dim + 1).flatten(dim, dim + 1)  # seq[0][i] at 2i, seq[1][i] at 2i + 1
    return (out.narrow(dim, 0, c) if odd else out), last


# Elements per block of ``blocked_linear_scan``: its work is ~ c B (inside blocks) + (c / B)^2
# (across them) per state element; 8 keeps both small for c up to ~1000 chunks.
SCAN_BLOCK = 8


def _segment_sums(la, axis):
    """la (…, T, …) log coefficients -> (…, T, T, …) along ``axis``: entry (i, j) = sum_{j < t
    <= i} la_t for j <= i (0 on the diagonal), -inf above it. Each entry is summed term by
    term (a cumulative sum down the columns of a masked copy), not taken as a difference of
    one cumulative sum, which would cancel: the factors exp(entry) are as exact as the loop's
    products."""
    axis = axis % la.ndim
    T = la.shape[axis]
    trailing = (1,) * (la.ndim - 1 - axis)
    lower = torch.ones(T, T, dtype=torch.bool, device=la.device).tril()
    strictly_lower = lower.tril(-1).view(T, T, *trailing)
    # (t, j): la_t where t > j, by broadcasting in where() (an expand would ask whether the
    # symbolic sizes before ``axis`` are 1: a guard under dynamic shapes)
    sums = torch.where(strictly_lower, la.unsqueeze(axis + 1), 0.0).cumsum(dim=axis)
    return sums.masked_fill(~lower.view(T, T, *trailing), NEG_INF)


def _blocked_apply(sr, L, x, axis):
    """sum_j exp(L_ij) x_j (LINEAR) or max_j (L_ij + x_j) (MAX_PLUS): L (…, I, J, …) with J
    at ``axis`` + 1, x (…, J, …) with J at ``axis``; -> (…, I, …). A product and a reduction,
    not a matmul: every operand keeps its layout (moving the symbolic chunk axis past others
    makes dynamic shapes guard on stride equalities, and recompile)."""
    if sr is LINEAR:
        return (L.exp() * x.unsqueeze(axis)).sum(dim=axis + 1)
    return (L + x.unsqueeze(axis)).amax(dim=axis + 1)


def _pad_axis(t, axis, before, after, value):
    return torch.nn.functional.pad(t, (0, 0) * (t.ndim - 1 - axis) + (before, after), value=value)


def _first(t, axis, length):
    """The first ``length`` entries of t along ``axis``, as a fresh tensor (index_select): a
    view would keep the strides of the longer axis, and every later layout decision would
    compare the two symbolic lengths under dynamic shapes (a guard, so a recompile)."""
    return t.index_select(axis, torch.arange(length, device=t.device))


def _blocked_scan(sr, la, x, initial, dim, inclusive=False):
    """S_j = x_j ⊕ exp(la_j) ⊗ S_{j-1} along ``dim`` in a number of operations independent of c.

    la: log coefficients (MAX_PLUS: the additive ones), size c along ``dim`` and 1 last,
    broadcastable to x (…, c, …, E); initial: x's shape without ``dim``. The elements are padded
    with the identity to P blocks of ``SCAN_BLOCK`` (at least one block of padding: no branch on
    it under dynamic shapes); inside a block the states are one (B x B) product with the
    segment sums of la, across blocks the same form over the blocks' totals, and each element
    adds its block's start state decayed to it. Returns (S before each element, or after it
    with ``inclusive``; the state after the last)."""
    c, B = x.shape[dim], SCAN_BLOCK
    # (one block more than needed, all identity: P >= 2 for every c, so that dynamic shapes
    # need not guard on P == 1 where the blocks' axis is merged with the leading ones)
    P = (c + B - 1) // B + 1
    pad = P * B - c
    pre, rest = x.shape[:dim], x.shape[dim + 1:]
    la_rest = la.shape[dim + 1:]
    # (split into (P, B), then merged with the leading axes: a view straight to (N, B) would
    # ask whether the leading sizes alone are divisible by N, a guard on P == 1)
    x = _pad_axis(x, dim, 0, pad, sr.zero).view(*pre, P, B, *rest).flatten(0, dim)  # (N, B, …, E)
    la = _pad_axis(la.expand(*pre, *la.shape[dim:]), dim, 0, pad, 0.0).view(*pre, P, B, *la_rest).flatten(0, dim)
    L = _segment_sums(la, 1)  # (N, B, B, …)
    D = la.cumsum(dim=1)  # log coefficient from the block's start through each element
    own_end = _blocked_apply(sr, L.narrow(1, B - 1, 1), x, 1).view(*pre, P, *rest)  # each block's own state
    totals = _pad_axis(D.select(1, B - 1).view(*pre, P, *la_rest), dim, 1, 0, 0.0)  # [0]: the initial state's
    start = initial.unsqueeze(dim).expand(*pre, 1, *rest)
    ends = _blocked_apply(sr, _segment_sums(totals, dim), torch.cat((start, own_end), dim=dim), dim)  # (…, P + 1, …)
    if not inclusive:  # the state before each element: one row down
        L = _pad_axis(L.narrow(1, 0, B - 1), 1, 1, 0, NEG_INF)
        D = _pad_axis(D.narrow(1, 0, B - 1), 1, 1, 0, 0.0)
    own = _blocked_apply(sr, L, x, 1)  # (N, B, …, E)
    block_start = _first(ends, dim, P).flatten(0, dim).unsqueeze(1)
    if sr is LINEAR:
        states = own + D.exp() * block_start
    else:
        states = torch.maximum(own, D + block_start)
    states = _first(states.view(*pre, P, B, *rest).flatten(dim, dim + 1), dim, c)
    return states, ends.select(dim, -1)


def blocked_linear_scan(log_a, x, initial=None, dim=0):
    """``linear_scan`` in a number of operations independent of c (``_blocked_scan``; for
    torch.compile, where the loop would unroll and the log-depth scan branches on c); backward
    is autograd's. log_a: log a_c <= 0 (-inf: a dropped state) with x's number of dimensions,
    size c along ``dim`` and 1 in the last; None for a = 1. The rest as ``linear_scan``."""
    if not 0 <= dim < x.ndim - 1:
        raise ValueError(f"dim must index one of x's dimensions before its last, got {dim} for {x.ndim} dims")
    initial = _start(x, initial, dim)
    if log_a is None:
        return linear_scan(None, x, initial, dim)
    if not torch.is_tensor(log_a) or log_a.ndim != x.ndim or log_a.shape[-1] != 1 or log_a.shape[dim] != x.shape[dim]:
        raise ValueError(f"log_a must have x's {x.ndim} dimensions, its size {x.shape[dim]} along dim and 1 in the "
                         f"last, got {getattr(log_a, 'shape', type(log_a))}")
    return _blocked_scan(LINEAR, log_a, x, initial, dim)


def _start(x, initial, dim):
    """The state before the first element: ``initial`` (None: zeros) as x's shape without ``dim``."""
    if x.shape[dim] == 0:
        raise ValueError("x must hold at least one element along dim")
    shape = x.select(dim, 0).shape
    return x.new_zeros(shape) if initial is None else torch.broadcast_to(initial, shape)


def _shift_coefficients(a, c, dim):
    """b_j = a_{j+1} (b_{c-1} = a_{c-1}, unused: it multiplies the zero start of the reverse scan)."""
    a = a.expand(*a.shape[:dim], c, *a.shape[dim + 1:]) if a.shape[dim] != c else a
    return torch.cat((a.narrow(dim, 1, c - 1), a.narrow(dim, c - 1, 1)), dim=dim)


class _LinearScan(torch.autograd.Function):
    """``linear_scan``; backward is the reverse scan of the module docstring."""

    @staticmethod
    def forward(ctx, a, x, initial, dim):
        before, last = _scan(LINEAR, a, x, initial, dim, exclusive=True)
        ctx.dim = dim
        ctx.save_for_backward(a, before)
        return before, last

    @staticmethod
    def backward(ctx, grad_before, grad_last):
        a, before = ctx.saved_tensors
        dim = ctx.dim
        c = before.shape[dim]
        # dL/dS_j from outside: S_j is before[j + 1] for j < c - 1, and the last state
        direct = torch.cat((grad_before.narrow(dim, 1, c - 1), grad_last.unsqueeze(dim)), dim=dim)
        lam, _ = _scan(LINEAR, _shift_coefficients(a, c, dim), direct, torch.zeros_like(grad_last), dim,
                       reverse=True)
        grad_a = (lam * before).sum_to_size(a.shape) if ctx.needs_input_grad[0] else None
        grad_initial = None
        if ctx.needs_input_grad[2]:
            grad_initial = grad_before.select(dim, 0) + (a.narrow(dim, 0, 1) * lam.narrow(dim, 0, 1)).squeeze(dim)
        return grad_a, lam, grad_initial, None


def linear_scan(a, x, initial=None, dim=0):
    """States of S_c = a_c S_{c-1} + x_c along ``dim`` (O(log c) operations, backward a
    reverse scan). x: (…, c, …); a: broadcastable to x with size c along ``dim`` (None: a = 1,
    an exclusive cumulative sum); initial: the state before the first (x's shape without
    ``dim``), None for zeros. Returns (before (…, c, …): the state before each element,
    last: the state after all)."""
    if a is not None and a.ndim != x.ndim:
        raise ValueError(f"a must have x's number of dimensions ({x.ndim}), got {a.ndim}")
    if not 0 <= dim < x.ndim:
        raise ValueError(f"dim must index x's dimensions, got {dim}")
    initial, c = _start(x, initial, dim), x.shape[dim]
    if a is None:
        inclusive = x.cumsum(dim) + initial.unsqueeze(dim)
        before = torch.cat((initial.unsqueeze(dim), inclusive.narrow(dim, 0, c - 1)), dim=dim)
        return before, inclusive.select(dim, c - 1)
    if a.shape[dim] != c:
        raise ValueError(f"a must have x's size {c} along dim, got {a.shape[dim]}")
    return _LinearScan.apply(a, x, initial, dim)


def sequential_linear_scan(a, x, initial=None, dim=0):
    """``linear_scan`` as a loop over the elements (the CPU's form: faster there)."""
    state = _start(x, initial, dim)
    # (unbind once: indexing element c inside the loop would cost a full-size zero gradient
    # per element in backward, quadratic in their number)
    coefficients = [None] * x.shape[dim] if a is None else a.unbind(dim)
    before = []
    for x_c, a_c in zip(x.unbind(dim), coefficients):
        before.append(state)
        state = x_c + (state if a_c is None else state * a_c)
    return torch.stack(before, dim=dim), state


# ``scan``'s algorithms, by name (``forms.Form.scan`` names one of them, or fla's kernels)
ALGORITHMS = {"log_depth": linear_scan, "loop": sequential_linear_scan, "blocked": blocked_linear_scan}
