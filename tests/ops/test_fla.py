"""The fla kernel (``ops/causal/fla.py``): ``causal_linear_attention`` on flash-linear-attention's
chunk kernels, judged by ``naive_causal_linear_attention`` in float64.

Two halves:

* the adapter: fla's kernels replaced (at ``fla._kernels``) by ``gla_recurrence``, fla's gated
  recurrence written out token by token in float64 (held equal to fla's own naive recurrences
  below), for every configuration the form maps, gradients included;
* fla's real Triton kernels, run on the CPU in Triton's interpreter (float32, small sizes):
  TRITON_INTERPRET must be set before triton is imported, so they run in a subprocess
  (``fla_interpreted.py``), which writes its outputs and gradients back for judging here.

And the picker: where 'auto' takes fla, and every refusal of kernel='fla' names its reason.
The same three parts for the delta rule on fla (``ops/delta/fla.py``), at the end.
"""

import functools
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linear_attention_transformer.ops import causal_linear_attention, naive_causal_linear_attention
from linear_attention_transformer.ops.causal import fla as fla_form
from linear_attention_transformer.ops.causal import forms
from linear_attention_transformer.ops.delta import chunk_delta_rule, naive_delta_rule
from linear_attention_transformer.ops.delta import fla as delta_fla
from linear_attention_transformer import Attention

DOUBLE = torch.float64
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ROOT = Path(__file__).resolve().parents[2]


def gla_recurrence(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla's chunk kernels' contract, one token at a time: S_t = exp(g_t) S_{t-1} + k_t v_tᵀ,
    o_t = scale S_tᵀ q_t, per head; g None, (B, T, H) or (B, T, H, K); the state restarts
    (from 0) at each start in ``cu_seqlens`` (then B is 1). Returns (o, final states or None)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    starts = set() if cu_seqlens is None else set(cu_seqlens[1:-1].tolist())
    outs, finals = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype), []
    for row in range(B):
        S = q.new_zeros(H, K, v.shape[-1]) if initial_state is None else initial_state[row]
        for t in range(T):
            if t in starts:
                finals.append(S)
                S = torch.zeros_like(S)
            if g is not None:
                S = S * (g[row, t][:, None, None] if g.ndim == 3 else g[row, t][..., None]).exp()
            S = S + k[row, t][:, :, None] * v[row, t][:, None, :]
            outs[row, t] = scale * torch.einsum("hk,hkv->hv", q[row, t], S)
        finals.append(S)
    return outs, torch.stack(finals) if output_final_state else None


@pytest.fixture
def recurrences(monkeypatch):
    """fla's kernels replaced by ``gla_recurrence``, CPU counted as interpreted: the form runs
    here, and ``calls`` records which kernel each call took."""
    calls = []

    def kernel(name):
        def run(q, k, v, g=None, **options):
            calls.append(name)
            return gla_recurrence(q, k, v, g, **options)
        return run

    monkeypatch.setattr(fla_form, "_kernels", lambda: (kernel("chunk_simple_gla"), kernel("chunk_gla")))
    monkeypatch.setattr(fla_form, "_import_error", lambda: None)
    monkeypatch.setattr(fla_form, "_interpreted", lambda: True)
    monkeypatch.setattr(fla_form, "KERNEL_DTYPES", (torch.float32, torch.float64))  # (the stand-in's)
    return calls


@pytest.mark.requires("fla", "triton")  # (fla's modules import Triton)
def test_the_recurrence_is_flas_own_naive_recurrences():
    """``gla_recurrence`` (the stand-in) equals fla's naive recurrent forms (plain PyTorch, float32),
    per head and per feature, from a state and to one."""
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 3, 8, generator=gen) for _ in range(3))
    state = torch.randn(2, 3, 8, 8, generator=gen)
    gk = F.logsigmoid(torch.randn(2, 37, 3, 8, generator=gen))
    for ours, theirs in [(gla_recurrence(q, k, v, gk, None, state, True),
                          naive_recurrent_gla(q, k, v, gk, state, True)),
                         (gla_recurrence(q, k, v, gk[..., 0], 1.0, state, True),
                          naive_recurrent_simple_gla(q, k, v, gk[..., 0], 1.0, state, True))]:
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


FEATURE_MAPS = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu, "callable": lambda x: F.relu(x) ** 2 + 1e-3}


def inputs(b, h, n, d, e, seed, exp_features, scale=1.0, feature_map="elu", decay=None, dtype=DOUBLE):
    """q, k (features or logits of standard deviation ``scale``), v, log_decay (None, 'head',
    'feature'), all leaves."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, dtype=dtype, generator=gen) * scale for _ in range(2))
    if not exp_features:
        q, k = FEATURE_MAPS[feature_map](q), FEATURE_MAPS[feature_map](k)
    v = torch.randn(b, h, n, e, dtype=dtype, generator=gen)
    log_decay = None
    if decay is not None:
        shape = (b, h, n) if decay == "head" else (b, h, n, d)
        log_decay = F.logsigmoid(torch.randn(*shape, dtype=dtype, generator=gen) + 2)
    return [t if t is None else t.requires_grad_() for t in (q, k, v, log_decay)]


def mask_and_segments(b, n, seed, masked, packed):
    gen = torch.Generator().manual_seed(seed + 1)
    mask = (torch.rand(b, n, generator=gen) < 0.8) if masked else None
    if mask is not None:
        mask[:, :3] = False  # queries that see no key: 0
    segments = torch.cumsum(torch.rand(b, n, generator=gen) < 0.06, dim=1) if packed else None
    return mask, segments


def grads(out, leaves, seed):
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 2))
    present = [t for t in leaves if t is not None]
    return torch.autograd.grad((out * weight).sum(), present)


def assert_close(actual, expected, rtol, what, atol=0.0):
    """|actual - expected| <= rtol max|expected| + atol everywhere, actual finite."""
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert torch.isfinite(actual).all(), f"{what}: non-finite"
    assert err <= rtol * scale + atol, \
        f"{what}: max error {err:.2e} vs scale {scale:.2e} (rtol {rtol:g}, atol {atol:g})"


# float64 gradients: relative to their largest value, and within 1e-12 absolute (v and the
# outputs are O(1)) where that is itself ~0: the queries' at logits x1000 under a blindspot,
# where the weights are saturated (8e-15 .. 7e-18 in the judge, rounding there 9e-16)
GRAD_ATOL = 1e-12


CONFIGS = [  # (exp_features, logit scale, feature map, decay)
    *[(False, 1.0, fmap, decay) for fmap in FEATURE_MAPS for decay in (None, "head", "feature")],
    *[(True, scale, None, decay) for scale in (1.0, 100.0, 1000.0) for decay in (None, "head", "feature")],
]


@pytest.mark.parametrize("exp_features, scale, feature_map, decay", CONFIGS)
@pytest.mark.parametrize("masked, packed", [(False, False), (True, True)])
@pytest.mark.parametrize("blindspot_size", [1, 5])
@pytest.mark.parametrize("d, e", [(4, 3), (3, 8)], ids=["keys wider", "keys narrower"])
def test_adapter_equals_the_naive_form(recurrences, exp_features, scale, feature_map, decay, masked, packed,
                                       blindspot_size, d, e):
    """Output and gradients (q, k, v, log_decay) equal the float64 judge, for given features
    (elu + 1, relu, a callable's), exponential features at logits x1 ... x1000, no / per-head /
    per-feature decay, with a mask (queries that see nothing included) and segments, with and
    without a blindspot (blocks of 5 in 23 tokens), keys of more or fewer features than the
    values have; and the kernel is the one the decay calls for."""
    b, h, n = 2, 2, 23
    leaves = inputs(b, h, n, d, e, 7, exp_features, scale, feature_map, decay)
    mask, segments = mask_and_segments(b, n, 7, masked, packed)
    options = dict(mask=mask, exp_features=exp_features, segments=segments, blindspot_size=blindspot_size)
    out = causal_linear_attention(*leaves, kernel="fla", **options)
    judge = naive_causal_linear_attention(*leaves, **options)
    assert_close(out, judge, 1e-10, "output")
    for name, got, want in zip("q k v log_decay".split(), grads(out, leaves, 7), grads(judge, leaves, 7)):
        assert_close(got, want, 1e-9, f"grad {name}", GRAD_ATOL)
    per_feature = exp_features or decay == "feature"
    assert recurrences == ["chunk_gla" if per_feature else "chunk_simple_gla"]


@pytest.mark.parametrize("exp_features, scale", [(False, 1.0), (True, 1.0), (True, 1000.0)])
@pytest.mark.parametrize("decay", [None, "feature"])
@pytest.mark.parametrize("blindspot_size, split", [(1, 11), (4, 12), (4, 11), (4, 26)])
def test_adapter_state_in_and_out(recurrences, exp_features, scale, decay, blindspot_size, split, helpers):
    """A prefix with return_state, then the rest from that state, equals one pass (and the
    judge), gradients through the state included; the state is the project's (the sequential
    form's, to rounding; with a blindspot its pending keys too, the prefix ending at, inside or
    one block after a block's end), and either form continues from the other's."""
    b, h, n, d, e = 2, 2, 30, 4, 3
    leaves = inputs(b, h, n, d, e, 3, exp_features, scale, "elu", decay)
    mask, _ = mask_and_segments(b, n, 3, True, False)
    q, k, v, log_decay = leaves

    def part(t, sl):
        return None if t is None else t[:, sl] if t.dtype == torch.bool else t[:, :, sl]

    def run(sl, kernel, state=None):
        return causal_linear_attention(*(part(t, sl) for t in (q, k, v, log_decay)), mask=part(mask, sl),
                                       exp_features=exp_features, state=state, return_state=True, kernel=kernel,
                                       blindspot_size=blindspot_size)

    head, tail = slice(0, split), slice(split, n)
    out_head, state = run(head, "fla")
    out_tail, last = run(tail, "fla", state)
    out = torch.cat((out_head, out_tail), dim=2)
    judge = naive_causal_linear_attention(*leaves, mask=mask, exp_features=exp_features,
                                          blindspot_size=blindspot_size)
    assert_close(out, judge, 1e-10, "output")
    for name, got, want in zip("q k v log_decay".split(), grads(out, leaves, 3), grads(judge, leaves, 3)):
        assert_close(got, want, 1e-9, f"grad {name}", GRAD_ATOL)
    _, state_sequential = run(head, "torch")
    helpers.assert_same_state(state.detach(), state_sequential.detach())
    _, last_sequential = run(tail, "torch", state)  # the other form, from fla's state
    helpers.assert_same_state(last.detach(), last_sequential.detach())
    out_mixed, _ = run(tail, "fla", state_sequential)  # fla, from the other form's state
    assert_close(out_mixed, judge[:, :, split:], 1e-10, "output from the sequential form's state")


@pytest.mark.parametrize("exp_features", [False, True])
@pytest.mark.parametrize("blindspot_size", [1, 4])
def test_non_finite_inputs_poison_what_sees_them_as_in_the_other_forms(recurrences, exp_features, blindspot_size):
    """A NaN key, an inf value and a NaN decay make exactly the outputs that see them NaN
    (``non_finite.py``), as the sequential form does; the rest, and the state, equal it."""
    q, k, v, log_decay = (t.detach() for t in inputs(2, 2, 30, 4, 3, 4, exp_features, decay="feature"))
    k[0, 1, 9, 2] = float("nan")
    v[1, 0, 17, 1] = float("inf")
    log_decay[1, 1, 21, 0] = float("nan")
    options = dict(exp_features=exp_features, blindspot_size=blindspot_size, return_state=True)
    out, state = causal_linear_attention(q, k, v, log_decay, kernel="fla", **options)
    expected, expected_state = causal_linear_attention(q, k, v, log_decay, form="sequential", **options)
    assert torch.equal(out.isnan(), expected.isnan()) and expected.isnan().any() and not expected.isnan().all()
    assert_close(out.nan_to_num(0.0), expected.nan_to_num(0.0), 1e-10, "finite outputs")
    assert torch.equal(state.kv.isnan(), expected_state.kv.isnan())


def test_the_form_leaves_its_inputs_alone(recurrences):
    leaves = inputs(1, 2, 20, 4, 3, 1, True, decay="feature")
    state = causal_linear_attention(*leaves, exp_features=True, return_state=True, kernel="fla")[1]
    before = [t.detach().clone() for t in (*leaves, state.kv, state.ref)]
    causal_linear_attention(*leaves, exp_features=True, state=state, kernel="fla")
    assert all(torch.equal(a, b) for a, b in zip(before, (*leaves, state.kv, state.ref)))


def test_a_form_names_the_torch_kernels_way_only(recurrences):
    """A scope's form leaves kernel='fla' to fla; a form named beside it in the call is refused,
    since it would not act."""
    leaves = inputs(1, 1, 9, 4, 3, 2, False)
    with forms.use_form("parallel"):
        causal_linear_attention(*leaves, kernel="fla")
        causal_linear_attention(*leaves)  # (the CPU's 'auto' is the torch kernel, here in the scope's form)
    assert recurrences == ["chunk_simple_gla"]
    with pytest.raises(ValueError, match="form names how the torch kernel runs, and kernel='fla' runs fla's"):
        causal_linear_attention(*leaves, kernel="fla", form="parallel")


# ------------------------------------------------------------------ where the form runs


@pytest.fixture
def fla_importable(monkeypatch):
    monkeypatch.setattr(fla_form, "_import_error", lambda: None)


def test_auto_takes_fla_on_cuda_when_it_maps(monkeypatch, fla_importable):
    """On a CUDA machine with fla importable 'auto' is the fla kernel, compiled or not, except
    where it does not map (float64) or fla does not import: then today's form."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fla_form, "_WARNED", set())
    assert forms.pick_form(CUDA) == forms.FLA
    assert forms.pick_form(CUDA, exp_features=True, blindspot_size=4) == forms.FLA
    assert forms.pick_form(CUDA, compiling=True, exp_features=True) == forms.FLA
    assert forms.pick_form(CUDA, exp_features=True, dtype=DOUBLE) == ("log_depth", True, 16)
    monkeypatch.setattr(fla_form, "_import_error", lambda: "fla-core does not import")
    with pytest.warns(RuntimeWarning, match="torch kernel on CUDA instead of fla's kernels: fla-core does not import"):
        assert forms.pick_form(CUDA, exp_features=True) == ("log_depth", True, 16)
    assert forms.pick_form(CUDA, compiling=True, exp_features=True) == ("blocked", True, 16)


def test_auto_warns_once_per_reason(monkeypatch, recwarn):
    """'auto' on CUDA without fla says so once per reason, naming the fix; float64 (the
    caller's choice) and kernel='torch' say nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fla_form, "_WARNED", set())
    reason = "fla-core is not installed; " + fla_form.FIX
    monkeypatch.setattr(fla_form, "_import_error", lambda: reason)
    forms.pick_form(CUDA, kernel="torch")
    forms.pick_form(CUDA, dtype=DOUBLE)
    assert not recwarn.list
    for _ in range(3):
        forms.pick_form(CUDA)
    assert [str(w.message) for w in recwarn.list] == [
        "kernel 'auto' runs the torch kernel on CUDA instead of fla's kernels: fla-core is not installed; "
        "pip install -e '.[cuda]' in a clone of this library, or pip install 'fla-core>=0.5.1,<0.7' (kernel='torch' "
        "chooses it without this warning)"]
    monkeypatch.setattr(fla_form, "_import_error", lambda: "fla-core does not import (ImportError: x)")
    forms.pick_form(CUDA)
    assert len(recwarn.list) == 2 and "does not import (ImportError: x)" in str(recwarn.list[1].message)


@pytest.mark.parametrize("triton_version, capability, tilelang, bad", [
    ("3.6.0", 9, False, True),
    ("3.4.0", 9, False, True),
    ("3.7.0+git1234", 9, False, True),
    ("3.7.1", 9, False, False),
    ("3.8.0", 9, False, False),
    ("3.3.1", 9, False, False),
    ("3.6.0", 8, False, False),
    ("3.6.0", 10, False, False),
    ("3.6.0", 9, True, False),
])
def test_the_known_bad_pair(triton_version, capability, tilelang, bad):
    """fla's gated backward of chunk_simple_gla is refused by fla itself on Hopper with Triton
    3.4.0 to 3.7.0 unless tilelang is installed: recognised from the versions alone."""
    why = fla_form.known_bad_pair(triton_version, capability, tilelang)
    assert (why is not None) == bad
    if bad:
        assert "Hopper" in why and triton_version in why and "pip install tilelang" in why


def test_the_known_bad_pair_runs_the_torch_form_for_what_it_affects(monkeypatch, fla_importable, recwarn):
    """On a Hopper with Triton 3.6 and no tilelang, given features with a per-head decay that
    need gradients run the torch kernel (one warning; a ValueError when fla is forced); every
    other configuration keeps fla."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fla_form, "_environment", lambda index: ("3.6.0", 9, False))
    monkeypatch.setattr(fla_form, "_WARNED", set())
    assert forms.pick_form(CUDA) == forms.FLA  # (no gradients of a gated call needed)
    assert forms.pick_form(CUDA, per_feature_decay=True) == forms.FLA
    for _ in range(2):
        assert forms.pick_form(CUDA, gated_backward=True).scan == "log_depth"
    assert len(recwarn.list) == 1 and "Hopper with Triton 3.6.0" in str(recwarn.list[0].message)
    with pytest.raises(ValueError, match="kernel='fla' cannot run this call: fla-core refuses the gated backward"):
        forms.pick_form(CUDA, kernel="fla", gated_backward=True)


def test_the_gated_backward_is_named_by_the_call(monkeypatch):
    """``causal_linear_attention`` asks for the gated backward exactly for given features with a
    per-head decay, where a gradient is needed."""
    asked = []
    real = forms.pick_form
    monkeypatch.setattr(chunk_module, "pick_form", lambda *args: asked.append(args[-1]) or real(*args))
    q, k, v, head, feature = inputs(1, 1, 8, 4, 3, 0, False, decay="head") + inputs(1, 1, 8, 4, 3, 0, False,
                                                                                    decay="feature")[3:]
    causal_linear_attention(q, k, v, head)
    causal_linear_attention(q, k, v, feature)
    causal_linear_attention(q, k, v, head, exp_features=True)
    with torch.no_grad():
        causal_linear_attention(q, k, v, head)
    causal_linear_attention(*(t.detach() for t in (q, k, v, head)))
    assert asked == [True, False, False, False, False]


def test_auto_on_the_cpu_never_asks_for_fla(monkeypatch):
    """No CPU change: 'auto' there neither imports fla nor checks for it."""
    def asked(*args):
        raise AssertionError("fla_missing called for the CPU's 'auto'")

    monkeypatch.setattr(forms, "fla_missing", asked)
    assert forms.pick_form(CPU, exp_features=True) == ("loop", False, 64)


@pytest.mark.parametrize("device, compiling, dtype, interpreted, import_error, reason", [
    (CPU, False, torch.float32, False, None, "TRITON_INTERPRET=1"),
    (CUDA, False, DOUBLE, True, None, "float32 .*not in torch.float64"),
    (torch.device("meta"), False, torch.float32, True, None, "run on CUDA, not on meta"),
    (CUDA, False, torch.float32, True, "fla-core does not import (ImportError)", r"does not import \(ImportError\)"),
])
def test_forcing_fla_where_it_cannot_run_names_why(monkeypatch, device, compiling, dtype, interpreted, import_error,
                                                     reason):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fla_form, "_interpreted", lambda: interpreted)
    monkeypatch.setattr(fla_form, "_import_error", lambda: import_error)
    with pytest.raises(ValueError, match=f"kernel='fla' cannot run this call: .*{reason}"):
        forms.pick_form(device, compiling, "fla", dtype=dtype)


def test_forcing_fla_on_float64_is_refused_by_the_kernel():
    leaves = inputs(1, 1, 8, 4, 3, 0, False)
    with pytest.raises(ValueError, match="fla's kernels compute in float32"):
        causal_linear_attention(*leaves, kernel="fla")


def test_the_package_runs_without_fla():
    """With fla unimportable the package imports and computes as before, and kernel='fla' says
    that fla does not import, for the additive rule and for the delta rule."""
    script = (
        "import sys; sys.modules['fla'] = None\n"
        "import torch\n"
        "from linear_attention_transformer.ops import causal_linear_attention\n"
        "from linear_attention_transformer.ops.causal import fla\n"
        "from linear_attention_transformer.ops.delta import chunk_delta_rule\n"
        "fla._interpreted = lambda: True  # as if Triton's interpreter were on, whether or not triton is installed\n"
        "q = k = v = torch.rand(1, 1, 5, 2)\n"
        "beta = torch.rand(1, 1, 5)\n"
        "assert causal_linear_attention(q, k, v).shape == (1, 1, 5, 2)\n"
        "assert chunk_delta_rule(q, k, v, beta).shape == (1, 1, 5, 2)\n"
        "for call in (lambda: causal_linear_attention(q, k, v, kernel='fla'),\n"
        "             lambda: chunk_delta_rule(q, k, v, beta, kernel='fla')):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as e:\n"
        "        print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("kernel='fla' cannot run this call: fla-core is not installed; pip install") == 2


# ------------------------------------------------------------------ fla's real kernels, interpreted


def interpreter_cases():
    """Small float32 cases for the interpreted kernels (each costs seconds there): lengths
    that are and are not a multiple of fla's chunk of 64. The tolerance is float32's rounding
    with a margin; at logits x1000 that of logits of that size (measured 2026-11-25: the fla
    form 3.3e-5 output / 5.3e-5 gradients, the sequential form 1.5e-5 / 3.1e-5 on the same case)."""
    cases = []
    for name, n, exp_features, scale, decay, masked, packed, split, blindspot_size, d, e in [
        ("features, per-head decay, mask, segments", 100, False, 1.0, "head", True, True, None, 1, 16, 16),
        ("features, per-feature decay", 64, False, 1.0, "feature", False, False, None, 1, 16, 16),
        ("logits x1000, per-feature decay, mask, segments", 100, True, 1000.0, "feature", True, True, None, 1, 16, 16),
        ("logits x1, no decay, state in and out", 100, True, 1.0, None, True, False, 64, 1, 16, 16),
        ("logits x1, per-head decay, blindspot 16, mask, segments", 100, True, 1.0, "head", True, True, None, 16, 16, 16),
        # a layer's dim_qk (16) beside its dim_head (32): keys narrower than the values
        ("features, keys 16 values 32, per-feature decay, mask", 100, False, 1.0, "feature", True, False, None, 1, 16, 32),
    ]:
        q, k, v, log_decay = (t if t is None else t.detach().float()
                              for t in inputs(1, 2, n, d, e, n, exp_features, scale, "elu", decay, torch.float32))
        mask, segments = mask_and_segments(1, n, n, masked, packed)
        weight = torch.randn(1, 2, n, e, generator=torch.Generator().manual_seed(5))
        cases.append(dict(name=name, q=q, k=k, v=v, log_decay=log_decay, mask=mask, segments=segments,
                          exp_features=exp_features, split=split, weight=weight, blindspot_size=blindspot_size,
                          rtol=1e-5 if scale == 1 else 3e-4))
    return cases


# a small LM with every option the fla kernel meets inside a model: a blindspot, gates, local
# heads beside the global ones, token shift (``fla_interpreted.py`` runs it in the fla kernel)
LM = dict(num_tokens=50, dim=32, heads=4, depth=1, max_seq_len=100, causal=True, dim_head=8, blindspot_size=8,
          n_local_attn_heads=2, local_attn_window_size=16, use_gate=True, shift_tokens=True)
# and one whose global heads take the delta rule, gated, beside local heads, with the local convolution
DELTA_LM = dict(num_tokens=50, dim=32, heads=4, depth=1, max_seq_len=100, causal=True, dim_head=8, update_rule="delta",
                n_local_attn_heads=2, local_attn_window_size=16, use_gate=True, use_local_conv=True)
LMS = {"additive": LM, "delta": DELTA_LM}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """(cases, results, lms, compiled): the cases (the delta rule's after the others), and the
    training steps of the LMs (``LMS``, by name, and their ``tokens``), run by
    ``fla_interpreted.py`` on fla's Triton kernels; ``compiled``: some cases again, inside
    torch.compile."""
    folder = tmp_path_factory.mktemp("fla")
    cases = interpreter_cases() + delta_interpreter_cases()
    tokens = torch.randint(0, LM["num_tokens"], (2, 71), generator=torch.Generator().manual_seed(3))
    torch.save((cases, dict(configs=LMS, tokens=tokens)), folder / "cases.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("fla_interpreted.py")),
                             str(folder / "cases.pt"), str(folder / "results.pt")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    results, lms, compiled = torch.load(folder / "results.pt")
    return cases, results, dict(lms, tokens=tokens), compiled


@pytest.mark.parametrize("index", range(6), ids=[c["name"] for c in interpreter_cases()])
@pytest.mark.requires("fla", "triton")
def test_flas_kernels_interpreted_equal_the_naive_form(interpreted, index):
    """fla's Triton kernels (float32, in Triton's interpreter) against the float64 judge of the
    same float32 inputs: output, gradients, and with a state the continuation from it."""
    cases, results, *_ = interpreted
    case, result = cases[index], results[index]
    leaves = [None if case[name] is None else case[name].double().requires_grad_()
              for name in ("q", "k", "v", "log_decay")]
    judge = naive_causal_linear_attention(*leaves, mask=case["mask"], exp_features=case["exp_features"],
                                          segments=case["segments"], blindspot_size=case["blindspot_size"])
    assert_close(result["out"], judge, case["rtol"], "output")
    wanted = torch.autograd.grad((judge * case["weight"].double()).sum(), [t for t in leaves if t is not None])
    for name, got, want in zip("q k v log_decay".split(), result["grads"], wanted):
        assert_close(got, want, case["rtol"], f"grad {name}")


@pytest.mark.requires("fla", "triton")
@pytest.mark.parametrize("index", [0, 2], ids=[interpreter_cases()[i]["name"] for i in (0, 2)])
def test_the_fla_form_inside_torch_compile(interpreted, index):
    """Inside torch.compile the fla kernel runs fla's kernels (between graphs: their entry points
    are torch.compiler.disable'd), forward and backward, with the eager results."""
    cases, results, _, compiled = interpreted
    result = compiled[index]
    assert len(result["calls"]) >= 1 and set(result["calls"]) <= {"chunk_gla", "chunk_simple_gla"}
    torch.testing.assert_close(result["out"], results[index]["out"], rtol=1e-6, atol=1e-6)
    for got, want in zip(result["grads"], results[index]["grads"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.requires("fla", "triton")
@pytest.mark.parametrize("rule", list(LMS))
def test_an_lm_in_the_fla_form_interpreted_equals_its_float64_self(interpreted, rule):
    """The LM's logits and parameter gradients with its global heads on fla's Triton kernels
    (float32, interpreted) equal the same LM in float64 in the CPU's form; so do the logits
    computed piece by piece from the cache (the prefill's state, and each piece's after it).
    Additive heads, and delta-rule heads (``chunk_gated_delta_rule``)."""
    from linear_attention_transformer import LinearAttentionTransformerLM

    lm = interpreted[2][rule]
    model = LinearAttentionTransformerLM(**LMS[rule]).double()
    model.load_state_dict(lm["state"])
    tokens = interpreted[2]["tokens"]
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert_close(lm["logits"], logits.detach(), 1e-5, "logits")
    assert_close(lm["cached"], logits.detach(), 1e-5, "logits from the cache")
    for name, parameter in model.named_parameters():
        assert_close(lm["grads"][name], parameter.grad, 1e-5, f"grad {name}")


# ------------------------------------------------------------------ the layer's kernel option

chunk_module = importlib.import_module("linear_attention_transformer.ops.causal.chunk")


def test_kernel_torch_never_asks_for_fla(monkeypatch):
    """kernel='torch' keeps today's forms even where 'auto' would take fla."""
    monkeypatch.setattr(forms, "fla_missing", lambda *args, **kwargs: None)  # fla could run anywhere
    cuda = torch.device("cuda")
    assert forms.pick_form(cuda, kernel="torch", exp_features=True).scan == "log_depth"
    assert forms.pick_form(torch.device("cpu"), kernel="torch").scan == "loop"


def test_the_layers_kernel_option_reaches_the_kernel(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2, 20, 16)  # (float32: fla's kernels refuse float64 first)
    layers = {kernel: Attention(16, heads=2, causal=True, kernel=kernel) for kernel in ("auto", "torch", "fla")}
    for layer in layers.values():
        layer.load_state_dict(layers["auto"].state_dict())
    assert torch.equal(layers["torch"](x), layers["auto"](x))
    # without the interpreter, the CPU cannot run fla: the forced kernel says why
    with pytest.raises(ValueError, match="kernel='fla' cannot run this call: on the CPU"):
        layers["fla"](x)
    # where fla can run, the layer's call goes to the fla kernel (here its adapter, spied on)
    calls = []
    monkeypatch.setattr(forms, "fla_missing", lambda *args, **kwargs: None)
    monkeypatch.setattr(chunk_module, "fla_causal_linear_attention",
                        lambda q, *args, **kwargs: calls.append(q.shape) or torch.zeros_like(q))
    assert torch.equal(layers["fla"](x), layers["fla"]._combine([torch.zeros(2, 2, 20, 8)], x))
    assert calls == [(2, 2, 20, 8)]


@pytest.mark.parametrize("options, named", [
    (dict(causal=True, kernel="triton"), "kernel must be one of 'auto', 'torch', 'fla'"),
    (dict(causal=False, kernel="fla"), "kernel applies to causal self-attention"),
    (dict(receives_context=True, kernel="fla"), "kernel applies to causal self-attention"),
    (dict(causal=True, n_local_attn_heads=2, kernel="fla"), "every head of this layer is local"),
])
def test_a_kernel_the_layer_cannot_use_is_refused(options, named):
    with pytest.raises(ValueError, match=named):
        Attention(16, heads=2, **options)


@pytest.mark.parametrize("options", [dict(), dict(receives_context=True), dict(n_local_attn_heads=2)], ids=str)
def test_kernel_torch_fits_every_layer(options):
    """'torch' asks for no fused kernel: every layer can honour it (its local heads, if any,
    then keep the blocked form: test_windowed_flex)."""
    torch.manual_seed(0)
    layers = [Attention(16, heads=2, kernel=kernel, **options) for kernel in ("auto", "torch")]
    layers[1].load_state_dict(layers[0].state_dict())
    x, context = torch.randn(2, 9, 16), torch.randn(2, 5, 16)
    inputs = dict(context=context) if options.get("receives_context") else {}
    assert torch.equal(layers[0](x, **inputs), layers[1](x, **inputs))


# ------------------------------------------------------------------ the delta rule on fla (ops/delta/fla.py)

delta_chunk = importlib.import_module("linear_attention_transformer.ops.delta.chunk")
FLOAT = torch.float32


def gated_delta_recurrence(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's ``chunk_gated_delta_rule`` contract, one token at a time: per head the state decays,
    S = exp(g_t) S, then moves towards v_t under k_t, S = S + k_t (b_t (v_t - Sᵀ k_t))ᵀ, and
    o_t = scale Sᵀ q_t; [B, T, H, ·] tensors, [N, H, K, V] states, one per sequence, each from 0
    (or its initial state) at its start in ``cu_seqlens`` (then B is 1). Returns (o, final
    states or None)."""
    assert not use_qk_l2norm_in_kernel  # (the adapter hands over normalised q and k)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    outs, finals = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype), []
    for row in range(B):
        for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            S = q.new_zeros(H, K, v.shape[-1]) if initial_state is None else initial_state[row + index]
            for t in range(start, end):
                S = S * g[row, t].exp()[:, None, None]
                written = beta[row, t][:, None] * (v[row, t] - torch.einsum("hk,hkv->hv", k[row, t], S))
                S = S + k[row, t][:, :, None] * written[:, None, :]
                outs[row, t] = scale * torch.einsum("hk,hkv->hv", q[row, t], S)
            finals.append(S)
    return outs, torch.stack(finals) if output_final_state else None


@pytest.fixture
def delta_recurrence(monkeypatch):
    """fla's delta-rule kernel replaced by ``gated_delta_recurrence``, CPU counted as
    interpreted; returns the options of each call."""
    calls = []

    def kernel(*args, **options):
        calls.append(options)
        return gated_delta_recurrence(*args, **options)

    monkeypatch.setattr(delta_fla, "_kernel", lambda: kernel)
    monkeypatch.setattr(delta_fla, "_import_error", lambda: None)
    monkeypatch.setattr(fla_form, "_interpreted", lambda: True)
    monkeypatch.setattr(fla_form, "KERNEL_DTYPES", (torch.float32, torch.float64))  # (the stand-in's)
    return calls


def delta_inputs(b, h, n, d, e, seed, gated=True, with_state=False, dtype=DOUBLE):
    """[q, k, v, beta, log_decay, state], the present ones leaves: q and k of unit norm (the
    layer normalises them), beta in (0, 1), a per-head log gate or None, a state or None."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(b, h, n, d, dtype=dtype, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(b, h, n, e, dtype=dtype, generator=gen)
    beta = torch.randn(b, h, n, dtype=dtype, generator=gen).sigmoid()
    log_decay = F.logsigmoid(torch.randn(b, h, n, dtype=dtype, generator=gen) + 2) if gated else None
    state = torch.randn(b, h, d, e, dtype=dtype, generator=gen) if with_state else None
    return [t if t is None else t.requires_grad_() for t in (q, k, v, beta, log_decay, state)]


def delta_mask_and_segments(b, n, seed, masked, packed):
    """``mask_and_segments``, with a segment starting at token 12 of every row when packed."""
    mask, segments = mask_and_segments(b, n, seed, masked, packed)
    return mask, None if segments is None else segments + (torch.arange(n) >= 12)


def delta_grads(out, last, leaves, seed):
    """Gradients of a weighted sum of the output and of the last state."""
    gen = torch.Generator().manual_seed(seed + 2)
    loss = (out * torch.randn(out.shape, dtype=out.dtype, generator=gen)).sum()
    loss = loss + (last * torch.randn(last.shape, dtype=last.dtype, generator=gen)).sum()
    return torch.autograd.grad(loss, [t for t in leaves if t is not None])


DELTA_LEAVES = "q k v beta log_decay state".split()


@pytest.mark.requires("fla", "triton")  # (fla's modules import Triton)
def test_naive_delta_rule_is_flas_own_naive_recurrences():
    """``naive_delta_rule`` (float64) and the stand-in ``gated_delta_recurrence`` equal fla's
    naive recurrences (plain PyTorch, which compute in float32) on the same float32 inputs, from
    a state and to one: ``naive_recurrent_gated_delta_rule`` with a per-head gate, and the
    ungated ``delta_rule_recurrence`` (heads first, queries scaled by K^-0.5)."""
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, beta, log_decay, state = (t.detach() for t in delta_inputs(2, 3, 37, 8, 6, 0, True, True, FLOAT))
    ours = [naive_delta_rule(*(t.double() for t in (q, k, v, beta)), g, state=state.double())
            for g in (log_decay.double(), None)]
    fla_layout = [t.transpose(1, 2) for t in (q, k, v, beta, log_decay)]  # [B, T, H, ...]
    gated = naive_recurrent_gated_delta_rule(*fla_layout, scale=1.0, initial_state=state, output_final_state=True)
    gated = (gated[0].transpose(1, 2), gated[1])
    plain = delta_rule_recurrence(q * 8 ** 0.5, k, v, beta, initial_state=state, output_final_state=True)
    stand_in = [gated_delta_recurrence(*(t.double() for t in fla_layout[:3]), g.double(), fla_layout[3].double(), 1.0,
                                       state.double(), True) for g in (fla_layout[4], torch.zeros_like(fla_layout[4]))]
    stand_in = [(o.transpose(1, 2), last) for o, last in stand_in]
    for what, theirs, mine, standing_in in [("gated", gated, ours[0], stand_in[0]),
                                            ("plain", plain, ours[1], stand_in[1])]:
        for part, a, b, c in zip(("output", "state"), theirs, mine, standing_in):
            assert_close(a, b, 1e-5, f"{what} {part}: fla's naive against ours")
            assert_close(c, b, 1e-12, f"{what} {part}: the stand-in against ours")


@pytest.mark.parametrize("gated", [False, True], ids=["no gate", "gate"])
@pytest.mark.parametrize("masked, packed, with_state",
                         [(False, False, False), (True, False, True), (True, True, False)],
                         ids=["plain", "mask, state in", "mask, segments"])
@pytest.mark.parametrize("d, e", [(4, 3), (3, 8)], ids=["keys wider", "keys narrower"])
def test_delta_adapter_equals_the_naive_delta_rule(delta_recurrence, gated, masked, packed, with_state, d, e):
    """Output, last state and gradients (every input, the state included) equal the float64
    judge without and with a gate, a mask, segments (each row's last state returned), a state;
    fla is called once, with scale 1, no normalisation of its own, and packed sequences exactly
    when there are segments."""
    b, h, n = 2, 2, 23
    leaves = delta_inputs(b, h, n, d, e, 11, gated, with_state)
    mask, segments = delta_mask_and_segments(b, n, 11, masked, packed)
    *tokens, state = leaves
    out, last = chunk_delta_rule(*tokens, mask=mask, state=state, segments=segments, return_state=True, kernel="fla")
    judge, judge_last = naive_delta_rule(*tokens, mask=mask, state=state, segments=segments)
    assert_close(out, judge, 1e-10, "output")
    assert_close(last, judge_last, 1e-10, "state")
    wanted = delta_grads(judge, judge_last, leaves, 11)
    for name, got, want in zip(DELTA_LEAVES, delta_grads(out, last, leaves, 11), wanted):
        assert_close(got, want, 1e-9, f"grad {name}", GRAD_ATOL)
    [options] = delta_recurrence
    assert options["scale"] == 1.0 and options["use_qk_l2norm_in_kernel"] is False
    assert (options["cu_seqlens"] is not None) == packed


def test_delta_adapter_state_is_the_torch_kernels(delta_recurrence):
    """A prefix's state from fla equals the torch kernel's, and either kernel continues from the
    other's state to the judge's output."""
    leaves = [t.detach() for t in delta_inputs(2, 2, 30, 4, 3, 5, True) if t is not None]
    mask, _ = delta_mask_and_segments(2, 30, 5, True, False)
    judge = naive_delta_rule(*leaves, mask=mask)[0]
    head = [t[:, :, :11] for t in leaves]
    tail = [t[:, :, 11:] for t in leaves]
    _, state_fla = chunk_delta_rule(*head, mask=mask[:, :11], return_state=True, kernel="fla")
    _, state_torch = chunk_delta_rule(*head, mask=mask[:, :11], return_state=True, kernel="torch")
    assert_close(state_fla, state_torch.double(), 1e-10, "state")
    for kernel, state in (("torch", state_fla), ("fla", state_torch)):
        out = chunk_delta_rule(*tail, mask=mask[:, 11:], state=state, kernel=kernel)
        assert_close(out, judge[:, :, 11:], 1e-10, f"{kernel} from the other kernel's state")


def test_the_delta_adapter_leaves_its_inputs_alone(delta_recurrence):
    leaves = [t.detach() for t in delta_inputs(2, 2, 20, 4, 3, 1, True, True)]
    mask, _ = delta_mask_and_segments(2, 20, 1, True, False)
    before = [t.clone() for t in (*leaves, mask)]
    chunk_delta_rule(*leaves[:5], mask=mask, state=leaves[5], return_state=True, kernel="fla")
    assert all(torch.equal(a, b) for a, b in zip(before, (*leaves, mask)))


def test_the_delta_adapter_computes_half_inputs_in_float32(delta_recurrence, monkeypatch):
    """bfloat16 inputs reach fla in float32 (the compute dtype of every form here); the output
    comes back in bfloat16, the state in float32."""
    q, k, v, beta, log_decay, _ = (t if t is None else t.detach().to(torch.bfloat16)
                                   for t in delta_inputs(1, 2, 9, 4, 3, 2, True))
    seen = []
    kernel = delta_fla._kernel()
    monkeypatch.setattr(delta_fla, "_kernel", lambda: lambda *args, **options: seen.append({t.dtype for t in args})
                        or kernel(*args, **options))
    out, last = chunk_delta_rule(q, k, v, beta, log_decay, return_state=True, kernel="fla")
    assert seen == [{torch.float32}] and out.dtype == torch.bfloat16 and last.dtype == torch.float32


def test_delta_auto_on_the_cpu_never_asks_for_fla(monkeypatch):
    """On the CPU 'auto' neither imports fla nor checks for it, CUDA present or not: the torch
    kernel runs."""
    def asked(*args, **kwargs):
        raise AssertionError("fla asked for by the CPU's 'auto'")

    monkeypatch.setattr(delta_chunk, "fla_missing", asked)
    monkeypatch.setattr(delta_fla, "_kernel", asked)
    leaves = delta_inputs(1, 2, 9, 4, 3, 0, dtype=FLOAT)[:5]
    expected = chunk_delta_rule(*leaves, kernel="torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch.equal(chunk_delta_rule(*leaves), expected)


@pytest.mark.parametrize("device, dtype, d, interpreted, import_error, reason", [
    (CPU, FLOAT, 16, False, None, "on the CPU .*TRITON_INTERPRET=1"),
    (CUDA, DOUBLE, 16, True, None, "float32 .*not in torch.float64"),
    (CUDA, FLOAT, 300, True, None, "keys of at most 256 features, not 300"),
    (torch.device("meta"), FLOAT, 16, True, None, "run on CUDA, not on meta"),
    (CUDA, FLOAT, 16, True, "fla-core does not import (ImportError)", r"does not import \(ImportError\)"),
])
def test_forcing_fla_for_the_delta_rule_where_it_cannot_run_names_why(monkeypatch, device, dtype, d, interpreted,
                                                                      import_error, reason):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fla_form, "_interpreted", lambda: interpreted)
    monkeypatch.setattr(delta_fla, "_import_error", lambda: import_error)
    with pytest.raises(ValueError, match=f"kernel='fla' cannot run this call: .*{reason}"):
        delta_chunk._runs_on_fla(device, "fla", dtype, False, d)


@pytest.mark.parametrize("dtype, reason", [(FLOAT, "on the CPU"), (DOUBLE, "fla's kernels compute in float32")])
def test_forcing_fla_for_the_delta_rule_on_the_cpu_is_refused_by_the_call(dtype, reason):
    leaves = delta_inputs(1, 1, 8, 4, 3, 0, dtype=dtype)[:5]
    with pytest.raises(ValueError, match=f"kernel='fla' cannot run this call: {reason}"):
        chunk_delta_rule(*leaves, kernel="fla")


def test_delta_auto_on_cuda_takes_fla_where_it_serves(monkeypatch, recwarn):
    """With fla importable 'auto' on CUDA takes fla; float64 and wide keys (the caller's choice)
    keep the torch kernel without a word; a call that needs gradients on a known-bad pair of
    Hopper and Triton keeps it and says why once (forced: a ValueError), one without takes fla;
    fla that does not import is said once too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fla_form, "_WARNED", set())
    monkeypatch.setattr(delta_fla, "_import_error", lambda: None)
    monkeypatch.setattr(fla_form, "_environment", lambda index: ("3.8.0", 9, False))
    runs = functools.partial(delta_chunk._runs_on_fla, CUDA)
    assert runs("auto", FLOAT, True, 64) and runs("fla", FLOAT, True, 64)
    assert not runs("auto", DOUBLE, False, 64) and not runs("auto", FLOAT, False, 512)
    assert not runs("torch", FLOAT, False, 64)
    assert not recwarn.list
    monkeypatch.setattr(fla_form, "_environment", lambda index: ("3.6.0", 9, False))
    assert runs("auto", FLOAT, False, 64)
    for _ in range(2):
        assert not runs("auto", FLOAT, True, 64)
    assert len(recwarn.list) == 1
    assert "chunk_gated_delta_rule on Hopper with Triton 3.6.0" in str(recwarn.list[0].message)
    with pytest.raises(ValueError, match="kernel='fla' cannot run this call: fla-core refuses the gated backward"):
        runs("fla", FLOAT, True, 64)
    monkeypatch.setattr(delta_fla, "_import_error", lambda: "fla-core does not import (ImportError: x)")
    assert not runs("auto", FLOAT, False, 64)
    assert len(recwarn.list) == 2 and "does not import (ImportError: x)" in str(recwarn.list[1].message)


def test_the_delta_rules_backward_is_named_by_the_call(monkeypatch):
    """``chunk_delta_rule`` asks fla for a backward exactly where a gradient is needed: an input
    (the state included) that requires one, outside ``no_grad``."""
    asked = []
    monkeypatch.setattr(delta_chunk, "fla_missing", lambda device, dtype, backward, d: asked.append(backward) or "no")
    leaves = delta_inputs(1, 1, 8, 4, 3, 0, True, True, FLOAT)
    fixed = [t.detach() for t in leaves]
    for some in (leaves, fixed, fixed[:5] + leaves[5:]):  # (kernel='fla': the CPU asks too)
        with pytest.raises(ValueError):
            chunk_delta_rule(*some[:5], state=some[5], kernel="fla")
    with torch.no_grad(), pytest.raises(ValueError):
        chunk_delta_rule(*leaves[:5], state=leaves[5], kernel="fla")
    assert asked == [True, False, True, False]


@pytest.mark.parametrize("name, value, named", [
    ("k", torch.zeros(1, 2, 9, 5), "k must have shape (1, 2, 9, 4)"),
    ("beta", torch.zeros(1, 2, 9, 1), "beta must have shape (1, 2, 9)"),
    ("log_decay", torch.zeros(1, 2, 9, 4), "log_decay must have shape (1, 2, 9)"),
    ("state", torch.zeros(1, 2, 3, 4), "state must have shape (1, 2, 4, 3)"),
])
def test_the_delta_rule_names_an_argument_of_the_wrong_shape(name, value, named):
    """Before either kernel: fla's own checks are assertions that name no argument."""
    leaves = dict(zip(DELTA_LEAVES, delta_inputs(1, 2, 9, 4, 3, 0, True, True, FLOAT)), **{name: value})
    with pytest.raises(ValueError, match=re.escape(named)):
        chunk_delta_rule(*(leaves[n] for n in DELTA_LEAVES[:5]), state=leaves["state"])


def delta_interpreter_cases():
    """Small float32 cases of the delta rule for the interpreted kernels: without and with a
    gate, a mask, segments, a state in, out and between two calls; lengths that are and are
    not a multiple of fla's chunk of 64. The tolerance is float32's rounding with a margin."""
    cases = []
    for name, b, n, d, e, gated, masked, packed, with_state, split in [
        ("delta, no gate, mask, segments", 2, 70, 16, 16, False, True, True, False, None),
        ("delta, gate, mask, segments, keys 32 values 16", 1, 70, 32, 16, True, True, True, False, None),
        ("delta, gate, mask, state in, out and between two calls, keys 16 values 32", 1, 70, 16, 32, True, True, False,
         True, 40),
        ("delta, no gate, state in and out", 1, 64, 16, 16, False, False, False, True, None),
    ]:
        leaves = [t if t is None else t.detach() for t in delta_inputs(b, 2, n, d, e, n + d, gated, with_state, FLOAT)]
        mask, segments = delta_mask_and_segments(b, n, n, masked, packed)
        gen = torch.Generator().manual_seed(5)
        cases.append(dict(zip(DELTA_LEAVES, leaves), op="delta", name=name, mask=mask, segments=segments, split=split,
                          weight=torch.randn(b, 2, n, e, generator=gen),
                          state_weight=torch.randn(b, 2, d, e, generator=gen), rtol=1e-5))
    return cases


@pytest.mark.parametrize("name", [case["name"] for case in delta_interpreter_cases()])
@pytest.mark.requires("fla", "triton")
def test_flas_delta_kernels_interpreted_equal_the_naive_delta_rule(interpreted, name):
    """fla's delta-rule Triton kernels through ``chunk_delta_rule(kernel='fla')`` (float32, in
    Triton's interpreter) against the float64 judge of the same float32 inputs: output, last
    state, and the gradients of both with respect to every input (the state included); the
    inputs are left as they were."""
    cases, results, *_ = interpreted
    index = [case["name"] for case in cases].index(name)
    case, result = cases[index], results[index]
    assert result["inputs_unchanged"]
    leaves = [None if case[n] is None else case[n].double().requires_grad_() for n in DELTA_LEAVES]
    *tokens, state = leaves
    judge, judge_last = naive_delta_rule(*tokens, mask=case["mask"], state=state, segments=case["segments"])
    assert_close(result["out"], judge, case["rtol"], "output")
    assert_close(result["state"], judge_last, case["rtol"], "state")
    loss = (judge * case["weight"].double()).sum() + (judge_last * case["state_weight"].double()).sum()
    wanted = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    present = [n for n in DELTA_LEAVES if case[n] is not None]
    assert len(result["grads"]) == len(present)
    for n, got, want in zip(present, result["grads"], wanted):
        assert_close(got, want, case["rtol"], f"grad {n}")
