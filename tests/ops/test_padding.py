"""Padding invariance: whatever sits at masked positions never reaches a real position,
in the outputs or in the gradients."""

import pytest
import torch

from linear_attention_transformer.ops import (
    FeatureMap,
    causal_linear_attention,
    linear_attention,
    naive_causal_linear_attention,
    recurrent_causal_linear_attention,
)

# every test here runs under each form of the causal kernel (conftest.causal_form)
pytestmark = pytest.mark.usefixtures("causal_form")

KINDS = ["softmax", "elu", "relu", "callable"]


def pipeline(kind, causal, gated, blindspot, helpers):
    fm = FeatureMap(helpers.squared_relu_map if kind == "callable" else kind)

    def run(mask, q, k, v, log_decay=None):
        if not causal:
            features, normalize = fm.noncausal_keys(k, mask)
            return linear_attention(fm.queries(q), features, v, mask=mask, normalize=normalize)
        q_in, k_in, exp_features = fm.causal_features(q, k)
        return causal_linear_attention(
            q_in, k_in, v, log_decay if gated else None, mask, blindspot, chunk_size=4, exp_features=exp_features
        )

    return run


def fill_padding(t, mask, value):
    pad = ~mask[:, None, :]
    while pad.ndim < t.ndim:
        pad = pad[..., None]
    return t.masked_fill(pad, value)


def outputs_and_grads(run, inputs, mask, r):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = run(mask, *inputs)
    loss = (out * r * mask[:, None, :, None]).sum()  # only real positions count
    grads = torch.autograd.grad(loss, inputs)
    return out, grads


CASES = [(kind, False, False, 1) for kind in KINDS]  # non-causal
CASES += [(kind, True, False, bs) for kind in KINDS for bs in (1, 4)]  # causal
CASES += [(kind, True, True, bs) for kind in ("softmax", "elu", "relu") for bs in (1, 4)]  # causal, gated


@pytest.mark.parametrize("kind, causal, gated, blindspot", CASES)
@pytest.mark.parametrize("pad_value", [1e6, -1e6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padding_never_reaches_real_positions(kind, causal, gated, blindspot, pad_value, dtype, helpers):
    b, h, n, d, e = 3, 2, 11, 3, 2
    q, k, v = helpers.logit_inputs(b, h, n, d, e, seed=KINDS.index(kind), scale=2.0, dtype=dtype)
    log_decay = helpers.random_log_decay("per_feature", b, h, n, d, seed=1, dtype=dtype) if gated else None
    mask = helpers.random_mask(b, n, seed=3)
    mask[0, :3] = False  # left padding: the first real query has no earlier key
    mask[1, -2:] = False  # right padding
    r = torch.randn(b, h, n, e, dtype=dtype, generator=torch.Generator().manual_seed(9))
    run = pipeline(kind, causal, gated, blindspot, helpers)

    clean = [q, k, v] + ([log_decay] if gated else [])
    padded = [fill_padding(t, mask, pad_value) for t in (q, k, v)]
    if gated:
        padded.append(fill_padding(log_decay, mask, -abs(pad_value)))  # a gate that forgets all

    out_clean, grads_clean = outputs_and_grads(run, clean, mask, r)
    out_pad, grads_pad = outputs_and_grads(run, padded, mask, r)

    real = mask[:, None, :, None].expand(b, h, n, e)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    helpers.assert_matches(out_pad[real], out_clean[real], rtol=rtol, what="outputs at real positions")
    for name, g_clean, g_pad in zip(("q", "k", "v", "log_decay"), grads_clean, grads_pad):
        assert torch.isfinite(g_pad).all(), f"non-finite gradient for {name}"
        real_g = mask[:, None, :].expand(g_pad.shape[:3])
        helpers.assert_matches(g_pad[real_g], g_clean[real_g], rtol=rtol, what=f"d/d{name} at real positions")
        padding_grad = g_pad[~real_g]
        assert torch.equal(padding_grad, torch.zeros_like(padding_grad)), f"gradient reaches padding of {name}"


def test_noncausal_softmax_key_features_are_zero_at_padding(helpers):
    b, h, n, d, e = 2, 2, 9, 3, 2
    _, k, _ = helpers.logit_inputs(b, h, n, d, e, seed=2)
    mask = helpers.random_mask(b, n, seed=2)
    mask[0, 0] = False
    k = fill_padding(k, mask, 1e6)
    features, _ = FeatureMap("softmax").noncausal_keys(k, mask)
    pad = ~mask[:, None, :, None].expand_as(features)
    assert torch.isfinite(features).all()
    assert torch.equal(features[pad], torch.zeros_like(features[pad]))
    assert (features[~pad] > 0).all()


@pytest.mark.parametrize("exp_features", [False, True], ids=["features", "exp"])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
def test_causal_padding_equals_dropping_the_padded_tokens(exp_features, decay, helpers):
    """Padding tokens have no key and do not decay the state, so at the real positions a
    padded row equals the same row with its padding cut out (blindspot 1: the blocks of a
    blindspot are positional and move when tokens are dropped)."""
    b, h, n, d, e = 3, 2, 23, 3, 2
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=12, exp_features=exp_features)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed=12)
    mask = helpers.random_mask(b, n, seed=12, keep=0.6)
    mask[0, :5] = False
    mask[2, -4:] = False
    kw = dict(exp_features=exp_features)
    out = causal_linear_attention(q, k, v, log_decay, mask, chunk_size=4, **kw)
    rec, _ = recurrent_causal_linear_attention(q, k, v, log_decay, mask, **kw)
    for row in range(b):
        keep = mask[row]
        cut = [None if t is None else t[row : row + 1, :, keep] for t in (q, k, v, log_decay)]
        dropped = naive_causal_linear_attention(*cut, **kw)
        helpers.assert_matches(out[row : row + 1, :, keep], dropped, what=f"chunked, row {row}")
        helpers.assert_matches(rec[row : row + 1, :, keep], dropped, what=f"recurrent, row {row}")
