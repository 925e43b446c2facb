"""Numerical stability: huge key logits, half precision, shifted logits, strong gates."""

import pytest
import torch
import torch.nn.functional as F

from linear_attention_transformer.ops import (
    CausalState,
    FeatureMap,
    causal_linear_attention,
    causal_linear_attention_step,
    linear_attention,
    naive_causal_linear_attention,
    recurrent_causal_linear_attention,
)

KINDS = ["softmax", "elu", "relu", "callable"]


def make_map(kind, helpers):
    return FeatureMap(helpers.squared_relu_map if kind == "callable" else kind)


def run_causal(fm, q, k, v, mask=None, chunk_size=16, kernel_inputs=None):
    """Feature map then kernel; the kernel's inputs are appended to `kernel_inputs`."""
    features, log_decay, _ = fm.causal_keys(k, mask)
    args = (fm.queries(q), features, v, log_decay)
    if kernel_inputs is not None:
        kernel_inputs.extend(args)
    return causal_linear_attention(*args, mask, chunk_size=chunk_size)


def run_noncausal(fm, q, k, v, mask=None, kernel_inputs=None):
    features, normalize = fm.noncausal_keys(k, mask)
    args = (fm.queries(q), features, v)
    if kernel_inputs is not None:
        kernel_inputs.extend(args + (normalize,))
    return linear_attention(*args, mask=mask, normalize=normalize)


def signed_logits(b, h, n, d, e, magnitude, seed):
    """Keys of magnitude 0.25 to 1 times `magnitude` with random signs; the largest arrive late."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g)
    sign = torch.where(torch.rand(b, h, n, d, generator=g) < 0.5, -1.0, 1.0)
    k = sign * magnitude * (0.5 + 0.5 * torch.rand(b, h, n, d, generator=g))
    k = k * torch.linspace(0.5, 1.0, n)[:, None]
    v = torch.randn(b, h, n, e, generator=g)
    return q, k, v


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("magnitude", [50.0, 500.0, 1e4])
@pytest.mark.parametrize("causal", [True, False])
def test_huge_key_logits_float32_finite_and_accurate(kind, magnitude, causal, helpers):
    b, h, n, d, e = 2, 2, 37, 4, 3
    q, k, v = signed_logits(b, h, n, d, e, magnitude, seed=int(magnitude) % 97)
    fm = make_map(kind, helpers)
    mask = helpers.random_mask(b, n, seed=1)
    run = run_causal if causal else run_noncausal
    out = run(fm, q, k, v, mask)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # every output is a convex combination of values: bounded by them
    assert out.abs().max() <= v.abs().max() * (1 + 1e-4)
    if kind == "softmax":
        # float32 stays close to the same computation in float64
        ref = run(fm, q.double(), k.double(), v.double(), mask)
        helpers.assert_matches(out, ref, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("magnitude", [50.0, 500.0, 1e4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_under_autocast_is_finite(kind, magnitude, causal, dtype, helpers):
    b, h, n, d, e = 2, 2, 37, 4, 3
    q, k, v = signed_logits(b, h, n, d, e, magnitude, seed=5)
    if kind == "callable" and dtype == torch.float16:
        k = k.clamp(-200, 200)  # the user's map squares: 1e4 ** 2 is beyond float16 itself
    fm = make_map(kind, helpers)
    mask = helpers.random_mask(b, n, seed=2)
    run = run_causal if causal else run_noncausal
    kernel_inputs = []
    with torch.autocast("cpu", dtype=dtype):
        out_cast = run(fm, q, k, v, mask)  # float32 inputs, low-precision autocast region
        out_low = run(fm, q.to(dtype), k.to(dtype), v.to(dtype), mask, kernel_inputs=kernel_inputs)
    assert torch.isfinite(out_cast).all()
    assert out_low.dtype == dtype and torch.isfinite(out_low).all()

    # the kernel adds no error beyond rounding its output: float64 on the same half features
    as64 = [t.double() if isinstance(t, torch.Tensor) else t for t in kernel_inputs]
    if causal:
        exact = causal_linear_attention(*as64, mask, chunk_size=16)
    else:
        exact = linear_attention(*as64[:3], mask=mask, normalize=as64[3])
    helpers.assert_matches(out_low, exact, rtol=1e-2 if dtype == torch.bfloat16 else 2e-3)

    # and the whole pipeline approximates float64 on the same inputs, where the features are
    # representable in half precision: the softmax map is normalised by its running max,
    # elu's exp(x) for x << 0 underflows in float16 (and everywhere for x < -104)
    if kind == "softmax" or (kind == "elu" and magnitude == 50.0 and dtype == torch.bfloat16):
        ref = run(fm, q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), mask)
        tol = 0.1 if dtype == torch.bfloat16 else 0.02
        assert (out_low.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("shift", [80.0, 500.0, -500.0])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_softmax_map_is_shift_invariant_in_float32(shift, masked, helpers):
    """exp(k) would overflow float32 beyond 88: the running max must cancel exactly."""
    b, h, n, d, e = 2, 2, 50, 4, 3
    q, k, v = helpers.logit_inputs(b, h, n, d, e, seed=4, scale=2.0, dtype=torch.float32)
    mask = helpers.random_mask(b, n, seed=4) if masked else None
    fm = FeatureMap("softmax")
    base = run_causal(fm, q, k, v, mask)
    shifted = run_causal(fm, q, k + shift, v, mask)
    assert torch.isfinite(shifted).all()
    helpers.assert_matches(shifted, base, rtol=1e-4)
    truth = run_causal(fm, q.double(), k.double(), v.double(), mask)
    helpers.assert_matches(base, truth, rtol=1e-5)


@pytest.mark.parametrize("shift", [80.0, 500.0])
def test_noncausal_softmax_map_is_shift_invariant_in_float32(shift, helpers):
    b, h, n, d, e = 2, 2, 50, 4, 3
    q, k, v = helpers.logit_inputs(b, h, n, d, e, seed=6, scale=2.0, dtype=torch.float32)
    mask = helpers.random_mask(b, n, seed=6)
    fm = FeatureMap("softmax")
    base = run_noncausal(fm, q, k, v, mask)
    helpers.assert_matches(run_noncausal(fm, q, k + shift, v, mask), base, rtol=1e-4)


def gate_log_decay(b, h, n, d, seed, dtype):
    """Gate pre-activations of +-50: log a = logsigmoid(x) / 16 per feature, from about
    -3.1 (forget almost everything) to -1e-23 (keep everything)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(b, h, n, d, generator=g) < 0.5, -50.0, 50.0).to(dtype)
    return F.logsigmoid(x) / 16


@pytest.mark.parametrize("n", [15, 16, 17, 100])
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_extreme_gate_decays(n, scalar, blindspot, helpers):
    b, h, d, e = 2, 2, 4, 3
    q, k, v = helpers.feature_inputs(b, h, n, d, e, seed=n)
    log_decay = gate_log_decay(b, h, n, d, seed=n, dtype=torch.float64)
    if scalar:
        log_decay = log_decay[..., 0]
    mask = helpers.random_mask(b, n, seed=n)
    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    out = causal_linear_attention(q, k, v, log_decay, mask, blindspot, chunk_size=64)
    helpers.assert_matches(out, ref)
    rec, _ = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    helpers.assert_matches(rec, ref)

    args = (q.float(), k.float(), v.float(), log_decay.float(), mask, blindspot)
    out32 = causal_linear_attention(*args, chunk_size=64)
    assert torch.isfinite(out32).all()
    if blindspot == 1:
        helpers.assert_matches(out32, ref, rtol=1e-4)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            low = causal_linear_attention(*(t.to(dtype) for t in args[:4]), mask, blindspot, chunk_size=64)
        assert low.dtype == dtype and torch.isfinite(low).all()


@pytest.mark.parametrize("kind", ["softmax", "elu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_steps_under_autocast_keep_a_float32_state(kind, dtype, helpers):
    """Cached decoding runs the step kernel inside the model's autocast region: k v^T of
    large features (elu(1e4) * 10 > float16's 65504) must not be formed in half precision,
    and the result must equal the chunked form, which computes in float32."""
    b, h, n, d, e = 2, 2, 20, 4, 3
    q, k, v = signed_logits(b, h, n, d, e, 1e4, seed=8)
    v = v * 10
    fm = make_map(kind, helpers)
    with torch.autocast("cpu", dtype=dtype):
        qf = fm.queries(q)
        features, log_decay, _ = fm.causal_keys(k)
        chunked = causal_linear_attention(qf, features, v, log_decay)
        state, outs = CausalState.zeros(b, h, d, e), []
        for t in range(n):
            ld = None if log_decay is None else log_decay[:, :, t]
            out, state = causal_linear_attention_step(qf[:, :, t], features[:, :, t], v[:, :, t], state, ld)
            outs.append(out)
        recurrent, rec_state = recurrent_causal_linear_attention(qf, features, v, log_decay)
    assert state.kv.dtype == rec_state.kv.dtype == torch.float32
    helpers.assert_matches(torch.stack(outs, dim=2), chunked, rtol=1e-5, what="steps")
    helpers.assert_matches(recurrent, chunked, rtol=1e-5, what="recurrent")
