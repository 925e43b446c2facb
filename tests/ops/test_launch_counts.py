"""Launches and host syncs, counted with a dispatch mode: the parallel form of the causal
kernel (what a GPU runs) makes a number of ops that does not grow with the length beyond
log n, and never reads a value back to the host, forward or backward.

The LM steps at n = 4096 and 65536 run on fake tensors (``FakeTensorMode``: shapes without
data, so the count takes a second); a test checks that fake and real tensors dispatch the
same ops. Views are not counted (they launch nothing)."""

import collections
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from linear_attention_transformer import LinearAttentionTransformerLM
from linear_attention_transformer.ops import causal_linear_attention, naive_causal_linear_attention

KERNEL = importlib.import_module("linear_attention_transformer.ops.causal.chunk")
FORMS = importlib.import_module("linear_attention_transformer.ops.causal.forms")

# ops that read a value back to the host, or size their output by one (the same wait)
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero", "aten::equal",
            "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
            "aten::bincount", "aten::repeat_interleave", "aten::_assert_async"}
BOOL_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _bool_index(args):
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(torch.is_tensor(t) and t.dtype == torch.bool for t in indices)


class OpCount(TorchDispatchMode):
    """Non-view aten ops by name, and the host syncs among them."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and not func.is_view:
            name = func.name()
            self.ops[name] += 1
            base = name.split(".")[0]
            if base in SYNC_OPS or (base in BOOL_INDEXING and _bool_index(args)):
                self.syncs.append(name)
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.ops.values())


CONFIGS = {
    "exact global heads (default map)": {},
    "use_gate": dict(use_gate=True),
    "local heads + blindspot + gate + conv + shift": dict(n_local_attn_heads=2, local_attn_window_size=128,
                                                          blindspot_size=64, use_gate=True, use_local_conv=True,
                                                          shift_tokens=True),
}


def lm_step_count(cfg, n, fake=True):
    """Ops and syncs of one training step (forward, loss, backward) of a 1-layer LM, dim 128, 4 heads."""
    mode = FakeTensorMode() if fake else None
    if mode is not None:
        mode.__enter__()
    try:
        torch.manual_seed(0)
        model = LinearAttentionTransformerLM(num_tokens=256, dim=128, depth=1, heads=4, max_seq_len=n, causal=True,
                                             **cfg)
        x = torch.randint(0, 256, (1, n + 1))
        with OpCount() as count:
            logits = model(x[:, :-1])
            F.cross_entropy(logits.transpose(1, 2), x[:, 1:]).backward()
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    return count


@pytest.fixture
def parallel():
    with FORMS.use_form("parallel"):
        yield


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lm_step_ops_do_not_grow_with_length_and_make_no_sync(name, parallel):
    """n = 4096 -> 65536 (16x): at most 1.25x the ops (the scan's log n levels), no sync."""
    short, long = (lm_step_count(CONFIGS[name], n) for n in (4096, 65536))
    assert short.syncs == [] and long.syncs == []
    assert long.total <= 1.25 * short.total, (short.total, long.total)
    assert short.total > 100  # something was counted


def test_fake_and_real_tensors_dispatch_the_same_ops(parallel):
    """The counts above are on fake tensors: on real ones the same ops run (n = 512)."""
    cfg = CONFIGS["use_gate"]
    real, fake = lm_step_count(cfg, 512, fake=False), lm_step_count(cfg, 512, fake=True)
    assert real.ops == fake.ops


def test_the_counter_sees_the_sequential_forms_sync_and_growth():
    """Not vacuous: the CPU's form (a loop over chunks; the inputs' finiteness and the
    lost-chunk check read back) shows two syncs per layer and ops growing with n past the
    bound above at only 8x the length."""
    with FORMS.use_form("sequential"):
        short, long = (lm_step_count({}, n, fake=False) for n in (256, 2048))
    assert short.syncs == ["aten::_local_scalar_dense", "aten::nonzero"]
    assert long.total > 1.25 * short.total


def kernel_inputs(b, h, n, d, e, decay, seed, scale):
    g = torch.Generator().manual_seed(seed)
    q, k = (scale * torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=g, dtype=torch.float64)
    log_decay = None
    if decay is not None:
        shape = (b, h, n) if decay == "head" else (b, h, n, d)
        log_decay = -2.0 * torch.rand(*shape, generator=g, dtype=torch.float64)
    return q, k, v, log_decay


@pytest.mark.parametrize("exp_features", [False, True], ids=["features", "exp"])
@pytest.mark.parametrize("decay", [None, "head", "feature"])
@pytest.mark.parametrize("blindspot", [1, 4])
@pytest.mark.parametrize("continued", [False, True])
def test_kernel_makes_no_sync_forward_or_backward(exp_features, decay, blindspot, continued, parallel):
    """Every configuration without segments: masks, both decay granularities, blindspot,
    a state carried in and returned; forward and backward."""
    b, h, n, d, e = 2, 2, 37, 4, 3
    q, k, v, log_decay = kernel_inputs(b, h, n, d, e, decay, seed=blindspot, scale=30.0 if exp_features else 1.0)
    if not exp_features:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    mask = torch.rand(b, n, generator=torch.Generator().manual_seed(3)) < 0.8
    inputs = [t.requires_grad_() for t in (q, k, v, log_decay) if t is not None]
    kw = dict(mask=mask, blindspot_size=blindspot, chunk_size=8, exp_features=exp_features)
    with OpCount() as count:
        if continued:
            split = 12  # with a blindspot, 13: inside a block (the continuation finishes it step by step)
            first = [t[:, :, :split + (blindspot > 1)] for t in (q, k, v)]
            ld = None if log_decay is None else log_decay[:, :, :split + (blindspot > 1)]
            _, state = causal_linear_attention(*first, ld, **{**kw, "mask": mask[:, :split + (blindspot > 1)]},
                                               return_state=True)
            rest = slice(split + (blindspot > 1), n)
            out, _ = causal_linear_attention(*(t[:, :, rest] for t in (q, k, v)),
                                             None if log_decay is None else log_decay[:, :, rest],
                                             **{**kw, "mask": mask[:, rest]}, state=state, return_state=True)
        else:
            out = causal_linear_attention(q, k, v, log_decay, **kw)
        out.sum().backward()
    assert count.syncs == []
    assert all(torch.isfinite(t.grad).all() for t in inputs)


@pytest.mark.parametrize("scale", [1.0, 100.0, 1000.0])
@pytest.mark.parametrize("decay", [None, "head", "feature"])
@pytest.mark.parametrize("n", [32, 37])
def test_parallel_exp_chunks_are_exact_without_any_recompute(scale, decay, n, parallel, monkeypatch):
    """The parallel form's exponential-feature chunks are exact by construction: with the
    recompute disabled (it would raise), float64 equals the explicit matrix at logit
    spreads up to 1000 (where the sequential form's fast chunks lose whole rows), gradients
    included; masks with left padding and an empty row."""
    def never(*args, **kwargs):
        raise AssertionError("the parallel form must not need the recompute")

    monkeypatch.setattr(KERNEL, "_lost_to_underflow", never)
    monkeypatch.setattr(KERNEL, "_recompute_chunks", never)
    b, h, d, e = 2, 2, 4, 3
    q, k, v, log_decay = kernel_inputs(b, h, n, d, e, decay, seed=n + int(scale), scale=scale)
    mask = torch.rand(b, n, generator=torch.Generator().manual_seed(n)) < 0.7
    mask[0, :3] = False
    mask[-1] = False
    w = torch.randn(b, h, n, e, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for fn in (causal_linear_attention, naive_causal_linear_attention):
        inputs = [None if t is None else t.clone().requires_grad_() for t in (q, k, v, log_decay)]
        kw = dict(chunk_size=8) if fn is causal_linear_attention else {}
        out = fn(*inputs, mask=mask, exp_features=True, **kw)
        grads = torch.autograd.grad((out * w).sum(), [t for t in inputs if t is not None])
        results.append((out.detach(), grads))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-9)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("exp_features", [False, True], ids=["features", "exp"])
@pytest.mark.parametrize("decay", [None, "head", "feature"])
@pytest.mark.parametrize("blindspot", [1, 4])
def test_segments_make_no_sync_and_stay_exact(exp_features, decay, blindspot, parallel, monkeypatch):
    """Packed sequences too: no sync forward or backward, and with the recompute disabled the
    exponential-feature chunks equal the explicit matrix in float64 at a spread of 100 (an
    earlier segment's keys in the same chunk e^2000 times a later one's: the running
    maxima restart with each segment; the fast form without its recompute is far off here).
    Segments that start inside chunks and sub-chunks, on their boundaries, and one token long."""
    def never(*args, **kwargs):
        raise AssertionError("the parallel form must not need the recompute")

    monkeypatch.setattr(KERNEL, "_lost_to_underflow", never)
    monkeypatch.setattr(KERNEL, "_recompute_chunks", never)
    b, h, n, d, e = 2, 2, 45, 4, 3
    q, k, v, log_decay = kernel_inputs(b, h, n, d, e, decay, seed=7, scale=100.0 if exp_features else 1.0)
    if not exp_features:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    else:
        k[:, :, :10] += 2000.0  # the first segment's keys dwarf the next one's inside chunk 0
    segments = torch.tensor([[0] * 10 + [1] * 6 + [2] * 1 + [3] * 15 + [4] * 13,
                             [5] * 3 + [6] * 21 + [7] * 21])
    mask = torch.rand(b, n, generator=torch.Generator().manual_seed(2)) < 0.85
    w = torch.randn(b, h, n, e, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for fn in (causal_linear_attention, naive_causal_linear_attention):
        inputs = [None if t is None else t.clone().requires_grad_() for t in (q, k, v, log_decay)]
        kw = dict(chunk_size=16) if fn is causal_linear_attention else {}
        with OpCount() as count:
            out = fn(*inputs, mask=mask, blindspot_size=blindspot, exp_features=exp_features, segments=segments,
                     **kw)
            grads = torch.autograd.grad((out * w).sum(), [t for t in inputs if t is not None])
        if fn is causal_linear_attention:
            assert count.syncs == []
        results.append((out.detach(), grads))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-9)
    if exp_features and blindspot == 1:  # not vacuous: these inputs defeat the fast form
        monkeypatch.setattr(KERNEL, "_lost_to_underflow", lambda den, *args: torch.zeros_like(den[..., 0], dtype=bool))
        monkeypatch.setattr(KERNEL, "_recompute_chunks", lambda out, *args: out)
        fast = causal_linear_attention(q, k, v, log_decay, mask=mask, exp_features=True, segments=segments,
                                       chunk_size=16, form="sequential")
        assert (fast - ref).abs().max() > 0.1


CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")


@pytest.fixture
def without_fla(monkeypatch):
    """The table's rows for a machine without fla (on a GPU with fla installed, 'auto' on
    CUDA is the fla kernel: tests/ops/test_fla.py checks that row)."""
    monkeypatch.setattr(FORMS, "fla_missing", lambda *args, **kwargs: "fla is not installed")


@pytest.mark.parametrize("device, compiling, kernel, form, expected", [
    (CPU, False, "auto", None, ("loop", False, 64)),
    (CUDA, False, "auto", None, ("log_depth", True, 16)),
    (META, False, "auto", None, ("log_depth", True, 16)),
    (CPU, False, "auto", "parallel", ("log_depth", True, 16)),
    (CUDA, False, "auto", "sequential", ("loop", False, 64)),
    (CPU, False, "auto", "compiled", ("blocked", False, 64)),
    (CPU, True, "auto", None, ("blocked", False, 64)),
    (CUDA, True, "auto", None, ("blocked", True, 16)),
    (CUDA, True, "auto", "sequential", ("blocked", False, 64)),
    (CPU, False, "torch", None, ("loop", False, 64)),
    (CUDA, False, "torch", None, ("log_depth", True, 16)),
    (CUDA, False, "torch", "sequential", ("loop", False, 64)),
])
def test_pick_form_follows_its_table(device, compiling, kernel, form, expected, without_fla):
    """The rows of forms.py's table, for exponential features without a blindspot."""
    assert tuple(FORMS.pick_form(device, compiling, kernel, form, exp_features=True)) == expected


def test_pick_form_options_decide_exact_chunks_and_the_chunk(without_fla):
    """Exact chunks only for exponential features outside the blindspot form; chunks of 16
    for them and for a per-feature decay of given features; the blindspot block otherwise."""
    assert FORMS.pick_form(CUDA, exp_features=False) == ("log_depth", False, 64)
    assert FORMS.pick_form(CUDA, exp_features=True, blindspot_size=4) == ("log_depth", False, 4)
    assert FORMS.pick_form(CPU, exp_features=False, per_feature_decay=True) == ("loop", False, 16)
    assert FORMS.pick_form(CPU, exp_features=True, per_feature_decay=True) == ("loop", False, 64)
    assert FORMS.pick_form(CUDA, exp_features=True, chunk_size=8) == ("log_depth", True, 8)


def test_a_bad_form_is_refused_naming_the_choices():
    q = k = v = torch.rand(1, 1, 4, 2)
    for bad in ("fast", "Parallel", "auto", "fla", 0):
        with pytest.raises(ValueError, match=r"form must be None or one of 'sequential', 'parallel', 'compiled', got"):
            FORMS.pick_form(CPU, form=bad)
        with pytest.raises(ValueError, match="form must be None or one of"):
            with FORMS.use_form(bad):
                pass
    with pytest.raises(ValueError, match="form must be None or one of"):
        causal_linear_attention(q, k, v, form="fast")
    for bad in ("sequential", "Auto", None):
        with pytest.raises(ValueError, match=r"kernel must be one of 'auto', 'torch', 'fla', got"):
            causal_linear_attention(q, k, v, kernel=bad)


@pytest.mark.parametrize("scan, form", [("blocked", "compiled"), ("loop", "sequential"), ("log_depth", "parallel")])
def test_a_scan_named_as_a_form_is_refused_naming_the_form_that_runs_it(scan, form):
    with pytest.raises(ValueError, match=rf"got {scan!r}: {scan!r} is a scan, which form={form!r} runs"):
        causal_linear_attention(*(torch.rand(1, 1, 4, 2) for _ in range(3)), form=scan)
    with pytest.raises(ValueError, match=rf"which form={form!r} runs"):
        with FORMS.use_form(scan):
            pass
    assert FORMS.FORMS[form].scan == scan


def test_use_form_is_scoped_and_restored():
    """The scope nests, is restored on exit (an exception's included), and an explicit
    ``form=`` wins over it; outside any scope the device decides (None)."""
    assert FORMS.scoped_form() is None
    with FORMS.use_form("parallel"):
        with pytest.raises(RuntimeError):
            with FORMS.use_form("compiled"):
                assert FORMS.scoped_form() == "compiled"
                raise RuntimeError
        assert FORMS.scoped_form() == "parallel"
    assert FORMS.scoped_form() is None
    # the scope acts (the parallel form makes no sync on these inputs) and form= wins over it
    q, k = (torch.randn(1, 1, 40, 4, generator=torch.Generator().manual_seed(i)) for i in (0, 1))
    v = torch.randn(1, 1, 40, 3)
    read_back = ["aten::_local_scalar_dense", "aten::nonzero"]  # the inputs' finiteness, the lost chunks
    for scope, form, syncs in [("parallel", None, []), ("parallel", "sequential", read_back),
                               ("sequential", None, read_back)]:
        with FORMS.use_form(scope), OpCount() as count:
            causal_linear_attention(q, k, v, exp_features=True, chunk_size=8, form=form)
        assert count.syncs == syncs, (scope, form)
