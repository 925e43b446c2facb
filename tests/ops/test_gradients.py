"""Gradients: gradcheck in float64, agreement with the explicit-matrix reference, and exact
causality of the gradient, for given and exponential features."""

import pytest
import torch
from torch.autograd import gradcheck

from linear_attention_transformer.ops import (
    FeatureMap,
    causal_linear_attention,
    linear_attention,
    naive_causal_linear_attention,
    recurrent_causal_linear_attention,
)

# every test here runs under each form of the causal kernel (conftest.causal_form)
pytestmark = pytest.mark.usefixtures("causal_form")

B, H, N, D, E = 1, 2, 10, 3, 2
# gradcheck costs a forward per input element: its causal cases take one head (heads are a
# batch dimension of every form; two heads' and two rows' gradients are judged against the
# explicit matrix's in test_chunked_and_recurrent_gradients_equal_naive_gradients)
H_CHECK = 1
EXP = [False, True]


def ids(exp_features):
    return "exp" if exp_features else "features"


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def left_padded_mask(n, seed, helpers):
    """Left padding (the first queries see no key: output 0, gradient 0) and holes."""
    mask = helpers.random_mask(B, n, seed)
    mask[:, :2] = False
    return mask


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_gradcheck_causal_kernel(exp_features, decay, blindspot, masked, helpers):
    """With a mask, its left padding makes the first queries see no key (output 0)."""
    q, k, v = (leaf(t) for t in helpers.kernel_inputs(B, H_CHECK, N, D, E, seed=1, exp_features=exp_features))
    log_decay = helpers.random_log_decay(decay, B, H_CHECK, N, D, seed=1)
    mask = left_padded_mask(N, 1, helpers) if masked else None
    inputs = (q, k, v) if log_decay is None else (q, k, v, leaf(log_decay))

    def fn(q, k, v, log_decay=None):
        return causal_linear_attention(q, k, v, log_decay, mask, blindspot, chunk_size=4, exp_features=exp_features)

    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
def test_gradcheck_causal_kernel_odd_chunks_and_holes(exp_features, helpers):
    """Chunk size 3 over 7 tokens, a mask with a hole and leading padding, per-feature decay."""
    n = 7
    q, k, v = (leaf(t) for t in helpers.kernel_inputs(B, H, n, 2, E, seed=11, exp_features=exp_features))
    log_decay = leaf(helpers.random_log_decay("per_feature", B, H, n, 2, seed=11))
    mask = torch.tensor([[False, True, True, False, True, True, True]])

    def fn(q, k, v, log_decay):
        return causal_linear_attention(q, k, v, log_decay, mask, chunk_size=3, exp_features=exp_features)

    assert gradcheck(fn, (q, k, v, log_decay), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_gradcheck_softmax_pipeline_from_logits(blindspot, masked, helpers):
    """Raw q, k logits -> softmax feature map -> kernel with exponential features. The
    kernel's references (maxima of the keys and of each query) carry no gradient: the check
    proves the result really does not depend on them."""
    q, k, v = (leaf(t) for t in helpers.logit_inputs(B, H_CHECK, N, D, E, seed=2, scale=3.0))
    mask = left_padded_mask(N, 2, helpers) if masked else None
    fm = FeatureMap("softmax")

    def fn(q, k, v):
        q_in, k_in, exp_features = fm.causal_features(q, k)
        return causal_linear_attention(q_in, k_in, v, None, mask, blindspot, chunk_size=4, exp_features=exp_features)

    assert gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("kind", ["softmax", "elu"])
@pytest.mark.parametrize("masked", [False, True])
def test_gradcheck_noncausal_pipeline(kind, masked, helpers):
    q, k, v = (leaf(t) for t in helpers.logit_inputs(2, H, N, D, E, seed=3, scale=2.0, m=7))
    mask = helpers.random_mask(2, 7, seed=3, empty_row=True) if masked else None
    fm = FeatureMap(kind)

    def fn(q, k, v):
        features, normalize = fm.noncausal_keys(k, mask)
        return linear_attention(fm.queries(q), features, v, mask=mask, normalize=normalize)

    assert gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("blindspot, chunk", [(1, 8), (1, 32), (4, 8)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_and_recurrent_gradients_equal_naive_gradients(exp_features, blindspot, chunk, dtype, helpers):
    """Same function, same gradients: chunked (n = 37) and recurrent vs the explicit matrix,
    with per-feature decay and left padding, so the first queries see no key: output 0 and
    gradient 0, never NaN (the naive form included)."""
    b, h, n, d, e = 2, 2, 37, 4, 3
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=4, exp_features=exp_features, dtype=dtype)
    log_decay = helpers.random_log_decay("per_feature", b, h, n, d, seed=4, dtype=dtype)
    mask = helpers.random_mask(b, n, seed=4)
    mask[:, :2] = False
    r = torch.randn(b, h, n, e, dtype=dtype, generator=torch.Generator().manual_seed(4))
    kw = dict(mask=mask, blindspot_size=blindspot, exp_features=exp_features)
    grads = []
    for fn in (
        lambda *a: naive_causal_linear_attention(*a, **kw),
        lambda *a: causal_linear_attention(*a, chunk_size=chunk, **kw),
        lambda *a: recurrent_causal_linear_attention(*a, **kw)[0],
    ):
        inputs = [leaf(t) for t in (q, k, v, log_decay)]
        (fn(*inputs) * r).sum().backward()
        grads.append([t.grad for t in inputs])
    naive = grads[0]
    for form, form_grads in zip(("chunked", "recurrent"), grads[1:]):
        for name, g, g_ref in zip(("q", "k", "v", "log_decay"), form_grads, naive):
            rtol = 1e-9 if dtype == torch.float64 else 1e-4
            helpers.assert_matches(g, g_ref, rtol=rtol, what=f"{form} d/d{name}")
    # the queries that see nothing have exactly zero gradient
    assert torch.equal(naive[0][:, :, :blindspot], torch.zeros_like(naive[0][:, :, :blindspot]))


def output_grads(fn, inputs, i, seed):
    """Gradients of sum(out[..., i, :] * r) with respect to every input."""
    inputs = [leaf(t) for t in inputs]
    out = fn(*inputs)
    r = torch.randn(out[:, :, i].shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out[:, :, i] * r).sum(), inputs)


@pytest.mark.parametrize("exp_features", EXP, ids=ids)
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_gradient_is_exactly_causal(exp_features, decay, blindspot, helpers):
    """Future tokens get a gradient of exactly 0, although for exponential features the
    chunk's reference is the maximum over keys that lie after the query."""
    n = 13
    q, k, v = helpers.kernel_inputs(B, H, n, D, E, seed=5, exp_features=exp_features)
    if exp_features:
        k = k + torch.linspace(0, 6, n, dtype=k.dtype)[:, None]  # the maxima keep moving
    log_decay = helpers.random_log_decay(decay, B, H, n, D, seed=5)
    inputs = [q, k, v] + ([] if log_decay is None else [log_decay])

    def fn(q, k, v, log_decay=None):
        return causal_linear_attention(q, k, v, log_decay, None, blindspot, chunk_size=4, exp_features=exp_features)

    for i in (0, 2, 3, 4, 6, 11, 12):
        grads = output_grads(fn, inputs, i, seed=i)
        for name, g in zip(("q", "k", "v", "log_decay"), grads):
            future = g[:, :, i + 1 :]
            assert torch.equal(future, torch.zeros_like(future)), f"d out[{i}] / d {name}[j > {i}] != 0"
        # ...and the past does matter (no vacuous zero): q_i once two keys are visible, k_0 and
        # v_0 once key 0 is visible
        if i >= blindspot and i > 0:
            assert grads[0][:, :, i].abs().max() > 0
        if i >= blindspot:
            assert grads[1][:, :, 0].abs().max() > 0 and grads[2][:, :, 0].abs().max() > 0


@pytest.mark.parametrize("masked", [False, True])
def test_softmax_pipeline_gradient_is_exactly_causal(masked, helpers):
    n = 13
    q, k, v = helpers.logit_inputs(B, H, n, D, E, seed=6, scale=3.0)
    k = k + torch.linspace(0, 6, n, dtype=k.dtype)[:, None]  # the key maxima move after i
    mask = helpers.random_mask(B, n, seed=6) if masked else None
    fm = FeatureMap("softmax")

    def fn(q, k, v):
        q_in, k_in, exp_features = fm.causal_features(q, k)
        return causal_linear_attention(q_in, k_in, v, None, mask, chunk_size=4, exp_features=exp_features)

    for i in (0, 3, 4, 9, 12):
        grads = output_grads(fn, (q, k, v), i, seed=i)
        for name, g in zip("qkv", grads):
            future = g[:, :, i + 1 :]
            assert torch.equal(future, torch.zeros_like(future)), f"d out[{i}] / d {name}[j > {i}] != 0"
        assert grads[2][:, :, : i + 1].abs().max() > 0


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_tiny_denominators_keep_float32_gradients_finite_and_exact(causal):
    """Features of elu-like pre-activations near -25 make every denominator ~1e-21: the
    output is an ordinary weighted average, and its float32 gradients must be finite and agree
    with float64 (d(1/den) = -1/den² alone would overflow float32 below den ~ 5e-20)."""
    g = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(1, 2, 37, 4, generator=g, dtype=torch.float64) - 25).exp() for _ in range(2))
    v = torch.randn(1, 2, 37, 3, generator=g, dtype=torch.float64)
    grads = {}
    for dtype in (torch.float64, torch.float32):
        ins = [leaf(t.to(dtype)) for t in (q, k, v)]
        if causal:
            out = causal_linear_attention(*ins, chunk_size=16)
        else:
            out = linear_attention(*ins)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
        grads[dtype] = [t.grad for t in ins]
    for g32, g64 in zip(grads[torch.float32], grads[torch.float64]):
        assert torch.isfinite(g32).all()
        scale = g64.abs().max()
        assert ((g32.double() - g64).abs() <= 1e-4 * scale).all()
