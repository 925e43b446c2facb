"""Feature maps end to end: the library pipeline (feature map -> kernel) against direct
float64 formulas written without any stabilisation."""

import pytest
import torch

from linear_attention_transformer.ops import (
    FEATURE_MAP_NAMES,
    FeatureMap,
    causal_linear_attention,
    linear_attention,
)

KINDS = ["softmax", "elu", "relu", "taylor", "callable"]


def make_map(kind, helpers):
    return FeatureMap(helpers.squared_relu_map if kind == "callable" else kind)


def direct_query_features(kind, q):
    if kind == "softmax":
        ex = q.exp()
        return ex / ex.sum(-1, keepdim=True)
    return direct_pointwise(kind, q)


def direct_pointwise(kind, x):
    if kind == "elu":
        return torch.where(x > 0, x + 1, x.exp())
    if kind == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if kind == "callable":
        return torch.where(x > 0, x * x, torch.zeros_like(x)) + 1e-3
    raise AssertionError(kind)


def weighted_average(w, v):
    """out_i = sum_j w_ij v_j / sum_j w_ij, 0 for a query with no weight at all."""
    num = torch.einsum("bhij,bhje->bhie", w, v)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def bounded_logits(b, h, n, d, e, seed, m=None):
    """Logits with |x| < 5, so exp(x) without stabilisation is accurate in float64; keys
    drift upwards along the sequence so the kernels' running maxima keep changing."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.rand(b, h, n, d, dtype=torch.float64, generator=g) * 9.8 - 4.9
    k = torch.rand(b, h, m, d, dtype=torch.float64, generator=g) * 6 - 4.9
    k = k + torch.linspace(0, 3.8, m, dtype=torch.float64)[:, None]
    v = torch.randn(b, h, m, e, dtype=torch.float64, generator=g)
    return q, k, v


def direct_taylor_weight(q, k):
    """1 + s + s²/2 with s = q·k / sqrt(d): exp(s) to second order, written out."""
    s = torch.einsum("bhid,bhjd->bhij", q, k) / q.shape[-1] ** 0.5
    return 1 + s + s * s / 2


def direct_weight(kind, q, k):
    """The unnormalised weight of key j for query i, (b, h, n, m)."""
    if kind == "taylor":
        return direct_taylor_weight(q, k)
    qf = direct_query_features(kind, q)
    kf = k.exp() if kind == "softmax" else direct_pointwise(kind, k)
    return torch.einsum("bhid,bhjd->bhij", qf, kf)


def direct_causal(kind, q, k, v, mask, blindspot):
    n = q.shape[2]
    w = direct_weight(kind, q, k)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    visible = (j // blindspot < i // blindspot) if blindspot > 1 else (j <= i)
    visible = visible[None, None]
    if mask is not None:
        visible = visible & mask[:, None, None, :]
    return weighted_average(torch.where(visible, w, torch.zeros_like(w)), v)


def direct_noncausal(kind, q, k, v, mask):
    keep = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool) if mask is None else mask
    keep = keep[:, None, :, None]
    if kind == "softmax":
        ex = torch.where(keep, k.exp(), torch.zeros_like(k))
        total = ex.sum(dim=2, keepdim=True)
        kf = torch.where(total > 0, ex / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(ex))
        return torch.einsum("bhid,bhjd,bhje->bhie", direct_query_features(kind, q), kf, v)  # rows sum to one
    w = direct_weight(kind, q, k)
    return weighted_average(torch.where(keep.transpose(-1, -2), w, torch.zeros_like(w)), v)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_causal_pipeline_equals_direct_formula(kind, n, masked, blindspot, helpers):
    """feature map -> causal kernel equals softmax(q) . exp(k) (or the pointwise map) formed
    directly: for the softmax map the kernel gets the raw logits, and the query's softmax
    normaliser, which it never forms, cancels."""
    b, h, d, e = 2, 2, 4, 3
    seed = 13 * n + blindspot + 100 * KINDS.index(kind)
    q, k, v = bounded_logits(b, h, n, d, e, seed)
    mask = helpers.random_mask(b, n, seed, empty_row=n > 1) if masked else None
    if mask is not None and n > 1:
        mask[0, :2] = False  # leading padding: the first real key arrives later
    fm = make_map(kind, helpers)

    q_in, k_in, exp_features = fm.causal_features(q, k)
    assert exp_features is (kind == "softmax")
    out = causal_linear_attention(q_in, k_in, v, None, mask, blindspot, chunk_size=16, exp_features=exp_features)
    helpers.assert_matches(out, direct_causal(kind, q, k, v, mask, blindspot))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, m", [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100), (17, 40), (40, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_noncausal_pipeline_equals_direct_formula(kind, n, m, masked, helpers):
    b, h, d, e = 2, 2, 4, 3
    seed = 17 * n + m + 100 * KINDS.index(kind)
    q, k, v = bounded_logits(b, h, n, d, e, seed, m=m)
    mask = helpers.random_mask(b, m, seed, empty_row=True) if masked else None
    fm = make_map(kind, helpers)

    features, normalize = fm.noncausal_keys(k, mask)
    assert normalize is (kind != "softmax")
    out = linear_attention(fm.queries(q), features, v, mask=mask, normalize=normalize)
    helpers.assert_matches(out, direct_noncausal(kind, q, k, v, mask))
    if masked:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("kind", KINDS)
def test_causal_features_contract(kind, helpers):
    """The softmax map hands the logits over untouched with exp_features=True (the kernel
    exponentiates them stably); the others return their pointwise features of queries and
    keys with exp_features=False, and gradients flow through them."""
    q, k, _ = bounded_logits(2, 2, 9, 4, 1, seed=8)
    q, k = q.requires_grad_(True), k.requires_grad_(True)
    q_in, k_in, exp_features = make_map(kind, helpers).causal_features(q, k)
    if kind == "softmax":
        assert exp_features is True and q_in is q and k_in is k
        return
    if kind == "taylor":  # 4 dimensions -> 1 + 4 + 10 features, whose dot products are the weights
        assert exp_features is False and q_in.shape[-1] == k_in.shape[-1] == 15 == FeatureMap("taylor").feature_dim(4)
        w = torch.einsum("bhid,bhjd->bhij", q_in, k_in)
        helpers.assert_matches(w, direct_taylor_weight(q.detach(), k.detach()), rtol=1e-13, what="taylor weights")
        assert (w >= 0.5 - 1e-12).all()  # ((s + 1)² + 1) / 2
        (q_in.sum() + k_in.sum()).backward()
        assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0
        return
    assert exp_features is False
    helpers.assert_matches(q_in, direct_pointwise(kind, q.detach()), rtol=1e-15, what="query features")
    helpers.assert_matches(k_in, direct_pointwise(kind, k.detach()), rtol=1e-15, what="key features")
    assert (q_in >= 0).all() and (k_in >= 0).all()
    (q_in.sum() + k_in.sum()).backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


def test_feature_map_construction():
    assert set(FEATURE_MAP_NAMES) == {"softmax", "elu", "relu", "taylor"}
    assert FeatureMap().is_softmax
    fm = FeatureMap("elu")
    assert FeatureMap(fm).kind == "elu" and not FeatureMap(fm).is_softmax
    with pytest.raises(ValueError, match="feature_map"):
        FeatureMap("gelu")
    assert "relu" in repr(FeatureMap("relu"))


@pytest.mark.parametrize(
    "dtype, lowest, rtol",
    [(torch.float64, -700.0, 1e-14), (torch.float32, -80.0, 1e-6), (torch.bfloat16, -80.0, 1e-2), (torch.float16, -9.0, 2e-3)],
)
def test_elu_map_keeps_small_features_in_low_precision(dtype, lowest, rtol):
    """elu(x) + 1 = exp(x) for x <= 0: formed as (exp(x) - 1) + 1 it cancels to 0 (bfloat16
    from x < -5.5), and a key whose features all vanish is dropped from attention."""
    x = torch.linspace(lowest, 3.0, 301, dtype=torch.float64)
    fm = FeatureMap("elu")
    got = fm.queries(x.to(dtype)).double()
    x = x.to(dtype).double()
    expected = torch.where(x > 0, x + 1, x.exp())
    assert ((got - expected).abs() <= rtol * expected).all()
    # still the same function, with finite gradients even far out
    t = torch.tensor([-1e4, -50.0, -1.0, 0.0, 1.0, 1e4], dtype=torch.float64, requires_grad=True)
    y = fm.causal_features(t.view(1, 1, 1, -1), t.view(1, 1, 1, -1))[1]
    y.sum().backward()
    exact = torch.where(t > 0, t + 1, t.exp()).detach()
    assert torch.allclose(y.flatten(), exact, rtol=1e-15, atol=0)
    assert torch.allclose(exact, torch.nn.functional.elu(t.detach()) + 1, rtol=1e-15, atol=1e-16)
    assert torch.isfinite(t.grad).all() and torch.allclose(t.grad, torch.where(t > 0, 1.0, t.detach().exp()).double())


def test_elu_map_works_under_torch_func():
    """The elu map's own backward (an autograd.Function) composes with torch.func."""
    x = torch.linspace(-30.0, 3.0, 12, dtype=torch.float64).view(3, 4)
    fm = FeatureMap("elu")
    slopes = torch.func.vmap(torch.func.grad(lambda t: fm.queries(t).sum()))(x)
    assert torch.allclose(slopes, torch.where(x > 0, 1.0, x.exp()), rtol=1e-15, atol=0)
    jac = torch.func.jacrev(lambda t: fm.queries(t))(x[0])
    assert torch.allclose(jac, torch.diag(torch.where(x[0] > 0, 1.0, x[0].exp())), rtol=1e-15, atol=0)
