"""Context parallelism (``context_parallel.py``): one sequence split over 2 or 4 gloo
processes must give, in float64, each rank its slice of the one-process output (1e-9), the
one-process parameter gradients summed over the ranks (1e-9), and the input gradients of its
slice (1e-9).

The workers are this file run as a script, all configurations in one set of 4 processes (one
torch import per process): the 4-way configurations use the whole world, the 2-way ones the
pairs {0, 1} and {2, 3}, which run different configurations side by side. They meet through
a file store in ``tmp_path``, save what they computed, and the test process compares it with
the whole sequence run in one process. A worker ends as ``test_distributed.py``'s do (see
its module docstring): a barrier, its modules dropped and ``gc.collect()`` before
``destroy_process_group``, and ``os._exit(0)`` once its output is flushed; a worker that
ended any other way aborted about once in 50 runs.

Each configuration's loss is sum(out * W) for a fixed random W over the whole sequence, so
every output position's gradient differs, and every rank's keys reach later ranks' queries.
``AutoregressiveWrapper``'s loss is compared as itself: the ranks' losses sum to the one-process
loss of the whole N + 1 tokens (1e-9), their parameter gradients too.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linear_attention_transformer import (
    Attention,
    AutoregressiveWrapper,
    LinearAttentionTransformer,
    LinearAttentionTransformerLM,
    LinformerSettings,
)
from linear_attention_transformer.context_parallel import ContextParallel, summary_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 4
PAIRS = ((0, 1), (2, 3))
B, DIM, HEADS = 2, 8, 2
BASE = dict(dim=DIM, heads=HEADS)

# name: (world size, sequence length, Attention options, input scale, mask)
ATTENTION_CONFIGS = {
    "causal_softmax": (2, 20, dict(causal=True, chunk_size=4), 1.0, True),
    "causal_softmax_spread": (2, 20, dict(causal=True, chunk_size=4), 30.0, False),
    "causal_gate_head_kv_heads_elu": (2, 20, dict(causal=True, chunk_size=4, use_gate=True, kv_heads=1,
                                                  feature_map="elu"), 1.0, True),
    "causal_gate_feature": (2, 20, dict(causal=True, chunk_size=4, use_gate=True, gate_granularity="feature"),
                            1.0, True),
    "causal_gate_head_4": (4, 24, dict(causal=True, chunk_size=4, use_gate=True), 1.0, True),
    "causal_relu_gate_feature_4": (4, 24, dict(causal=True, chunk_size=4, use_gate=True, gate_granularity="feature",
                                               feature_map="relu"), 1.0, False),
    "causal_local_blindspot_conv": (2, 16, dict(causal=True, n_local_attn_heads=1, local_attn_window_size=4,
                                                blindspot_size=4, use_local_conv=True, use_gate=True), 1.0, True),
    "causal_local_exact_4": (4, 32, dict(causal=True, n_local_attn_heads=1, local_attn_window_size=4,
                                         local_attn_look_backward=2, local_attn_exact_windowsize=True, chunk_size=4),
                             1.0, True),
    "noncausal_softmax": (2, 20, dict(), 1.0, True),
    "noncausal_softmax_gate_head": (2, 20, dict(use_gate=True), 1.0, False),
    "noncausal_relu": (2, 20, dict(feature_map="relu", kv_heads=1), 1.0, True),
    "noncausal_elu_gate_feature_4": (4, 24, dict(feature_map="elu", use_gate=True, gate_granularity="feature"),
                                     1.0, True),
    "noncausal_local_conv_4": (4, 32, dict(n_local_attn_heads=1, local_attn_window_size=4, use_local_conv=True,
                                           local_conv_kernel=5), 1.0, True),
    # the global heads' q and k narrower (2) or wider (6) than dim_head (4)
    "causal_dim_qk_taylor_gate_feature_conv": (2, 20, dict(causal=True, chunk_size=4, dim_qk=2, feature_map="taylor",
                                                           use_gate=True, gate_granularity="feature",
                                                           use_local_conv=True), 1.0, True),
    "causal_dim_qk_softmax_blindspot_kv_heads_4": (4, 24, dict(causal=True, chunk_size=4, dim_qk=6, blindspot_size=2,
                                                               kv_heads=1), 1.0, True),
    "noncausal_dim_qk_elu_local_gate_conv": (2, 16, dict(dim_qk=6, feature_map="elu", n_local_attn_heads=1,
                                                         local_attn_window_size=4, use_gate=True,
                                                         use_local_conv=True), 1.0, True),
    "noncausal_dim_qk_softmax_gate": (2, 20, dict(dim_qk=2, use_gate=True), 1.0, False),
}
NUM_TOKENS = 11
MODEL = dict(dim=DIM, heads=HEADS, depth=2)
# name: (kind, world size, sequence length, options, mask)
MODEL_CONFIGS = {
    "transformer_gate_conv_shift": ("transformer", 2, 16, dict(causal=True, use_gate=True, use_local_conv=True,
                                                               shift_tokens=True, chunk_size=4), True),
    "transformer_encoder_local_shift_rotary_4": ("transformer", 4, 32, dict(n_local_attn_heads=1, shift_tokens=True,
                                                                            local_attn_window_size=4,
                                                                            use_rotary_emb=True), True),
    "lm_local_blindspot_axial": ("lm", 2, 16, dict(causal=True, n_local_attn_heads=1, local_attn_window_size=4,
                                                   blindspot_size=4, use_gate=True, gate_granularity="feature"),
                                 False),
    "lm_rotary_reversible_gate_per_layer_local_4": ("lm", 4, 32, dict(causal=True, use_rotary_emb=True,
                                                                      reversible=True, use_gate=True, chunk_size=4,
                                                                      n_local_attn_heads=(1, 0),
                                                                      local_attn_window_size=4, shift_tokens=True),
                                                    False),
    "lm_dim_qk_rotary_local_gate_feature": ("lm", 2, 16, dict(causal=True, dim_qk=2, use_rotary_emb=True,
                                                             n_local_attn_heads=1, local_attn_window_size=4,
                                                             use_gate=True, gate_granularity="feature",
                                                             chunk_size=4), True),
    "lm_checkpoint_conv_absolute": ("lm", 2, 16, dict(causal=True, checkpoint=True, use_local_conv=True,
                                                      use_axial_pos_emb=False, chunk_size=4), True),
    # what AutoregressiveWrapper's loss reads: the features before the output layer
    "lm_output_features_factorised": ("lm_features", 2, 16, dict(causal=True, emb_dim=4, shift_tokens=True,
                                                                 chunk_size=4), True),
}


# AutoregressiveWrapper's loss: name: (world size, N (the net reads N tokens of the N + 1),
# LM options, mask, ignore_index, whether the net exposes output_features (the chunked loss) or
# only logits (F.cross_entropy)); rank r passes tokens[:, r n_local : (r + 1) n_local + 1]
WRAPPER_CONFIGS = {
    "wrapper_chunked_loss": (2, 16, dict(causal=True, chunk_size=4, shift_tokens=True), "random", -100, True),
    "wrapper_logits_loss": (2, 16, dict(causal=True, chunk_size=4, use_gate=True), "random", -100, False),
    # rank 2's targets all masked out (and rank 1's last, across the boundary): a rank that
    # counts no target still takes part, and the mean is over the whole sequence's count
    "wrapper_local_masked_slice_4": (4, 32, dict(causal=True, n_local_attn_heads=1, local_attn_window_size=4,
                                                 use_local_conv=True), "slice", -100, True),
    "wrapper_ignore_index_4": (4, 32, dict(causal=True, chunk_size=4, use_rotary_emb=True), None, 3, True),
}


class LogitsOnly(torch.nn.Module):
    """An LM seen through its logits only (no output_features): the wrapper's plain loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.max_seq_len = lm, lm.max_seq_len

    def forward(self, x, input_mask=None, **kwargs):
        return self.lm(x, input_mask, **kwargs)


def make_wrapper(name):
    _, n, options, _, ignore_index, chunked = WRAPPER_CONFIGS[name]
    torch.manual_seed(0)
    lm = LinearAttentionTransformerLM(NUM_TOKENS, max_seq_len=n, **MODEL, **options).double()
    return AutoregressiveWrapper(lm if chunked else LogitsOnly(lm), ignore_index=ignore_index)


def wrapper_inputs(name):
    """The whole sequence of N + 1 tokens and its mask (or None)."""
    world, n, _, masked, _, _ = WRAPPER_CONFIGS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    tokens = torch.randint(0, NUM_TOKENS, (B, n + 1), generator=g)
    mask = None
    if masked == "random":
        mask = torch.rand(B, n + 1, generator=g) > 0.25
    elif masked == "slice":  # the targets of rank 2's positions, tokens 2 n_local + 1 .. 3 n_local
        n_local = n // world
        mask = torch.ones(B, n + 1, dtype=torch.bool)
        mask[:, 2 * n_local : 3 * n_local + 1] = False
    return tokens, mask


def wrapper_slice(t, rank, n_local):
    """Rank ``rank``'s part of tokens (or mask) (b, N + 1): its n_local and the one after."""
    return None if t is None else t[:, rank * n_local : (rank + 1) * n_local + 1]


def run_wrapper(wrapper, tokens, mask, **kwargs):
    """The wrapper's loss and its parameter gradients."""
    wrapper.zero_grad(set_to_none=True)
    loss = wrapper(tokens, input_mask=mask, **kwargs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in wrapper.named_parameters() if p.grad is not None}


class OutputFeatures(torch.nn.Module):
    """An LM's ``output_features`` as a module's forward."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x, input_mask=None, **kwargs):
        return self.lm.output_features(x, input_mask, **kwargs)
# the bytes a rank hands to the collectives, counted at two lengths (world 2)
BYTES_CONFIGS = {
    "causal_softmax": (dict(causal=True, chunk_size=4), dict(exp_features=True)),
    "causal_gate_feature_elu": (dict(causal=True, chunk_size=4, use_gate=True, gate_granularity="feature",
                                     feature_map="elu"), dict(gate_width=DIM // HEADS)),
    "noncausal_softmax": (dict(), dict(causal=False, normalize=False, softmax_keys=True)),
    "noncausal_elu": (dict(feature_map="elu"), dict(causal=False)),
    # the halos on top: P * b * (h_local * 2 * w * d + w) elements for the local heads'
    # keys, values and mask, P * b * 3 * h * 2 * d for the convolution's two inputs before
    "causal_local_conv": (dict(causal=True, chunk_size=4, n_local_attn_heads=1, local_attn_window_size=4,
                               use_local_conv=True), None),
}
BYTES_LENGTHS = (8, 64)  # per rank


def make_attention(options):
    torch.manual_seed(0)
    return Attention(**BASE, **options).double()


def make_model(kind, n, options):
    torch.manual_seed(0)
    if kind == "lm":
        return LinearAttentionTransformerLM(NUM_TOKENS, max_seq_len=n, **MODEL, **options).double()
    if kind == "lm_features":
        return OutputFeatures(LinearAttentionTransformerLM(NUM_TOKENS, max_seq_len=n, **MODEL, **options).double())
    return LinearAttentionTransformer(max_seq_len=n, **MODEL, **options).double()


def inputs(name, n, scale=1.0, masked=False, tokens=False, out_width=DIM):
    """The whole sequence's input, mask and loss weights (the same in every process)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if tokens:
        x = torch.randint(0, NUM_TOKENS, (B, n), generator=g)
    else:
        x = torch.randn(B, n, DIM, generator=g, dtype=torch.float64) * scale
    weight = torch.randn(B, n, out_width, generator=g, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(B, n, generator=g) > 0.25
        mask[:, 0] = True
    return x, mask, weight


def run(module, x, mask, weight, **kwargs):
    """Forward, loss sum(out * weight), backward: (out, input gradient (None for tokens),
    parameter gradients)."""
    if x.dtype.is_floating_point:
        x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(x, input_mask=mask, **kwargs)
    (out * weight).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def config(name):
    """(make the module, world size, sequence length, input, mask, weight) of a configuration."""
    if name in ATTENTION_CONFIGS:
        world, n, options, scale, masked = ATTENTION_CONFIGS[name]
        return (lambda: make_attention(options)), world, n, *inputs(name, n, scale, masked)
    kind, world, n, options, masked = MODEL_CONFIGS[name]
    width = {"lm": NUM_TOKENS, "lm_features": options.get("emb_dim", DIM)}.get(kind, DIM)
    tokens = kind != "transformer"
    return (lambda: make_model(kind, n, options)), world, n, *inputs(name, n, 1.0, masked, tokens, width)


def assignments():
    """Which group runs each configuration: the world, or one of the pairs (alternating)."""
    placed, pair = {}, 0
    for name in [*ATTENTION_CONFIGS, *MODEL_CONFIGS, *WRAPPER_CONFIGS]:
        world = WRAPPER_CONFIGS[name][0] if name in WRAPPER_CONFIGS else config(name)[1]
        if world == WORLD:
            placed[name] = None
        else:
            placed[name], pair = PAIRS[pair], 1 - pair
    return placed


# --------------------------------------------------------------------------- worker


class ByteCounter:
    """Counts the bytes this process hands to all_gather / all_reduce / scatter."""

    def __init__(self, dist):
        self.dist, self.count, self.saved = dist, 0, {}

    def __enter__(self):
        for name in ("all_gather", "all_reduce", "scatter"):
            original = getattr(self.dist, name)
            self.saved[name] = original

            def counted(*args, _original=original, _name=name, **kwargs):
                if _name == "all_gather":
                    tensor = args[1] if len(args) > 1 else kwargs["tensor"]
                elif _name == "scatter":  # the sending rank's list, or None
                    tensors = args[1] if len(args) > 1 else kwargs.get("scatter_list")
                    tensor = None
                    if tensors:
                        self.count += sum(t.numel() * t.element_size() for t in tensors)
                else:
                    tensor = args[0] if args else kwargs["tensor"]
                if tensor is not None:
                    self.count += tensor.numel() * tensor.element_size()
                return _original(*args, **kwargs)

            setattr(self.dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.dist, name, original)


def worker(rank, store_path, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        pairs = {pair: dist.new_group(list(pair)) for pair in PAIRS}  # every rank creates every group
        world_group = dist.group.WORLD
        module = None
        for name, group_ranks in assignments().items():
            ranks = tuple(range(WORLD)) if group_ranks is None else group_ranks
            if rank not in ranks:
                continue
            group = world_group if group_ranks is None else pairs[group_ranks]
            if name in WRAPPER_CONFIGS:
                world, n = WRAPPER_CONFIGS[name][:2]
                tokens, mask = wrapper_inputs(name)
                module = make_wrapper(name)
                local_rank = ranks.index(rank)
                loss, grads = run_wrapper(module, wrapper_slice(tokens, local_rank, n // world),
                                          wrapper_slice(mask, local_rank, n // world), context_parallel=group)
                torch.save(dict(loss=loss, grads=grads), out_dir / f"{name}-{local_rank}.pt")
                continue
            make, world, n, x, mask, weight = config(name)
            local_rank, n_local = ranks.index(rank), n // world
            part = slice(local_rank * n_local, (local_rank + 1) * n_local)
            module = make()
            out, x_grad, grads = run(module, x[:, part], None if mask is None else mask[:, part], weight[:, part],
                                     context_parallel=group)
            torch.save(dict(out=out, x_grad=x_grad, grads=grads), out_dir / f"{name}-{local_rank}.pt")

        # bytes per layer, on the pair {0, 1}, at two slice lengths; the ContextParallel is
        # built first, so that only the layer's own collectives are counted
        if rank in PAIRS[0]:
            counts = {}
            for name, (options, _) in BYTES_CONFIGS.items():
                module = make_attention(options)
                for n_local in BYTES_LENGTHS:
                    x, mask, weight = inputs(name, 2 * n_local, 1.0, True)
                    part = slice(rank * n_local, (rank + 1) * n_local)
                    place = ContextParallel.of(pairs[PAIRS[0]], B, n_local)
                    x_part = x[:, part].clone().requires_grad_(True)
                    with ByteCounter(dist) as forward:
                        out = module(x_part, input_mask=mask[:, part], context_parallel=place)
                    with ByteCounter(dist) as backward:
                        (out * weight[:, part]).sum().backward()
                    counts[(name, n_local)] = (forward.count, backward.count)
            # slices of different lengths are refused on every rank
            try:
                make_attention(dict(causal=True))(torch.zeros(B, 3 + rank, DIM, dtype=torch.float64),
                                                  context_parallel=pairs[PAIRS[0]])
                counts["unequal"] = None
            except ValueError as error:
                counts["unequal"] = str(error)
            # a whole sequence longer than max_seq_len is refused on every rank
            try:
                make_model("lm", 8, dict(causal=True))(torch.zeros(B, 8, dtype=torch.long),
                                                       context_parallel=pairs[PAIRS[0]])
                counts["too long"] = None
            except ValueError as error:
                counts["too long"] = str(error)
            # the wrapper's slices must overlap by one token: slices that do not are refused
            wrapper = make_wrapper("wrapper_chunked_loss")
            tokens = torch.arange(16, dtype=torch.long)[None].expand(B, 16) % NUM_TOKENS
            try:
                wrapper(tokens[:, rank * 8 : (rank + 1) * 8], context_parallel=pairs[PAIRS[0]])
                counts["no overlap"] = None
            except ValueError as error:
                counts["no overlap"] = str(error)
            torch.save(counts, out_dir / f"bytes-{rank}.pt")
        del module
        dist.barrier()  # every rank is done communicating before any shuts a connection
    finally:
        gc.collect()
        dist.destroy_process_group()


def worker_main(argv):
    """Run a worker, then leave without interpreter finalization (see the module docstring)."""
    worker(int(argv[0]), argv[1], argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run the four workers once; return the directory holding what they computed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with the gloo backend is needed for these tests")
    out = tmp_path_factory.mktemp("context_parallel")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(out / "store"), str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return out


def _close(got, want, what):
    err = (got - want).abs().max().item()
    assert err <= 1e-9, f"{what}: off by {err:.2e}"


@pytest.mark.parametrize("name", [*ATTENTION_CONFIGS, *MODEL_CONFIGS])
def test_slices_equal_the_whole_sequence(results, name):
    make, world, n, x, mask, weight = config(name)
    want_out, want_x_grad, want_grads = run(make(), x, mask, weight)
    n_local = n // world
    got = [torch.load(results / f"{name}-{r}.pt") for r in range(world)]
    assert want_out.abs().max() > 1e-3  # the comparison proves something
    for r, g in enumerate(got):
        part = slice(r * n_local, (r + 1) * n_local)
        _close(g["out"], want_out[:, part], f"rank {r} output")
        if want_x_grad is not None:
            _close(g["x_grad"], want_x_grad[:, part], f"rank {r} input gradient")
    assert set(got[0]["grads"]) == set(want_grads)
    for key, want in want_grads.items():
        _close(sum(g["grads"][key] for g in got), want, f"gradient of {key}")
    # what the slices exchange matters: the second slice run alone differs from its part of
    # the whole sequence's output (for models, positions aside: run at positions 0..n_local-1)
    if name not in MODEL_CONFIGS:
        alone, _, _ = run(make(), x[:, n_local:], None if mask is None else mask[:, n_local:], weight[:, n_local:])
        assert (alone[:, :n_local] - want_out[:, n_local : 2 * n_local]).abs().max() > 1e-6


@pytest.mark.parametrize("name", list(WRAPPER_CONFIGS))
def test_autoregressive_loss_equals_the_whole_sequence(results, name):
    """The ranks' losses sum to the one-process loss of the N + 1 tokens, and their summed
    parameter gradients are its gradients: every target counted once, the mean over all."""
    world, n = WRAPPER_CONFIGS[name][:2]
    tokens, mask = wrapper_inputs(name)
    want_loss, want_grads = run_wrapper(make_wrapper(name), tokens, mask)
    got = [torch.load(results / f"{name}-{r}.pt") for r in range(world)]
    _close(sum(g["loss"] for g in got), want_loss, "summed loss")
    assert set(got[0]["grads"]) == set(want_grads)
    for key, want in want_grads.items():
        _close(sum(g["grads"][key] for g in got), want, f"gradient of {key}")
    # each rank's part is its own targets' share, not the whole: they differ from rank to rank
    assert max(abs(g["loss"] - want_loss / world).item() for g in got) > 1e-6
    if WRAPPER_CONFIGS[name][3] == "slice":
        assert got[2]["loss"].item() == 0.0 and torch.isfinite(want_loss)


def test_autoregressive_slices_that_do_not_overlap_are_refused_on_every_rank(results):
    for r in PAIRS[0]:
        message = torch.load(results / f"bytes-{r}.pt")["no overlap"]
        assert message is not None and "ranks 0 and 1 differ" in message


@pytest.mark.parametrize("name", list(BYTES_CONFIGS))
def test_bytes_per_layer_do_not_depend_on_the_length(results, name):
    counts = [torch.load(results / f"bytes-{r}.pt") for r in PAIRS[0]]
    options, shape = BYTES_CONFIGS[name]
    dim_head, world = DIM // HEADS, len(PAIRS[0])
    if shape is None:  # one global head, one local head of window 4 (look_backward 1), kernel 3
        summary = summary_bytes(B, 1, dim_head, dim_head, world, exp_features=True, dtype=torch.float64)[0]
        halos = world * B * (1 * 2 * 4 * dim_head + 4) * 8 + world * B * 3 * 1 * 2 * dim_head * 8
        expected = (summary + halos, summary + halos)
    else:
        expected = summary_bytes(B, HEADS, dim_head, dim_head, world, dtype=torch.float64, **shape)
    for rank_counts in counts:
        short, long = (rank_counts[(name, n)] for n in BYTES_LENGTHS)
        assert short == long, f"bytes (forward, backward) depend on the length: {short} vs {long}"
        assert short == expected, f"(forward, backward) send {short} bytes, summary_bytes says {expected}"


def test_unequal_slices_are_refused_on_every_rank(results):
    for r in PAIRS[0]:
        message = torch.load(results / f"bytes-{r}.pt")["unequal"]
        assert message is not None and "same (batch, length)" in message


def test_a_whole_sequence_longer_than_max_seq_len_is_refused_on_every_rank(results):
    for r in PAIRS[0]:
        message = torch.load(results / f"bytes-{r}.pt")["too long"]
        assert message is not None and "sequence length 16 (2 slices of 8) exceeds max_seq_len=8" in message


REFUSED = {  # Attention options, forward keywords, slice length, what the message names
    "local heads, slice not a multiple of the window": (
        dict(causal=True, n_local_attn_heads=1, local_attn_window_size=4), {}, 6, "multiple of local_attn_window_size=4"),
    "local heads, slice shorter than the windows looked at": (dict(n_local_attn_heads=1, local_attn_window_size=4,
                                                                   local_attn_look_backward=2), {}, 4,
                                                              "local_attn_look_backward"),
    "blindspot, slice not a multiple of the block": (dict(causal=True, blindspot_size=4), {}, 6,
                                                     "multiple of blindspot_size=4"),
    "convolution, slice shorter than its taps": (dict(causal=True, use_local_conv=True, local_conv_kernel=5), {}, 3,
                                                 "local_conv_kernel"),
    "segment_ids": (dict(causal=True), dict(segment_ids=torch.zeros(B, 6, dtype=torch.long)), 6, "segment_ids"),
    "cache": (dict(causal=True), dict(return_cache=True), 6, "cache"),
    "cross-attention": (dict(receives_context=True), dict(context=torch.zeros(B, 5, DIM)), 6, "receives_context"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_unsupported_attention_options_are_refused_before_any_communication(what):
    """The options are checked before the group is touched: any placeholder shows it."""
    options, kwargs, n, named = REFUSED[what]
    layer = Attention(**BASE, **options)
    with pytest.raises(ValueError, match=named):
        layer(torch.zeros(B, n, DIM), context_parallel=object(), **kwargs)


MODELS_REFUSED = {  # model, forward keywords, what the message names
    "Linformer": (lambda: LinearAttentionTransformer(DIM, 1, 8, heads=HEADS, linformer_settings=LinformerSettings(k=4)),
                  {}, "Linformer"),
    "attend_axially": (lambda: LinearAttentionTransformer(DIM, 1, 8, heads=HEADS, attend_axially=True,
                                                          local_attn_window_size=4), {}, "attend_axially"),
    "cross-attention": (lambda: LinearAttentionTransformer(DIM, 1, 8, heads=HEADS, receives_context=True),
                        dict(context=torch.zeros(B, 5, DIM)), "receives_context"),
    "segment_ids": (lambda: LinearAttentionTransformer(DIM, 1, 8, heads=HEADS),
                    dict(segment_ids=torch.zeros(B, 8, dtype=torch.long)), "segment_ids"),
    "LM cache": (lambda: LinearAttentionTransformerLM(NUM_TOKENS, DIM, 1, 8, heads=HEADS, causal=True),
                 dict(return_cache=True), "cache"),
    "LM layer's local heads": (lambda: LinearAttentionTransformerLM(NUM_TOKENS, DIM, 1, 8, heads=HEADS,
                                                                    n_local_attn_heads=(1,), local_attn_window_size=3),
                               {}, "local_attn_window_size=3"),
}


@pytest.mark.parametrize("what", list(MODELS_REFUSED))
def test_unsupported_model_options_are_refused_before_any_communication(what):
    make, kwargs, named = MODELS_REFUSED[what]
    model = make()
    lm = isinstance(model, LinearAttentionTransformerLM)
    x = torch.zeros(B, 8, dtype=torch.long) if lm else torch.zeros(B, 8, DIM)
    with pytest.raises(ValueError, match=named):
        model(x, context_parallel=object(), **kwargs)


WRAPPER_REFUSED = {  # what is called, what the message names
    "generate": (lambda w: w.generate(torch.zeros(B, 3, dtype=torch.long), 2, context_parallel=object()),
                 "context_parallel: generate"),
    "generate with the cache": (lambda w: w.generate(torch.zeros(B, 3, dtype=torch.long), 2, use_cache=True,
                                                     context_parallel=object()), "context_parallel: generate"),
    "segment_ids": (lambda w: w(torch.zeros(B, 9, dtype=torch.long), segment_ids=torch.zeros(B, 9, dtype=torch.long),
                                context_parallel=object()), "segment_ids"),
}


@pytest.mark.parametrize("what", list(WRAPPER_REFUSED))
def test_unsupported_wrapper_uses_are_refused_before_any_communication(what):
    call, named = WRAPPER_REFUSED[what]
    with pytest.raises(ValueError, match=named):
        call(make_wrapper("wrapper_chunked_loss"))


def test_the_wrapper_needs_a_process_group():
    with pytest.raises(TypeError, match="context_parallel must be a torch.distributed ProcessGroup"):
        make_wrapper("wrapper_chunked_loss")(torch.zeros(B, 9, dtype=torch.long), context_parallel="group")


def test_context_parallel_must_be_a_process_group():
    with pytest.raises(TypeError, match="context_parallel must be a torch.distributed ProcessGroup"):
        Attention(**BASE, causal=True)(torch.zeros(B, 6, DIM), context_parallel="group")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker_main(sys.argv[2:5])


@pytest.mark.parametrize("exp_features", [False, True])
@pytest.mark.parametrize("decay", [None, "head", "feature"])
def test_causal_summary_is_the_recurrences_state(exp_features, decay):
    """A slice's summary (``scan.summarize`` under ``causal_summary``) is the state the
    recurrence holds after the slice from a zero start, its reference included, float64,
    masked tokens neither adding a key nor decaying; a slice whose keys are all masked has
    a summary of zeros on references of -inf. Its log decay is the slice's total."""
    from linear_attention_transformer.context_parallel import causal_summary
    from linear_attention_transformer.ops import recurrent_causal_linear_attention

    g = torch.Generator().manual_seed(3)
    b, h, n, d, e = 2, 2, 13, 4, 3
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * 4 for _ in range(2))
    if not exp_features:
        q, k = q.abs(), k.abs()
    v = torch.randn(b, h, n, e, generator=g, dtype=torch.float64)
    log_decay = None if decay is None else -torch.rand(b, h, n, *(() if decay == "head" else (d,)), generator=g,
                                                       dtype=torch.float64)
    mask = torch.rand(b, n, generator=g) < 0.7
    mask[1] = False  # a slice without a key
    summary = causal_summary(k, v, log_decay, mask, exp_features)
    _, state = recurrent_causal_linear_attention(q, k, v, log_decay, mask, exp_features=exp_features)
    torch.testing.assert_close(summary.kv, state.kv, rtol=1e-12, atol=1e-12)
    assert torch.equal(summary.kv[1], torch.zeros_like(summary.kv[1]))
    if exp_features:
        torch.testing.assert_close(summary.ref, state.ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(summary.ref[1], torch.full_like(summary.ref[1], float("-inf")))
    if decay is not None:
        masked = log_decay.masked_fill(~mask.view(b, 1, n, *([1] if decay == "feature" else [])), 0.0)
        torch.testing.assert_close(summary.log_decay, masked.sum(dim=2).view(b, h, -1), rtol=1e-12, atol=1e-12)
