"""torch.compile: the compiled LM gives the eager logits and gradients, and the default
configuration compiles to one graph (no graph break, in the ops or anywhere else).

Compilation on the CPU takes seconds per graph, so the models are tiny (one or two layers of
width 16) and each is compiled once. Every configuration goes through dynamo and
AOTAutograd (``backend="aot_eager"``: tracing, functionalisation and the autograd graphs,
where the package's code matters); the default configuration also through inductor, the
default backend, whose fused kernels round differently (hence the tolerance).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS, LENGTH = 24, 20  # 20: not a multiple of the chunk (8) nor of the window (8)
TINY = dict(num_tokens=NUM_TOKENS, dim=16, depth=1, max_seq_len=32, heads=2, causal=True, chunk_size=8)
CONFIGS = {
    "plain": dict(),
    # one local and one global head; gate and convolution on the global one
    "local_gate_conv": dict(n_local_attn_heads=1, local_attn_window_size=8, use_gate=True, use_local_conv=True),
    "reversible": dict(reversible=True, shift_tokens=True, n_local_attn_heads=1, local_attn_window_size=8),
}


def make_model(**kwargs):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(**{**TINY, **kwargs})


def tokens():
    return torch.randint(0, NUM_TOKENS, (2, LENGTH), generator=torch.Generator().manual_seed(1))


def forward_backward(model, x):
    """Logits and the gradient of every parameter for a loss that reaches all logits."""
    model.zero_grad(set_to_none=True)
    logits = model(x)
    (logits.square().mean() + logits[:, -1].sum()).backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def assert_close(actual, expected, rtol, what):
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rtol * max(scale, 1e-6), f"{what}: max error {err:.2e} vs scale {scale:.2e}"


def assert_compiled_matches_eager(model, backend, rtol):
    x = tokens()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(model, backend=counting)
    got_logits, got_grads = forward_backward(compiled, x)
    want_logits, want_grads = forward_backward(model, x)
    assert_close(got_logits, want_logits, rtol, "logits")
    for (name, _), got, want in zip(model.named_parameters(), got_grads, want_grads):
        assert_close(got, want, rtol, f"gradient of {name}")
    return graphs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_matches_eager(name):
    graphs = assert_compiled_matches_eager(make_model(**CONFIGS[name]), "aot_eager", 1e-6)
    if name != "reversible":
        # one graph: no break anywhere. The reversible stack breaks at its autograd Function
        # (reversible.py records RNG states with torch.get_rng_state, which dynamo does not
        # trace, and its backward calls torch.autograd.grad); its branches compile as graphs
        # of their own.
        assert len(graphs) == 1, f"{len(graphs)} graphs: a graph break in configuration {name}"


def test_inductor_matches_eager_on_the_default_configuration():
    from torch._inductor import config

    with config.patch(compile_threads=1):  # no pool of compile workers to start for one graph
        assert_compiled_matches_eager(make_model(), "inductor", 1e-4)


def test_default_configuration_has_no_graph_break():
    """``torch._dynamo.explain`` of the LM with its default options: one graph. (The causal
    configurations are checked by the graph counts above.) A break in the ops would name a
    frame under ``ops/``: the message says where."""
    model = LinearAttentionTransformerLM(num_tokens=NUM_TOKENS, dim=32, depth=2, max_seq_len=64)
    explanation = torch._dynamo.explain(model)(tokens())
    where = [
        f"{frame.filename}:{frame.lineno}: {reason.reason.splitlines()[0]}"
        for reason in explanation.break_reasons
        for frame in reason.user_stack[-1:]
    ]
    assert explanation.graph_break_count == 0, "graph breaks:\n" + "\n".join(where)
    assert explanation.graph_count == 1


@pytest.mark.parametrize("magnitude", [1.0, 100.0])
def test_compiled_kernel_recomputes_lost_chunks(magnitude, monkeypatch):
    """Compiled with a dynamic length, the kernel's safe recompute is a ``torch.cond`` and its
    chunk states the blocked scan: at x100 logits (where some chunks are lost to underflow:
    without the recompute the result is far off) and at x1 (where none is) the compiled
    output and gradients equal the float64 reference, at a length that is not a multiple of
    the chunk (8) and at one that is, on one graph. The length is the one dynamic size (batch,
    heads and features symbolic too cost the tracer minutes in symbolic arithmetic): the
    causal LM's dynamic training step below compiles the same recompute and scan with every
    size of its input symbolic."""
    from linear_attention_transformer.ops import causal_linear_attention, naive_causal_linear_attention

    kernel_module = importlib.import_module("linear_attention_transformer.ops.causal.chunk")
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(causal_linear_attention, backend="aot_eager", fullgraph=True)
    for n in (20, 32):
        q, k = (magnitude * torch.randn(1, 2, n, 4, generator=g) for _ in range(2))
        v = torch.randn(1, 2, n, 3, generator=g)
        mask = torch.ones(1, n, dtype=torch.bool)
        mask[0, 5] = False

        def run(fn, *inputs, **options):
            inputs = [t.clone().requires_grad_() for t in inputs]
            if fn is compiled:
                for t in inputs:
                    torch._dynamo.mark_dynamic(t, 2)
                torch._dynamo.mark_dynamic(mask, 1)
            out = fn(*inputs, mask=mask, exp_features=True, **options)
            (out * torch.linspace(-1, 1, 3)).sum().backward()
            return out.detach().double(), [t.grad.double() for t in inputs]

        expected, expected_grads = run(naive_causal_linear_attention, *(t.double() for t in (q, k, v)))
        with monkeypatch.context() as m:  # the inputs need the recompute exactly when magnitude is large
            m.setattr(kernel_module, "_recompute_chunks", lambda out, *args: out)
            unsafe, _ = run(causal_linear_attention, q, k, v, chunk_size=8)
        unsafe_error = (unsafe - expected).abs().max().item()
        assert (unsafe_error > 1e-2) == (magnitude > 1), (n, unsafe_error)

        with torch._dynamo.config.patch(error_on_recompile=n != 20):
            out, grads = run(compiled, q, k, v, chunk_size=8)
        assert_close(out, expected, 1e-4, f"output, n={n}")
        for name, got, want in zip("qkv", grads, expected_grads):
            assert_close(got, want, 1e-3, f"d{name}, n={n}")


# ------------------------------------------------ dynamic shapes: one graph for every length

LENGTHS = (21, 40, 64, 61)  # chunk 8: not a multiple, multiples (40; 64 also of the blocked scan's 8 chunks)


def dynamic_training_compiles(model):
    """Compile ``AutoregressiveWrapper(model)`` (loss: the chunked cross-entropy) with
    ``dynamic=True`` and train one step at each of ``LENGTHS`` (backward outside the compiled
    call, as in a training loop). Returns, per length, how many graphs the backend was given
    during that step: a graph for the first length only means no recompile (dynamo may hand
    over a graph twice for one frame when it restarts its analysis; with
    ``error_on_recompile`` a guard that fails at a new length raises)."""
    from linear_attention_transformer import AutoregressiveWrapper

    calls = []

    def counting(gm, example_inputs):
        calls[-1] += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(AutoregressiveWrapper(model), backend=counting, dynamic=True)
    g = torch.Generator().manual_seed(5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in LENGTHS:
            calls.append(0)
            x = torch.randint(0, NUM_TOKENS, (2, n + 1), generator=g)
            compiled(x).backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
            model.zero_grad(set_to_none=True)
    return calls


def test_dynamic_training_step_one_graph_for_every_length_default_model():
    """The default LM (no causal mask): the graph compiled at the first length serves the
    others, no recompile."""
    model = LinearAttentionTransformerLM(num_tokens=NUM_TOKENS, dim=16, depth=1, max_seq_len=64, heads=2)
    calls = dynamic_training_compiles(model)
    assert calls[0] >= 1 and calls[1:] == [0] * (len(LENGTHS) - 1), calls


def test_dynamic_training_step_one_graph_for_every_length_causal_model():
    """A causal LM (chunk 8, exact global heads, the safe recompute a torch.cond): one graph
    for every length, multiples of the chunk (40) and of the chunk times the blocked scan's
    block (64) included. The kernel's chunk states are ``blocked_linear_scan`` under compile:
    the loop over chunks would unroll into a graph for each chunk count."""
    calls = dynamic_training_compiles(make_model(max_seq_len=max(LENGTHS)))
    assert calls[0] >= 1 and calls[1:] == [0] * (len(LENGTHS) - 1), calls


def test_axial_positions_compile_with_dynamic_shapes_under_inductor():
    """The axial embedding's gradients, compiled by inductor with dynamic shapes, equal eager
    ones at two lengths (its two-gather form crashed there with an out-of-bounds index, or
    as two F.embedding calls gave wrong gradients: positional.py uses one table compiled)."""
    from torch._inductor import config

    from linear_attention_transformer.positional import AxialPositionalEmbedding

    torch.manual_seed(0)
    emb = AxialPositionalEmbedding(16, 256, 128)

    def loss(x):
        return (x + emb(torch.arange(x.shape[1]))).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, dynamic=True)
    with config.patch(compile_threads=1):
        for n in (21, 200):  # positions in the first row of the table only, and in both rows
            x = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n))
            grads = []
            for fn in (compiled, loss):
                emb.zero_grad(set_to_none=True)
                fn(x).backward()
                grads.append([p.grad.clone() for p in emb.parameters()])
            for got, want in zip(*grads):
                assert_close(got, want, 1e-5, f"axial gradient at n={n}")
