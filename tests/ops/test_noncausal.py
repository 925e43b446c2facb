"""Non-causal (global) linear attention against its explicit (n x m) reference."""

import pytest
import torch

from linear_attention_transformer.ops import linear_attention, naive_linear_attention


@pytest.mark.parametrize("n, m", [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100), (15, 17), (17, 1), (1, 100)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_attention_equals_naive(n, m, masked, normalize, helpers):
    b, h, d, e = 2, 3, 5, 4
    seed = 11 * n + m
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed, m=m)
    mask = helpers.random_mask(b, m, seed) if masked else None
    out = linear_attention(q, k, v, mask=mask, normalize=normalize)
    ref = naive_linear_attention(q, k, v, mask=mask, normalize=normalize)
    assert out.shape == (b, h, n, e) and out.dtype == torch.float64
    helpers.assert_matches(out, ref)


def test_naive_linear_attention_is_what_it_claims(helpers):
    """The reference itself against a literal double loop."""
    b, h, n, m, d, e = 1, 2, 4, 5, 3, 2
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed=5, m=m)
    mask = torch.tensor([[True, False, True, True, False]])
    ref = naive_linear_attention(q, k, v, mask=mask)
    for hh in range(h):
        for i in range(n):
            num, den = torch.zeros(e, dtype=q.dtype), 0.0
            for j in range(m):
                if mask[0, j]:
                    w = (q[0, hh, i] * k[0, hh, j]).sum()
                    num, den = num + w * v[0, hh, j], den + w
            assert torch.allclose(ref[0, hh, i], num / den, rtol=1e-12, atol=0)


@pytest.mark.parametrize("normalize", [True, False])
def test_fully_masked_row_gives_zero(normalize, helpers):
    b, h, n, m, d, e = 2, 2, 6, 9, 3, 4
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed=9, m=m)
    mask = helpers.random_mask(b, m, seed=9, empty_row=True)
    out = linear_attention(q, k, v, mask=mask, normalize=normalize)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    helpers.assert_matches(out, naive_linear_attention(q, k, v, mask=mask, normalize=normalize))


def test_masked_keys_equal_dropped_keys(helpers):
    """Masking keys is the same as removing them (cross attention with fewer keys)."""
    b, h, n, m, d, e = 1, 2, 7, 10, 4, 3
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed=4, m=m)
    mask = helpers.random_mask(b, m, seed=4)
    keep = mask[0]
    out = linear_attention(q, k, v, mask=mask)
    dropped = linear_attention(q, k[:, :, keep], v[:, :, keep])
    helpers.assert_matches(out, dropped)
