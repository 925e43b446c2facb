"""Padding invariance: whatever sits at masked positions never reaches a real position,
in the outputs or in the gradients."""

import pytest
import torch

from linear_attention_transformer.ops import FeatureMap, causal_linear_attention, linear_attention

KINDS = ["softmax", "elu", "relu", "callable"]


def pipeline(kind, causal, gated, blindspot, helpers):
    fm = FeatureMap(helpers.squared_relu_map if kind == "callable" else kind)

    def run(mask, q, k, v, log_decay=None):
        if not causal:
            features, normalize = fm.noncausal_keys(k, mask)
            return linear_attention(fm.queries(q), features, v, mask=mask, normalize=normalize)
        features, map_decay, _ = fm.causal_keys(k, mask)
        decay = log_decay if gated else map_decay
        return causal_linear_attention(fm.queries(q), features, v, decay, mask, blindspot, chunk_size=4)

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
CASES += [(kind, True, True, bs) for kind in ("elu", "relu") for bs in (1, 4)]  # causal, gated


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


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_key_features_are_zero_at_padding(causal, helpers):
    b, h, n, d, e = 2, 2, 9, 3, 2
    _, k, _ = helpers.logit_inputs(b, h, n, d, e, seed=2)
    mask = helpers.random_mask(b, n, seed=2)
    mask[0, 0] = False
    k = fill_padding(k, mask, 1e6)
    fm = FeatureMap("softmax")
    features = fm.causal_keys(k, mask)[0] if causal else fm.noncausal_keys(k, mask)[0]
    pad = ~mask[:, None, :, None].expand_as(features)
    assert torch.isfinite(features).all()
    assert torch.equal(features[pad], torch.zeros_like(features[pad]))
    assert (features[~pad] > 0).all()
