"""The three views of causal linear attention (explicit matrix, recurrence, chunks) agree,
for given features and for exponential features (logits, ``exp_features=True``)."""

import pytest
import torch

from linear_attention_transformer.ops import (
    causal_linear_attention,
    naive_causal_linear_attention,
    recurrent_causal_linear_attention,
)

# every test here runs under each form of the causal kernel (conftest.causal_form)
pytestmark = pytest.mark.usefixtures("causal_form")

EXP = [False, True]


def ids(exp_features):
    return "exp" if exp_features else "features"


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot, chunk", [(1, 16), (1, 48), (1, 7), (1, 1), (4, 16), (16, 16)])
@pytest.mark.parametrize("masked", [False, True])
def test_views_agree_for_lengths_around_the_block_size(exp_features, n, decay, blindspot, chunk, masked, helpers):
    """Lengths that are and are not multiples of the chunk / blindspot block, masks with
    left padding and an all-padding row; the final state of the chunked form equals the
    recurrence's (for exponential features: the same references, the same sums)."""
    b, h, d, e = 2, 2, 4, 3
    seed = 7 * n + blindspot + chunk
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed, exp_features)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed)
    mask = None
    if masked:
        mask = helpers.random_mask(b, n, seed, empty_row=True)
        mask[0, : min(2, n - 1)] = False  # left padding: the first queries see no key

    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, blindspot, exp_features=exp_features)
    chunked, chunked_state = causal_linear_attention(
        q, k, v, log_decay, mask, blindspot, chunk_size=chunk, exp_features=exp_features, return_state=True
    )
    recurrent, recurrent_state = recurrent_causal_linear_attention(
        q, k, v, log_decay, mask, blindspot, exp_features=exp_features
    )
    helpers.assert_matches(chunked, ref, what="chunked")
    helpers.assert_matches(recurrent, ref, what="recurrent")
    if masked:  # the all-padding row, and a query with no earlier real key, get exactly 0
        assert torch.equal(chunked[-1], torch.zeros_like(chunked[-1]))
        assert torch.equal(recurrent[-1], torch.zeros_like(recurrent[-1]))

    assert chunked_state.position == recurrent_state.position == n
    helpers.assert_same_state(chunked_state, recurrent_state)
    assert (chunked_state.ref is None) == (not exp_features)
    assert (chunked_state.pending is None) == (blindspot == 1)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("masked", [False, True])
def test_default_chunk_size_over_several_chunks(exp_features, decay, masked, helpers):
    """n = 150 with the default chunk of 64: two full chunks and a partial one."""
    b, h, n, d, e = 2, 3, 150, 8, 5
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=3, exp_features=exp_features)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed=3, strength=0.1)
    mask = helpers.random_mask(b, n, seed=3) if masked else None
    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, exp_features=exp_features)
    helpers.assert_matches(causal_linear_attention(q, k, v, log_decay, mask, exp_features=exp_features), ref)


@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_exp_features_are_the_exponentials_of_the_logits(decay, blindspot, helpers):
    """exp_features=True on logits is the same attention as given features exp(q), exp(k):
    every view, against the explicit matrix of the exponentiated features."""
    b, h, n, d, e = 2, 2, 23, 4, 3
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=5, exp_features=True)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed=5)
    mask = helpers.random_mask(b, n, seed=5)
    plain = naive_causal_linear_attention(q.exp(), k.exp(), v, log_decay, mask, blindspot)
    kw = dict(log_decay=log_decay, mask=mask, blindspot_size=blindspot, exp_features=True)
    helpers.assert_matches(naive_causal_linear_attention(q, k, v, **kw), plain, what="naive")
    helpers.assert_matches(causal_linear_attention(q, k, v, chunk_size=8, **kw), plain, what="chunked")
    helpers.assert_matches(recurrent_causal_linear_attention(q, k, v, **kw)[0], plain, what="recurrent")


def test_naive_reference_is_the_literal_sum(helpers):
    """The explicit-matrix reference itself against a literal loop over i, j and d, for both
    kinds of features, with a per-feature decay, a mask and a blindspot."""
    b, h, n, d, e, B = 1, 2, 7, 3, 2, 2
    log_decay = helpers.random_log_decay("per_feature", b, h, n, d, seed=2)
    mask = torch.tensor([[True, False, True, True, True, False, True]])
    for exp_features in EXP:
        q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=2, exp_features=exp_features)
        ld = log_decay.masked_fill(~mask[:, None, :, None], 0.0)
        G = ld.cumsum(dim=2)
        ref = naive_causal_linear_attention(q, k, v, log_decay, mask, B, exp_features=exp_features)
        for hh in range(h):
            for i in range(n):
                num, den = torch.zeros(e, dtype=q.dtype), 0.0
                for j in range(n):
                    if mask[0, j] and j // B < i // B:
                        for f in range(d):
                            qi, kj = q[0, hh, i, f], k[0, hh, j, f]
                            w = (qi + kj).exp() if exp_features else qi * kj
                            w = w * (G[0, hh, i, f] - G[0, hh, j, f]).exp()
                            num, den = num + w * v[0, hh, j], den + w
                expected = num / den if den > 0 else num
                assert torch.allclose(ref[0, hh, i], expected, rtol=1e-12, atol=1e-15), (exp_features, hh, i)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
def test_blindspot_hides_the_own_block_and_first_block_gets_zero(exp_features, helpers):
    """With blindspot B the first block sees no key (output 0) and a later query sees
    exactly the keys of earlier blocks: changing a key inside its own block changes nothing."""
    b, h, n, d, e, B = 1, 2, 12, 3, 2, 4
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=3, exp_features=exp_features)
    out = causal_linear_attention(q, k, v, blindspot_size=B, exp_features=exp_features)
    assert torch.equal(out[:, :, :B], torch.zeros_like(out[:, :, :B]))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 9], v2[:, :, 9] = 5.0, -7.0  # inside the last block (positions 8..11)
    out2 = causal_linear_attention(q, k2, v2, blindspot_size=B, exp_features=exp_features)
    helpers.assert_matches(out2, out, rtol=1e-12, what="blindspot output")
    # ... while the preceding block's keys are seen by the last block
    k3 = k.clone()
    k3[:, :, 5] = 5.0
    out3 = causal_linear_attention(q, k3, v, blindspot_size=B, exp_features=exp_features)
    assert (out3[:, :, 8:] - out[:, :, 8:]).abs().max() > 1e-3
    helpers.assert_matches(out3[:, :, :8], out[:, :, :8], rtol=1e-12, what="blocks before the change")


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("d, e", [(8, 32), (32, 8)], ids=["keys narrower", "keys wider"])
@pytest.mark.parametrize("n", [16, 21])
@pytest.mark.parametrize("decay, blindspot", [(None, 1), ("scalar", 4), ("per_feature", 1)])
def test_key_features_of_another_width_than_the_values(exp_features, d, e, n, decay, blindspot, helpers):
    """Queries and keys of d features, values of e (a layer's dim_qk beside its dim_head): the
    chunked form (chunks of 8: 16 is a multiple, 21 not) and the recurrence equal the naive form
    with a key mask, and the state one row per key feature."""
    b, h = 2, 2
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=n + d, exp_features=exp_features)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed=n + d, strength=0.3)
    mask = helpers.random_mask(b, n, seed=n + d)
    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, blindspot, exp_features=exp_features)
    chunked, state = causal_linear_attention(q, k, v, log_decay, mask, blindspot, chunk_size=8,
                                             exp_features=exp_features, return_state=True)
    recurrent, _ = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot, exp_features=exp_features)
    assert ref.shape == (b, h, n, e)
    helpers.assert_matches(chunked, ref, what="chunked")
    helpers.assert_matches(recurrent, ref, what="recurrent")
    assert state.kv.shape[-2] == d
