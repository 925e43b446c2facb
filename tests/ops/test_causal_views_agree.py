"""The three views of causal linear attention (explicit matrix, recurrence, chunks) agree."""

import pytest
import torch

from linear_attention_transformer.ops import (
    causal_linear_attention,
    naive_causal_linear_attention,
    recurrent_causal_linear_attention,
)


@pytest.mark.parametrize("n", [1, 37, 64, 100])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot", [1, 16])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_and_recurrent_equal_naive(n, decay, blindspot, masked):
    g = torch.Generator().manual_seed(n)
    b, h, d, e = 2, 3, 8, 5
    q, k = (torch.rand(b, h, n, d, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(b, h, n, e, dtype=torch.float64, generator=g)
    shape = {None: None, "scalar": (b, h, n), "per_feature": (b, h, n, d)}[decay]
    log_decay = None if shape is None else -torch.rand(*shape, dtype=torch.float64, generator=g)
    mask = (torch.rand(b, n, generator=g) > 0.3) if masked else None

    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    chunked = causal_linear_attention(q, k, v, log_decay, mask, blindspot, chunk_size=16)
    recurrent, _ = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    scale = ref.abs().max()
    assert (chunked - ref).abs().max() <= 1e-9 * scale
    assert (recurrent - ref).abs().max() <= 1e-9 * scale


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot, chunk", [(1, 16), (1, 7), (1, 1), (4, 16), (16, 16)])
@pytest.mark.parametrize("masked", [False, True])
def test_views_agree_for_lengths_around_the_block_size(n, decay, blindspot, chunk, masked, helpers):
    """Lengths that are and are not multiples of the chunk / blindspot block, and the final
    state of the chunked form equals the recurrence's."""
    b, h, d, e = 2, 2, 4, 3
    seed = 7 * n + blindspot + chunk
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed)
    mask = helpers.random_mask(b, n, seed, empty_row=True) if masked else None

    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    chunked, chunked_state = causal_linear_attention(
        q, k, v, log_decay, mask, blindspot, chunk_size=chunk, return_state=True
    )
    recurrent, recurrent_state = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    helpers.assert_matches(chunked, ref, what="chunked")
    helpers.assert_matches(recurrent, ref, what="recurrent")

    assert chunked_state.position == recurrent_state.position == n
    helpers.assert_matches(chunked_state.kv, recurrent_state.kv, what="state.kv")
    if blindspot == 1:
        assert chunked_state.pending is None and recurrent_state.pending is None
    else:
        helpers.assert_matches(chunked_state.pending, recurrent_state.pending, what="state.pending")


def test_blindspot_hides_the_own_block_and_first_block_gets_zero(helpers):
    """With blindspot B the first block sees no key (output 0) and a later query sees
    exactly the keys of earlier blocks: changing a key inside its own block changes nothing."""
    b, h, n, d, e, B = 1, 2, 12, 3, 2, 4
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed=3)
    out = causal_linear_attention(q, k, v, blindspot_size=B)
    assert torch.equal(out[:, :, :B], torch.zeros_like(out[:, :, :B]))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 9], v2[:, :, 9] = 5.0, -7.0  # inside the last block (positions 8..11)
    out2 = causal_linear_attention(q, k2, v2, blindspot_size=B)
    helpers.assert_matches(out2, out, rtol=1e-12, what="blindspot output")
    # ... while the preceding block's keys are seen by the last block
    k3 = k.clone()
    k3[:, :, 5] = 5.0
    out3 = causal_linear_attention(q, k3, v, blindspot_size=B)
    assert (out3[:, :, 8:] - out[:, :, 8:]).abs().max() > 1e-3
    helpers.assert_matches(out3[:, :, :8], out[:, :, :8], rtol=1e-12, what="blocks before the change")
