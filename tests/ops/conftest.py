"""Shared helpers for the ops tests, handed out as fixtures so that they work under any
pytest import mode."""

import types

import pytest
import torch
import torch.nn.functional as F

DOUBLE = torch.float64
NEG_INF = float("-inf")


def assert_matches(actual, reference, rtol=1e-9, what="output"):
    """|actual - reference| <= rtol * max|reference| everywhere (both finite, same shape)."""
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert torch.isfinite(reference).all(), f"{what}: non-finite reference"
    scale = reference.abs().max().item() if reference.numel() else 0.0
    err = (actual.to(DOUBLE) - reference.to(DOUBLE)).abs().max().item() if reference.numel() else 0.0
    assert err <= rtol * max(scale, 1e-300), f"{what}: max error {err:.3e} vs scale {scale:.3e} (rtol {rtol:g})"


def feature_inputs(b, h, n, d, e, seed, dtype=DOUBLE, m=None):
    """Non-negative query/key features (bounded away from 0) and signed values."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.rand(b, h, n, d, dtype=dtype, generator=g) + 0.05
    k = torch.rand(b, h, m, d, dtype=dtype, generator=g) + 0.05
    v = torch.randn(b, h, m, e, dtype=dtype, generator=g)
    return q, k, v


def logit_inputs(b, h, n, d, e, seed, scale=1.0, dtype=DOUBLE, m=None):
    """Raw (signed) query/key logits and values, as a projection would produce them."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.randn(b, h, n, d, dtype=dtype, generator=g)
    k = torch.randn(b, h, m, d, dtype=dtype, generator=g) * scale
    v = torch.randn(b, h, m, e, dtype=dtype, generator=g)
    return q, k, v


def kernel_inputs(b, h, n, d, e, seed, exp_features, dtype=DOUBLE, scale=3.0):
    """q, k, v for the causal kernels: non-negative features, or with ``exp_features``
    query and key logits of moderate size (standard deviation ``scale``)."""
    if not exp_features:
        return feature_inputs(b, h, n, d, e, seed, dtype)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, dtype=dtype, generator=g) * scale
    k = torch.randn(b, h, n, d, dtype=dtype, generator=g) * scale
    v = torch.randn(b, h, n, e, dtype=dtype, generator=g)
    return q, k, v


def random_mask(b, n, seed, keep=0.7, empty_row=False):
    """Random (b, n) bool mask with at least one real token per row; optionally the
    last row is all padding."""
    g = torch.Generator().manual_seed(seed + 1000)
    mask = torch.rand(b, n, generator=g) < keep
    mask[:, torch.randint(n, (1,), generator=g)] = True
    if empty_row:
        mask[-1] = False
    return mask


def random_log_decay(kind, b, h, n, d, seed, dtype=DOUBLE, strength=1.0):
    """log a_t <= 0: None, per position (b, h, n) or per position and feature (b, h, n, d)."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed + 2000)
    shape = (b, h, n) if kind == "scalar" else (b, h, n, d)
    return -strength * torch.rand(*shape, dtype=dtype, generator=g)


def squared_relu_map(x):
    """A user-given (callable) feature map: non-negative, strictly positive."""
    return F.relu(x) ** 2 + 1e-3


def without_padding(k, v, log_decay, mask, exp_features):
    """What a caller of the step kernel hands over for a padding token: no key (zero
    features, or logits of -inf), no value and no decay."""
    if mask is None:
        return k, v, log_decay
    pad = ~mask[:, None, :, None]
    k = k.masked_fill(pad, NEG_INF if exp_features else 0.0)
    v = v.masked_fill(pad, 0.0)
    if log_decay is not None:
        log_decay = log_decay.masked_fill(pad if log_decay.ndim == 4 else pad[..., 0], 0.0)
    return k, v, log_decay


def rebase(acc, ref, new_ref):
    """A (b, h, d, e + 1) accumulator held relative to the per-feature log reference `ref`
    (b, h, d), expressed relative to `new_ref` >= ref: acc * exp(ref - new_ref). Features
    that no key has reached (ref = -inf, acc = 0) stay 0."""
    ratio = (ref - new_ref).exp().nan_to_num(nan=0.0)
    return acc * ratio[..., None]


def assert_same_state(actual, expected, rtol=1e-9):
    """Two CausalStates hold the same sums. The references of `kv` are the decayed maxima of
    the same keys: the same features are -inf, the others agree up to rounding (the chunked
    form sums the decays per chunk, the recurrence per token), and the sums are compared on
    a common reference; so is `pending`."""
    assert actual.position == expected.position, f"position {actual.position} != {expected.position}"
    assert (actual.ref is None) == (expected.ref is None), "only one state has references"
    assert (actual.pending is None) == (expected.pending is None), "only one state has pending keys"
    if expected.ref is None:
        assert_matches(actual.kv, expected.kv, rtol, what="state.kv")
    else:
        reached = torch.isfinite(expected.ref)
        assert torch.equal(torch.isfinite(actual.ref), reached), "state.ref: different features reached"
        assert_matches(actual.ref[reached], expected.ref[reached], rtol, what="state.ref")
        common = torch.maximum(actual.ref, expected.ref)
        assert_matches(rebase(actual.kv, actual.ref, common), rebase(expected.kv, expected.ref, common), rtol,
                       what="state.kv")
    if expected.pending is None:
        assert actual.pending_ref is None and expected.pending_ref is None
        return
    if expected.ref is None:
        assert actual.pending_ref is None and expected.pending_ref is None
        assert_matches(actual.pending, expected.pending, rtol, what="state.pending")
        return
    common = torch.maximum(actual.pending_ref, expected.pending_ref)
    assert_matches(
        rebase(actual.pending, actual.pending_ref, common),
        rebase(expected.pending, expected.pending_ref, common),
        rtol,
        what="state.pending",
    )


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """The ops tests run thousands of tiny kernels, which gain nothing from intra-op threads
    and, on a busy machine, wait for them: run each module on one thread, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def helpers():
    return types.SimpleNamespace(
        assert_matches=assert_matches,
        feature_inputs=feature_inputs,
        logit_inputs=logit_inputs,
        kernel_inputs=kernel_inputs,
        random_mask=random_mask,
        random_log_decay=random_log_decay,
        squared_relu_map=squared_relu_map,
        without_padding=without_padding,
        rebase=rebase,
        assert_same_state=assert_same_state,
    )


@pytest.fixture(params=["sequential", "parallel", "compiled"])
def causal_form(request):
    """Runs a test under the forms of ``causal_linear_attention`` (``forms.use_form``): the
    loop over chunks that the CPU takes, the scan without host sync that other devices take,
    and the blocked scan that torch.compile traces (run eagerly). All must equal the same
    naive views."""
    from linear_attention_transformer.ops.causal.forms import use_form

    with use_form(request.param):
        yield request.param
