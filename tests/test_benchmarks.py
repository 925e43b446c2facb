"""The benchmarks' harness (benchmarks/common.py) counts what it claims, the scripts run their
variants at small sizes, and the figure check finds a quote that its recorded run does not hold."""

import json
import math
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import common  # noqa: E402


def test_step_flops_counts_every_matmul_of_forward_and_backward():
    lin = nn.Linear(32, 48)
    x = torch.randn(16, 32, requires_grad=True)
    # forward addmm, then the input's and the weight's gradients: 3 matmuls of 2 m n k each
    assert common.step_flops(lambda: lin(x).sum().backward()) == 3 * 2 * 16 * 32 * 48


def test_step_flops_of_the_causal_kernel_match_its_block_shapes():
    """Forward, per head, with C the chunk and e + 1 for the normaliser's column of v: the full
    C x C block of q kᵀ (2 n C d) and of weights @ v (2 n C (e + 1)), q @ state and the chunk
    states (2 n d (e + 1) each)."""
    from linear_attention_transformer.ops import causal_linear_attention

    heads, n, d, chunk = 2, 64, 8, 16
    q, k, v = (torch.rand(1, heads, n, d) for _ in range(3))
    forward = heads * (2 * n * chunk * d + 2 * n * chunk * (d + 1) + 4 * n * d * (d + 1))
    assert common.step_flops(lambda: causal_linear_attention(q, k, v, chunk_size=chunk)) == forward


def test_softmax_reference_is_causal():
    torch.manual_seed(0)
    layer = common.SoftmaxSelfAttention(dim=16, heads=2, dim_head=8)
    x = torch.randn(1, 10, 16)
    changed = x.clone()
    changed[:, 6] += 1
    before, after = layer(x), layer(changed)
    assert torch.equal(before[:, :6], after[:, :6])
    assert (before[:, 6:] - after[:, 6:]).abs().amax(dim=-1).min() > 0


def test_settings_parse_python_literals_and_refuse_the_rest():
    assert common.parse_settings("base") == {}
    assert common.parse_settings("use_gate=True,gate_granularity=head,depth=4") == dict(
        use_gate=True, gate_granularity="head", depth=4)
    assert common.settings_text({"segments": 8}) == "segments=8" and common.settings_text({}) == "base"
    for bad in ("use_gate", "2x=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            common.parse_settings(bad)


def test_step_ratios_compare_with_upstream_the_first_variant_and_the_shortest_length():
    def case(impl, settings, n):
        return dict(impl=impl, settings=settings, n=n)

    cases = [case("ours", {}, 64), case("upstream", {}, 64), case("ours", {"depth": 4}, 64), case("ours", {}, 128)]
    results = [dict(median=1.0, peak=10), dict(median=3.0, peak=20), dict(median=2.0, peak=5),
               dict(median=2.5, peak=30)]
    ratios = common.step_ratios(cases, results)
    assert ratios == {"speed vs upstream, base n=64": 3.0, "peak vs upstream, base n=64": 0.5,
                      "time vs first variant, depth=4 n=64": 2.0, "peak vs first variant, depth=4 n=64": 0.5,
                      "peak n=128 / n=64, base": 3.0}


def test_run_step_cases_keeps_each_cases_fastest_round(monkeypatch, capsys):
    import argparse

    medians = iter([3.0, 5.0, 2.0, 6.0, 4.0, None])  # rounds of two cases; the last run fails

    def run_in_subprocess(script, argv, label, env=None):
        median = next(medians)
        return (None, f"{label} failed") if median is None else (dict(median=median), None)

    monkeypatch.setattr(common, "run_in_subprocess", run_in_subprocess)
    args = argparse.Namespace(device="cpu", steps=1, warmup=0, threads=None, matmul_size=None, rounds=3)
    cases = [dict(impl="ours", settings={}, n=8), dict(impl="ours", settings={"depth": 1}, n=8)]
    assert common.run_step_cases("x.py", args, cases) == [dict(median=2.0), dict(median=5.0)]
    assert "depth=1 n=8 failed" in capsys.readouterr().out


def test_bench_lm_runs_its_variants_and_records_them(tmp_path, monkeypatch, capsys):
    """Every variant in its own subprocess, the table, the ratios against the first variant, and
    the record that check_figures reads."""
    import bench_lm

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    code = bench_lm.main(["--device", "cpu", "--lengths", "32", "--steps", "1", "--warmup", "0", "--threads", "1",
                          "--matmul-size", "64", "--variants", "base", "segments=2,loss=wrapper,depth=1",
                          "--record", "tiny"])
    out = capsys.readouterr().out
    assert code == 0, out
    entry = json.loads((tmp_path / "tiny.json").read_text())
    assert entry["command"].startswith("python benchmarks/") and entry["date"][:4].isdigit()
    base = entry["figures"]["ours base n=32"]
    assert base["median"] > 0 and base["peak"] >= 0 and 0 < base["floor_share"]
    assert "time vs first variant, segments=2,loss=wrapper,depth=1 n=32" in entry["figures"]


def test_bench_layer_builds_the_gated_and_the_softmax_layers():
    import bench_layer

    for settings in ({}, {"use_gate": True, "use_local_conv": True}, {"layer": "softmax"}):
        layer, step = bench_layer.build_step(dict(impl="ours", settings=settings, n=16), "cpu")
        step()
        assert all(p.grad is not None for p in layer.parameters() if p.requires_grad), settings
    assert isinstance(bench_layer.build_step(dict(impl="ours", settings={"layer": "softmax"}, n=8), "cpu")[0],
                      common.SoftmaxSelfAttention)


def test_bench_generate_cached_and_recomputed_tokens_agree():
    import argparse

    import bench_generate

    for options in ({}, dict(use_gate=True, use_local_conv=True)):  # (--set's model arguments)
        args = argparse.Namespace(device="cpu", batch=2, prompt_len=4, new_tokens=16, check_tokens=8,
                                  model={**bench_generate.MODEL, **options})
        figures = bench_generate.measure(args)
        assert figures["same_tokens"]
        # (times of a few tokens on a shared machine: the ratios are only checked to be figures)
        assert all(math.isfinite(figures[key]) for key in ("speedup", "batch_ratio", "flat"))


def test_bench_generate_weight_floor_reads_every_matrix_a_step_reads(monkeypatch):
    """The weights' floor multiplies one vector by every 2-D parameter except the token
    embedding (a step reads one row of it), once per pass; both floors are positive times."""
    import bench_generate

    model = bench_generate.build_wrapper("cpu", dict(bench_generate.MODEL, depth=1, max_seq_len=64)).net
    seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, w: seen.append(tuple(w.shape)) or mm(x, w))
    warm, cold = bench_generate.weight_floors(model, "cpu", reps=2)
    expected = sorted(tuple(p.shape[::-1]) for name, p in model.named_parameters()
                      if p.ndim == 2 and name != "token_emb.weight")
    assert sorted(seen[: len(seen) // 4]) == expected and len(seen) == 4 * len(expected)
    assert 0 < warm < math.inf and 0 < cold < math.inf


def test_check_figures_finds_a_stale_quote_and_a_missing_date(tmp_path):
    import check_figures

    (tmp_path / "results").mkdir()
    entry = dict(command="python benchmarks/x.py", date="2026-01-02 03:04 UTC", figures={"a": {"b": 48.7}})
    (tmp_path / "results" / "x.json").write_text(json.dumps(entry))
    quote = [("doc.md", "x", ["a", "b"], "**{:.0f}x faster**")]

    def check(text, quotes=quote):
        (tmp_path / "doc.md").write_text(text)
        return check_figures.problems(quotes, root=str(tmp_path), results=str(tmp_path / "results"))

    assert check("generation is **49x faster** (2026-01-02)") == []
    assert "should quote '**49x faster**'" in check("generation is **87x faster** (2026-01-02)")[0]
    assert "without its run's date" in check("generation is **49x faster**")[0]
    quotient = [("doc.md", "x", (["a", "b"], ["a", "b"]), "takes {:.2f}x")]
    assert check("it takes 1.00x (2026-01-02)", quotient) == []
    assert "no recorded figure" in check("", [("doc.md", "y", ["a"], "{}")])[0]
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "README.md").write_text("| speed-up | 48.7x | `x` | 2026-01-01 03:04 UTC |")
    stale_row = check("**49x faster** (2026-01-02)")
    assert "a row of x dated 2026-01-01 03:04 UTC, its latest run 2026-01-02 03:04 UTC" in stale_row[0]


def test_the_documents_quote_the_latest_recorded_figures():
    import check_figures

    assert check_figures.problems() == []


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


def test_bench_recall_held_out_past_the_training_length_stretches_the_query_slots():
    """The longer held-out sets (--lengths): at every factor the same pairs open the sequence
    and the keys are asked in the same order; training slot s of S moves to a slot of
    [floor(s S' / S), floor((s + 1) S' / S)) of the longer sequence's S', so the queries lie
    further from their keys; at factor 1 the set is the usual held-out set."""
    from bench_recall import HELD_OUT, IGNORE, batch_generator, held_out_past, mqar_batch

    seq_len, pairs, vocab, count = 40, 6, 64, 200
    base_tokens, base_targets = mqar_batch(count, seq_len, pairs, vocab, batch_generator(*HELD_OUT))
    tokens, targets = held_out_past(count, 1, seq_len, pairs, vocab)
    assert torch.equal(tokens, base_tokens) and torch.equal(targets, base_targets)

    def asked(tokens, targets):  # per sequence, the keys in the order they are asked, and their slots
        where = [(t != IGNORE).nonzero()[:, 0] for t in targets]
        return [row[w].tolist() for row, w in zip(tokens, where)], [((w - 2 * pairs) // 2).tolist() for w in where]

    base_order, base_slots = asked(base_tokens, base_targets)
    slots = (seq_len - 2 * pairs) // 2  # 14
    for factor in (2, 4, 16):
        tokens, targets = held_out_past(count, factor, seq_len, pairs, vocab)
        assert tokens.shape == (count, factor * seq_len)
        assert torch.equal(tokens[:, : 2 * pairs], base_tokens[:, : 2 * pairs])  # the same pairs
        order, long_slots = asked(tokens, targets)
        assert order == base_order  # the same keys, asked in the same order, each once
        wide = (factor * seq_len - 2 * pairs) // 2
        moved = []
        for short, long in zip(base_slots, long_slots):
            for s, t in zip(short, long):
                assert s * wide // slots <= t < (s + 1) * wide // slots, (factor, s, t)
                moved.append(t - s * wide // slots)
        assert len(set(moved)) > 1  # a draw within the share, not its first slot
        for row, target in zip(tokens.tolist(), targets.tolist()):
            bound = dict(zip(row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]))
            assert all(target[i] == bound[row[i]] for i, t in enumerate(target) if t != IGNORE)
        # further from their keys: the mean slot grows about as wide / slots
        grown = torch.tensor(sum(long_slots, [])).double().mean() / torch.tensor(sum(base_slots, [])).double().mean()
        assert 0.8 * wide / slots < grown < 1.2 * wide / slots, factor


def test_bench_recall_clean_filler_drops_the_asked_keys_and_keeps_the_rest():
    """--clean-filler: the clean held-out set has none of a sequence's keys in its filler, while
    the plain one has some; the pairs, the queries (positions, keys, targets) and every filler
    token that was not a key are the same in both."""
    from bench_recall import IGNORE, clean_filler, held_out_past

    seq_len, pairs, vocab, count = 40, 6, 32, 100
    for factor in (1, 4):
        tokens, targets = held_out_past(count, factor, seq_len, pairs, vocab)
        clean = clean_filler(tokens, targets, pairs, vocab)
        keys = tokens[:, 0 : 2 * pairs : 2]
        filler = (torch.arange(tokens.shape[1]) >= 2 * pairs) & (targets == IGNORE)
        was_key = filler & (tokens.unsqueeze(-1) == keys.unsqueeze(1)).any(dim=-1)
        assert was_key.any()  # the plain filler holds asked keys (about 1 in 6 of it here)
        assert not (filler & (clean.unsqueeze(-1) == keys.unsqueeze(1)).any(dim=-1)).any(), factor
        assert torch.equal(clean[~was_key], tokens[~was_key])  # pairs, queries, the rest of the filler
        redrawn = clean[was_key]
        assert len(set(redrawn.tolist())) > vocab // 4  # drawn from the vocabulary, not one token
        assert torch.equal(clean_filler(tokens, targets, pairs, vocab), clean)  # the same every time


def test_bench_recall_key_reappears_and_the_recency_oracle():
    """key_reappears and recency_oracle on a hand-made sequence: key 1 reappears in the filler
    before its query with another token after it, so a memory of the latest binding answers it
    wrong; key 2 reappears only after its query; key 3 does not reappear."""
    from bench_recall import IGNORE, key_reappears, recency_oracle

    #          k1 v1 k2 v2 k3 v3 | filler and queries
    row = [1, 10, 2, 11, 3, 12, 5, 1, 13, 2, 0, 3, 6, 1, 4, 2, 7]
    target = [IGNORE] * len(row)
    target[9], target[11], target[13] = 11, 12, 10  # k2 at 9, k3 at 11, k1 at 13
    tokens, targets = torch.tensor([row, row]), torch.tensor([target, target])
    targets[1, 13] = 13  # (not a real target: the oracle compares with it)
    # queries row by row, by position: k2, k3, k1
    assert key_reappears(tokens, targets, pairs=3).tolist() == [False, False, True] * 2
    assert recency_oracle(tokens, targets).tolist() == [True, True, False, True, True, True]


def test_bench_recall_scores_past_the_training_length_only_where_positions_reach():
    """past_training_length: at 1x the figure is the usual held-out accuracy; a rotary model
    reads every factor, a model with a position table of the training length none past 1x."""
    import argparse

    from bench_recall import HELD_OUT, accuracy, batch_generator, build_model, mqar_batch, past_training_length

    torch.manual_seed(0)
    args = argparse.Namespace(lengths=[1, 2, 4], held_out=20, held_out_past=None, vocab=32, power_a=0.01,
                              device="cpu", variant="tiny", seed=0, progress=None, clean_filler=True)
    for name, reaches in (("softmax-rotary-untied-emb1", True), ("softmax", False), ("gate+conv+rotary", True)):
        model = build_model(name, vocab=32, dim=16, depth=1, heads=2, seq_len=24)
        figures = past_training_length(model, args, seq_len=24, pairs=4)
        usual = accuracy(model, *mqar_batch(20, 24, 4, 32, batch_generator(*HELD_OUT)), "cpu")
        assert figures["1x"]["accuracy"] == round(usual, 4) and figures["1x"]["past_share"] == 0, name
        for factor in ("2x", "4x"):
            if reaches:
                assert 0 <= figures[factor]["accuracy"] <= 1 and 0 < figures[factor]["past_share"] < 1, name
                assert figures[factor]["mean_distance"] > figures["1x"]["mean_distance"], name
                assert figures[factor]["reappear_share"] > figures["1x"]["reappear_share"], name
                assert 0 <= figures[factor]["clean_accuracy"] <= 1, name
            else:
                assert figures[factor] is None, name


def test_bench_recall_models_are_causal_and_read_logits_at_the_queries():
    """bench_recall.py's softmax transformers (the short convolution included) and a library
    variant see no later token (a change at position t moves the logits at t onward only),
    and the loss's logits, read only at the query positions, are the full forward's there."""
    from bench_recall import build_model, query_logits

    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 12))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 32
    asked = torch.rand(2, 12) < 0.5
    for name in ("softmax", "softmax+conv", "softmax-mlp", "softmax-rotary", "softmax-rotary-untied",
                 "softmax-rotary-untied-emb1", "softmax-nobias", "taylor+conv+dh16"):
        model = build_model(name, vocab=32, dim=16, depth=2, heads=2, seq_len=12)
        with torch.no_grad():
            before, after = model(tokens), model(changed)
            assert torch.allclose(query_logits(model, tokens, asked), before[asked], atol=1e-5), name
        assert torch.equal(before[:, :6], after[:, :6]), name
        assert (before[:, 6:] - after[:, 6:]).abs().amax(dim=-1).min() > 0, name


def test_bench_recall_softmax_variants_change_what_they_name():
    """The embeddings' scale (GPT-2's 0.02, or PyTorch's 1), the positions, the tied output
    layer and the biases of bench_recall.py's softmax transformers are what each name says."""
    from bench_recall import SoftmaxTransformer, build_model

    torch.manual_seed(0)
    gpt2 = build_model("softmax", vocab=512, dim=64, depth=2, heads=2, seq_len=128)
    wide = build_model("softmax-rotary-untied-emb1", vocab=512, dim=64, depth=2, heads=2, seq_len=128)
    bare = build_model("softmax-nobias", vocab=512, dim=64, depth=2, heads=2, seq_len=128)
    assert abs(gpt2.token_emb.weight.std().item() - 0.02) < 0.002 and abs(gpt2.pos_emb.weight.std().item() - 0.02) < 0.002
    assert gpt2.output_layer.weight is gpt2.token_emb.weight
    assert abs(wide.token_emb.weight.std().item() - 1.0) < 0.05 and wide.pos_emb is None and wide.rotary is not None
    assert wide.output_layer.weight is not wide.token_emb.weight
    assert not any(name.endswith("bias") for name, _ in bare.named_parameters())
    bare_conv = SoftmaxTransformer(512, 64, 2, 2, 128, short_conv=True, bias=False)
    assert not any(name.endswith("bias") for name, _ in bare_conv.named_parameters())
    assert any(name.endswith("bias") for name, _ in gpt2.named_parameters())


def test_bench_length_trains_scores_and_records_every_model(tmp_path, monkeypatch, capsys):
    """Tiny runs of bench_length.py: every model and seed recorded with BPC at each length, the
    mean over seeds; a linear model's streamed losses are its full forward's, and the softmax
    reference rebuilt to cover a longer length reads the training length as trained."""
    import bench_length
    from train_enwik8 import build_model

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(torch.randint(97, 105, (4000,), generator=torch.Generator().manual_seed(0)).tolist()))
    argv = ["--data", str(data), "--steps", "2", "--seq-len", "16", "--factors", "1", "4", "--eval-windows", "2",
            "--seeds", "0", "1", "--threads", "1", "--out", str(tmp_path / "runs"), "--record", "tiny",
            "--set", "dim=16", "depth=1", "batch_size=2", "eval_batches=1", "local_attn_window_size=8"]
    assert bench_length.main(argv) == 0, capsys.readouterr().out
    figures = json.loads((tmp_path / "tiny.json").read_text())["figures"]
    for name in bench_length.MODELS:
        seeds = [figures[f"{name} seed {s}"] for s in (0, 1)]
        for result in seeds:
            assert result["steps"] == 2 and len(result["4x per block"]) == 4
            assert all(0 < result[key] < 16 for key in ("1x", "4x", "4x last quarter"))
        assert figures[f"{name} mean"]["4x"] == pytest.approx((seeds[0]["4x"] + seeds[1]["4x"]) / 2)
    assert "softmax-rotary" in capsys.readouterr().out

    args = bench_length.build_parser().parse_args(argv)
    windows = torch.randint(97, 105, (2, 65), generator=torch.Generator().manual_seed(1))
    run = bench_length.run_options(args, "recommended-rotary", 0)
    state, log = bench_length.trained_model(run, reuse=True)
    assert log["date"] == figures["recommended-rotary seed 0"]["trained"]  # read from the checkpoint, not trained again
    rotary = bench_length.scoring_model(run, state, 64)
    assert rotary.net.max_seq_len == 16
    torch.testing.assert_close(bench_length.window_losses(rotary, windows, 16, streamed=True),
                               bench_length.window_losses(rotary, windows, 16, streamed=False), rtol=1e-5, atol=1e-5)
    run = bench_length.run_options(args, "softmax-rotary", 0)
    state, _ = bench_length.trained_model(run, reuse=True)
    as_trained = build_model(run)
    as_trained.load_state_dict(state)
    short = windows[:, :17]
    torch.testing.assert_close(bench_length.window_losses(bench_length.scoring_model(run, state, 64), short, 16, False),
                               bench_length.window_losses(as_trained.eval(), short, 16, False))
    last = figures["softmax-rotary seed 0"]
    assert last["4x last block"] == last["4x per block"][-1] and 0 < last["4x last block read alone"] < 16


def test_bench_generate_times_tokens_within_and_past_max_seq_len():
    """The rotary model's generation past max_seq_len: per-token times within and past it, their
    ratio, and the peak memory of the whole generation and of the one that stops at max_seq_len."""
    import argparse

    import bench_generate

    args = argparse.Namespace(device="cpu", prompt_len=4, past_max_seq_len=32, past_factor=4, past_reps=1,
                              model=dict(bench_generate.MODEL, depth=1))
    figures = bench_generate.past_max_seq_len(args)
    assert figures["tokens"] == 4 * 32 - 4 and figures["same_tokens"]
    assert figures["within_ms_per_token"] > 0 and figures["past_ms_per_token"] > 0
    assert figures["past_over_within"] == pytest.approx(figures["past_ms_per_token"] / figures["within_ms_per_token"])
    assert figures["peak_bytes"] >= 0 and figures["peak_within_bytes"] >= 0 and figures["memory_method"]


def test_bench_step_times_the_rules_it_names_and_reports_the_median_ratio(capsys):
    import re
    import statistics

    import bench_step

    models = [bench_step.build({"update_rule": rule}) for rule in ("additive", "delta")]
    rules = [{m.update_rule for m in model.modules() if hasattr(m, "update_rule")} for model in models]
    assert rules == [{"additive"}, {"delta"}]
    assert bench_step.main(["--rounds", "3", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    ratios = [float(r) for r in re.findall(r"^round \d+: .* ratio ([0-9.]+)$", out, flags=re.M)]
    assert len(ratios) == 3
    median = float(re.search(r"^median: .*: ([0-9.]+)x$", out, flags=re.M).group(1))
    assert abs(median - statistics.median(ratios)) <= 1e-3
