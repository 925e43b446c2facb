"""Numerical stability: large logits, half precision, shifted logits, strong gates.

What the exponential-feature kernels (the softmax map's causal path) promise, and what is
tested here:

* no factor exceeds 1, nothing overflows, and the common factors cancel: a common shift of
  the key logits or of one query's logits changes nothing;
* the recurrence (decoding), the blindspot form and the states between chunks live on
  decayed running maxima set by keys every reader sees: their denominators are >= 1;
* inside a chunk a query may see only keys far below the chunk's maximum; such chunks are
  found by their tiny denominators and recomputed with per-query shifts, so every form is
  exact at any logit spread (float64 equal to the reference, float32 within the rounding of
  its logits, gradients finite), with and without decays.
"""

import importlib

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

# every test here runs under each form of the causal kernel (conftest.causal_form)
pytestmark = pytest.mark.usefixtures("causal_form")

KINDS = ["softmax", "elu", "relu", "callable"]
KERNEL_MODULE = "linear_attention_transformer.ops.causal.chunk"


def make_map(kind, helpers):
    return FeatureMap(helpers.squared_relu_map if kind == "callable" else kind)


def run_causal(fm, q, k, v, mask=None, chunk_size=16, kernel_inputs=None):
    """Feature map then kernel; the kernel's inputs are appended to `kernel_inputs`."""
    q_in, k_in, exp_features = fm.causal_features(q, k)
    if kernel_inputs is not None:
        kernel_inputs.extend((q_in, k_in, v, exp_features))
    return causal_linear_attention(q_in, k_in, v, None, mask, chunk_size=chunk_size, exp_features=exp_features)


def run_noncausal(fm, q, k, v, mask=None, kernel_inputs=None):
    features, normalize = fm.noncausal_keys(k, mask)
    args = (fm.queries(q), features, v)
    if kernel_inputs is not None:
        kernel_inputs.extend(args + (normalize,))
    return linear_attention(*args, mask=mask, normalize=normalize)


def signed_logits(b, h, n, d, e, magnitude, seed, huge_queries=False):
    """Keys of magnitude 0.25 to 1 times `magnitude` with random signs; the largest arrive
    late. Queries are standard normal, or like the keys with `huge_queries`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g)
    sign = torch.where(torch.rand(b, h, n, d, generator=g) < 0.5, -1.0, 1.0)
    k = sign * magnitude * (0.5 + 0.5 * torch.rand(b, h, n, d, generator=g))
    k = k * torch.linspace(0.5, 1.0, n)[:, None]
    if huge_queries:
        sign = torch.where(torch.rand(b, h, n, d, generator=g) < 0.5, -1.0, 1.0)
        q = sign * magnitude * (0.25 + 0.75 * torch.rand(b, h, n, d, generator=g))
    v = torch.randn(b, h, n, e, generator=g)
    return q, k, v


def gate_log_decay(b, h, n, d, seed, dtype):
    """Gate pre-activations of +-50: log a = logsigmoid(x) / 16 per feature, from about
    -3.1 (forget almost everything) to -1e-23 (keep everything)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(b, h, n, d, generator=g) < 0.5, -50.0, 50.0).to(dtype)
    return F.logsigmoid(x) / 16


def assert_bounded_by_values(out, v):
    """Every output is a convex combination of values (or 0): bounded by them."""
    assert out.float().abs().max() <= v.float().abs().max() * (1 + 1e-4)


# ------------------------------------------------- exponential features: exact regimes


@pytest.mark.parametrize("std", [1.0, 5.0, 20.0])
@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("gated", [False, True])
def test_exp_features_float32_exact_for_logits_up_to_std_20(std, blindspot, gated, helpers):
    """Query and key logits of standard deviation up to 20 (exp(k) alone overflows float32
    from 88): the float32 chunked kernel (default chunk 64, two full chunks and a partial
    one) and the recurrence equal the float64 reference, and so do their gradients."""
    b, h, n, d, e = 2, 2, 150, 8, 3
    seed = int(std) + 10 * blindspot
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed, exp_features=True, scale=std)
    log_decay = gate_log_decay(b, h, n, d, seed, torch.float64) if gated else None
    mask = helpers.random_mask(b, n, seed)
    mask[0, :5] = False
    r = torch.randn(b, h, n, e, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    kw = dict(mask=mask, blindspot_size=blindspot, exp_features=True)
    results = []
    for fn, dtype in (
        (naive_causal_linear_attention, torch.float64),
        (causal_linear_attention, torch.float32),
        (lambda *a, **kw: recurrent_causal_linear_attention(*a, **kw)[0], torch.float32),
    ):
        given = (q, k, v) if log_decay is None else (q, k, v, log_decay)
        inputs = [t.to(dtype).detach().requires_grad_(True) for t in given]
        out = fn(*inputs[:3], inputs[3] if gated else None, **kw)
        assert out.dtype == dtype
        (out * r.to(dtype)).sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    (ref, ref_grads), *forms = results
    for form, (out, grads) in zip(("chunked", "recurrent"), forms):
        helpers.assert_matches(out, ref, rtol=1e-4, what=form)
        for name, g, g_ref in zip(("q", "k", "v", "log_decay"), grads, ref_grads):
            helpers.assert_matches(g, g_ref, rtol=1e-4, what=f"{form} d/d{name}")


@pytest.mark.parametrize("magnitude", [50.0, 500.0, 1e4])
@pytest.mark.parametrize("form", ["recurrent", "recurrent, blindspot", "chunked, blindspot"])
def test_exp_features_recurrence_and_blindspot_exact_for_any_logit_size(magnitude, form, helpers):
    """Queries and keys of +-magnitude in float32: the forms whose queries only read states
    set by keys they see are exact against float64, with finite gradients."""
    b, h, n, d, e = 2, 2, 37, 4, 3
    q, k, v = signed_logits(b, h, n, d, e, magnitude, seed=int(magnitude) % 89, huge_queries=True)
    mask = helpers.random_mask(b, n, seed=3)
    mask[0, :3] = False
    blindspot = 1 if form == "recurrent" else 4
    ref = naive_causal_linear_attention(q.double(), k.double(), v.double(), None, mask, blindspot, exp_features=True)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kw = dict(mask=mask, blindspot_size=blindspot, exp_features=True)
    if form.startswith("recurrent"):
        out, state = recurrent_causal_linear_attention(*inputs, **kw)
    else:
        out = causal_linear_attention(*inputs, chunk_size=16, **kw)
    helpers.assert_matches(out, ref, rtol=1e-4)
    out.sum().backward()
    for name, t in zip("qkv", inputs):
        assert torch.isfinite(t.grad).all(), f"non-finite gradient for {name}"
    assert inputs[2].grad.abs().max() > 0


@pytest.mark.parametrize("jump", [30.0, 60.0, 80.0, 110.0, 1e4])
def test_a_large_key_later_in_the_chunk(jump, helpers):
    """One key `jump` above all others, late in a chunk of 8: the queries before it would
    read their keys relative to it and underflow (the limit this kernel once had). Their
    chunk is recomputed: float32 result and gradients exact at any jump, like the
    recurrence and a chunk that ends before the jump."""
    b, h, n, d, e = 1, 2, 8, 2, 3
    g = torch.Generator().manual_seed(int(jump) % 7)
    q, k, v = (torch.randn(b, h, n, dim, generator=g) for dim in (d, d, e))
    k[:, :, 5] += jump
    ref_inputs = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = naive_causal_linear_attention(*ref_inputs, exp_features=True)
    r = torch.randn(ref.shape, dtype=ref.dtype, generator=g)
    ref_grads = torch.autograd.grad((ref * r).sum(), ref_inputs)

    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = causal_linear_attention(*inputs, chunk_size=8, exp_features=True)
    assert torch.isfinite(out).all()
    assert_bounded_by_values(out, v)
    helpers.assert_matches(out, ref, rtol=1e-5)
    grads = torch.autograd.grad((out * r.float()).sum(), inputs)
    for name, g32, g64 in zip("qkv", grads, ref_grads):
        helpers.assert_matches(g32, g64, rtol=1e-4, what=f"d/d{name}")
    helpers.assert_matches(out[:, :, 5:], ref[:, :, 5:], rtol=1e-5, what="queries that see the large key")
    helpers.assert_matches(causal_linear_attention(q, k, v, chunk_size=5, exp_features=True), ref, rtol=1e-5)
    helpers.assert_matches(recurrent_causal_linear_attention(q, k, v, exp_features=True)[0], ref, rtol=1e-5)


# ------------------------------------------------------------------ huge logits, any map


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
    assert_bounded_by_values(out, v)
    if kind == "softmax" and not causal:
        # float32 stays close to the same computation in float64
        ref = run(fm, q.double(), k.double(), v.double(), mask)
        helpers.assert_matches(out, ref, rtol=1e-4)
    if kind == "softmax" and causal:
        # the chunked form and the decoding recurrence are exact at any size
        rec, _ = recurrent_causal_linear_attention(*fm.causal_features(q, k)[:2], v, mask=mask, exp_features=True)
        ref = naive_causal_linear_attention(q.double(), k.double(), v.double(), mask=mask, exp_features=True)
        helpers.assert_matches(rec, ref, rtol=1e-4)
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
    assert_bounded_by_values(out_low, v.to(dtype))
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3

    as64 = [t.double() if isinstance(t, torch.Tensor) else t for t in kernel_inputs]
    if causal and kind == "softmax":
        # the decoding recurrence under autocast: exact up to rounding its output, against
        # float64 on the same half-precision logits
        with torch.autocast("cpu", dtype=dtype):
            rec, _ = recurrent_causal_linear_attention(*kernel_inputs[:3], mask=mask, exp_features=True)
        assert rec.dtype == dtype
        helpers.assert_matches(rec, naive_causal_linear_attention(*as64[:3], mask=mask, exp_features=True), rtol=tol)
        return

    # the kernel adds no error beyond rounding its output: float64 on the same half features
    if causal:
        exact = causal_linear_attention(*as64[:3], mask=mask, chunk_size=16)
    else:
        exact = linear_attention(*as64[:3], mask=mask, normalize=as64[3])
    helpers.assert_matches(out_low, exact, rtol=tol)

    # and the whole pipeline approximates float64 on the same inputs, where the features are
    # representable in half precision: the non-causal softmax map is normalised by its
    # maximum, elu's exp(x) for x << 0 underflows in float16 (and everywhere for x < -104)
    if (kind == "softmax") or (kind == "elu" and magnitude == 50.0 and dtype == torch.bfloat16):
        ref = run(fm, q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), mask)
        tol = 0.1 if dtype == torch.bfloat16 else 0.02
        assert (out_low.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("gated", [False, True])
def test_exp_features_logits_of_1e4_under_autocast_are_finite(dtype, blindspot, gated, helpers):
    """Query and key logits of +-1e4 in half precision: every form's forward pass is finite
    and bounded by the values."""
    b, h, n, d, e = 2, 2, 37, 4, 3
    q, k, v = signed_logits(b, h, n, d, e, 1e4, seed=7, huge_queries=True)
    log_decay = gate_log_decay(b, h, n, d, seed=7, dtype=torch.float32) if gated else None
    mask = helpers.random_mask(b, n, seed=7)
    mask[1, :4] = False
    low = [None if t is None else t.to(dtype) for t in (q, k, v, log_decay)]
    kw = dict(mask=mask, blindspot_size=blindspot, exp_features=True)
    with torch.autocast("cpu", dtype=dtype):
        outs = {
            "chunked": (causal_linear_attention(*low, chunk_size=16, **kw), low[2]),
            "chunked, float32 inputs": (causal_linear_attention(q, k, v, log_decay, chunk_size=16, **kw), v),
            "recurrent": (recurrent_causal_linear_attention(*low, **kw)[0], low[2]),
        }
    for name, (out, values) in outs.items():
        assert torch.isfinite(out).all(), f"{name}: non-finite output"
        assert_bounded_by_values(out, values)
    assert outs["chunked"][0].dtype == outs["recurrent"][0].dtype == dtype


# ------------------------------------------------------------------------ shift invariance


@pytest.mark.parametrize("shift", [80.0, 500.0, -500.0])
@pytest.mark.parametrize("target", ["keys", "query_row"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_causal_softmax_map_is_shift_invariant(shift, target, masked, blindspot, helpers):
    """exp(k) overflows float32 beyond 88: a common shift of all key logits, or of one
    query's logits, must cancel exactly. float64: unchanged to 1e-9; float32: exact against
    float64 on the same (rounded) shifted logits, and unchanged up to that rounding."""
    b, h, n, d, e = 2, 2, 50, 4, 3
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=4, exp_features=True, scale=2.0)
    mask = helpers.random_mask(b, n, seed=4) if masked else None
    fm = FeatureMap("softmax")

    def shifted(q, k):
        q, k = q.clone(), k.clone()
        if target == "keys":
            k += shift
        else:
            q[:, :, 7] += shift
            q[:, :, -1] += shift
        return q, k

    def run(q, k, v):
        q_in, k_in, exp_features = fm.causal_features(q, k)
        return causal_linear_attention(q_in, k_in, v, None, mask, blindspot, chunk_size=16, exp_features=exp_features)

    base = run(q, k, v)
    helpers.assert_matches(run(*shifted(q, k), v), base, rtol=1e-9, what="float64")

    q32, k32 = shifted(q.float(), k.float())
    out32 = run(q32, k32, v.float())
    assert out32.dtype == torch.float32
    exact = naive_causal_linear_attention(q32.double(), k32.double(), v, None, mask, blindspot, exp_features=True)
    helpers.assert_matches(out32, exact, rtol=1e-5, what="float32 vs float64 on the same logits")
    # the shifted logits are rounded to float32 near |shift| (half a unit there: 3e-5 at 500)
    helpers.assert_matches(out32, base, rtol=5e-4, what="float32 shifted vs unshifted")


@pytest.mark.parametrize("shift", [80.0, 500.0])
def test_noncausal_softmax_map_is_shift_invariant_in_float32(shift, helpers):
    b, h, n, d, e = 2, 2, 50, 4, 3
    q, k, v = helpers.logit_inputs(b, h, n, d, e, seed=6, scale=2.0, dtype=torch.float32)
    mask = helpers.random_mask(b, n, seed=6)
    fm = FeatureMap("softmax")
    base = run_noncausal(fm, q, k, v, mask)
    helpers.assert_matches(run_noncausal(fm, q, k + shift, v, mask), base, rtol=1e-4)


# ---------------------------------------------------------------------------- strong gates


@pytest.mark.parametrize("exp_features", [False, True], ids=["features", "exp"])
@pytest.mark.parametrize("n", [15, 16, 17, 100])
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_extreme_gate_decays(exp_features, n, scalar, blindspot, helpers):
    """Log decays from gate pre-activations of +-50: every view equals the reference in
    float64, float32 stays finite and accurate, half precision under autocast finite."""
    b, h, d, e = 2, 2, 4, 3
    q, k, v = helpers.kernel_inputs(b, h, n, d, e, seed=n, exp_features=exp_features)
    log_decay = gate_log_decay(b, h, n, d, seed=n, dtype=torch.float64)
    if scalar:
        log_decay = log_decay[..., 0]
    mask = helpers.random_mask(b, n, seed=n)
    kw = dict(mask=mask, blindspot_size=blindspot, exp_features=exp_features)
    ref = naive_causal_linear_attention(q, k, v, log_decay, **kw)
    out = causal_linear_attention(q, k, v, log_decay, chunk_size=64, **kw)
    helpers.assert_matches(out, ref)
    rec, _ = recurrent_causal_linear_attention(q, k, v, log_decay, **kw)
    helpers.assert_matches(rec, ref)

    args = (q.float(), k.float(), v.float(), log_decay.float())
    out32 = causal_linear_attention(*args, chunk_size=64, **kw)
    assert torch.isfinite(out32).all()
    helpers.assert_matches(out32, ref, rtol=1e-4)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            low = causal_linear_attention(*(t.to(dtype) for t in args), chunk_size=64, **kw)
        assert low.dtype == dtype and torch.isfinite(low).all()


# -------------------------------------------------------------- decoding under autocast


@pytest.mark.parametrize("kind", ["softmax", "elu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_steps_under_autocast_keep_a_float32_state(kind, dtype, helpers):
    """Cached decoding runs the step kernel inside the model's autocast region: k v^T of
    large features (elu(1e4) * 10 > float16's 65504) must not be formed in half precision,
    and the state (with its references, for the softmax map's logits of +-1e4) stays
    float32. The steps equal the recurrence and the exact result: the chunked form for elu,
    float64 for the softmax map."""
    b, h, n, d, e = 2, 2, 20, 4, 3
    q, k, v = signed_logits(b, h, n, d, e, 1e4, seed=8, huge_queries=kind == "softmax")
    v = v * 10
    fm = make_map(kind, helpers)
    with torch.autocast("cpu", dtype=dtype):
        q_in, k_in, exp_features = fm.causal_features(q, k)
        state, outs = CausalState.zeros(b, h, d, e, exp_features=exp_features), []
        for t in range(n):
            out, state = causal_linear_attention_step(
                q_in[:, :, t], k_in[:, :, t], v[:, :, t], state, exp_features=exp_features
            )
            outs.append(out)
        recurrent, rec_state = recurrent_causal_linear_attention(q_in, k_in, v, exp_features=exp_features)
        chunked = causal_linear_attention(q_in, k_in, v, exp_features=exp_features)
    assert state.kv.dtype == rec_state.kv.dtype == torch.float32
    if exp_features:
        assert state.ref.dtype == torch.float32
        helpers.assert_matches(state.ref, k.amax(dim=2), rtol=0, what="state.ref")
        exact = naive_causal_linear_attention(q.double(), k.double(), v.double(), exp_features=True)
    else:
        exact = chunked
    assert torch.isfinite(chunked).all()
    helpers.assert_matches(torch.stack(outs, dim=2), exact, rtol=1e-5, what="steps")
    helpers.assert_matches(recurrent, exact, rtol=1e-5, what="recurrent")


# ------------------------------------------- exponential features: exact at any spread


def spread_inputs(b, h, n, d, e, scale, seed, dtype=torch.float64):
    """Query and key logits of standard deviation `scale` (a trained-looking model's grow
    to hundreds), values standard normal."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=dtype) * scale for _ in range(2))
    return q, k, torch.randn(b, h, n, e, generator=g, dtype=dtype)


@pytest.fixture(params=["fast", "safe everywhere"])
def safe_path(request, monkeypatch):
    """'safe everywhere' sends every chunk through the recomputation (per-query shifts in
    log space), so the safe form itself is checked against the reference."""
    if request.param == "safe everywhere":
        monkeypatch.setattr(importlib.import_module(KERNEL_MODULE), "SAFE_BELOW", float("inf"))
    return request.param


@pytest.mark.parametrize("scale", [1.0, 10.0, 100.0, 1000.0])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("n", [32, 37])
def test_exp_features_float64_exact_at_any_logit_spread(scale, decay, n, safe_path, helpers):
    """In float64 the chunked kernel equals the explicit matrix at every spread: the chunks
    whose queries lost weight to underflow (float64 too underflows at e^-745) are recomputed,
    and with every chunk recomputed the safe form alone equals it too. Masks with left
    padding and an empty row, chunks of 8 (n a multiple or not), decays."""
    b, h, d, e = 2, 2, 4, 3
    seed = int(scale) + n
    q, k, v = spread_inputs(b, h, n, d, e, scale, seed)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed, strength=2.0)
    mask = helpers.random_mask(b, n, seed, empty_row=True)
    mask[0, :3] = False
    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, exp_features=True)
    out = causal_linear_attention(q, k, v, log_decay, mask, chunk_size=8, exp_features=True)
    helpers.assert_matches(out, ref, rtol=1e-9)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the empty row


@pytest.mark.parametrize("scale, rtol", [(1.0, 1e-5), (10.0, 1e-4), (100.0, 1e-3), (1000.0, 1e-2)])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
def test_exp_features_float32_close_to_float64_at_any_logit_spread(scale, rtol, decay, helpers):
    """float32 against float64 on the same (float32-rounded) logits, forward and gradients:
    the error is that of rounding q + k near the logits' size (|q + k| ~ 4 scale, half a
    unit in the last place 3e-5 at 100), not a cliff; every gradient finite. Chunk 16 with
    n = 70 (a partial last chunk) and a mask; the recurrence is checked alike."""
    b, h, n, d, e = 1, 2, 70, 8, 3
    q, k, v = spread_inputs(b, h, n, d, e, scale, seed=int(scale), dtype=torch.float32)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed=3, dtype=torch.float32, strength=2.0)
    mask = helpers.random_mask(b, n, seed=3)
    given = [t for t in (q, k, v, log_decay) if t is not None]
    r = torch.randn(b, h, n, e, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(fn, dtype):
        inputs = [t.to(dtype).requires_grad_(True) for t in given]
        ld = inputs[3] if log_decay is not None else None
        out = fn(*inputs[:3], ld)
        return out.detach(), torch.autograd.grad((out * r.to(dtype)).sum(), inputs)

    kw = dict(mask=mask, exp_features=True)
    ref, ref_grads = run(lambda q, k, v, ld: naive_causal_linear_attention(q, k, v, ld, **kw), torch.float64)
    forms = {
        "chunked": lambda q, k, v, ld: causal_linear_attention(q, k, v, ld, chunk_size=16, **kw),
        "recurrent": lambda q, k, v, ld: recurrent_causal_linear_attention(q, k, v, ld, **kw)[0],
    }
    for form, fn in forms.items():
        out, grads = run(fn, torch.float32)
        helpers.assert_matches(out, ref, rtol=rtol, what=form)
        for name, g, g_ref in zip(("q", "k", "v", "log_decay"), grads, ref_grads):
            assert torch.isfinite(g).all(), f"{form} d/d{name}: not finite"
            if scale <= 100 or name == "v":
                # (at 1000 the weights are one-hot up to e^-1000s: d/dq, d/dk, d/dlog_decay are
                # ~1e-9 in float64, and float32 rounding of logits of ~4000 moves them by 1e-6)
                helpers.assert_matches(g, g_ref, rtol=10 * rtol, what=f"{form} d/d{name}")


@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("split", [5, 16, 29])
def test_exp_features_large_spread_chunked_prefill_then_steps(decay, split, safe_path, helpers):
    """State continuation at a spread of 100 in float64: a chunked prefill of `split` tokens
    (whose lost chunks are recomputed), then chunked and step-by-step continuations, equal
    the one-pass reference; the returned states hold the same sums."""
    b, h, n, d, e = 2, 2, 40, 4, 3
    q, k, v = spread_inputs(b, h, n, d, e, 100.0, seed=split)
    log_decay = helpers.random_log_decay(decay, b, h, n, d, seed=split, strength=2.0)
    mask = helpers.random_mask(b, n, seed=split)
    kw = dict(exp_features=True)
    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, **kw)

    def part(t, sl):
        return None if t is None else t[:, :, sl] if t.ndim > 2 else t[:, sl]

    first, rest = slice(0, split), slice(split, n)
    out1, state = causal_linear_attention(*(part(t, first) for t in (q, k, v, log_decay)), mask=mask[:, first],
                                          chunk_size=8, return_state=True, **kw)
    out2, end_chunked = causal_linear_attention(*(part(t, rest) for t in (q, k, v, log_decay)), mask=mask[:, rest],
                                                chunk_size=8, state=state, return_state=True, **kw)
    helpers.assert_matches(torch.cat((out1, out2), dim=2), ref, what="chunked continuation")
    out3, end_steps = recurrent_causal_linear_attention(*(part(t, rest) for t in (q, k, v, log_decay)),
                                                        mask=mask[:, rest], state=state, **kw)
    helpers.assert_matches(torch.cat((out1, out3), dim=2), ref, what="steps after a chunked prefill")
    helpers.assert_same_state(end_chunked, end_steps)
