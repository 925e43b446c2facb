"""The benchmarks' shared measuring helpers (benchmarks/common.py) count what they claim."""

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from common import _MatmulRecorder, _random_like, causal_kernel_flops, matmul_replay  # noqa: E402


def test_matmul_replay_counts_every_matmul_of_forward_and_backward():
    lin = nn.Linear(32, 48)
    x = torch.randn(16, 32, requires_grad=True)
    seconds, flops, calls = matmul_replay(lambda: lin(x).sum().backward(), "cpu", reps=1)
    # forward addmm, then the input's and the weight's gradients: 3 matmuls of 2 m n k each
    assert calls == 3
    assert flops == 3 * 2 * 16 * 32 * 48
    assert seconds > 0


def test_matmul_recorder_keeps_each_operand_layout():
    a, b = torch.randn(4, 6), torch.randn(5, 6)
    with _MatmulRecorder() as recorder:
        torch.mm(a, b.t())
    (name, (spec_a, spec_b)), = recorder.calls
    assert name == "mm"
    replayed = _random_like(spec_b, "cpu")
    assert replayed.shape == (6, 5) and replayed.stride() == b.t().stride() == (1, 6)


def test_matmul_replay_counts_batched_matmuls_as_the_kernel_formula_does():
    # the recorded FLOPs of the causal kernel (no state, no mask) must match the formula, which
    # is derived by hand from the kernel's block shapes
    from linear_attention_transformer.ops import causal_linear_attention

    q, k, v = (torch.rand(1, 2, 64, 8) for _ in range(3))
    _, flops, _ = matmul_replay(lambda: causal_linear_attention(q, k, v, chunk_size=16), "cpu", reps=1)
    assert flops == causal_kernel_flops(2, 64, 8, 8, 16)


def test_bench_context_parallel_counts_the_bytes_a_layer_sends(tmp_path):
    """bench_context_parallel's counter, around one causal layer on a group of one: the float
    bytes forward + backward are summary_bytes' (the formula tests/test_context_parallel.py
    checks on 2 ranks), the integers the shape check's two int64."""
    import torch.distributed as dist

    from bench_context_parallel import CollectiveBytes
    from linear_attention_transformer import Attention
    from linear_attention_transformer.context_parallel import summary_bytes

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = Attention(dim=16, heads=2, causal=True)
        x = torch.randn(3, 8, 16, requires_grad=True)
        with CollectiveBytes() as sent:
            layer(x, context_parallel=dist.group.WORLD).sum().backward()
        assert sent.floats == sum(summary_bytes(3, 2, 8, 8, 1, exp_features=True))
        assert sent.integers == 2 * 8
    finally:
        dist.destroy_process_group()


def test_bench_threads_reads_its_configs():
    """bench_threads' configs: 'auto' (the default command) or a thread count, either with
    '+spin' (torch imported before the script sets OpenMP's waiting); anything else refused."""
    import pytest

    from bench_threads import SPIN_LAUNCHER, parse_config

    assert parse_config("auto") == (None, False)
    assert parse_config("2+spin") == (2, True)
    assert parse_config("1") == (1, False)
    for bad in ("0", "two", "2+sleep", "auto+"):
        with pytest.raises(SystemExit, match="--configs"):
            parse_config(bad)
    # the launcher imports torch before it runs the script, so the script cannot set the policy
    assert SPIN_LAUNCHER.index("torch") < SPIN_LAUNCHER.index("run_path")


def test_bench_recall_mqar_asks_every_key_once_for_its_own_value():
    """MQAR data (bench_recall.py), Zoology's layout: distinct keys from [1, vocab/2), each
    followed by its value (distinct, from [vocab/2, vocab)); every key is asked exactly once,
    at the first token of a two-token slot after the pairs, and the target there is its
    value; every other later token is random filler, not a constant."""
    from bench_recall import IGNORE, batch_generator, mqar_batch

    seq_len, pairs, vocab = 40, 6, 32
    tokens, targets = mqar_batch(50, seq_len, pairs, vocab, batch_generator(3, 5))
    again, _ = mqar_batch(50, seq_len, pairs, vocab, batch_generator(3, 5))
    assert torch.equal(tokens, again)  # the seed and the step fix the batch
    assert not torch.equal(tokens, mqar_batch(50, seq_len, pairs, vocab, batch_generator(3, 6))[0])
    filler = []
    for row, target in zip(tokens.tolist(), targets.tolist()):
        keys, values = row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(1 <= k < vocab // 2 for k in keys)
        assert len(set(values)) == pairs and all(vocab // 2 <= v < vocab for v in values)
        bound = dict(zip(keys, values))
        asked = [i for i, t in enumerate(target) if t != IGNORE]
        assert sorted(row[i] for i in asked) == sorted(keys)  # each key asked once
        for i in asked:
            assert i >= 2 * pairs and (i - 2 * pairs) % 2 == 0 and target[i] == bound[row[i]]
        filler += [t for i, t in enumerate(row[2 * pairs :], 2 * pairs) if i not in asked]
    assert len(filler) == 50 * (seq_len - 3 * pairs)
    assert set(filler) == set(range(vocab))  # uniform over the whole vocabulary (1,100 draws of 32)


def test_bench_recall_query_slots_follow_the_power_law():
    """Zoology's spacing: the slot of a query is drawn with weight g ** (power_a - 1), so with
    the default power_a most queries come in the first slots after the pairs; power_a = 1 is
    uniform. Here 4 queries among 96 slots: P(slot < 10) is about 0.5 against 0.1."""
    from bench_recall import IGNORE, batch_generator, mqar_batch

    seq_len, pairs, vocab = 200, 4, 512
    for power_a, low, high in ((0.01, 0.4, 0.7), (1.0, 0.05, 0.17)):
        _, targets = mqar_batch(300, seq_len, pairs, vocab, batch_generator(0, 0), power_a=power_a)
        slots = ((targets != IGNORE).nonzero()[:, 1] - 2 * pairs) // 2
        assert slots.numel() == 300 * pairs
        assert low < (slots < 10).float().mean().item() < high, power_a


def test_bench_recall_models_are_causal_and_read_logits_at_the_queries():
    """bench_recall.py's softmax reference and a library variant see no later token (a change
    at position t moves the logits at t onward only), and the loss's logits, read only at
    the query positions, are the full forward's there."""
    from bench_recall import build_model, query_logits

    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 12))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 32
    asked = torch.rand(2, 12) < 0.5
    for name in ("softmax", "softmax+rotary", "taylor+conv+dh16"):
        model = build_model(name, vocab=32, dim=16, depth=2, heads=2, seq_len=12)
        with torch.no_grad():
            before, after = model(tokens), model(changed)
            assert torch.allclose(query_logits(model, tokens, asked), before[asked], atol=1e-5), name
        assert torch.equal(before[:, :6], after[:, :6]), name
        assert (before[:, 6:] - after[:, 6:]).abs().amax(dim=-1).min() > 0, name
