"""The chunk summaries' scan (ops/causal/scan.py) against its naive judge, the loop over spans:
float64, random inputs, span counts that are and are not powers of 2 (1 included), decays
per head and per feature, drops (segment starts: log decay -inf), references of -inf (spans
without a key), initial states; gradients by gradcheck; the backward's memory."""

import pytest
import torch
from torch.autograd import gradcheck

from linear_attention_transformer.ops.causal.scan import (
    ALGORITHMS,
    SCAN_BLOCK,
    Summary,
    blocked_linear_scan,
    combine,
    linear_scan,
    references,
    scan,
    sequential_linear_scan,
)

DOUBLE = torch.float64
NEG_INF = float("-inf")
COUNTS = [1, 2, 3, 5, 8, 13, 64, 100]


def sequential_scan(summaries, initial=None, dim=0):
    """The naive judge of ``scan``: ``combine`` folded over the spans along ``dim``, one at a
    time. Returns (before, final): ``before`` stacks the summary of everything before each
    span (``initial`` included; its log_decay the total decay before the span), ``final``
    that of everything."""
    def span(i):
        return Summary(*(None if t is None else t.select(dim, i) for t in summaries))

    first = span(0)
    acc = initial if initial is not None else Summary(
        torch.zeros_like(first.kv), None if first.log_decay is None else torch.zeros_like(first.log_decay),
        None if first.ref is None else torch.full_like(first.ref, NEG_INF))
    befores = []
    for i in range(summaries.kv.shape[dim]):
        befores.append(acc)
        acc = combine(acc, span(i))
    before = Summary(*(None if befores[0][f] is None else torch.stack(
        [torch.broadcast_to(b[f], befores[-1][f].shape) for b in befores], dim=dim) for f in range(3)))
    return before, acc


def coefficients(kind, b, c, d, g, zeros=False):
    """a in [0, 1] shaped to broadcast against a (b, c, d, e) state: per head (b, c, 1, 1) or
    per feature (b, c, d, 1); optionally some exactly 0 (a dropped state)."""
    if kind is None:
        return None
    a = torch.rand(b, c, 1 if kind == "head" else d, 1, dtype=DOUBLE, generator=g)
    if zeros:
        a = a.masked_fill(torch.rand(a.shape, generator=g) < 0.2, 0.0)
    return a


@pytest.mark.parametrize("c", COUNTS)
@pytest.mark.parametrize("kind", [None, "head", "feature"])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("zeros", [False, True])
def test_linear_scan_equals_the_loop(c, kind, with_initial, zeros):
    g = torch.Generator().manual_seed(c * 7 + with_initial)
    b, d, e = 2, 3, 4
    a = coefficients(kind, b, c, d, g, zeros)
    x = torch.randn(b, c, d, e, dtype=DOUBLE, generator=g)
    initial = torch.randn(b, d, e, dtype=DOUBLE, generator=g) if with_initial else None
    before, last = linear_scan(a, x, initial, dim=1)
    ref_before, ref_last = sequential_linear_scan(a, x, initial, dim=1)
    torch.testing.assert_close(before, ref_before, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, ref_last, rtol=1e-12, atol=1e-12)
    # the loop itself is the recurrence written out
    state = torch.zeros(b, d, e, dtype=DOUBLE) if initial is None else initial
    for i in range(c):
        torch.testing.assert_close(ref_before[:, i], state, rtol=1e-12, atol=1e-12)
        state = x[:, i] + (state if a is None else a[:, i] * state)


@pytest.mark.parametrize("c", [1, 3, 6, 7])
@pytest.mark.parametrize("kind", ["head", "feature"])
def test_linear_scan_gradcheck(c, kind):
    """The backward (a reverse scan) in float64 for every input, both outputs used."""
    g = torch.Generator().manual_seed(c)
    b, d, e = 2, 3, 2
    a = coefficients(kind, b, c, d, g).requires_grad_()
    x = torch.randn(b, c, d, e, dtype=DOUBLE, generator=g, requires_grad=True)
    initial = torch.randn(b, d, e, dtype=DOUBLE, generator=g, requires_grad=True)
    w1 = torch.randn(b, c, d, e, dtype=DOUBLE, generator=g)
    w2 = torch.randn(b, d, e, dtype=DOUBLE, generator=g)

    def f(a, x, initial):
        before, last = linear_scan(a, x, initial, dim=1)
        return (before * w1).sum() + (last * w2).sum()

    assert gradcheck(f, (a, x, initial))


def test_linear_scan_gradients_equal_the_loops():
    """Broadcast coefficients (one per batch row and span, shared by every head) get the
    gradient summed over what they broadcast to, as the loop's autograd gives."""
    g = torch.Generator().manual_seed(5)
    a = torch.rand(2, 1, 11, 1, 1, dtype=DOUBLE, generator=g)
    x = torch.randn(2, 3, 11, 4, 5, dtype=DOUBLE, generator=g)
    w = torch.randn(2, 3, 11, 4, 5, dtype=DOUBLE, generator=g)
    grads = []
    for fn in (linear_scan, sequential_linear_scan):
        ai, xi = a.clone().requires_grad_(), x.clone().requires_grad_()
        before, last = fn(ai, xi, None, 2)
        ((before * w).sum() + last.sum()).backward()
        grads.append((ai.grad, xi.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_linear_scan_backward_keeps_no_intermediate_states():
    """What the forward saves for backward: the coefficients and the states it returns, not
    the log c levels of the scan (counted with saved-tensor hooks)."""
    b, c, d, e = 1, 256, 8, 8
    a = torch.rand(b, c, d, 1, dtype=DOUBLE, requires_grad=True)
    x = torch.randn(b, c, d, e, dtype=DOUBLE, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        before, last = linear_scan(a, x, None, 1)
    assert sum(saved) <= a.numel() + before.numel(), saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequential_linear_scan(a, x, None, 1)
    assert sum(saved) >= before.numel()  # (the loop keeps every state too: the count is not vacuous)


# --------------------------------------------------------------------- summaries


def summaries(c, d, e, decay, exp, seed, drops=False, empty=False, scale=3.0):
    """Random chunk summaries (b=2 rows, c spans) as the kernel forms them: kv relative to its
    ref (the largest term of each feature 1), log decays <= 0 (some -inf with ``drops``),
    and with ``empty`` some spans without a key (ref -inf, kv 0)."""
    g = torch.Generator().manual_seed(seed)
    b = 2
    kv = torch.rand(b, c, d, e, dtype=DOUBLE, generator=g)
    log_decay = None
    if decay is not None:
        log_decay = -2.0 * torch.rand(b, c, 1 if decay == "head" else d, dtype=DOUBLE, generator=g)
        if drops:
            log_decay = log_decay.masked_fill(torch.rand(log_decay.shape, generator=g) < 0.25, NEG_INF)
    ref = None
    if exp:
        ref = scale * torch.randn(b, c, d, dtype=DOUBLE, generator=g)
        kv = kv / kv.amax(dim=-1, keepdim=True)
        if empty:
            none = torch.rand(b, c, d, generator=g) < 0.3
            ref = ref.masked_fill(none, NEG_INF)
            kv = kv.masked_fill(none[..., None], 0.0)
    return Summary(kv, log_decay, ref)


def initial_summary(d, e, exp, seed, empty=False):
    g = torch.Generator().manual_seed(seed + 99)
    kv = torch.rand(2, d, e, dtype=DOUBLE, generator=g)
    ref = None
    if exp:
        ref = 3.0 * torch.randn(2, d, dtype=DOUBLE, generator=g)
        if empty:
            ref[0, 0] = NEG_INF
            kv[0, 0] = 0.0
    return Summary(kv, -torch.rand(2, 1, dtype=DOUBLE, generator=g), ref)


def on_common_reference(s, t):
    """Two summaries' kv (…, d, e) made comparable: each rebased onto max(ref_s, ref_t)."""
    if s.ref is None:
        return s.kv, t.kv
    common = torch.maximum(s.ref, t.ref)

    def rebase(kv, ref):
        ratio = torch.where(torch.isfinite(common), (ref - torch.where(torch.isfinite(common), common, 0)).exp(), 0)
        return kv * ratio[..., None]

    assert torch.equal(torch.isfinite(s.ref), torch.isfinite(t.ref)), "different features reached"
    return rebase(s.kv, s.ref), rebase(t.kv, t.ref)


def assert_same(s, t, what):
    a, b = on_common_reference(s, t)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=what)
    if s.ref is not None:
        finite = torch.isfinite(t.ref)
        torch.testing.assert_close(s.ref[finite], t.ref[finite], rtol=1e-10, atol=1e-10, msg=f"{what} ref")


@pytest.mark.parametrize("c", [1, 3, 8, 13])
# drops are log decays of -inf: they need a decay
@pytest.mark.parametrize("decay, drops", [(None, False), ("head", False), ("feature", False),
                                          ("head", True), ("feature", True)])
@pytest.mark.parametrize("exp", [False, True], ids=["given", "exp"])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_scan_equals_the_sequential_fold_of_combine(c, decay, exp, drops, with_initial, algorithm):
    d, e = 3, 4
    s = summaries(c, d, e, decay, exp, seed=c + 10 * drops, drops=drops, empty=exp)
    initial = initial_summary(d, e, exp, c, empty=True) if with_initial else None
    before, final = scan(s, initial, dim=1, drops=drops, algorithm=algorithm)
    ref_before, ref_final = sequential_scan(s, initial, dim=1)
    assert_same(before, ref_before, "before")
    assert_same(final, ref_final, "final")
    if ref_final.log_decay is None:
        assert final.log_decay is None
    else:
        torch.testing.assert_close(final.log_decay, ref_final.log_decay, rtol=1e-12, atol=1e-12)
    if exp:  # every factor <= 1: no entry exceeds the sum of the entries' bounds (1 per span)
        bound = c + (0 if initial is None else initial.kv.amax().item())
        assert before.kv.amax() <= bound + 1e-9 and final.kv.amax() <= bound + 1e-9


def test_scan_with_drops_exact_where_the_o1_references_are_not():
    """A segment start after a state far above the new keys: the (max, +) scan restarts the
    reference, the O(1) form (a drop taken as a decay of -1e4) would keep it and underflow
    the new keys. drops=True is exact."""
    kv = torch.ones(1, 2, 1, 1, dtype=DOUBLE)
    ref = torch.tensor([[[2e4], [0.0]]], dtype=DOUBLE)
    g = torch.tensor([[[0.0], [NEG_INF]]], dtype=DOUBLE)
    _, final = scan(Summary(kv, g, ref), dim=1, drops=True)
    _, ref_final = sequential_scan(Summary(kv, g, ref), dim=1)
    assert_same(final, ref_final, "final")
    assert final.ref.item() == 0.0 and final.kv.item() == 1.0


@pytest.mark.parametrize("exp", [False, True], ids=["given", "exp"])
@pytest.mark.parametrize("decay", [None, "head", "feature"])
def test_combine_is_associative_with_an_identity(exp, decay):
    s = summaries(3, 4, 2, decay, exp, seed=3, drops=decay is not None, empty=exp)
    x, y, z = (Summary(*(None if t is None else t[:, i] for t in s)) for i in range(3))
    assert_same(combine(combine(x, y), z), combine(x, combine(y, z)), "associativity")
    identity = Summary(torch.zeros_like(x.kv), None if x.log_decay is None else torch.zeros_like(x.log_decay),
                       None if x.ref is None else torch.full_like(x.ref, NEG_INF))
    assert_same(combine(identity, y), y, "identity first")
    assert_same(combine(y, identity), y, "identity last")


def test_summaries_of_slices_combine_to_the_whole():
    """Context parallelism's use: each slice's final summary, combined across slices, equals
    the whole sequence's; and a slice scanned from the state before it (its initial) gives
    the whole scan's states."""
    s = summaries(12, 3, 2, "feature", True, seed=4, drops=True, empty=True)
    _, whole = scan(s, dim=1)
    before_all, _ = scan(s, dim=1)
    parts = [Summary(*(None if t is None else t[:, i:i + 4] for t in s)) for i in (0, 4, 8)]
    finals = [scan(p, dim=1)[1] for p in parts]
    stacked = Summary(*(torch.stack([f[i] for f in finals], dim=1) for i in range(3)))
    slice_before, total = scan(stacked, dim=1)  # the exclusive scan across the slices
    assert_same(total, whole, "total")
    for i, p in enumerate(parts):
        initial = Summary(slice_before.kv[:, i], None, slice_before.ref[:, i])
        before, _ = scan(p, initial, dim=1)
        assert_same(before, Summary(before_all.kv[:, 4 * i:4 * i + 4], None, before_all.ref[:, 4 * i:4 * i + 4]),
                     f"slice {i}")


def test_bad_input_names_the_argument():
    s = summaries(3, 2, 2, None, True, seed=0)
    with pytest.raises(TypeError, match="summaries"):
        scan((s.kv, None, s.ref), dim=1)
    with pytest.raises(ValueError, match="dim"):
        scan(s, dim=2)
    with pytest.raises(ValueError, match="ref"):
        scan(Summary(s.kv, None, s.ref[..., None]), dim=1)
    with pytest.raises(ValueError, match="initial"):
        scan(s, Summary(s.kv[:, 0]), dim=1)
    for bad in ("compiled", "sequential", "fla", None):  # (forms and fla's kernels are not scans)
        with pytest.raises(ValueError, match=r"algorithm must be one of 'log_depth', 'loop', 'blocked', got"):
            scan(s, dim=1, algorithm=bad)
    with pytest.raises(ValueError, match="ref"):
        combine(Summary(s.kv[:, 0]), Summary(s.kv[:, 1], None, s.ref[:, 1]))
    with pytest.raises(ValueError, match="a must"):
        linear_scan(torch.ones(3, 1), torch.zeros(1, 3, 2), dim=1)
    with pytest.raises(ValueError, match="x must"):
        linear_scan(None, torch.zeros(1, 0, 2), dim=1)


def test_inputs_are_not_modified():
    s = summaries(5, 3, 2, "head", True, seed=1, drops=True, empty=True)
    copies = [None if t is None else t.clone() for t in s]
    scan(s, dim=1)
    sequential_scan(s, dim=1)
    for t, copy in zip(s, copies):
        assert torch.equal(t, copy)


# ------------------------------------------------- the blocked scan (what torch.compile traces)

BLOCKED_COUNTS = [1, 2, SCAN_BLOCK - 1, SCAN_BLOCK, SCAN_BLOCK + 1, 3 * SCAN_BLOCK, 100]


def log_or_none(a):
    return None if a is None else a.log()  # a = 0 (a dropped state) -> -inf


@pytest.mark.parametrize("c", BLOCKED_COUNTS)
@pytest.mark.parametrize("kind", [None, "head", "feature"])
@pytest.mark.parametrize("with_initial", [False, True])
def test_blocked_linear_scan_equals_the_loop(c, kind, with_initial):
    """Float64, counts below, at and past multiples of the block, some coefficients exactly 0
    (log a = -inf): states before each element and the last equal the loop's to rounding."""
    g = torch.Generator().manual_seed(c * 11 + with_initial)
    b, d, e = 2, 3, 4
    a = coefficients(kind, b, c, d, g, zeros=True)
    x = torch.randn(b, c, d, e, dtype=DOUBLE, generator=g)
    initial = torch.randn(b, d, e, dtype=DOUBLE, generator=g) if with_initial else None
    before, last = blocked_linear_scan(log_or_none(a), x, initial, dim=1)
    ref_before, ref_last = sequential_linear_scan(a, x, initial, dim=1)
    torch.testing.assert_close(before, ref_before, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, ref_last, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("c", [3, SCAN_BLOCK + 5])
@pytest.mark.parametrize("kind", ["head", "feature"])
def test_blocked_linear_scan_gradients_equal_the_loops(c, kind):
    """Autograd through the blocked form equals autograd through the loop, for x, the initial
    state and log a (d/dlog a = a d/da), -inf coefficients included (their gradient 0, not
    NaN); and gradcheck where every coefficient is finite."""
    g = torch.Generator().manual_seed(c)
    b, d, e = 2, 3, 2
    a = coefficients(kind, b, c, d, g, zeros=True)
    x = torch.randn(b, c, d, e, dtype=DOUBLE, generator=g)
    initial = torch.randn(b, d, e, dtype=DOUBLE, generator=g)
    w1 = torch.randn(b, c, d, e, dtype=DOUBLE, generator=g)
    w2 = torch.randn(b, d, e, dtype=DOUBLE, generator=g)

    def loss(fn, coefficient, x, initial):
        before, last = fn(coefficient, x, initial, 1)
        return (before * w1).sum() + (last * w2).sum()

    la, xb, ib = (t.clone().requires_grad_() for t in (a.log(), x, initial))
    loss(blocked_linear_scan, la, xb, ib).backward()
    ar, xr, ir = (t.clone().requires_grad_() for t in (a, x, initial))
    loss(sequential_linear_scan, ar, xr, ir).backward()
    assert torch.isfinite(la.grad).all()
    torch.testing.assert_close(la.grad, ar.grad * a, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xb.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ib.grad, ir.grad, rtol=1e-10, atol=1e-12)
    finite = coefficients(kind, b, c, d, g).log().requires_grad_()
    assert gradcheck(lambda *t: loss(blocked_linear_scan, *t), (finite, xb.detach().requires_grad_(),
                                                                 ib.detach().requires_grad_()))


@pytest.mark.parametrize("c", [1, SCAN_BLOCK, 13])
def test_blocked_references_equal_the_log_depth_ones(c):
    """The (max, +) scan of the references with drops, blocked as under torch.compile: equal
    to the log-depth scan (and -inf at the same places)."""
    g = torch.Generator().manual_seed(c + 3)
    m = 3.0 * torch.randn(2, 2, c, 4, dtype=DOUBLE, generator=g)
    m = m.masked_fill(torch.rand(m.shape, generator=g) < 0.2, NEG_INF)
    log_decay = -torch.rand(2, 2, c, 1, dtype=DOUBLE, generator=g)
    log_decay = log_decay.masked_fill(torch.rand(log_decay.shape, generator=g) < 0.25, NEG_INF)
    start = torch.randn(2, 2, 4, dtype=DOUBLE, generator=g)
    for got, want in zip(references(m, log_decay, start, 2, drops=True, blocked=True),
                         references(m, log_decay, start, 2, drops=True)):
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        torch.testing.assert_close(got[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-12, atol=1e-12)


def test_blocked_linear_scan_bad_input_names_the_argument():
    x = torch.zeros(2, 3, 4, 5)
    with pytest.raises(ValueError, match="log_a"):
        blocked_linear_scan(torch.zeros(2, 3, 4, 5), x, dim=1)  # a decay that depends on the last axis
    with pytest.raises(ValueError, match="log_a"):
        blocked_linear_scan(torch.zeros(2, 2, 4, 1), x, dim=1)
    with pytest.raises(ValueError, match="dim"):
        blocked_linear_scan(None, x, dim=3)
    with pytest.raises(ValueError, match="x must"):
        blocked_linear_scan(None, torch.zeros(2, 0, 4, 5), dim=1)
