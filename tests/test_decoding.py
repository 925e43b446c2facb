"""The one-token step (a forward with a cache and one token per row while no gradient is recorded,
``Place.step``: each stateful layer's recurrent form inside its forward) equals the full forward,
and the in-place recurrence step (``CausalState``, ops/causal/recurrent.py) equals the reference
step beside it."""

import pytest
import torch
import torch.nn.functional as F
from test_cache import CONFIGS, inputs, make
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM
from linear_attention_transformer.cache import tensors_of
from linear_attention_transformer.ops import CausalState, causal_linear_attention, naive_causal_linear_attention
from linear_attention_transformer.ops.causal.recurrent import join_flags

D = torch.float64

DECODER_CONFIGS = {
    **{name: cfg for name, cfg in CONFIGS.items() if not cfg.get("attend_axially")},
    "gate+conv+rotary+exact window": dict(
        use_gate=True, use_local_conv=True, use_rotary_emb=True, n_local_attn_heads=2, local_attn_window_size=3,
        local_attn_look_backward=2, local_attn_exact_windowsize=True,
    ),
    "head gate+kv_heads+relu+factorised tied": dict(
        use_gate=True, gate_granularity="head", kv_heads=2, feature_map="relu", emb_dim=8, tie_embedding=True,
        n_local_attn_heads=2, local_attn_window_size=4, blindspot_size=2,
    ),
    "global only, blindspot 5": dict(blindspot_size=5, shift_tokens=True),
    "elu, blindspot 3, no gate": dict(feature_map="elu", blindspot_size=3, n_local_attn_heads=1, local_attn_window_size=6),
    "delta+gate+conv+rotary+local+kv_heads+shift": dict(
        update_rule="delta", use_gate=True, use_local_conv=True, use_rotary_emb=True, n_local_attn_heads=2,
        local_attn_window_size=4, kv_heads=2, shift_tokens=True),
    "delta, dim_qk 6, reversible, no gate": dict(update_rule="delta", dim_qk=6, reversible=True),
    # keys four times the heads' width (docs/layers.md's delta-rule heads for recall), beside local heads
    "delta+gate+conv, dim_qk 16, local": dict(
        update_rule="delta", use_gate=True, use_local_conv=True, dim_qk=16, n_local_attn_heads=2,
        local_attn_window_size=4),
}


class StepCount:
    """Counts the model's forwards that take the one-token step (``place.step``), not the
    general cached path."""

    def __init__(self, model):
        self.stack, self.calls = model.transformer, 0

    def __enter__(self):
        original = self.stack.attend

        def counted(x, place, *args):
            self.calls += place.step
            return original(x, place, *args)

        self.stack.attend = counted
        return self

    def __exit__(self, *exc):
        del self.stack.attend


def prime(model, x, mask=None, **kw):
    """The prompt x read under no_grad: (logits at its last position (b, num_tokens), cache)."""
    with torch.no_grad():
        logits, cache = model(x, input_mask=mask, return_cache=True, **kw)
    return logits[:, -1], cache


def step(model, tokens, cache):
    """One token per row, tokens (b,), through the one-token step on ``cache`` -> logits (b, num_tokens)."""
    with torch.no_grad():
        logits, same = model(tokens[:, None], cache=cache, return_cache=True)
    assert same is cache
    return logits[:, 0]


def decoded(model, x, mask, kw, prompt):
    """Logits for positions prompt - 1 .. n - 1: the prompt's last, then one per token fed: a
    real token in every row takes the one-token step; a column with padding (interior padding
    of blindspot configs, ``inputs``) takes the general cached path with its mask. Returns
    (logits, cache, the one-token steps taken, the steps expected)."""
    logits, cache = prime(model, x[:, :prompt], mask[:, :prompt], **kw)
    outs, expected = [logits], 0
    with StepCount(model) as count:
        for t in range(prompt, x.shape[1]):
            if bool(mask[:, t].all()):
                outs.append(step(model, x[:, t], cache))
                expected += 1
            else:
                with torch.no_grad():
                    out, cache = model(x[:, t:t + 1], input_mask=mask[:, t:t + 1], cache=cache, return_cache=True)
                outs.append(out[:, 0])
    return torch.stack(outs, dim=1), cache, count.calls, expected


@pytest.mark.parametrize("name", list(DECODER_CONFIGS))
# the padding (first 3 tokens of row 1; columns 5 .. 7 with a blindspot, ``inputs``) in the prompt or not
@pytest.mark.parametrize("prompt", [3, 4, 9])
def test_decoder_equals_full_forward_float64(name, prompt):
    cfg = DECODER_CONFIGS[name]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = model(x, input_mask=mask, **kw)
    out, cache, steps, expected = decoded(model, x, mask, kw, prompt)
    assert steps == expected > 0  # the one-token step, not the general cached path
    assert cache.position == x.shape[1]
    scale = full[mask].abs().max()
    assert (out - full[:, prompt - 1:])[mask[:, prompt - 1:]].abs().max() <= 1e-12 * scale
    after = model.state_dict()  # the steps read the weights; they never add to or write into the model
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def local_caches(cache):
    return [branch.fn.local for pair in cache.layers for branch in pair
            if branch is not None and getattr(branch.fn, "local", None) is not None]


@pytest.mark.parametrize("name", ["local+blindspot+shift+reversible", "gate+conv+rotary+exact window",
                                  "elu, blindspot 3, no gate"])
def test_the_cache_read_after_steady_steps_holds_every_key_position(name):
    """Steps past the point where every ring slot holds a real key write each key's position
    as the full forward does: the stepped cache equals the full forward's, and the cached
    path continues from it."""
    cfg = DECODER_CONFIGS[name]
    model = make(cfg)
    x, mask, kw = inputs(cfg, n=30)
    _, cache, steps, expected = decoded(model, x[:, :27], mask[:, :27], kw, prompt=4)
    assert steps == expected >= 19
    _, full_cache = model(x[:, :27], input_mask=mask[:, :27], return_cache=True, **kw)
    ours, want = local_caches(cache), local_caches(full_cache)
    assert len(ours) == len(want) > 0
    for a, b in zip(ours, want):
        assert torch.equal(a.positions, b.positions)
    continued, _ = model(x[:, 27:], input_mask=mask[:, 27:], cache=cache, return_cache=True, **kw)
    full = model(x, input_mask=mask, **kw)
    assert (continued - full[:, 27:]).abs().max() <= 1e-12 * full.abs().max()


@pytest.mark.parametrize("name", ["local+blindspot+shift+reversible", "gate+conv+rotary+exact window"])
def test_decoder_exact_at_large_logits(name):
    """Queries and keys scaled to logits in the hundreds: the exponential features' references
    keep every step finite and equal to the full forward."""
    cfg = DECODER_CONFIGS[name]
    model = make(cfg)
    with torch.no_grad():
        for layer in model.modules():
            if hasattr(layer, "to_kv"):
                layer.to_q.weight.mul_(300.0)
                layer.to_kv.weight.mul_(300.0)
    x, mask, kw = inputs(cfg)
    full = model(x, input_mask=mask, **kw)
    out, _, steps, expected = decoded(model, x, mask, kw, 5)
    assert steps == expected > 0
    assert torch.isfinite(out).all()
    assert (out - full[:, 4:])[mask[:, 4:]].abs().max() <= 1e-9 * full[mask].abs().max()


def test_decoder_float32_close_to_full_forward():
    cfg = DECODER_CONFIGS["local+blindspot+shift+reversible"]
    model = make(cfg, torch.float32)
    x, mask, kw = inputs(cfg, dtype=torch.float32)
    full = model(x, input_mask=mask, **kw)
    out, _, steps, expected = decoded(model, x, mask, kw, 5)
    assert steps == expected > 0
    torch.testing.assert_close(out[mask[:, 4:]], full[:, 4:][mask[:, 4:]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["local+blindspot+shift+reversible", "elu+gate+blindspot 3+conv 4+per-layer local"],
                         ids=["local+blindspot+shift (not reversible)", "elu+gate+blindspot+conv"])
def test_decoder_under_autocast_close_to_full_forward(name):
    """Under CPU bfloat16 autocast a step takes the functional form (the eager form's buffers
    hold the model's dtype): it runs, and its logits are the full forward's to bfloat16
    rounding."""
    cfg = {**DECODER_CONFIGS[name], "reversible": False}
    model = make(cfg, torch.float32)
    x, mask, kw = inputs(cfg, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(x, input_mask=mask, **kw)
        out, _, steps, expected = decoded(model, x, mask, kw, 5)
    assert steps == expected > 0
    assert out.dtype == full.dtype == torch.bfloat16
    err = (out.float() - full[:, 4:].float())[mask[:, 4:]].abs().max()
    assert err <= 0.03 * full[mask].float().abs().max()


def test_axial_model_gets_the_general_form_behind_the_same_interface():
    cfg = CONFIGS["gate+conv+axial+rotary"]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    out, _, steps, expected = decoded(model, x, mask, kw, 6)
    assert steps == expected > 0 and not model.step_compiles  # axial attention steps on its cached path
    full = model(x, input_mask=mask, **kw)
    assert (out - full[:, 5:])[mask[:, 5:]].abs().max() <= 1e-12 * full[mask].abs().max()


def test_decoder_refuses_steps_beyond_max_seq_len():
    model = make(CONFIGS["exact global"])
    assert model.length_limit == 40
    _, cache = prime(model, torch.randint(0, 20, (1, 39)))
    step(model, torch.tensor([3]), cache)  # position 39: the last one of max_seq_len = 40
    with pytest.raises(ValueError, match="sequence length 41 exceeds max_seq_len=40"):
        step(model, torch.tensor([3]), cache)
    assert cache.position == 40


def test_generate_uses_the_decoder_and_matches_recompute():
    model = make(DECODER_CONFIGS["gate+conv+rotary+exact window"], torch.float32)
    wrapper = AutoregressiveWrapper(model)
    prompt = torch.randint(0, 20, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, :2] = False
    primed = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: primed.append(kwargs.get("cache") is None),
                                           with_kwargs=True)
    with StepCount(model) as count:
        cached = wrapper.generate(prompt, 30, temperature=0, input_mask=mask, use_cache=True)
    hook.remove()
    recomputed = wrapper.generate(prompt, 30, temperature=0, input_mask=mask, use_cache=False)
    assert primed == [True] + [False] * 29 and count.calls == 29  # primed once, then stepped
    assert torch.equal(cached, recomputed)


def test_a_step_reads_parameters_changed_in_place():
    """A parameter changed in place between steps (an optimizer step) shows in the next step:
    its logits are a fresh full forward's with the new weights (float64). The changed weights
    (the last attention layer's queries, the output layer) leave every cached state as it
    was, so the full forward is the judge."""
    cfg = DECODER_CONFIGS["exact global"]
    model = make(cfg)
    x, mask, _ = inputs(cfg, n=13)

    @torch.no_grad()
    def full(n):  # the logits at position n - 1 of a fresh full forward
        return model(x[:, :n], input_mask=mask[:, :n])[:, -1]

    _, cache = prime(model, x[:, :6], mask[:, :6])
    for t in range(6, 9):
        step(model, x[:, t], cache)
    before = full(10)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.to_logits.weight.add_(torch.randn(model.to_logits.weight.shape, generator=g, dtype=D))
    got, want = step(model, x[:, 9], cache), full(10)
    assert (want - before).abs().max() > 1e-3  # the change shows in the logits
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()

    before = full(11)
    last_attention = [m for m in model.modules() if hasattr(m, "to_q") and hasattr(m, "to_kv")][-1]
    with torch.no_grad():
        last_attention.to_q.weight.add_(torch.randn(last_attention.to_q.weight.shape, generator=g, dtype=D))
    got, want = step(model, x[:, 10], cache), full(11)
    assert (want - before).abs().max() > 1e-3
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    got = step(model, x[:, 11], cache)  # and the steps after it
    want = full(12)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


# ------------------------------------------------------------ the recurrence step alone


# large logits matter for exponential features (given features are already non-negative)
@pytest.mark.parametrize("exp_features, logit_scale", [(True, 1.0), (True, 300.0), (False, 1.0)])
@pytest.mark.parametrize("blindspot", [1, 3])
@pytest.mark.parametrize("gate", [None, "head", "feature"])
def test_global_step_equals_the_explicit_matrix_float64(exp_features, logit_scale, blindspot, gate):
    g = torch.Generator().manual_seed(blindspot)
    b, h, d, e, n = 2, 3, 4, 5, 11
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=D) * logit_scale for _ in range(2))
    v = torch.randn(b, h, n, e, generator=g, dtype=D)
    if not exp_features:
        q, k = q.exp(), k.exp()
    log_decay = None
    if gate is not None:
        shape = (b, h, n) if gate == "head" else (b, h, n, d)
        log_decay = -torch.rand(*shape, generator=g, dtype=D) * 3
    judge = naive_causal_linear_attention(q, k, v, log_decay, blindspot_size=blindspot, exp_features=exp_features)
    lean = CausalState.zeros(b, h, d, e, blindspot, exp_features, dtype=D)
    zero = torch.zeros((), dtype=D)
    for t in range(n):
        ld = None if log_decay is None else log_decay[:, :, t]
        join = join_flags(torch.tensor(t), blindspot, exp_features, zero, torch.full((), float("-inf"), dtype=D))
        got = lean.step(q[:, :, t], k[:, :, t], v[:, :, t], ld, join if blindspot > 1 else None)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, judge[:, :, t], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("exp_features, logit_scale", [(True, 1.0), (True, 300.0), (False, 1.0)])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("prompt", [0, 2, 4])  # 2, 4: the first block began in the prompt (pending)
def test_step_after_a_prompt_equals_the_explicit_matrix_float64(exp_features, logit_scale, traced, prompt):
    """The in-place step loaded with the chunked kernel's state after a prompt of ``prompt``
    tokens (``CausalState.load``, as a cached call leaves it): every output equals the
    explicit matrix's, and the state at the end the chunked kernel's, with the join given as
    the position an eager step knows (an int: joined only at a block's end) or as tensor flags
    (the form a compiled step traces: computed at every step, a no-op where the block is not
    complete)."""
    g = torch.Generator().manual_seed(prompt)
    b, h, d, e, n, blindspot = 2, 3, 4, 5, 14, 3
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=D) * logit_scale for _ in range(2))
    v = torch.randn(b, h, n, e, generator=g, dtype=D)
    if not exp_features:
        q, k = q.exp(), k.exp()
    kw = dict(blindspot_size=blindspot, exp_features=exp_features)
    judge, after = causal_linear_attention(q, k, v, return_state=True, **kw)
    torch.testing.assert_close(judge, naive_causal_linear_attention(q, k, v, **kw), rtol=1e-12, atol=1e-12)
    prompted = CausalState.zeros(b, h, d, e, dtype=D, **kw)
    if prompt:
        _, prompted = causal_linear_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], return_state=True,
                                              **kw)
    given = [t.clone() for t in prompted.buffers()]
    lean = CausalState.zeros(b, h, d, e, dtype=D, **kw)
    lean.load(prompted)
    zero, hidden = torch.zeros((), dtype=D), torch.full((), float("-inf"), dtype=D)
    for t in range(prompt, n):
        join = join_flags(torch.tensor(t) if traced else t, blindspot, exp_features, zero, hidden)
        got = lean.step(q[:, :, t], k[:, :, t], v[:, :, t], None, join)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, judge[:, :, t], rtol=1e-12, atol=1e-12)
    # loading copies: the prompt's state was not stepped in place
    assert all(torch.equal(a, b) for a, b in zip(given, prompted.buffers()))
    torch.testing.assert_close(lean.as_causal_state(n).kv, after.kv, rtol=1e-12, atol=1e-12)
    if exp_features:
        torch.testing.assert_close(lean.ref, after.ref, rtol=1e-12, atol=0)


# ------------------------------------------- no sync, fixed buffers, one compiled graph

# ops that read a value back to the host (or size their output by one: the same wait)
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero", "aten::equal",
            "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
            "aten::bincount", "aten::repeat_interleave.Tensor", "aten::repeat_interleave.self_Tensor",
            "aten::_assert_async", "aten::_assert_async.msg"}

LONG_CONFIGS = {  # for hundreds of steps: max_seq_len 256 (the decoder's state does not grow with it)
    "local+blindspot+gate+shift": dict(n_local_attn_heads=2, local_attn_window_size=4, blindspot_size=3,
                                       use_gate=True, shift_tokens=True),
    "local+blindspot+shift": dict(n_local_attn_heads=2, local_attn_window_size=4, blindspot_size=3,
                                  shift_tokens=True),
    "global gate per feature+conv+rotary+exact window+kv_heads": dict(
        use_gate=True, gate_granularity="feature", use_local_conv=True, use_rotary_emb=True, n_local_attn_heads=1,
        local_attn_window_size=3, local_attn_exact_windowsize=True, kv_heads=2),
    "elu+blindspot 4+reversible": dict(feature_map="elu", blindspot_size=4, reversible=True, n_local_attn_heads=2,
                                       local_attn_window_size=5),
    "dim_qk 6+elu+gate per feature+conv+rotary+kv_heads+local": dict(
        dim_qk=6, feature_map="elu", use_gate=True, gate_granularity="feature", use_local_conv=True,
        use_rotary_emb=True, kv_heads=2, n_local_attn_heads=2, local_attn_window_size=3),
    "delta+gate+conv+rotary+local": dict(update_rule="delta", use_gate=True, use_local_conv=True, use_rotary_emb=True,
                                         n_local_attn_heads=2, local_attn_window_size=3),
}


def make_long(cfg, dtype=D):
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=2, heads=4, max_seq_len=256, causal=True,
                                         chunk_size=4, **cfg).to(dtype).eval()
    with torch.no_grad():  # gates and convolutions start near identity: move them
        for name, p in model.named_parameters():
            if "gate" in name or "conv" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def padded_prompt(cfg, n=5):
    """Row 1 padded on the left (2 tokens), or with a blindspot (refused with left padding in a
    cache) in its interior (columns 2 and 3)."""
    x = torch.randint(0, 20, (2, n), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, n, dtype=torch.bool)
    if cfg.get("blindspot_size", 1) > 1:
        mask[1, 2:4] = False
    else:
        mask[1, :2] = False
    return x, mask


class OpLog(TorchDispatchMode):
    """Every aten op run under it, with its output shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(t))
        self.ops.append((func.name(), shapes))
        return out

    def syncs(self):
        return [name for name, _ in self.ops if name in SYNC_OPS or name.split(".")[0] in SYNC_OPS]


@pytest.mark.parametrize("name", list(LONG_CONFIGS))
def test_step_reads_back_only_its_position_and_keeps_its_buffers(name):
    """Over 60 eager steps on a CPU (blocks completing, windows filling, the prompt's padding
    leaving the window): the one value read back is the position (free on a CPU; elsewhere
    and under compile a step reads nothing: the compiled tests' one graph), and every buffer
    keeps its shape and its memory."""
    cfg = LONG_CONFIGS[name]
    model = make_long(cfg, torch.float32)
    x, mask = padded_prompt(cfg)
    _, cache = prime(model, x, mask)
    layout = [(tuple(t.shape), t.data_ptr()) for t in cache.static_tensors()]
    assert layout == [(tuple(t.shape), t.data_ptr()) for t in tensors_of(cache)]
    column = torch.tensor([[3], [7]])
    for mode in (torch.no_grad, torch.inference_mode):
        for _ in range(30):
            with OpLog() as log, mode():
                model(column, cache=cache, return_cache=True)
            syncs = log.syncs()
            assert len(syncs) == 1 and set(syncs) <= {"aten::item", "aten::_local_scalar_dense"}
    assert [(tuple(t.shape), t.data_ptr()) for t in cache.static_tensors()] == layout
    assert cache.position == 5 + 60


def graphs(counter):
    """Graphs compiled (dynamo may hand the backend an empty graph when it restarts its first
    analysis of a frame; with ``error_on_recompile`` a guard that fails raises)."""
    return sum(1 for gm in counter.graphs if any(node.op.startswith("call") for node in gm.graph.nodes))


@pytest.mark.parametrize("name", ["local+blindspot+gate+shift", "local+blindspot+shift"])
def test_compiled_step_one_graph_over_200_steps_float64(name):
    """``torch.compile`` of the one-token call (``model(x, cache=cache, return_cache=True)``,
    fullgraph=True): one graph, no recompile over 200 steps (local heads with their ring,
    blindspot joins with the gate or without it, token shift); every step's logits equal the
    full forward in float64; a second cache of the same model reuses the graph."""
    model = make_long(LONG_CONFIGS[name])
    x, mask = padded_prompt(LONG_CONFIGS[name])
    tokens = torch.randint(0, 20, (2, 200), generator=torch.Generator().manual_seed(3))
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()

    def one_token(x, cache):
        return model(x, cache=cache, return_cache=True)[0]

    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        logits, cache = prime(model, x, mask)
        compiled = torch.compile(one_token, backend=counter, fullgraph=True)
        outs = [logits] + [compiled(tokens[:, t:t + 1], cache)[:, 0] for t in range(200)]
        assert graphs(counter) == 1
        _, second = prime(model, x, mask)
        again = torch.compile(one_token, backend=counter, fullgraph=True)
        for t in range(3):
            torch.testing.assert_close(again(tokens[:, t:t + 1], second)[:, 0], outs[t + 1], rtol=0, atol=0)
        assert graphs(counter) == 1
    full = model(torch.cat((x, tokens), dim=1), input_mask=F.pad(mask, (0, 200), value=True))
    got = torch.stack(outs, dim=1)
    assert (got - full[:, 4:]).abs().max() <= 1e-12 * full.abs().max()
    assert cache.position == 205  # read back from the device after compiled steps
    step(model, tokens[:, 0], cache)  # an eager step after compiled ones continues from there
    assert cache.position == 206


@pytest.mark.parametrize("name", list(LONG_CONFIGS)[2:])
def test_compiled_step_equals_eager_steps(name):
    """The other layouts (gate per feature, convolution, rotary, exact window, kv_heads; elu
    features, reversible): one graph over 40 steps, equal to eager steps in float64."""
    model = make_long(LONG_CONFIGS[name])
    x, mask = padded_prompt(LONG_CONFIGS[name])
    tokens = torch.randint(0, 20, (2, 40), generator=torch.Generator().manual_seed(4))
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    _, eager = prime(model, x, mask)
    _, cache = prime(model, x, mask)

    def one_token(x, cache):
        return model(x, cache=cache, return_cache=True)[0]

    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        compiled = torch.compile(one_token, backend=counter, fullgraph=True)
        for t in range(40):
            want = step(model, tokens[:, t], eager)
            torch.testing.assert_close(compiled(tokens[:, t:t + 1], cache)[:, 0], want, rtol=1e-13, atol=1e-13)
    assert graphs(counter) == 1


@pytest.mark.parametrize("use_axial_pos_emb", [True, False], ids=["axial", "absolute"])
def test_steps_look_positions_up_as_the_full_forward_float64(use_axial_pos_emb):
    """Steps look each position's embedding up by the position's tensor, eager and compiled,
    and give the full forward's logits: axial and absolute embeddings, positions past one
    axial row."""
    cfg = dict(use_axial_pos_emb=use_axial_pos_emb, n_local_attn_heads=2, local_attn_window_size=4, blindspot_size=3)
    model = make_long(cfg)
    x, mask = padded_prompt(cfg)
    tokens = torch.cat((x, torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(4))), dim=1)
    full = model(tokens, input_mask=torch.cat((mask, torch.ones(2, 12, dtype=torch.bool)), dim=1))
    _, eager = prime(model, x, mask)
    _, traced = prime(model, x, mask)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, cache: model(x, cache=cache, return_cache=True)[0], backend="aot_eager",
                             fullgraph=True)
    for t in range(x.shape[1], tokens.shape[1]):
        want = full[:, t]
        torch.testing.assert_close(step(model, tokens[:, t], eager), want, rtol=1e-12, atol=1e-12)
        with torch.no_grad():
            torch.testing.assert_close(compiled(tokens[:, t:t + 1], traced)[:, 0], want, rtol=1e-12, atol=1e-12)


def test_compiled_step_checks_max_seq_len_on_the_device():
    model = make_long(LONG_CONFIGS["local+blindspot+gate+shift"], torch.float32)
    _, cache = prime(model, torch.randint(0, 20, (1, 254)))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, cache: model(x, cache=cache, return_cache=True)[0], backend="aot_eager",
                             fullgraph=True)
    one = torch.tensor([[1]])
    with torch.no_grad():
        compiled(one, cache)  # position 254
        compiled(one, cache)  # 255: the last of max_seq_len = 256
        with pytest.raises(RuntimeError, match="max_seq_len"):
            compiled(one, cache)


def test_step_refuses_bad_tokens():
    model = make_long(LONG_CONFIGS["local+blindspot+gate+shift"], torch.float32)
    _, cache = prime(model, torch.randint(0, 20, (2, 4)))
    with pytest.raises(TypeError, match="x must be an integer tensor"):
        step(model, torch.tensor([1.0, 2.0]), cache)
    with pytest.raises(ValueError, match="x must have one token for each of the cache's 2 rows, got 3"):
        step(model, torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ValueError, match="x holds token ids from 1 to 20; valid ids are 0 to 19"):
        step(model, torch.tensor([1, 20]), cache)
    with pytest.raises(ValueError, match="x holds token ids from -1 to 2"):
        step(model, torch.tensor([-1, 2]), cache)
    assert cache.position == 4


# ------------------------------------------------------------ generate(compile_step=...)


def test_generate_with_a_compiled_step_equals_eager_and_compiles_once():
    """generate(compile_step={...}) picks the tokens the eager step picks (float64, greedy); a
    second call with another prompt and length reuses the graph (no recompile)."""
    cfg = LONG_CONFIGS["local+blindspot+gate+shift"]
    model = make_long(cfg)
    wrapper = AutoregressiveWrapper(model)
    x, mask = padded_prompt(cfg)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = wrapper.generate(x, 30, temperature=0, input_mask=mask, compile_step={"backend": counter})
        again = wrapper.generate(x[:, 1:], 12, temperature=0, input_mask=mask[:, 1:], compile_step={"backend": counter})
    assert graphs(counter) == 1
    assert torch.equal(compiled, wrapper.generate(x, 30, temperature=0, input_mask=mask))
    assert torch.equal(again, wrapper.generate(x[:, 1:], 12, temperature=0, input_mask=mask[:, 1:]))


def test_generate_compile_step_refusals():
    model = make_long(LONG_CONFIGS["local+blindspot+gate+shift"], torch.float32)
    wrapper = AutoregressiveWrapper(model)
    prompt = torch.randint(0, 20, (1, 4))
    for bad in ("yes", 1, {"backend": "eager", 3: 4}):
        with pytest.raises(TypeError, match="compile_step"):
            wrapper.generate(prompt, 2, compile_step=bad)
    with pytest.raises(ValueError, match="compile_step compiles the net's one-token call with the cache"):
        wrapper.generate(prompt, 2, use_cache=False, compile_step=True)
    axial = AutoregressiveWrapper(make(CONFIGS["gate+conv+axial+rotary"], torch.float32))  # it steps eagerly only
    assert not axial.net.step_compiles
    with pytest.raises(ValueError, match="compile_step: .*has no one-token call that compiles as one graph"):
        axial.generate(prompt, 2, compile_step={"backend": "eager"})


# ------------------------------------------------- each piece's step against its full form


def test_piece_steps_equal_their_full_forms_float64():
    """Token shift, the local convolution and the local heads' ring readout: one position
    continuing from the buffer of what came before (updated in place) equals the full form
    on the last position."""
    from linear_attention_transformer.gating import LocalConv
    from linear_attention_transformer.ops.windowed_attention import (Window, windowed_attention_by_position,
                                                                     windowed_attention_step)
    from linear_attention_transformer.token_shift import shift_tokens

    g = torch.Generator().manual_seed(7)
    b, n, dim = 2, 6, 9
    x = torch.randn(b, n, dim, generator=g, dtype=D)
    previous = x[:, -2].clone()
    want = shift_tokens(x, (1, 0))[:, -1]
    got = shift_tokens(x[:, -1:], (1, 0), previous=previous, keep=previous)[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(previous, x[:, -1])  # the buffer now holds the token, for the next step

    torch.manual_seed(0)
    conv = LocalConv(3 * 4, kernel_size=4).to(D)
    with torch.no_grad():
        conv.conv_weight.normal_()
    t = torch.randn(b, 3, n, 4, generator=g, dtype=D)
    buffer = t[:, :, -4:-1].clone()
    with torch.no_grad():
        got = conv(t[:, :, -1:], previous=buffer, keep=buffer)[:, :, 0]
        torch.testing.assert_close(got, conv(t)[:, :, -1], rtol=1e-12, atol=1e-12)
    assert torch.equal(buffer, t[:, :, -3:])

    window = Window(3, look_backward=1)
    q, k, v = (torch.randn(b, 2, n, 4, generator=g, dtype=D) for _ in range(3))
    positions = torch.arange(n)
    want = windowed_attention_by_position(q, k, v, positions, positions, window)[:, :, -1]
    slots = window.most_keys  # a ring of the last keys, in slot order t mod slots
    order = positions[-slots:] % slots
    keys, values = (torch.zeros(b, 2, slots, 4, dtype=D).index_copy(2, order, t[:, :, -slots:]) for t in (k, v))
    ring_positions = torch.zeros(slots, dtype=torch.long).index_copy(0, order, positions[-slots:])
    bias = torch.where(window.visible(positions[-1], ring_positions), 0.0, float("-inf")).to(D)[None, None]
    got = windowed_attention_step(q[:, :, -1:] * 4 ** -0.5, keys, values, bias)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
