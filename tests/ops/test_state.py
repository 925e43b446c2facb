"""State continuation, the contract cached decoding relies on: a prefix, then the rest
from the returned state, equals one pass; states and inputs are never modified in place;
and the state holds what ``CausalState`` documents."""

import pytest
import torch
import torch.nn.functional as F

from linear_attention_transformer.ops import (
    CausalState,
    FeatureMap,
    causal_linear_attention,
    causal_linear_attention_step,
    naive_causal_linear_attention,
    recurrent_causal_linear_attention,
)

# every test here runs under each form of the causal kernel (conftest.causal_form)
pytestmark = pytest.mark.usefixtures("causal_form")

EXP = [False, True]
NEG_INF = float("-inf")
STATE_FIELDS = ("kv", "ref", "pending", "pending_ref")


def ids(exp_features):
    return "exp" if exp_features else "features"


def piece(t, sl):
    """Slice a (b, h, n, ...) tensor, (b, n) mask or None along the sequence."""
    if t is None:
        return None
    return t[:, sl] if t.ndim == 2 and t.dtype == torch.bool else t[:, :, sl]


def snapshot(*objs):
    """Clones of every tensor in objs (CausalState expanded), to compare later."""
    out = []
    for o in objs:
        if isinstance(o, CausalState):
            fields = tuple(None if getattr(o, f) is None else getattr(o, f).clone() for f in STATE_FIELDS)
            out.append((fields, o.position))
        else:
            out.append(None if o is None else o.clone())
    return out


def assert_unchanged(before, *objs):
    for saved, o in zip(before, objs):
        if isinstance(o, CausalState):
            fields, position = saved
            assert o.position == position, "state.position modified"
            for name, old in zip(STATE_FIELDS, fields):
                new = getattr(o, name)
                assert (new is None) == (old is None), f"state.{name} replaced"
                assert new is None or torch.equal(new, old), f"state.{name} modified in place"
        elif o is not None:
            assert torch.equal(o, saved), "input modified in place"


def make_inputs(decay, masked, n, seed, helpers, exp_features, b=2, h=2, d=3, e=2):
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed, exp_features)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed)
    mask = helpers.random_mask(b, n, seed) if masked else None
    return q, k, v, log_decay, mask


CASES = [(1, 4, 15, s) for s in (1, 3, 4, 5, 11, 14)] + [(4, 16, 15, s) for s in (1, 2, 3, 4, 5, 8, 12, 14)]
CASES += [(4, 16, 16, s) for s in (3, 4, 8, 13)] + [(5, 16, 17, s) for s in (4, 5, 6, 16)]


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("blindspot, chunk, n, split", CASES)
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("masked", [False, True])
def test_prefix_then_rest_equals_one_pass(exp_features, blindspot, chunk, n, split, decay, masked, helpers):
    """Splits inside and at the end of blindspot blocks and chunks; with a mask, row 1's
    whole prefix is padding (its state has seen no key: references still -inf)."""
    q, k, v, log_decay, mask = make_inputs(decay, masked, n, n + split + blindspot, helpers, exp_features)
    if masked:
        mask[1, :split] = False
    kw = dict(blindspot_size=blindspot, chunk_size=chunk, exp_features=exp_features, return_state=True)
    full, full_state = causal_linear_attention(q, k, v, log_decay, mask, **kw)
    inputs = snapshot(q, k, v, log_decay, mask)

    head, rest = slice(0, split), slice(split, n)
    out1, state1 = causal_linear_attention(*(piece(t, head) for t in (q, k, v, log_decay, mask)), **kw)
    saved = snapshot(state1)
    out2, state2 = causal_linear_attention(*(piece(t, rest) for t in (q, k, v, log_decay, mask)), state=state1, **kw)
    helpers.assert_matches(torch.cat((out1, out2), dim=2), full)
    helpers.assert_same_state(state2, full_state)
    assert state1.position == split and state2.position == n
    if masked and exp_features:
        assert torch.equal(state1.ref[1], torch.full_like(state1.ref[1], NEG_INF))
        assert torch.equal(state1.kv[1], torch.zeros_like(state1.kv[1]))

    # the old state is untouched: continuing from it again gives bit-identical results
    assert_unchanged(saved, state1)
    again, _ = causal_linear_attention(*(piece(t, rest) for t in (q, k, v, log_decay, mask)), state=state1, **kw)
    assert torch.equal(again, out2)
    assert_unchanged(saved, state1)
    assert_unchanged(inputs, q, k, v, log_decay, mask)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("blindspot, chunk", [(1, 4), (4, 16), (3, 2)])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("masked", [False, True])
def test_three_pieces_and_token_by_token_calls(exp_features, blindspot, chunk, decay, masked, helpers):
    """Pieces that start and end inside blocks, and n = 1 calls (one decoding step each)."""
    n = 17
    q, k, v, log_decay, mask = make_inputs(decay, masked, n, blindspot + 3, helpers, exp_features)
    kw = dict(blindspot_size=blindspot, chunk_size=chunk, exp_features=exp_features, return_state=True)
    full, full_state = causal_linear_attention(q, k, v, log_decay, mask, **kw)
    for cuts in ([0, 3, 6, n], [0, 5, 13, n], list(range(n + 1))):
        state, outs = None, []
        for a, z in zip(cuts[:-1], cuts[1:]):
            out, state = causal_linear_attention(
                *(piece(t, slice(a, z)) for t in (q, k, v, log_decay, mask)), state=state, **kw
            )
            outs.append(out)
        helpers.assert_matches(torch.cat(outs, dim=2), full, what=f"pieces {cuts}")
        helpers.assert_same_state(state, full_state)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("blindspot, chunk, split", [(1, 4, 6), (1, 4, 8), (4, 16, 6), (4, 16, 8), (4, 16, 0)])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("masked", [False, True])
def test_steps_from_a_chunked_state_equal_the_chunked_continuation(
    exp_features, blindspot, chunk, split, decay, masked, helpers
):
    n = 15
    b, h, d, e = 2, 2, 3, 2
    q, k, v, log_decay, mask = make_inputs(decay, masked, n, split + 40, helpers, exp_features)
    kw = dict(blindspot_size=blindspot, chunk_size=chunk, exp_features=exp_features)
    full, full_state = causal_linear_attention(q, k, v, log_decay, mask, return_state=True, **kw)
    if split:
        head = (piece(t, slice(0, split)) for t in (q, k, v, log_decay, mask))
        _, state = causal_linear_attention(*head, return_state=True, **kw)
    else:
        state = CausalState.zeros(b, h, d, e, blindspot, exp_features, dtype=q.dtype)
    start = state
    saved = snapshot(start)
    chunked_rest, _ = causal_linear_attention(
        *(piece(t, slice(split, n)) for t in (q, k, v, log_decay, mask)), state=start, return_state=True, **kw
    )

    # padding is handled by the caller of a step: a padded token has no key and no decay
    ks, vs, lds = helpers.without_padding(k, v, log_decay, mask, exp_features)
    outs, old_states = [], []
    for t in range(split, n):
        ld = None if lds is None else lds[:, :, t]
        old_states.append((state, snapshot(state)))
        out, state = causal_linear_attention_step(
            q[:, :, t], ks[:, :, t], vs[:, :, t], state, ld, blindspot, exp_features=exp_features
        )
        outs.append(out)
    stepped = torch.stack(outs, dim=2)
    helpers.assert_matches(stepped, chunked_rest, what="steps vs chunked continuation")
    helpers.assert_matches(stepped, full[:, :, split:], what="steps vs one pass")
    helpers.assert_same_state(state, full_state)
    for old, saved_old in old_states:
        assert_unchanged(saved_old, old)
    assert_unchanged(saved, start)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("decay", [None, "per_feature"])
def test_chunked_continuation_from_a_stepped_state(exp_features, blindspot, decay, helpers):
    """Decode a few tokens one step at a time (ending inside a block), then a chunk."""
    n, split = 19, 6
    q, k, v, log_decay, _ = make_inputs(decay, False, n, 77, helpers, exp_features)
    b, h, _, d = q.shape
    kw = dict(blindspot_size=blindspot, exp_features=exp_features)
    full = causal_linear_attention(q, k, v, log_decay, chunk_size=4, **kw)
    state = CausalState.zeros(b, h, d, v.shape[-1], blindspot, exp_features, dtype=q.dtype)
    outs = []
    for t in range(split):
        ld = None if log_decay is None else log_decay[:, :, t]
        out, state = causal_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, ld, **kw)
        outs.append(out[:, :, None])
    saved = snapshot(state)
    rest = (piece(t, slice(split, n)) for t in (q, k, v, log_decay))
    outs.append(causal_linear_attention(*rest, chunk_size=4, state=state, **kw))
    helpers.assert_matches(torch.cat(outs, dim=2), full)
    assert_unchanged(saved, state)
    # the recurrent reference continues the same way
    rest = (piece(t, slice(split, n)) for t in (q, k, v, log_decay))
    rec, _ = recurrent_causal_linear_attention(*rest, state=state, **kw)
    helpers.assert_matches(rec, full[:, :, split:])
    assert_unchanged(saved, state)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("blindspot, split", [(1, 3), (1, 8), (4, 3), (4, 8)])
def test_gradients_flow_through_the_state(exp_features, blindspot, split, helpers):
    """Training across a split (truncated backpropagation keeps the graph): the gradients of
    prefix + continuation equal those of one pass, also into the prefix's tokens."""
    n = 15
    q, k, v, log_decay, mask = make_inputs("per_feature", True, n, 60 + split, helpers, exp_features)
    r = torch.randn(q.shape[:3] + v.shape[3:], dtype=q.dtype, generator=torch.Generator().manual_seed(split))
    kw = dict(blindspot_size=blindspot, chunk_size=4, exp_features=exp_features)
    grads = []
    for cut in (None, split):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, log_decay)]
        if cut is None:
            out = causal_linear_attention(*inputs, mask, **kw)
        else:
            head, rest = slice(0, cut), slice(cut, n)
            out1, state = causal_linear_attention(
                *(piece(t, head) for t in inputs), mask[:, head], return_state=True, **kw
            )
            out2 = causal_linear_attention(*(piece(t, rest) for t in inputs), mask[:, rest], state=state, **kw)
            out = torch.cat((out1, out2), dim=2)
        grads.append(torch.autograd.grad((out * r).sum(), inputs))
    for name, g_split, g_full in zip(("q", "k", "v", "log_decay"), *grads[::-1]):
        helpers.assert_matches(g_split, g_full, what=f"d/d{name}")
    assert grads[1][1][:, :, :split].abs().max() > 0  # the prefix's keys do get a gradient


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
def test_zero_state_dtype_conversion_and_detach(exp_features, helpers):
    q, k, v, log_decay, mask = make_inputs("scalar", True, 9, 5, helpers, exp_features)
    b, h, n, d = q.shape
    e = v.shape[-1]
    kw = dict(blindspot_size=3, exp_features=exp_features)
    out = causal_linear_attention(q, k, v, log_decay, mask, **kw)
    zero = CausalState.zeros(b, h, d, e, dtype=q.dtype, **kw)
    assert zero.position == 0 and zero.kv.dtype == q.dtype
    assert zero.kv.shape == zero.pending.shape == (b, h, d, e + 1)
    assert torch.equal(zero.kv, torch.zeros_like(zero.kv)) and torch.equal(zero.pending, zero.kv)
    if exp_features:
        assert zero.ref.shape == zero.pending_ref.shape == (b, h, d)
        assert torch.equal(zero.ref, torch.full_like(zero.ref, NEG_INF)) and torch.equal(zero.pending_ref, zero.ref)
    else:
        assert zero.ref is None and zero.pending_ref is None
    plain = CausalState.zeros(b, h, d, e, exp_features=exp_features)
    assert plain.pending is None and plain.pending_ref is None and plain.kv.dtype == torch.float32
    assert (plain.ref is None) != exp_features
    helpers.assert_matches(causal_linear_attention(q, k, v, log_decay, mask, state=zero, **kw), out)

    q4, k4, v4 = (t[:, :, :4].clone().requires_grad_(True) for t in (q, k, v))
    _, state = causal_linear_attention(q4, k4, v4, return_state=True, **kw)
    as32 = state.to(torch.float32)
    assert as32.position == state.position == 4
    assert state.kv.dtype == torch.float64  # .to returns a new state
    for name in STATE_FIELDS:
        old, new = getattr(state, name), getattr(as32, name)
        assert (old is None) == (new is None) == (name.endswith("ref") and not exp_features)
        if old is not None:
            assert new.dtype == torch.float32
            assert torch.equal(new, old.float())

    assert state.kv.requires_grad and state.pending.requires_grad
    detached = state.detach()
    assert detached.position == 4 and not detached.kv.requires_grad and not detached.pending.requires_grad
    assert torch.equal(detached.kv, state.kv) and state.kv.requires_grad  # a new state, again
    # a detached state continues exactly like the original one, without a graph back to it
    rest = [t[:, :, 4:] for t in (q, k, v)]
    from_detached = causal_linear_attention(*rest, state=detached, **kw)
    from_state = causal_linear_attention(*rest, state=state, **kw)
    assert from_state.requires_grad and not from_detached.requires_grad
    helpers.assert_matches(from_detached, from_state.detach())


# --------------------------------------------------- exponential features: the references


def reference_state(k, v, lo, hi):
    """Per-feature maximum of the real (finite) key logits k[lo:hi] (-inf if none) and
    sum_j exp(k_j - max) [v_j, 1]: what an undecayed state holds by its documentation."""
    k, v = k[:, :, lo:hi], F.pad(v[:, :, lo:hi], (0, 1), value=1.0)
    ref = k.amax(dim=2) if hi > lo else torch.full(k.shape[:2] + k.shape[3:], NEG_INF, dtype=k.dtype)
    finite_ref = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))
    return ref, torch.einsum("bhnd,bhne->bhde", (k - finite_ref[:, :, None]).exp(), v)


def states_of_every_form(q, k, v, mask, blindspot, chunk):
    """(name, state) after the whole sequence: chunked, recurrent and step by step."""
    b, h, n, d = q.shape
    kw = dict(blindspot_size=blindspot, exp_features=True)
    yield "chunked", causal_linear_attention(q, k, v, mask=mask, chunk_size=chunk, return_state=True, **kw)[1]
    yield "recurrent", recurrent_causal_linear_attention(q, k, v, mask=mask, **kw)[1]
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    state = CausalState.zeros(b, h, d, v.shape[-1], dtype=q.dtype, **kw)
    for t in range(n):
        k_t = k[:, :, t].masked_fill(~real[:, t, None, None], NEG_INF)
        _, state = causal_linear_attention_step(q[:, :, t], k_t, v[:, :, t] * real[:, t, None, None], state, **kw)
    yield "steps", state


@pytest.mark.parametrize("n", [1, 4, 5, 13, 16, 23])
@pytest.mark.parametrize("blindspot, chunk", [(1, 4), (1, 64), (4, 16)])
@pytest.mark.parametrize("masked", [False, True])
def test_state_holds_exp_sums_relative_to_the_key_maxima(n, blindspot, chunk, masked, helpers):
    """The documented meaning of the state, checked directly, for an undecayed stream: `ref`
    is the per-feature maximum of the real keys so far (-inf before any), and `kv` is
    sum_j exp(k_j - ref) [v_j, 1] over them; with a blindspot both cover the completed
    blocks, and `pending` holds the same sum for the unfinished block on its reference."""
    b, h, d, e = 3, 2, 3, 2
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=n + chunk, exp_features=True)
    mask = None
    if masked:
        mask = helpers.random_mask(b, n, seed=n)
        mask[1, : n - 1] = False  # row 1: padding up to its last token
        mask[2] = False  # row 2: padding only
    real_k = k if mask is None else k.masked_fill(~mask[:, None, :, None], NEG_INF)
    complete = n - n % blindspot
    ref, kv = reference_state(real_k, v, 0, complete)
    for name, state in states_of_every_form(q, k, v, mask, blindspot, chunk):
        assert state.position == n
        assert torch.equal(state.ref, ref), f"{name}: ref is not the maximum of the real keys"
        helpers.assert_matches(state.kv, kv, rtol=1e-12, what=f"{name}: kv")
        if mask is not None:
            assert torch.equal(state.ref[2], torch.full_like(state.ref[2], NEG_INF)), f"{name}: row without keys"
            assert torch.equal(state.kv[2], torch.zeros_like(state.kv[2]))
        if blindspot == 1:
            assert state.pending is None and state.pending_ref is None
            continue
        block_ref, block_kv = reference_state(real_k, v, complete, n)
        # the pending keys sit on a reference at least their maximum (the chunked form uses
        # the running maximum of all keys): compare on the block's own maximum
        assert (state.pending_ref >= block_ref).all()
        helpers.assert_matches(
            helpers.rebase(state.pending, state.pending_ref, torch.maximum(state.pending_ref, block_ref)),
            helpers.rebase(block_kv, block_ref, torch.maximum(state.pending_ref, block_ref)),
            rtol=1e-12,
            what=f"{name}: pending",
        )
        if name != "chunked":  # the recurrence starts each block afresh
            assert torch.equal(state.pending_ref, block_ref)


@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("split", [1, 3, 4, 7, 8, 14])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_map_carried_across_a_split_with_growing_keys(blindspot, split, masked, helpers):
    """The pipeline (feature map -> kernel with exp features) continued from a state, while
    the keys keep growing: every chunk moves the references, and a row whose whole prefix
    is padding starts from references of -inf."""
    b, h, n, d, e = 3, 2, 15, 4, 2
    g = torch.Generator().manual_seed(split)
    q = torch.randn(b, h, n, d, dtype=torch.float64, generator=g)
    k = torch.randn(b, h, n, d, dtype=torch.float64, generator=g)
    k = k + torch.linspace(0, 12, n, dtype=torch.float64)[:, None]  # every chunk raises the maxima
    v = torch.randn(b, h, n, e, dtype=torch.float64, generator=g)
    mask = None
    if masked:
        mask = helpers.random_mask(b, n, seed=split)
        mask[1, : split + 1] = False  # the whole prefix of row 1 is padding
    fm = FeatureMap("softmax")

    def run(q, k, v, mask, state=None):
        q_in, k_in, exp_features = fm.causal_features(q, k)
        return causal_linear_attention(
            q_in, k_in, v, None, mask, blindspot, chunk_size=4, exp_features=exp_features, state=state,
            return_state=True,
        )

    full, full_state = run(q, k, v, mask)
    helpers.assert_matches(full, naive_causal_linear_attention(q, k, v, None, mask, blindspot, exp_features=True))
    inputs = snapshot(q, k, v, mask)
    out1, state1 = run(*(piece(t, slice(0, split)) for t in (q, k, v, mask)))
    saved = snapshot(state1)
    out2, state2 = run(*(piece(t, slice(split, n)) for t in (q, k, v, mask)), state=state1)
    helpers.assert_matches(torch.cat((out1, out2), dim=2), full)
    helpers.assert_same_state(state2, full_state)
    assert_unchanged(saved, state1)
    assert_unchanged(inputs, q, k, v, mask)


@pytest.mark.parametrize("offset", [-150.0, 60.0, 200.0])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_split_after_an_all_padding_prefix_float32(offset, blindspot, helpers):
    """A prefix that is all padding has seen no key: its references are -inf and its sums
    0, and whatever it carries must not distort the keys that follow, even when their
    logits are far from 0 (exp overflows or underflows float32 there)."""
    b, h, n, d, e, split = 2, 2, 10, 4, 2, 4
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, h, n, d, generator=g) + torch.linspace(0, 4, n)[:, None] + offset
    v = torch.randn(b, h, n, e, generator=g)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[:, :split] = False
    kw = dict(blindspot_size=blindspot, exp_features=True, return_state=True)
    full, _ = causal_linear_attention(q, k, v, None, mask, **kw)
    truth = naive_causal_linear_attention(q.double(), k.double(), v.double(), None, mask, blindspot, exp_features=True)
    helpers.assert_matches(full, truth, rtol=1e-5, what="one pass, float32")

    head, rest = slice(0, split), slice(split, n)
    out1, state1 = causal_linear_attention(*(piece(t, head) for t in (q, k, v)), mask=mask[:, head], **kw)
    assert torch.equal(out1, torch.zeros_like(out1))
    assert torch.equal(state1.ref, torch.full_like(state1.ref, NEG_INF))
    assert torch.equal(state1.kv, torch.zeros_like(state1.kv))
    out2, state2 = causal_linear_attention(*(piece(t, rest) for t in (q, k, v)), mask=mask[:, rest], state=state1, **kw)
    helpers.assert_matches(out2, full[:, :, split:], rtol=1e-5, what="continued after padding")
    complete = n - n % blindspot
    assert torch.equal(state2.ref, k[:, :, split:complete].amax(dim=2))

    # decoding token by token from the empty state: the same
    state, outs = state1, []
    for t in range(split, n):
        out, state = causal_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, None, blindspot, True)
        outs.append(out)
    helpers.assert_matches(torch.stack(outs, dim=2), full[:, :, split:], rtol=1e-5, what="steps after padding")
    assert torch.equal(state.ref, state2.ref)


def test_a_step_refuses_a_state_of_another_layout():
    """A state made for other options would be read wrongly (or fail deep inside): refused."""
    q = k = torch.rand(1, 2, 3)
    v = torch.rand(1, 2, 4)
    zeros = CausalState.zeros(1, 2, 3, 4, blindspot_size=2, exp_features=True)
    single = CausalState.zeros(1, 2, 3, 4)
    wrong = [(zeros, dict(blindspot_size=2)), (zeros, dict(exp_features=True)), (single, dict(blindspot_size=2))]
    for state, kw in wrong:
        with pytest.raises(ValueError, match="state must be a CausalState of these exp_features and blindspot_size"):
            causal_linear_attention_step(q, k, v, state, **kw)
    out, state = causal_linear_attention_step(q, k, v, zeros, blindspot_size=2, exp_features=True)
    assert state.position == 1 and torch.equal(out, torch.zeros_like(out))  # the first block sees no key


@pytest.mark.parametrize("blindspot, split", [(1, 11), (4, 24), (4, 26)])
def test_steps_from_a_chunked_prefix_at_large_logits_keep_their_gradients(blindspot, split, helpers):
    """A chunked prefix's reference may sit a rounding above its largest term, so a step's
    denominator can fall just below 1: read as it is (a clamp to 1 there once cut the
    gradient of every key, and moved the output by ~1e-13 in float64)."""
    n = 30
    q, k, v, log_decay, mask = make_inputs("per_feature", True, n, 3, helpers, True)
    q, k = q * 1000, k * 1000
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, log_decay)]
    kw = dict(blindspot_size=blindspot, exp_features=True)
    head, rest = slice(0, split), slice(split, n)
    out1, state = causal_linear_attention(*(piece(t, head) for t in leaves), mask[:, head], return_state=True, **kw)
    out2, _ = recurrent_causal_linear_attention(*(piece(t, rest) for t in leaves), mask[:, rest], state=state, **kw)
    judge = naive_causal_linear_attention(*leaves, mask=mask, **kw)
    r = torch.randn(judge.shape, dtype=judge.dtype, generator=torch.Generator().manual_seed(0))
    helpers.assert_matches(torch.cat((out1, out2), dim=2), judge, rtol=1e-12)
    got, want = (torch.autograd.grad((out * r).sum(), leaves) for out in (torch.cat((out1, out2), dim=2), judge))
    for name, g_got, g_want in zip(("q", "k", "v", "log_decay"), got, want):
        helpers.assert_matches(g_got, g_want, rtol=1e-9, what=f"d/d{name}")
