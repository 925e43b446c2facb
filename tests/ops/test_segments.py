"""Packed sequences in the pure kernels: each fast form with ``segments`` equals its plain
reference (the masked matrix, the recurrence that empties its state, the explicit window
with segment-relative positions), and the references equal each segment run alone."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linear_attention_transformer.gating import LocalConv
from linear_attention_transformer.ops import (
    FeatureMap,
    causal_linear_attention,
    linear_attention,
    naive_causal_linear_attention,
    naive_linear_attention,
    recurrent_causal_linear_attention,
)
from linear_attention_transformer.ops.segments import (
    aligned_layout,
    from_layout,
    positions_in_segment,
    segment_runs,
    segment_softmax,
    to_layout,
)
from linear_attention_transformer.ops.windowed_attention import (
    Window,
    windowed_attention,
    windowed_attention_by_position,
)
from linear_attention_transformer.token_shift import shift_tokens

# every test here runs under each form of the causal kernel (conftest.causal_form)
pytestmark = pytest.mark.usefixtures("causal_form")

D = torch.float64


def ids_from_lengths(rows):
    """(b, n) ids, alternating 0/1 per segment (a run, not a value, is a segment)."""
    return torch.stack([torch.cat([torch.full((l,), i % 2) for i, l in enumerate(row)]) for row in rows])


def bounds(row):
    start = 0
    for length in row:
        yield start, start + length
        start += length


# n = 13 and 32 with chunks of 4 and 16: a length-1 segment, a boundary exactly at a chunk
# boundary (4, 8, 16), segments longer than a chunk, and ends off the grid
LAYOUTS = {13: [[1, 3, 4, 5], [6, 1, 1, 5]], 32: [[4, 12, 1, 15], [3, 17, 2, 10]]}


def test_runs_and_positions():
    ids = torch.tensor([[0, 0, 1, 1, 0], [5, 5, 5, 5, 5]])
    assert segment_runs(ids).tolist() == [[0, 0, 1, 1, 2], [0, 0, 0, 0, 0]]
    assert torch.equal(segment_runs(segment_runs(ids)), segment_runs(ids))  # idempotent
    assert positions_in_segment(segment_runs(ids)).tolist() == [[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]]


def test_aligned_layout_moves_each_segment_to_a_multiple():
    runs = segment_runs(ids_from_lengths([[3, 1, 4, 2], [6, 4]]))
    slots, length = aligned_layout(runs, 4)
    assert slots[0].tolist() == [0, 1, 2, 4, 8, 9, 10, 11, 12, 13]
    assert slots[1].tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    assert length == 16
    x = torch.randn(2, 10, 3)
    assert torch.equal(from_layout(to_layout(x, slots, length), slots), x)


@pytest.mark.parametrize("exp_features", [False, True], ids=["features", "exp"])
@pytest.mark.parametrize("n", [13, 32])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot, chunk", [(1, 4), (1, 16), (1, 64), (4, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_views_agree_with_segments(exp_features, n, decay, blindspot, chunk, masked, helpers):
    b, h, d, e = 2, 2, 4, 3
    seed = n + chunk + blindspot
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed, exp_features)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed)
    mask = helpers.random_mask(b, n, seed) if masked else None
    segments = ids_from_lengths(LAYOUTS[n])
    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, blindspot, exp_features, segments=segments)
    chunked = causal_linear_attention(q, k, v, log_decay, mask, blindspot, chunk, exp_features, segments=segments)
    recurrent, _ = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot, exp_features,
                                                     segments=segments)
    helpers.assert_matches(chunked, ref, what="chunked")
    helpers.assert_matches(recurrent, ref, what="recurrent")
    if blindspot == 1:  # the reference is each segment alone (blocks count from 0 there)
        for r, row in enumerate(LAYOUTS[n]):
            for a, z in bounds(row):
                part = [t[r : r + 1, :, a:z] for t in (q, k, v)]
                ld = None if log_decay is None else log_decay[r : r + 1, :, a:z]
                m = None if mask is None else mask[r : r + 1, a:z]
                alone = naive_causal_linear_attention(*part, ld, m, exp_features=exp_features)
                helpers.assert_matches(ref[r : r + 1, :, a:z], alone, rtol=1e-12, what="naive vs alone")


@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_exp_features_with_segments_exact_at_large_logits(decay, chunk, helpers):
    """Logits x100 (and an earlier segment's keys far above a later one's in the same chunk):
    float64 equals the matrix, float32 within the rounding of its logits, gradients too."""
    b, h, n, d, e = 2, 2, 70, 4, 3
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=chunk, exp_features=True, scale=100.0)
    k[:, :, 10:13] += 1000.0  # the end of a segment, in the chunk where the next one starts
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed=3)
    segments = ids_from_lengths([[13, 1, 20, 36], [16, 16, 5, 33]])
    mask = helpers.random_mask(b, n, seed=4)
    ref_inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = naive_causal_linear_attention(*ref_inputs, log_decay, mask, exp_features=True, segments=segments)
    out = causal_linear_attention(q, k, v, log_decay, mask, chunk_size=chunk, exp_features=True, segments=segments)
    helpers.assert_matches(out, ref, rtol=1e-9)
    r = torch.randn(ref.shape, dtype=D, generator=torch.Generator().manual_seed(5))
    ref_grads = torch.autograd.grad((ref * r).sum(), ref_inputs)
    inputs = [t.float().requires_grad_(True) for t in (q, k, v)]
    ld32 = None if log_decay is None else log_decay.float()
    out32 = causal_linear_attention(*inputs, ld32, mask, chunk_size=chunk, exp_features=True, segments=segments)
    helpers.assert_matches(out32, ref, rtol=1e-4, what="float32")
    grads = torch.autograd.grad((out32 * r.float()).sum(), inputs)
    for name, g32, g64 in zip("qkv", grads, ref_grads):
        helpers.assert_matches(g32, g64, rtol=1e-3, what=f"float32 d/d{name}")


def test_segments_refused_with_a_state(helpers):
    q, k, v = helpers.kernel_inputs(1, 1, 4, 2, 2, 0, True)
    with pytest.raises(ValueError, match="segments"):
        causal_linear_attention(q, k, v, exp_features=True, segments=torch.zeros(1, 4, dtype=torch.long),
                                return_state=True)


@pytest.mark.parametrize("kind", ["softmax", "elu"])
@pytest.mark.parametrize("masked", [False, True])
def test_noncausal_with_segments_equals_each_segment_alone(kind, masked, helpers):
    b, h, n, d, e = 2, 2, 13, 4, 3
    q, k, v = helpers.logit_inputs(b, h, n, d, e, seed=6, scale=3.0)
    rows = LAYOUTS[n]
    segments = segment_runs(ids_from_lengths(rows))
    mask = helpers.random_mask(b, n, seed=7) if masked else None
    fm = FeatureMap(kind)
    keys, normalize = fm.noncausal_keys(k, mask, segments)
    out = linear_attention(fm.queries(q), keys, v, mask, normalize, segments=segments)
    helpers.assert_matches(out, naive_linear_attention(fm.queries(q), keys, v, mask, normalize, segments=segments))
    for r, row in enumerate(rows):
        for a, z in bounds(row):
            m = None if mask is None else mask[r : r + 1, a:z]
            keys_alone, _ = fm.noncausal_keys(k[r : r + 1, :, a:z], m)
            alone = naive_linear_attention(fm.queries(q[r : r + 1, :, a:z]), keys_alone, v[r : r + 1, :, a:z], m,
                                           normalize)
            helpers.assert_matches(out[r : r + 1, :, a:z], alone, what="vs alone")


WINDOWS = [
    Window(4, 1, 0, True), Window(4, 2, 0, True), Window(3, 1, 0, True, exact=True), Window(4, 2, 0, True, exact=True),
    Window(4, 1, 1, False), Window(3, 2, 2, False), Window(4, 0, 1, False), Window(4, 1, 0, False),
    Window(16, 1, 0, True, exact=True), Window(16, 0, 0, True), Window(16, 1, 1, False),  # (longer than n = 13)
]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("n", [13, 32])
@pytest.mark.parametrize("masked", [False, True])
def test_windows_with_segments(window, n, masked, helpers):
    """Blocked form == explicit masked softmax at segment-relative positions == each
    segment alone (its windows counted from its own start)."""
    b, h, d = 2, 2, 4
    q, k, v = helpers.logit_inputs(b, h, n, d, d, seed=n, scale=2.0)
    rows = LAYOUTS[n]
    runs = segment_runs(ids_from_lengths(rows))
    mask = helpers.random_mask(b, n, seed=8) if masked else None
    positions = positions_in_segment(runs)
    out = windowed_attention(q, k, v, window, mask, runs)
    helpers.assert_matches(out, windowed_attention_by_position(q, k, v, positions, positions, window, mask, runs, runs))
    for r, row in enumerate(rows):
        for a, z in bounds(row):
            m = None if mask is None else mask[r : r + 1, a:z]
            alone = windowed_attention(*(t[r : r + 1, :, a:z] for t in (q, k, v)), window, m)
            helpers.assert_matches(out[r : r + 1, :, a:z], alone, what="vs alone")


@pytest.mark.parametrize("causal, kernel", [(True, 3), (True, 4), (False, 3), (False, 5)])
def test_local_conv_taps_stay_in_the_segment(causal, kernel):
    torch.manual_seed(0)
    conv = LocalConv(2 * 3, kernel, causal).to(D)
    with torch.no_grad():
        conv.conv_weight.normal_()
    rows = LAYOUTS[13]
    x = torch.randn(2, 2, 13, 3, dtype=D)
    runs = segment_runs(ids_from_lengths(rows))
    out = conv(x, segments=runs)
    for r, row in enumerate(rows):
        for a, z in bounds(row):
            torch.testing.assert_close(out[r : r + 1, :, a:z], conv(x[r : r + 1, :, a:z]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shifts", [(1, 0), (1, -1, 0)])
def test_token_shift_stays_in_the_segment(shifts):
    rows = LAYOUTS[13]
    x = torch.randn(2, 13, 6, dtype=D)
    runs = segment_runs(ids_from_lengths(rows))
    out = shift_tokens(x, shifts, segments=runs)
    for r, row in enumerate(rows):
        for a, z in bounds(row):
            assert torch.equal(out[r : r + 1, a:z], shift_tokens(x[r : r + 1, a:z], shifts))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), changed=st.integers(0, 5),
       exp_features=st.booleans(), chunk=st.sampled_from([3, 4, 8]), gated=st.booleans())
def test_changing_one_segment_leaves_the_others_unchanged(lengths, changed, exp_features, chunk, gated, helpers):
    """Property: new inputs in one segment change no output of any other segment."""
    changed %= len(lengths)
    n, (b, h, d, e) = sum(lengths), (1, 2, 3, 2)
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=n, exp_features=exp_features)
    log_decay = helpers.random_log_decay("per_feature" if gated else None, b, h, n, d, seed=n)
    segments = ids_from_lengths([lengths])
    a, z = list(bounds(lengths))[changed]
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :, a:z] = t[:, :, a:z].flip(-1) * 2 + 0.5
    run = dict(chunk_size=chunk, exp_features=exp_features, segments=segments)
    out = causal_linear_attention(q, k, v, log_decay, **run)
    out2 = causal_linear_attention(q2, k2, v2, log_decay, **run)
    outside = torch.ones(n, dtype=torch.bool)
    outside[a:z] = False
    # equal up to rounding: a chunk's shared shifts may move with the changed keys
    helpers.assert_matches(out2[:, :, outside], out[:, :, outside], rtol=1e-12)


def test_segment_softmax_takes_raw_ids_and_normalises_each_run():
    # raw ids whose values repeat in different runs ([0, 0, 1, 1, 0, 7]: four segments)
    ids = torch.tensor([[0, 0, 1, 1, 0, 7], [5, 5, 5, 5, 5, 5]])
    x = torch.randn(2, 3, 6, 4, dtype=torch.float64) * 30
    runs = [[(0, 2), (2, 4), (4, 5), (5, 6)], [(0, 6)]]
    expected = torch.cat([torch.cat([x[r:r + 1, :, a:b].softmax(dim=-2) for a, b in row], dim=2)
                          for r, row in enumerate(runs)])
    torch.testing.assert_close(segment_softmax(x, ids), expected, rtol=1e-12, atol=1e-14)
