"""Bad input is refused with an error that names the argument."""

import pytest
import torch

from linear_attention_transformer.ops import (
    FeatureMap,
    causal_linear_attention,
    linear_attention,
    recurrent_causal_linear_attention,
)

b, h, n, m, d, e = 2, 2, 6, 5, 3, 2


def inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.rand(b, h, n, d, generator=g)
    k_self, v_self = torch.rand(b, h, n, d, generator=g), torch.randn(b, h, n, e, generator=g)
    k_cross, v_cross = torch.rand(b, h, m, d, generator=g), torch.randn(b, h, m, e, generator=g)
    return q, k_self, v_self, k_cross, v_cross


def calls():
    """(name, function of mask) for every op that takes a key mask; the right mask is (b, keys)."""
    q, k, v, kc, vc = inputs()
    return {
        "linear_attention (cross)": (lambda mask: linear_attention(q, kc, vc, mask=mask), m),
        "causal_linear_attention": (lambda mask: causal_linear_attention(q, k, v, mask=mask), n),
        "causal_linear_attention (blindspot)": (
            lambda mask: causal_linear_attention(q, k, v, mask=mask, blindspot_size=4),
            n,
        ),
        "causal_linear_attention (exp features)": (
            lambda mask: causal_linear_attention(q, k, v, mask=mask, exp_features=True),
            n,
        ),
        "causal_linear_attention (exp features, blindspot)": (
            lambda mask: causal_linear_attention(q, k, v, mask=mask, blindspot_size=4, exp_features=True),
            n,
        ),
        "recurrent_causal_linear_attention": (lambda mask: recurrent_causal_linear_attention(q, k, v, mask=mask), n),
        "recurrent_causal_linear_attention (exp features)": (
            lambda mask: recurrent_causal_linear_attention(q, k, v, mask=mask, exp_features=True),
            n,
        ),
        "FeatureMap.noncausal_keys (softmax)": (lambda mask: FeatureMap("softmax").noncausal_keys(kc, mask), m),
        "FeatureMap.noncausal_keys (relu)": (lambda mask: FeatureMap("relu").noncausal_keys(kc, mask), m),
    }


OPS = list(calls())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_mask_of_wrong_dtype_raises_type_error(op, dtype):
    fn, keys = calls()[op]
    with pytest.raises(TypeError, match="mask"):
        fn(torch.ones(b, keys, dtype=dtype))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", ["longer", "shorter", "batch", "1d", "3d"])
def test_mask_of_wrong_shape_raises_value_error(op, shape):
    fn, keys = calls()[op]
    bad = {"longer": (b, keys + 1), "shorter": (b, keys - 1), "batch": (b + 1, keys), "1d": (keys,), "3d": (b, 1, keys)}
    with pytest.raises(ValueError, match="mask"):
        fn(torch.ones(*bad[shape], dtype=torch.bool))


@pytest.mark.parametrize("op", OPS)
def test_right_mask_is_accepted(op):
    fn, keys = calls()[op]
    result = fn(torch.ones(b, keys, dtype=torch.bool))
    first = result[0] if isinstance(result, tuple) else result
    assert torch.isfinite(first).all()


def test_cross_attention_mask_follows_the_keys_not_the_queries():
    q, _, _, kc, vc = inputs()
    with pytest.raises(ValueError, match=r"mask.*\(2, 5\)"):
        linear_attention(q, kc, vc, mask=torch.ones(b, n, dtype=torch.bool))


@pytest.mark.parametrize("kwargs", [dict(blindspot_size=0), dict(chunk_size=0), dict(blindspot_size=-2)])
@pytest.mark.parametrize("exp_features", [False, True])
def test_bad_sizes_raise_value_error(kwargs, exp_features):
    q, k, v, _, _ = inputs()
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        causal_linear_attention(q, k, v, exp_features=exp_features, **kwargs)


@pytest.mark.parametrize("kind", ["gelu", "", None, 3])
def test_unknown_feature_map_raises_value_error(kind):
    with pytest.raises(ValueError, match="feature_map"):
        FeatureMap(kind)
