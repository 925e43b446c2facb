"""The one-token decoder (lm.py's ``Decoder``) equals the full forward, and the in-place recurrence
step (``CausalState``, ops/causal/recurrent.py) equals the reference step beside it."""

import pytest
import torch
import torch.nn.functional as F
from test_cache import CONFIGS, inputs, make
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM
from linear_attention_transformer.lm import Decoder
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
}


def decoded(model, x, mask, kw, prompt):
    """Logits for positions prompt - 1 .. n - 1: the prompt's last, then one per step."""
    logits, decoder = model.start_decoding(x[:, :prompt], input_mask=mask[:, :prompt], **kw)
    steps = [logits] + [decoder.step(x[:, t]) for t in range(prompt, x.shape[1])]
    return torch.stack(steps, dim=1), decoder


@pytest.mark.parametrize("name", list(DECODER_CONFIGS))
@pytest.mark.parametrize("prompt", [3, 4, 9])  # the padding (first 3 tokens of row 1) is in the prompt
def test_decoder_equals_full_forward_float64(name, prompt):
    cfg = DECODER_CONFIGS[name]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = model(x, input_mask=mask, **kw)
    out, decoder = decoded(model, x, mask, kw, prompt)
    assert isinstance(decoder, Decoder)  # the lean form, not the fallback
    assert decoder.position == x.shape[1]
    scale = full[mask].abs().max()
    assert (out - full[:, prompt - 1:])[mask[:, prompt - 1:]].abs().max() <= 1e-12 * scale
    after = model.state_dict()  # the decoder copies weights; it never adds to or writes into the model
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def local_caches(cache):
    return [branch.fn.local for pair in cache.layers for branch in pair
            if branch is not None and getattr(branch.fn, "local", None) is not None]


@pytest.mark.parametrize("name", ["local+blindspot+shift+reversible", "gate+conv+rotary+exact window",
                                  "elu, blindspot 3, no gate"])
def test_the_cache_read_after_steady_steps_holds_every_key_position(name):
    """Eager steps past the point where every ring slot holds a real key read the local
    heads' bias from a table made once, and still write each key's position: the decoder's
    cache equals the full forward's, and the cached path continues from it."""
    cfg = DECODER_CONFIGS[name]
    model = make(cfg)
    x, mask, kw = inputs(cfg, n=30)
    _, decoder = decoded(model, x[:, :27], mask[:, :27], kw, prompt=4)
    cache = decoder.cache
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
    out, _ = decoded(model, x, mask, kw, 5)
    assert torch.isfinite(out).all()
    assert (out - full[:, 4:])[mask[:, 4:]].abs().max() <= 1e-9 * full[mask].abs().max()


def test_decoder_float32_close_to_full_forward():
    cfg = DECODER_CONFIGS["local+blindspot+shift+reversible"]
    model = make(cfg, torch.float32)
    x, mask, kw = inputs(cfg, dtype=torch.float32)
    full = model(x, input_mask=mask, **kw)
    out, _ = decoded(model, x, mask, kw, 5)
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
        out, _ = decoded(model, x, mask, kw, 5)
    assert out.dtype == full.dtype == torch.bfloat16
    err = (out.float() - full[:, 4:].float())[mask[:, 4:]].abs().max()
    assert err <= 0.03 * full[mask].float().abs().max()


def test_axial_model_gets_the_general_form_behind_the_same_interface():
    cfg = CONFIGS["gate+conv+axial+rotary"]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    out, decoder = decoded(model, x, mask, kw, 6)
    assert isinstance(decoder, Decoder) and not decoder.compilable  # axial attention steps on its cached path
    full = model(x, input_mask=mask, **kw)
    assert (out - full[:, 5:])[mask[:, 5:]].abs().max() <= 1e-12 * full[mask].abs().max()


def test_decoder_refuses_steps_beyond_max_seq_len():
    model = make(CONFIGS["exact global"])
    _, decoder = model.start_decoding(torch.randint(0, 20, (1, 39)))
    decoder.step(torch.tensor([3]))  # position 39: the last one of max_seq_len = 40
    with pytest.raises(ValueError, match="max_seq_len"):
        decoder.step(torch.tensor([3]))


def test_generate_uses_the_decoder_and_matches_recompute():
    model = make(DECODER_CONFIGS["gate+conv+rotary+exact window"], torch.float32)
    wrapper = AutoregressiveWrapper(model)
    prompt = torch.randint(0, 20, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, :2] = False
    calls = []
    original = model.start_decoding
    model.start_decoding = lambda *a, **k: calls.append(1) or original(*a, **k)
    cached = wrapper.generate(prompt, 30, temperature=0, input_mask=mask, use_cache=True)
    del model.start_decoding
    recomputed = wrapper.generate(prompt, 30, temperature=0, input_mask=mask, use_cache=False)
    assert calls == [1]  # primed once, then stepped
    assert torch.equal(cached, recomputed)


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


def padded_prompt(n=5):
    x = torch.randint(0, 20, (2, n), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, n, dtype=torch.bool)
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
def test_step_makes_no_sync_and_keeps_its_buffers(name):
    """Over 60 steps (blocks completing, windows filling, the prompt's padding leaving the
    window): no op reads a value back, eager or in the form a compiled step traces
    (``model.step`` without the host's position), and every buffer keeps its shape and its
    memory. The traced form runs the same ops on the same shapes at every position."""
    model = make_long(LONG_CONFIGS[name], torch.float32)
    x, mask = padded_prompt()
    _, decoder = model.start_decoding(x, input_mask=mask)
    buffers = decoder.buffers()
    layout = [(tuple(t.shape), t.data_ptr()) for t in buffers]
    tokens = torch.tensor([3, 7])
    with OpLog() as log:
        for _ in range(30):
            decoder.step(tokens)
    assert log.syncs() == []
    per_step = []
    with torch.inference_mode():
        for _ in range(30):
            with OpLog() as log:
                model.step(tokens, decoder.cache, decoder.made)
            assert log.syncs() == []
            per_step.append(log.ops)
    assert all(ops == per_step[0] for ops in per_step)
    assert [(tuple(t.shape), t.data_ptr()) for t in decoder.buffers()] == layout
    assert decoder.position == 5 + 60


def test_the_step_reads_tensors_made_once_and_marked_static():
    """What a step reads besides the parameters and the cache (each attention layer's
    concatenated projection, the position table, ...) is made once per decoder: those tensors
    keep their memory over eager and compiled steps, ``mark_static`` marks every one of them
    (``torch._dynamo.mark_static_address``: a CUDA graph then reads them where they are, with
    no copy per replay), and a compiled step's graph takes them as its inputs."""
    model = make_long(LONG_CONFIGS["global gate per feature+conv+rotary+exact window+kv_heads"], torch.float32)
    x, mask = padded_prompt()
    _, decoder = model.start_decoding(x, input_mask=mask)
    static = decoder.static_tensors()
    layout = [(t.data_ptr(), tuple(t.shape)) for t in static]
    weights = [made.weight for pair in decoder.made.layers for _, _, made in pair if hasattr(made, "weight")]
    assert len(weights) == 2 and all(any(w is t for t in static) for w in weights)
    inputs = []

    def backend(gm, example_inputs):
        inputs.extend(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    step = AutoregressiveWrapper(model)._compiled_step(decoder, {"backend": backend})
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in static)
    tokens = torch.tensor([3, 7])
    for _ in range(3):
        decoder.step(tokens)
        step(tokens)
    read = {t.data_ptr() for t in inputs if torch.is_tensor(t)}
    assert all(w.data_ptr() in read for w in weights)
    assert [(t.data_ptr(), tuple(t.shape)) for t in decoder.static_tensors()] == layout


def graphs(counter):
    """Graphs compiled (dynamo may hand the backend an empty graph when it restarts its first
    analysis of a frame; with ``error_on_recompile`` a guard that fails raises)."""
    return sum(1 for gm in counter.graphs if any(node.op.startswith("call") for node in gm.graph.nodes))


@pytest.mark.parametrize("name", ["local+blindspot+gate+shift", "local+blindspot+shift"])
def test_compiled_step_one_graph_over_200_steps_float64(name):
    """``torch.compile(decoder.step, fullgraph=True)``: one graph, no recompile over 200 steps
    (local heads with their ring, blindspot joins with the gate or without it, token shift); every step's logits equal the full forward in float64; a
    second decoder of the same model reuses the graph."""
    model = make_long(LONG_CONFIGS[name])
    x, mask = padded_prompt()
    tokens = torch.randint(0, 20, (2, 200), generator=torch.Generator().manual_seed(3))
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        logits, decoder = model.start_decoding(x, input_mask=mask)
        step = torch.compile(decoder.step, backend=counter, fullgraph=True)
        outs = [logits] + [step(tokens[:, t]) for t in range(200)]
        assert graphs(counter) == 1
        _, second = model.start_decoding(x, input_mask=mask)
        again = torch.compile(second.step, backend=counter, fullgraph=True)
        for t in range(3):
            torch.testing.assert_close(again(tokens[:, t]), outs[t + 1], rtol=0, atol=0)
        assert graphs(counter) == 1
    full = model(torch.cat((x, tokens), dim=1), input_mask=F.pad(mask, (0, 200), value=True))
    got = torch.stack(outs, dim=1)
    assert (got - full[:, 4:]).abs().max() <= 1e-12 * full.abs().max()
    assert decoder.position == 205  # read back from the device after compiled steps
    decoder.step(tokens[:, 0])  # an eager step after compiled ones continues from there
    assert decoder.position == 206


@pytest.mark.parametrize("name", list(LONG_CONFIGS)[2:])
def test_compiled_step_equals_eager_steps(name):
    """The other layouts (gate per feature, convolution, rotary, exact window, kv_heads; elu
    features, reversible): one graph over 40 steps, equal to eager steps in float64."""
    model = make_long(LONG_CONFIGS[name])
    x, mask = padded_prompt()
    tokens = torch.randint(0, 20, (2, 40), generator=torch.Generator().manual_seed(4))
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    _, eager = model.start_decoding(x, input_mask=mask)
    _, decoder = model.start_decoding(x, input_mask=mask)
    with torch._dynamo.config.patch(error_on_recompile=True):
        step = torch.compile(decoder.step, backend=counter, fullgraph=True)
        for t in range(40):
            want = eager.step(tokens[:, t])
            torch.testing.assert_close(step(tokens[:, t]), want, rtol=1e-13, atol=1e-13)
    assert graphs(counter) == 1


@pytest.mark.parametrize("use_axial_pos_emb", [True, False], ids=["axial", "absolute"])
def test_steps_look_positions_up_as_the_full_forward_float64(use_axial_pos_emb):
    """Steps look each position's embedding up (``PositionRows``: by an int on eager steps, by
    the position's tensor on compiled ones) and give the full forward's logits: axial and
    absolute embeddings, positions past one axial row."""
    model = make_long(dict(use_axial_pos_emb=use_axial_pos_emb, n_local_attn_heads=2, local_attn_window_size=4,
                           blindspot_size=3))
    x, mask = padded_prompt()
    tokens = torch.cat((x, torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(4))), dim=1)
    full = model(tokens, input_mask=torch.cat((mask, torch.ones(2, 12, dtype=torch.bool)), dim=1))
    _, eager = model.start_decoding(x, input_mask=mask)
    _, traced = model.start_decoding(x, input_mask=mask)
    torch._dynamo.reset()
    step = torch.compile(traced.step, backend="aot_eager", fullgraph=True)
    for t in range(x.shape[1], tokens.shape[1]):
        want = full[:, t]
        torch.testing.assert_close(eager.step(tokens[:, t]), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(step(tokens[:, t]), want, rtol=1e-12, atol=1e-12)


def test_compiled_step_checks_max_seq_len_on_the_device():
    model = make_long(LONG_CONFIGS["local+blindspot+gate+shift"], torch.float32)
    _, decoder = model.start_decoding(torch.randint(0, 20, (1, 254)))
    torch._dynamo.reset()
    step = torch.compile(decoder.step, backend="aot_eager", fullgraph=True)
    step(torch.tensor([1]))  # position 254
    step(torch.tensor([1]))  # 255: the last of max_seq_len = 256
    with pytest.raises(RuntimeError, match="max_seq_len"):
        step(torch.tensor([1]))


def test_eager_step_runs_on_step_threads_and_restores_torch_threads():
    """On a CPU an eager step of a few rows runs its ops on one thread (Decoder.step_threads)
    and leaves torch's thread count as it found it; step_threads None leaves it alone; more
    rows than ONE_THREAD_MAX_BATCH keep torch's count."""
    from linear_attention_transformer.lm import ONE_THREAD_MAX_BATCH

    class Threads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(torch.get_num_threads())
            return func(*args, **(kwargs or {}))

    model = make_long(LONG_CONFIGS["local+blindspot+shift"], torch.float32)
    x, _ = padded_prompt()
    _, decoder = model.start_decoding(x)
    _, many = model.start_decoding(x[:1].expand(ONE_THREAD_MAX_BATCH + 1, -1))
    assert decoder.step_threads == 1 and many.step_threads is None
    tokens, more_tokens = torch.tensor([3, 7]), torch.full((ONE_THREAD_MAX_BATCH + 1,), 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with Threads() as inside:
            decoder.step(tokens)
        assert inside.seen == {1} and torch.get_num_threads() == 2
        decoder.step_threads = None
        with Threads() as inside:
            decoder.step(tokens)
        assert inside.seen == {2}
        with Threads() as inside:
            many.step(more_tokens)
        assert inside.seen == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_step_refuses_bad_tokens():
    model = make_long(LONG_CONFIGS["local+blindspot+gate+shift"], torch.float32)
    _, decoder = model.start_decoding(torch.randint(0, 20, (2, 4)))
    with pytest.raises(TypeError, match="tokens"):
        decoder.step(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="tokens"):
        decoder.step(torch.tensor([1, 2, 3]))
    assert decoder.position == 4


# ------------------------------------------------------------ generate(compile_step=...)


def test_generate_with_a_compiled_step_equals_eager_and_compiles_once():
    """generate(compile_step={...}) picks the tokens the eager step picks (float64, greedy); a
    second call with another prompt and length reuses the graph (no recompile)."""
    model = make_long(LONG_CONFIGS["local+blindspot+gate+shift"])
    wrapper = AutoregressiveWrapper(model)
    x, mask = padded_prompt()
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
    with pytest.raises(ValueError, match="compile_step"):
        wrapper.generate(prompt, 2, use_cache=False, compile_step=True)
    axial = AutoregressiveWrapper(make(CONFIGS["gate+conv+axial+rotary"], torch.float32))  # its decoder steps eagerly only
    with pytest.raises(ValueError, match="compile_step"):
        axial.generate(prompt, 2, compile_step={"backend": "eager"})


# ------------------------------------------------- each piece's step against its full form


def test_piece_steps_equal_their_full_forms_float64():
    """Token shift, the local convolution, the feed-forward and the local heads' ring readout:
    each one-token step (in place on its buffer) equals its full form on the last position."""
    from linear_attention_transformer.feedforward import FeedForward
    from linear_attention_transformer.gating import LocalConv, local_conv_step
    from linear_attention_transformer.ops.windowed_attention import (Window, windowed_attention_by_position,
                                                                     windowed_attention_step)
    from linear_attention_transformer.token_shift import shift_step, shift_tokens

    g = torch.Generator().manual_seed(7)
    b, n, dim = 2, 6, 9
    x = torch.randn(b, n, dim, generator=g, dtype=D)
    previous = x[:, -2].clone()
    want = shift_tokens(x, (1, 0))[:, -1]
    torch.testing.assert_close(shift_step(x[:, -1], previous), want, rtol=0, atol=0)
    assert torch.equal(previous, x[:, -1])  # the buffer now holds the token, for the next step

    torch.manual_seed(0)
    conv = LocalConv(3 * 4, kernel_size=4).to(D)
    with torch.no_grad():
        conv.conv_weight.normal_()
    t = torch.randn(b, 3, n, 4, generator=g, dtype=D)
    buffer = t[:, :, -4:-1].clone()
    got = local_conv_step(t[:, :, -1], buffer, conv.taps(3).detach())
    torch.testing.assert_close(got, conv(t)[:, :, -1].detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(buffer, t[:, :, -3:])

    for glu in (False, True):
        ff = FeedForward(dim, mult=2, glu=glu).to(D).eval()
        into = x[:, -1].clone()
        with torch.no_grad():
            ff.step(x[:, -1], None, ff.prepare_step(), into=into)
            torch.testing.assert_close(into, x[:, -1] + ff(x)[:, -1], rtol=1e-12, atol=1e-12)

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
