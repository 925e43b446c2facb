"""State continuation, the contract cached decoding relies on: a prefix, then the rest
from the returned state, equals one pass; states and inputs are never modified in place."""

import pytest
import torch

from linear_attention_transformer.ops import (
    CausalState,
    FeatureMap,
    causal_linear_attention,
    causal_linear_attention_step,
    recurrent_causal_linear_attention,
)


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
            out.append((o.kv.clone(), None if o.pending is None else o.pending.clone(), o.position))
        else:
            out.append(None if o is None else o.clone())
    return out


def assert_unchanged(before, *objs):
    for saved, o in zip(before, objs):
        if isinstance(o, CausalState):
            kv, pending, position = saved
            assert torch.equal(o.kv, kv) and o.position == position, "state modified in place"
            assert (o.pending is None and pending is None) or torch.equal(o.pending, pending), "state.pending modified"
        elif o is not None:
            assert torch.equal(o, saved), "input modified in place"


def assert_same_state(actual, expected, helpers):
    assert actual.position == expected.position
    helpers.assert_matches(actual.kv, expected.kv, what="state.kv")
    assert (actual.pending is None) == (expected.pending is None)
    if expected.pending is not None:
        helpers.assert_matches(actual.pending, expected.pending, what="state.pending")


def make_inputs(decay, masked, n, seed, helpers, b=2, h=2, d=3, e=2):
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed)
    mask = helpers.random_mask(b, n, seed) if masked else None
    return q, k, v, log_decay, mask


CASES = [(1, 4, 15, s) for s in (1, 3, 4, 5, 11, 14)] + [(4, 16, 15, s) for s in (1, 2, 3, 4, 5, 8, 12, 14)]
CASES += [(4, 16, 16, s) for s in (3, 4, 8, 13)] + [(5, 16, 17, s) for s in (4, 5, 6, 16)]


@pytest.mark.parametrize("blindspot, chunk, n, split", CASES)
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("masked", [False, True])
def test_prefix_then_rest_equals_one_pass(blindspot, chunk, n, split, decay, masked, helpers):
    q, k, v, log_decay, mask = make_inputs(decay, masked, n, seed=n + split + blindspot, helpers=helpers)
    kw = dict(blindspot_size=blindspot, chunk_size=chunk, return_state=True)
    full, full_state = causal_linear_attention(q, k, v, log_decay, mask, **kw)
    inputs = snapshot(q, k, v, log_decay, mask)

    head, rest = slice(0, split), slice(split, n)
    out1, state1 = causal_linear_attention(*(piece(t, head) for t in (q, k, v, log_decay, mask)), **kw)
    saved = snapshot(state1)
    out2, state2 = causal_linear_attention(*(piece(t, rest) for t in (q, k, v, log_decay, mask)), state=state1, **kw)
    helpers.assert_matches(torch.cat((out1, out2), dim=2), full)
    assert_same_state(state2, full_state, helpers)
    assert state1.position == split and state2.position == n

    # the old state is untouched: continuing from it again gives bit-identical results
    assert_unchanged(saved, state1)
    again, _ = causal_linear_attention(*(piece(t, rest) for t in (q, k, v, log_decay, mask)), state=state1, **kw)
    assert torch.equal(again, out2)
    assert_unchanged(saved, state1)
    assert_unchanged(inputs, q, k, v, log_decay, mask)


@pytest.mark.parametrize("blindspot, chunk", [(1, 4), (4, 16), (3, 2)])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("masked", [False, True])
def test_three_pieces_and_token_by_token_calls(blindspot, chunk, decay, masked, helpers):
    """Pieces that start and end inside blocks, and n = 1 calls (one decoding step each)."""
    n = 17
    q, k, v, log_decay, mask = make_inputs(decay, masked, n, seed=blindspot + 3, helpers=helpers)
    kw = dict(blindspot_size=blindspot, chunk_size=chunk, return_state=True)
    full, full_state = causal_linear_attention(q, k, v, log_decay, mask, **kw)
    for cuts in ([0, 3, 6, n], [0, 5, 13, n], list(range(n + 1))):
        state, outs = None, []
        for a, z in zip(cuts[:-1], cuts[1:]):
            out, state = causal_linear_attention(
                *(piece(t, slice(a, z)) for t in (q, k, v, log_decay, mask)), state=state, **kw
            )
            outs.append(out)
        helpers.assert_matches(torch.cat(outs, dim=2), full, what=f"pieces {cuts}")
        assert_same_state(state, full_state, helpers)


@pytest.mark.parametrize("blindspot, chunk, split", [(1, 4, 6), (1, 4, 8), (4, 16, 6), (4, 16, 8), (4, 16, 0)])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("masked", [False, True])
def test_steps_from_a_chunked_state_equal_the_chunked_continuation(blindspot, chunk, split, decay, masked, helpers):
    n = 15
    b, h, d, e = 2, 2, 3, 2
    q, k, v, log_decay, mask = make_inputs(decay, masked, n, seed=split + 40, helpers=helpers)
    kw = dict(blindspot_size=blindspot, chunk_size=chunk)
    full, full_state = causal_linear_attention(q, k, v, log_decay, mask, return_state=True, **kw)
    if split:
        head = (piece(t, slice(0, split)) for t in (q, k, v, log_decay, mask))
        _, state = causal_linear_attention(*head, return_state=True, **kw)
    else:
        state = CausalState.zeros(b, h, d, e, blindspot, dtype=q.dtype)
    start = state
    saved = snapshot(start)
    chunked_rest, _ = causal_linear_attention(
        *(piece(t, slice(split, n)) for t in (q, k, v, log_decay, mask)), state=start, return_state=True, **kw
    )

    # padding is handled by the caller of a step: a padded token has no key and no decay
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    keep = real[:, None, :, None].to(q.dtype)
    ks, vs = k * keep, v * keep
    lds = None
    if log_decay is not None:
        lds = log_decay * (keep if log_decay.ndim == 4 else keep[..., 0])
    outs, old_states = [], []
    for t in range(split, n):
        ld = None if lds is None else lds[:, :, t]
        old_states.append((state, snapshot(state)))
        out, state = causal_linear_attention_step(q[:, :, t], ks[:, :, t], vs[:, :, t], state, ld, blindspot)
        outs.append(out)
    stepped = torch.stack(outs, dim=2)
    helpers.assert_matches(stepped, chunked_rest, what="steps vs chunked continuation")
    helpers.assert_matches(stepped, full[:, :, split:], what="steps vs one pass")
    assert_same_state(state, full_state, helpers)
    for old, saved_old in old_states:
        assert_unchanged(saved_old, old)
    assert_unchanged(saved, start)


@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("decay", [None, "per_feature"])
def test_chunked_continuation_from_a_stepped_state(blindspot, decay, helpers):
    """Decode a few tokens one step at a time (ending inside a block), then a chunk."""
    n, split = 19, 6
    q, k, v, log_decay, _ = make_inputs(decay, False, n, seed=77, helpers=helpers)
    b, h, _, d = q.shape
    full = causal_linear_attention(q, k, v, log_decay, blindspot_size=blindspot, chunk_size=4)
    state = CausalState.zeros(b, h, d, v.shape[-1], blindspot, dtype=q.dtype)
    outs = []
    for t in range(split):
        ld = None if log_decay is None else log_decay[:, :, t]
        out, state = causal_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, ld, blindspot)
        outs.append(out[:, :, None])
    saved = snapshot(state)
    rest = (piece(t, slice(split, n)) for t in (q, k, v, log_decay))
    outs.append(causal_linear_attention(*rest, blindspot_size=blindspot, chunk_size=4, state=state))
    helpers.assert_matches(torch.cat(outs, dim=2), full)
    assert_unchanged(saved, state)
    # the recurrent reference continues the same way
    rec, _ = recurrent_causal_linear_attention(
        *(piece(t, slice(split, n)) for t in (q, k, v, log_decay)), blindspot_size=blindspot, state=state
    )
    helpers.assert_matches(rec, full[:, :, split:])


def test_zero_state_and_state_dtype_conversion(helpers):
    q, k, v, log_decay, mask = make_inputs("scalar", True, 9, seed=5, helpers=helpers)
    b, h, n, d = q.shape
    out = causal_linear_attention(q, k, v, log_decay, mask, blindspot_size=3)
    zero = CausalState.zeros(b, h, d, v.shape[-1], blindspot_size=3, dtype=q.dtype)
    assert zero.kv.shape == (b, h, d, v.shape[-1] + 1) and zero.pending.shape == zero.kv.shape
    assert CausalState.zeros(b, h, d, v.shape[-1]).pending is None
    helpers.assert_matches(causal_linear_attention(q, k, v, log_decay, mask, blindspot_size=3, state=zero), out)

    _, state = causal_linear_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], blindspot_size=3, return_state=True)
    as32 = state.to(torch.float32)
    assert as32.kv.dtype == as32.pending.dtype == torch.float32 and as32.position == 4
    assert state.kv.dtype == torch.float64  # .to returns a new state
    helpers.assert_matches(as32.kv.double(), state.kv, rtol=1e-6)


# ---------------------------------------------------------------- softmax map: running max


def growing_logits(b, h, n, d, e, seed, offset=0.0, dtype=torch.float64):
    """Key logits whose maximum keeps growing, so the running max moves across a split."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, dtype=dtype, generator=g)
    k = torch.randn(b, h, n, d, dtype=dtype, generator=g) + torch.linspace(0, 4, n, dtype=dtype)[:, None] + offset
    v = torch.randn(b, h, n, e, dtype=dtype, generator=g)
    return q, k, v


def softmax_pass(fm, q, k, v, mask, blindspot, state=None, running_max=None):
    features, log_decay, new_max = fm.causal_keys(k, mask, running_max=running_max)
    out, new_state = causal_linear_attention(
        fm.queries(q), features, v, log_decay, mask, blindspot, chunk_size=4, state=state, return_state=True
    )
    return out, new_state, new_max


@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("split", [1, 3, 4, 7, 8, 14])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_map_running_max_carried_across_split(blindspot, split, masked, helpers):
    b, h, n, d, e = 3, 2, 15, 4, 2
    q, k, v = growing_logits(b, h, n, d, e, seed=split)
    mask = None
    if masked:
        mask = helpers.random_mask(b, n, seed=split)
        mask[1, : split + 1] = False  # the whole prefix of row 1 is padding
    fm = FeatureMap("softmax")
    full, full_state, full_max = softmax_pass(fm, q, k, v, mask, blindspot)
    inputs = snapshot(q, k, v, mask)

    head, rest = slice(0, split), slice(split, n)
    out1, state1, max1 = softmax_pass(fm, *(piece(t, head) for t in (q, k, v, mask)), blindspot)
    saved = snapshot(state1, max1)
    out2, state2, max2 = softmax_pass(
        fm, *(piece(t, rest) for t in (q, k, v, mask)), blindspot, state=state1, running_max=max1
    )
    helpers.assert_matches(torch.cat((out1, out2), dim=2), full)
    assert torch.equal(max2, full_max)
    assert_same_state(state2, full_state, helpers)
    assert_unchanged(saved, state1, max1)
    assert_unchanged(inputs, q, k, v, mask)


@pytest.mark.parametrize("masked", [False, True])
def test_softmax_map_token_by_token_decoding(masked, helpers):
    """Decoding one token at a time with the step kernel and the carried running max."""
    b, h, n, d, e = 2, 2, 12, 4, 2
    q, k, v = growing_logits(b, h, n, d, e, seed=21)
    mask = helpers.random_mask(b, n, seed=21) if masked else None
    if masked:
        mask[0, :3] = False
    fm = FeatureMap("softmax")
    full, _, full_max = softmax_pass(fm, q, k, v, mask, 1)
    state, running_max, outs = CausalState.zeros(b, h, d, e, dtype=q.dtype), None, []
    for t in range(n):
        m_t = None if mask is None else mask[:, t : t + 1]
        features, log_decay, running_max = fm.causal_keys(k[:, :, t : t + 1], m_t, running_max=running_max)
        real = torch.ones(b, dtype=q.dtype) if mask is None else mask[:, t].to(q.dtype)
        out, state = causal_linear_attention_step(
            fm.queries(q[:, :, t]),
            features[:, :, 0] * real[:, None, None],
            v[:, :, t] * real[:, None, None],
            state,
            log_decay[:, :, 0] * real[:, None],
        )
        outs.append(out)
    helpers.assert_matches(torch.stack(outs, dim=2), full)
    assert torch.equal(running_max, full_max)


@pytest.mark.parametrize("offset", [-150.0, 60.0])
def test_softmax_map_split_after_all_padding_prefix_float32(offset, helpers):
    """A prefix that is all padding has seen no key: whatever it carries must not distort
    the keys that follow, even when their logits are far from 0 (float32 range)."""
    b, h, n, d, e, split = 2, 2, 10, 4, 2, 4
    q, k, v = growing_logits(b, h, n, d, e, seed=3, offset=offset, dtype=torch.float32)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[:, :split] = False
    fm = FeatureMap("softmax")
    full, _, full_max = softmax_pass(fm, q, k, v, mask, 1)
    truth, _, _ = softmax_pass(fm, q.double(), k.double(), v.double(), mask, 1)
    helpers.assert_matches(full, truth, rtol=1e-5, what="one pass, float32")

    out1, state1, max1 = softmax_pass(fm, *(piece(t, slice(0, split)) for t in (q, k, v, mask)), 1)
    assert torch.equal(out1, torch.zeros_like(out1))
    out2, _, max2 = softmax_pass(
        fm, *(piece(t, slice(split, n)) for t in (q, k, v, mask)), 1, state=state1, running_max=max1
    )
    helpers.assert_matches(out2, full[:, :, split:], rtol=1e-5, what="continued after padding")
    assert torch.equal(max2, full_max)
