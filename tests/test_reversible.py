"""ReversibleSequence equals the reversible rule computed with ordinary autograd, stores
no per-block activations, replays dropout, and delivers every gradient exactly once."""

import gc
import weakref

import pytest
import torch
from torch import nn

from linear_attention_transformer.reversible import ReversibleSequence, SequentialSequence

DIM = 6


class Branch(nn.Module):
    """A stand-in for attention / feed-forward: tanh(Linear(x)), optionally attending to
    a ``context`` (through its mean), masked, scaled by an int kwarg, with dropout."""

    def __init__(self, dim=DIM, dropout=0.0, use_context=False):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.ctx_lin = nn.Linear(dim, dim) if use_context else None
        self.drop = nn.Dropout(dropout)

    def forward(self, x, context=None, mask=None, scale=1, unused=None):
        h = torch.tanh(self.lin(x))
        if self.ctx_lin is not None and context is not None:
            h = h + torch.tanh(self.ctx_lin(context)).mean(dim=-2, keepdim=True) * h
        if mask is not None:
            h = h * mask[..., None].to(h.dtype)
        return self.drop(h) * scale


def make_blocks(depth, dtype=torch.float64, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    blocks = [
        (Branch(dropout=dropout, use_context=True), Branch(dropout=dropout, use_context=(i % 2 == 0)))
        for i in range(depth)
    ]
    for f, g in blocks:
        f.to(dtype)
        g.to(dtype)
    return blocks


def explicit_reversible(blocks, x, **kwargs):
    """The reversible rule with ordinary autograd (stores every activation)."""
    x1 = x2 = x
    for f, g in blocks:
        y1 = x1 + f(x2, **kwargs)
        y2 = x2 + g(y1, **kwargs)
        x1, x2 = y1, y2
    return (x1 + x2) / 2


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def inputs(dtype=torch.float64, seed=1, b=2, n=5, m=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, DIM, dtype=dtype, generator=g)
    context = torch.randn(b, m, DIM, dtype=dtype, generator=g)
    mask = torch.rand(b, n, generator=g) > 0.3
    probe = torch.randn(b, n, DIM, dtype=dtype, generator=g)  # d loss / d out
    return x, context, mask, probe


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


# --------------------------------------------------------------------------- sequential


def test_sequential_equals_manual_loop():
    blocks = make_blocks(3)
    seq = SequentialSequence(blocks)
    x, context, mask, _ = inputs()
    expected = x
    for f, g in blocks:
        expected = expected + f(expected, context=context, mask=mask)
        expected = expected + g(expected, context=context, mask=mask)
    out = seq(x, context=context, mask=mask)
    assert torch.equal(out, expected)
    assert isinstance(seq.blocks, nn.ModuleList) and all(isinstance(p, nn.ModuleList) for p in seq.blocks)
    n_params = sum(len(list(f.parameters())) + len(list(g.parameters())) for f, g in blocks)
    assert len(list(seq.parameters())) == n_params
    # it is not the reversible rule
    assert not torch.allclose(out, explicit_reversible(blocks, x, context=context, mask=mask))


# --------------------------------------------------------------------------- forward / backward


@pytest.mark.parametrize("depth", [1, 4])
def test_forward_equals_explicit_rule(depth):
    blocks = make_blocks(depth)
    rev = ReversibleSequence(blocks)
    x, context, mask, _ = inputs()
    x.requires_grad_()
    kwargs = dict(context=context, mask=mask, scale=2, unused=None)
    out = rev(x, **kwargs)
    ref = explicit_reversible(blocks, x, **kwargs)
    assert out.shape == x.shape
    assert rel_err(out, ref) <= 1e-12
    # the recomputing autograd function is what runs when a gradient is needed
    assert any("_ReversibleFunction" in type(fn).__name__ for fn, _ in _walk(out.grad_fn))


def _walk(fn, depth=4):
    """A few levels of the autograd graph below ``fn``."""
    found, frontier = [], [(fn, 0)]
    while frontier:
        node, level = frontier.pop()
        if node is None or level > depth:
            continue
        found.append((node, level))
        frontier.extend((child, level + 1) for child, _ in node.next_functions)
    return found


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("x_grad,context_grad", [(True, True), (True, False), (False, True)])
def test_gradients_equal_explicit(depth, x_grad, context_grad):
    blocks = make_blocks(depth)
    rev = ReversibleSequence(blocks)
    x, context, mask, probe = inputs()
    x.requires_grad_(x_grad)
    context.requires_grad_(context_grad)
    params = list(rev.parameters())
    wrt = [t for t in (x, context) if t.requires_grad] + params
    kwargs = dict(context=context, mask=mask, scale=3, unused=None)

    got = grads_of((rev(x, **kwargs) * probe).sum(), wrt)
    want = grads_of((explicit_reversible(blocks, x, **kwargs) * probe).sum(), wrt)
    for a, b in zip(got, want):
        assert b is not None and a is not None
        assert rel_err(a, b) <= 1e-10


def test_gradients_accumulate_into_dot_grad():
    blocks = make_blocks(2)
    rev = ReversibleSequence(blocks)
    x, context, mask, probe = inputs()
    context.requires_grad_()
    (rev(x, context=context, mask=mask) * probe).sum().backward()
    got = [p.grad.clone() for p in rev.parameters()] + [context.grad.clone()]
    rev.zero_grad()
    context.grad = None
    (explicit_reversible(blocks, x, context=context, mask=mask) * probe).sum().backward()
    want = [p.grad for p in rev.parameters()] + [context.grad]
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-10


def test_float32_close_to_explicit():
    blocks = make_blocks(4, dtype=torch.float32)
    rev = ReversibleSequence(blocks)
    x, context, mask, probe = inputs(dtype=torch.float32)
    x.requires_grad_()
    wrt = [x] + list(rev.parameters())
    out = rev(x, context=context, mask=mask)
    assert out.dtype == torch.float32
    ref = explicit_reversible(blocks, x, context=context, mask=mask)
    assert rel_err(out, ref) <= 1e-6
    for a, b in zip(grads_of((out * probe).sum(), wrt), grads_of((ref * probe).sum(), wrt)):
        assert rel_err(a, b) <= 1e-4


def test_gradcheck_inputs_and_finite_differences_for_parameters():
    torch.manual_seed(0)
    dim = 3

    class Tiny(nn.Module):
        def __init__(self, use_context):
            super().__init__()
            self.lin = nn.Linear(dim, dim).double()
            self.ctx = nn.Linear(dim, dim).double() if use_context else None

        def forward(self, x, context=None):
            h = self.lin(x)
            if self.ctx is not None:
                h = h + self.ctx(context).sum(dim=-2, keepdim=True)
            return torch.tanh(h)

    rev = ReversibleSequence([(Tiny(True), Tiny(False)), (Tiny(False), Tiny(False))])
    x = torch.randn(1, 2, dim, dtype=torch.float64, requires_grad=True)
    context = torch.randn(1, 2, dim, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: rev(a, context=c), (x, context), eps=1e-6, atol=1e-8)

    # parameters: central differences of <out, probe> against the analytic .grad
    probe = torch.randn(1, 2, dim, dtype=torch.float64)
    (rev(x, context=context) * probe).sum().backward()
    eps = 1e-6
    with torch.no_grad():
        for p in rev.parameters():
            flat = p.view(-1)
            numeric = torch.empty_like(flat)
            for i in range(flat.numel()):
                orig = flat[i].item()
                flat[i] = orig + eps
                hi = (rev(x, context=context) * probe).sum()
                flat[i] = orig - eps
                lo = (rev(x, context=context) * probe).sum()
                flat[i] = orig
                numeric[i] = (hi - lo) / (2 * eps)
            assert torch.allclose(p.grad.view(-1), numeric, atol=1e-8, rtol=1e-6)


# --------------------------------------------------------------------------- randomness


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_masks_replay_exactly(device):
    blocks = make_blocks(3, dropout=0.3)
    rev = ReversibleSequence(blocks).train().to(device)
    x, context, mask, probe = (t.to(device) for t in inputs())
    x.requires_grad_()
    context.requires_grad_()
    wrt = [x, context] + list(rev.parameters())
    kwargs = dict(context=context, mask=mask)

    def rng_state():
        return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state(x.device)

    torch.manual_seed(1234)  # seeds the CUDA generators too
    out = rev(x, **kwargs)
    state_after_forward = rng_state()
    got = grads_of((out * probe).sum(), wrt)
    # the backward replays the recorded streams without advancing the caller's one
    assert torch.equal(rng_state(), state_after_forward)

    torch.manual_seed(1234)
    ref = explicit_reversible(blocks, x, **kwargs)
    assert torch.equal(rng_state(), state_after_forward)
    want = grads_of((ref * probe).sum(), wrt)

    assert rel_err(out, ref) <= 1e-12
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-12

    # dropout is really active: another seed gives other masks, eval mode none
    torch.manual_seed(4321)
    assert rel_err(rev(x, **kwargs), ref) > 1e-3
    rev.eval()
    assert rel_err(rev(x, **kwargs), ref) > 1e-3


def test_dropout_replay_with_interleaved_randomness_before_backward():
    """Draws between forward and backward must not change the replayed masks."""
    blocks = make_blocks(2, dropout=0.5)
    rev = ReversibleSequence(blocks).train()
    x, context, mask, probe = inputs()
    params = list(rev.parameters())

    torch.manual_seed(7)
    out = rev(x, context=context, mask=mask)
    torch.rand(1000)  # unrelated randomness
    got = grads_of((out * probe).sum(), params)

    torch.manual_seed(7)
    want = grads_of((explicit_reversible(blocks, x, context=context, mask=mask) * probe).sum(), params)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-12


# --------------------------------------------------------------------------- sharing / DDP


def test_shared_parameters_across_blocks():
    torch.manual_seed(0)
    f, g = Branch(use_context=True).double(), Branch().double()
    other = Branch().double()
    blocks = [(f, g), (other, f), (f, g)]  # f used three times, once as a g
    rev = ReversibleSequence(blocks)
    assert len(list(rev.parameters())) == 4 + 2 + 2  # f: lin + ctx_lin; g, other: lin
    x, context, mask, probe = inputs()
    x.requires_grad_()
    context.requires_grad_()
    wrt = [x, context] + list(rev.parameters())
    kwargs = dict(context=context, mask=mask)
    got = grads_of((rev(x, **kwargs) * probe).sum(), wrt)
    want = grads_of((explicit_reversible(blocks, x, **kwargs) * probe).sum(), wrt)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-10


def test_each_parameter_is_accumulated_exactly_once():
    """What DDP relies on: one gradient accumulation per parameter per backward."""
    torch.manual_seed(0)
    f, g = Branch(use_context=True).double(), Branch().double()
    rev = ReversibleSequence([(f, g), (f, g), (Branch().double(), g)])
    calls = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(id(p), calls.get(id(p), 0) + 1))
        for p in rev.parameters()
    ]
    x, context, mask, probe = inputs()
    (rev(x, context=context, mask=mask) * probe).sum().backward()
    for h in handles:
        h.remove()
    assert sorted(calls.values()) == [1] * len(list(rev.parameters()))
    assert set(calls) == {id(p) for p in rev.parameters()}


def test_ddp_single_process(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo backend unavailable")
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    f, g = Branch(use_context=True).double(), Branch().double()
    blocks = [(f, g), (f, g)]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DDP(ReversibleSequence(blocks))
        x, context, mask, probe = inputs()
        for _ in range(2):  # a second iteration checks the reducer was left in a clean state
            model.zero_grad()
            (model(x, context=context, mask=mask) * probe).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    params = list(model.module.parameters())
    want = grads_of((explicit_reversible(blocks, x, context=context, mask=mask) * probe).sum(), params)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-10


# --------------------------------------------------------------------------- memory


def _count_saved(fn):
    packed = []

    def pack(t):
        packed.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, packed


@pytest.mark.parametrize("with_context", [False, True])
def test_saved_tensors_do_not_grow_with_depth(with_context):
    x, context, mask, probe = inputs()
    x.requires_grad_()
    kwargs = dict(context=context.requires_grad_(), mask=mask) if with_context else {}
    rev_counts, rev_numels, ref_counts = [], [], []
    for depth in (1, 2, 6):
        blocks = make_blocks(depth)
        out, packed = _count_saved(lambda: ReversibleSequence(blocks)(x, **kwargs))
        rev_counts.append(len(packed))
        rev_numels.append(sum(packed))
        _, packed_ref = _count_saved(lambda: explicit_reversible(blocks, x, **kwargs))
        ref_counts.append(len(packed_ref))
        out.sum().backward()  # the saved tensors are enough for the backward
    # the explicit rule keeps activations per block (so the hook does see them) ...
    assert ref_counts[0] < ref_counts[1] < ref_counts[2]
    # ... the reversible one keeps the two final streams (and the kwargs), at any depth
    assert rev_counts[0] == rev_counts[1] == rev_counts[2]
    assert rev_numels[0] == rev_numels[1] == rev_numels[2]
    kw_numel = context.numel() + mask.numel() if with_context else 0
    assert rev_numels[0] == 2 * x.numel() + kw_numel


def test_intermediate_activations_are_freed_after_forward():
    class Recorder(nn.Module):
        def __init__(self, inner, seen):
            super().__init__()
            self.inner, self.seen = inner, seen

        def forward(self, x, **kwargs):
            self.seen.append(weakref.ref(x))
            return self.inner(x, **kwargs)

    depth = 4
    x, _, _, _ = inputs()
    x.requires_grad_()
    for reversible, expect_freed in ((True, True), (False, False)):
        seen = []
        blocks = [(Recorder(f, seen), Recorder(g, seen)) for f, g in make_blocks(depth)]
        if reversible:
            out = ReversibleSequence(blocks)(x)
        else:
            out = explicit_reversible(blocks, x)
        gc.collect()
        # seen: f0(x), g0(y1_0), f1(y2_0), g1(y1_1), ... ; skip x itself and the last g's
        # input (the final y1, whose data the backward keeps)
        inner = seen[1:-1]
        alive = [r() is not None for r in inner]
        assert len(inner) == 2 * depth - 2
        if expect_freed:
            assert not any(alive)
        else:
            assert all(alive)
        del out


# --------------------------------------------------------------------------- modes


def test_autocast_state_is_recorded_and_restored():
    class Probe(nn.Module):
        def __init__(self, log):
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)
            self.log = log

        def forward(self, x, **kwargs):
            h = self.lin(x)
            self.log.append((torch.is_autocast_enabled("cpu"), h.dtype))
            return torch.tanh(h).to(x.dtype)

    torch.manual_seed(0)
    log = []
    blocks = [(Probe(log), Probe(log)) for _ in range(2)]
    rev = ReversibleSequence(blocks)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    probe = torch.randn(2, 5, DIM)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rev(x)
    assert all(entry == (True, torch.bfloat16) for entry in log)
    log.clear()
    grads = grads_of((out * probe).sum(), [x] + list(rev.parameters()))  # outside autocast
    assert len(log) == 4 and all(entry == (True, torch.bfloat16) for entry in log)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = explicit_reversible(blocks, x)
    want = grads_of((ref * probe).sum(), [x] + list(rev.parameters()))
    assert rel_err(out, ref) <= 1e-6
    for a, b in zip(grads, want):
        assert rel_err(a, b) <= 5e-2

    # and the other way round: a float32 forward is recomputed in float32 even when the
    # backward is called under autocast
    out = rev(x)
    log.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out * probe).sum().backward()
    assert len(log) == 4 and all(entry == (False, torch.float32) for entry in log)


def test_no_grad_and_frozen_paths_compute_directly():
    blocks = make_blocks(3)
    rev = ReversibleSequence(blocks)
    x, context, mask, _ = inputs()
    ref = explicit_reversible(blocks, x, context=context, mask=mask)
    with torch.no_grad():
        out = rev(x.requires_grad_(), context=context, mask=mask)
    assert out.grad_fn is None and rel_err(out, ref) <= 1e-12
    with torch.inference_mode():
        assert rel_err(rev(x, context=context, mask=mask), ref) <= 1e-12

    rev.requires_grad_(False)
    x = x.detach()
    out = rev(x, context=context, mask=mask)
    assert out.grad_fn is None and not out.requires_grad
    assert rel_err(out, ref) <= 1e-12


def test_empty_sequence_and_constant_block():
    x, _, _, _ = inputs()
    assert ReversibleSequence([])(x) is x

    class Constant(nn.Module):
        def forward(self, x, **kwargs):
            return torch.ones_like(x)

    torch.manual_seed(0)
    f = Branch().double()
    blocks = [(f, Constant()), (Constant(), f)]
    rev = ReversibleSequence(blocks)
    x.requires_grad_()
    wrt = [x] + list(rev.parameters())
    got = grads_of(rev(x).square().sum(), wrt)
    want = grads_of(explicit_reversible(blocks, x).square().sum(), wrt)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-10


# --------------------------------------------------------------------------- errors


def test_invalid_blocks_raise():
    lin = nn.Linear(2, 2)
    with pytest.raises(TypeError):
        ReversibleSequence(lin)
    with pytest.raises(TypeError):
        SequentialSequence([lin])
    with pytest.raises(ValueError):
        ReversibleSequence([(lin, lin, lin)])
    with pytest.raises(TypeError):
        ReversibleSequence([(lin, lambda x: x)])
    with pytest.raises(TypeError):
        ReversibleSequence([(lin, lin)])(x=[1.0])


def test_nested_tensor_requiring_grad_raises():
    rev = ReversibleSequence(make_blocks(1))
    x, context, _, _ = inputs()
    with pytest.raises(TypeError, match="nests a tensor"):
        rev(x, unused=[context.requires_grad_()])


def test_parameters_changed_between_forward_and_backward_raise():
    rev = ReversibleSequence(make_blocks(2))
    x, _, _, _ = inputs()
    out = rev(x)
    with torch.no_grad():
        next(rev.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()

    params = dict(rev.named_parameters())
    swapped = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    out = torch.func.functional_call(rev, swapped, (x,))
    with pytest.raises(RuntimeError, match="replaced"):
        out.sum().backward()
