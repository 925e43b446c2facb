"""The scripts of examples/ run end to end on tiny data: training learns, resuming is exact,
the plot is a PNG of the expected size, the comparison writes its table."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import compare_improvements  # noqa: E402
import compare_variants  # noqa: E402
import image_attention  # noqa: E402
import train_enwik8  # noqa: E402

# a model and a budget small enough to train in about a second
# (one thread: the default choice follows the machine's load, and tests compare runs exactly)
TINY = ["--dim", "32", "--depth", "1", "--heads", "2", "--n-local-attn-heads", "1",
        "--local-attn-window-size", "16", "--seq-len", "32", "--batch-size", "4",
        "--eval-batches", "2", "--generate", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A small repeated English text (~20 KB): a byte LM learns it within a few dozen steps."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    sentence = "the quick brown fox jumps over the lazy dog, and the cat sleeps on the warm mat. "
    path.write_text(sentence * 250)
    return path


def png_size(path):
    """(width, height) from a PNG's IHDR chunk; fails unless the file starts with the PNG signature."""
    raw = Path(path).read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert raw[12:16] == b"IHDR"
    return struct.unpack(">II", raw[16:24])


def test_train_script_learns_and_writes_log_plot_sample(text, tmp_path):
    # as a user runs it: a subprocess, the package found through PYTHONPATH
    log, plot = tmp_path / "run.json", tmp_path / "curve.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(EXAMPLES / "train_enwik8.py"), "--data", str(text), *TINY, "--steps", "40",
           "--lr", "3e-3", "--eval-every", "10", "--generate", "16", "--sample-every", "20", "--threads", "1",
           "--test-batches", "2", "--log", str(log), "--plot", str(plot)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(log.read_text())
    val = [h["val_bpc"] for h in result["history"]]
    assert [h["step"] for h in result["history"]] == [10, 20, 30, 40]
    assert val[-1] < val[0] - 1.0, val  # a repeated sentence: far below the first evaluation
    assert result["history"][-1]["train_bpc"] < result["history"][0]["train_bpc"] - 1.0
    assert 0 < result["final_test_bpc"] < 8
    assert len(result["train_losses"]) == 40
    assert "sample after step 20" in done.stdout and "sample after step 40" in done.stdout
    assert len(result["sample"]["generated"]) > 0
    assert png_size(plot) == (600, 400)  # figsize 6 x 4 inches at 100 dpi
    # run as a script, it set OpenMP's waiting before torch loaded (the environment did not)
    assert result["machine"]["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def test_resume_continues_with_identical_losses(text, tmp_path):
    # dropout and gradient accumulation on: the random state and the batch order must both be restored
    common = ["--data", str(text), *TINY, "--dropout", "0.1", "--grad-accum", "2", "--eval-every", "3",
              "--test-batches", "0"]
    full, part, resumed = tmp_path / "full.json", tmp_path / "part.json", tmp_path / "resumed.json"
    ckpt = tmp_path / "ckpt.pt"
    train_enwik8.main([*common, "--steps", "6", "--log", str(full)])
    train_enwik8.main([*common, "--steps", "3", "--save", str(ckpt), "--log", str(part)])
    train_enwik8.main(["--resume", str(ckpt), "--steps", "6", "--log", str(resumed), "--test-batches", "0"])
    uninterrupted = json.loads(full.read_text())["train_losses"]
    continued = json.loads(resumed.read_text())["train_losses"]
    assert json.loads(part.read_text())["train_losses"] == uninterrupted[:3]
    assert continued[3] == uninterrupted[3]  # the next loss after resuming, exactly
    assert continued == uninterrupted
    assert len(set(uninterrupted)) == 6  # the losses do change from step to step


def test_context_parallel_with_data_parallel_trains_as_one_process(text, tmp_path):
    """torchrun, 4 processes: 2 data-parallel groups of 2 context-parallel ranks, 4 windows per
    group, against one process on the same 8 windows per step: the same losses (the gradients
    summed over the slices and averaged over the groups, the same updates), and the same
    validation and test losses (evaluated by the first group, split, on the same 8 windows)."""
    common = ["--data", str(text), *TINY, "--steps", "3", "--eval-every", "3", "--threads", "1"]
    single, split = tmp_path / "single.json", tmp_path / "split.json"
    train_enwik8.main([*common, "--batch-size", "8", "--eval-batches", "1", "--test-batches", "1",
                       "--log", str(single)])
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(EXAMPLES / "train_enwik8.py"), *common, "--context-parallel", "2", "--batch-size", "4",
           "--eval-batches", "2", "--test-batches", "2", "--json-log", str(split)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    want, got = json.loads(single.read_text()), json.loads(split.read_text())
    assert got["machine"]["processes"] == 4 and got["machine"]["context_parallel"] == 2
    assert len(set(want["train_losses"])) == 3  # the updates change the loss
    assert got["train_losses"] == pytest.approx(want["train_losses"], rel=1e-5)
    for key in ("final_val_loss", "final_test_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


def test_context_parallel_needs_torchrun(text):
    with pytest.raises(SystemExit, match="torchrun"):
        train_enwik8.main(["--data", str(text), *TINY, "--steps", "1", "--context-parallel", "2"])
    with pytest.raises(SystemExit, match="--context-parallel"):
        train_enwik8.main(["--data", str(text), *TINY, "--steps", "1", "--context-parallel", "0"])
    with pytest.raises(SystemExit, match="--threads >= 0"):
        train_enwik8.main(["--data", str(text), *TINY, "--steps", "1", "--threads", "-1"])


def test_resume_refuses_a_different_model(text, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    train_enwik8.main(["--data", str(text), *TINY, "--steps", "1", "--test-batches", "0", "--save", str(ckpt)])
    with pytest.raises(SystemExit, match="dim"):
        train_enwik8.main(["--resume", str(ckpt), "--steps", "2", "--dim", "64"])


def test_a_checkpoint_is_plain_data_and_one_holding_other_objects_is_refused(text, tmp_path):
    """--resume loads with torch.load(weights_only=True): what --save writes is tensors, numbers,
    strings, lists and dicts alone; a file holding another pickled object (here a Path) is refused,
    naming it, and so is a file torch.save did not write."""
    import torch

    ckpt, pickled = tmp_path / "ckpt.pt", tmp_path / "pickled.pt"
    train_enwik8.main(["--data", str(text), *TINY, "--steps", "1", "--test-batches", "0", "--save", str(ckpt)])
    saved = torch.load(ckpt, weights_only=True)

    def leaves(value):
        if isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from leaves(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from leaves(item)
        else:
            yield value

    kinds = {type(leaf) for leaf in leaves(saved)}
    assert kinds <= {torch.Tensor, int, float, str, bool, type(None)}, kinds
    assert torch.Tensor in kinds and float in kinds
    saved["config"]["data"] = Path(saved["config"]["data"])
    torch.save(saved, pickled)
    with pytest.raises(SystemExit, match=r"holds pathlib\.\w*Path, not only plain data.*not loaded"):
        train_enwik8.main(["--resume", str(pickled), "--steps", "2"])
    with pytest.raises(SystemExit, match="not a checkpoint written by torch.save"):
        train_enwik8.main(["--resume", str(text), "--steps", "2"])
    torch.save({"model": saved["model"]}, pickled)
    with pytest.raises(SystemExit, match="not a checkpoint of this script .no optimizer, scheduler"):
        train_enwik8.main(["--resume", str(pickled), "--steps", "2"])


@pytest.mark.requires("transformers")
def test_hf_save_writes_a_checkpoint_that_from_pretrained_loads(text, tmp_path):
    """--hf-save: AutoModelForCausalLM.from_pretrained loads the trained model (the logits of the
    model --save holds) and AutoTokenizer the byte tokenizer; options made by hooks, which a
    config cannot describe, are refused before training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import linear_attention_transformer.hf  # noqa: F401  (registers the model with the Auto classes)

    ckpt, folder = tmp_path / "ckpt.pt", tmp_path / "hf"
    argv = ["--data", str(text), *TINY, "--steps", "3", "--test-batches", "0"]
    train_enwik8.main([*argv, "--save", str(ckpt), "--hf-save", str(folder)])
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    trained = train_enwik8.build_model(train_enwik8.build_parser().parse_args(argv))
    trained.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    fresh = train_enwik8.build_model(train_enwik8.build_parser().parse_args(argv))  # the initialisation
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained.net.eval()(x)
        torch.testing.assert_close(loaded(input_ids=x).logits, want)
        assert not torch.allclose(fresh.net.eval()(x), want, atol=1e-3)  # three steps did change it
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("héllo").input_ids == list("héllo".encode("utf-8"))
    for option, value in (("--conv-activation", "silu"), ("--conv-on", "v"), ("--gate-parts", "forget")):
        with pytest.raises(SystemExit, match=f"--hf-save: {option} {value} changes the model by hooks"):
            train_enwik8.main([*argv, option, value, "--hf-save", str(tmp_path / "refused")])
    with pytest.raises(SystemExit, match="--hf-save .*: a file"):
        train_enwik8.main([*argv, "--hf-save", str(ckpt)])


def test_load_bytes_is_the_file(tmp_path):
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(256)) * 2)
    data = train_enwik8.load_bytes(path)
    assert data.tolist() == list(range(256)) * 2
    with pytest.raises(SystemExit, match="no such file"):
        train_enwik8.load_bytes(tmp_path / "missing")


def test_compare_variants_writes_table_and_plot(text, tmp_path):
    out = tmp_path / "cmp"
    compare_variants.main(["--data", str(text), "--variants", "baseline", "conv_only", "--seeds", "0", "1",
                           "--steps", "4", "--out", str(out), "--set", *[f"{k.lstrip('-').replace('-', '_')}={v}"
                                                                          for k, v in zip(TINY[::2], TINY[1::2])],
                           "eval_every=2"])
    table = (out / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| variant | valid BPC (mean ± std over 2 seeds) | seed 0 | seed 1 |")
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["baseline", "conv_only"]
    logs = {p.name for p in out.glob("*_seed*.json")}
    assert logs == {"baseline_seed0.json", "baseline_seed1.json", "conv_only_seed0.json", "conv_only_seed1.json"}
    base0 = json.loads((out / "baseline_seed0.json").read_text())
    # the table's per-seed figure is the run's final validation BPC
    assert f"{base0['final_val_bpc']:.4f}" in rows[1]
    assert png_size(out / "loss_comparison.png") == (700, 450)


def test_compare_variants_reuses_only_logs_with_the_same_options(text, tmp_path):
    out = tmp_path / "cmp"
    tiny = [f"{k.lstrip('-').replace('-', '_')}={v}" for k, v in zip(TINY[::2], TINY[1::2])]
    argv = ["--data", str(text), "--variants", "baseline", "--seeds", "0", "--out", str(out), "--set", *tiny]
    compare_variants.main([*argv, "--steps", "3"])
    log_path = out / "baseline_seed0.json"
    log = json.loads(log_path.read_text())
    log["final_val_bpc"] = 12.3456  # a mark no training run can produce (bytes: at most 8 bits)
    log_path.write_text(json.dumps(log))

    def table_bpc():
        rows = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| baseline")]
        return rows[0].split("|")[2].strip()

    compare_variants.main([*argv, "--steps", "3", "--reuse"])  # same options: read, not trained
    assert table_bpc().startswith("12.3456")
    assert "(1 of 1 runs read from their logs" in (out / "results.md").read_text()
    compare_variants.main([*argv, "--steps", "4", "--reuse"])  # other options: trained again
    assert not table_bpc().startswith("12.3456")
    assert json.loads(log_path.read_text())["steps_done"] == 4
    log_path.write_text(log_path.read_text()[:50])  # a log cut short: trained again, no crash
    compare_variants.main([*argv, "--steps", "4", "--reuse"])
    assert json.loads(log_path.read_text())["steps_done"] == 4
    assert "runs read from their logs" not in (out / "results.md").read_text()


def test_image_attention_loss_falls():
    result = image_attention.main(["--steps", "100", "--print-every", "50"])
    loss_before, _ = result["held_out_before"]
    loss_after, accuracy_after = result["held_out_after"]
    assert loss_after < loss_before - 0.3
    assert accuracy_after > 0.8  # chance is 0.5


def test_conv_on_v_bypasses_the_query_and_key_convolutions():
    import torch

    args = train_enwik8.build_parser().parse_args([*TINY, "--variant", "conv_only", "--conv-on", "v"])
    torch.manual_seed(0)
    probe = train_enwik8.build_model(args)
    args.conv_on = "qkv"
    torch.manual_seed(0)
    plain = train_enwik8.build_model(args)
    with torch.no_grad():
        for conv in (m for m in probe.modules() if isinstance(m, train_enwik8.LocalConv)):
            conv.conv_weight.normal_()  # far from the identity start
        plain.load_state_dict(probe.state_dict())
        x = torch.randint(0, 256, (2, 32))
        convolving_qkv = plain.net(x)
        for layer in (m for m in plain.modules() if isinstance(getattr(m, "local_conv", None), torch.nn.ModuleList)):
            for conv in layer.local_conv[:2]:  # q and k back to the identity by hand
                conv.conv_weight.zero_()
                conv.conv_weight[:, 0, -1] = 1.0
    torch.testing.assert_close(probe.net(x), plain.net(x))
    assert not torch.allclose(probe.net(x), convolving_qkv, atol=1e-3)  # the bypass does change the model


def test_the_softmax_variant_is_causal_softmax_attention_over_the_whole_context():
    """Every head of every layer is a local head whose window covers the training context: the
    layer equals causal scaled-dot-product attention on its own projections (float64)."""
    import torch
    import torch.nn.functional as F
    from einops import rearrange

    from linear_attention_transformer import Attention

    args = train_enwik8.build_parser().parse_args([*TINY, "--variant", "softmax"])
    torch.manual_seed(0)
    layers = [m for m in train_enwik8.build_model(args).modules() if isinstance(m, Attention)]
    assert len(layers) == 1 and layers[0].n_local == layers[0].heads == 2
    layer = layers[0].double()
    x = torch.randn(3, 32, 32, dtype=torch.float64)
    q = rearrange(layer.to_q(x), "b n (h d) -> b h n d", h=2)
    k, v = rearrange(layer.to_kv(x), "b n (two h d) -> two b h n d", two=2, h=2)
    expected = layer.to_out(rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h n d -> b n (h d)"))
    torch.testing.assert_close(layer(x), expected)


def test_pos_emb_none_builds_a_model_without_positions_that_reads_any_length():
    args = train_enwik8.build_parser().parse_args([*TINY, "--variant", "recommended", "--pos-emb", "none"])
    net = train_enwik8.build_model(args).net
    assert net.pos_emb is None and net.length_limit is None
    assert not any("pos" in name or "rotary" in name for name, _ in net.named_parameters())
    assert train_enwik8.build_model(train_enwik8.build_parser().parse_args(TINY)).net.length_limit is None  # rotary


def test_manpage_text_keeps_the_words_and_drops_the_markup():
    import make_local_corpus

    troff = ('.\\" Copyright line\n.TH glob 7 2023-02-05 "Linux man-pages 6.03"\n.SH NAME\nglob \\- globbing\n'
             '.PP\nSee\n.BR glob (3)\nfor \\fBmore\\fP, \\[aq]?\\[aq] matches.\n.nr X 2\n')
    assert make_local_corpus.manpage_text(troff) == "NAME\nglob - globbing\nSee\nglob (3)\nfor more, '?' matches."


def test_resume_keeps_the_runs_outputs_and_says_where_it_resumes(text, tmp_path, capsys):
    """--resume without --save / --log / --plot writes the original run's files, and says from
    which step it resumes."""
    import torch

    ckpt, log, plot = tmp_path / "ckpt.pt", tmp_path / "run.json", tmp_path / "curve.png"
    train_enwik8.main(["--data", str(text), *TINY, "--steps", "2", "--eval-every", "1", "--test-batches", "0",
                       "--save", str(ckpt), "--log", str(log), "--plot", str(plot)])
    plot.unlink()
    capsys.readouterr()
    train_enwik8.main(["--resume", str(ckpt), "--steps", "4"])
    out = capsys.readouterr().out
    assert f"resuming from step 2 of {ckpt}" in out
    assert torch.load(ckpt, weights_only=True)["progress"]["step"] == 4
    resumed = json.loads(log.read_text())
    assert resumed["steps_done"] == 4 and [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    assert resumed["config"]["eval_every"] == 1  # the reporting too, not the default 100
    assert png_size(plot) == (600, 400)
    other = tmp_path / "other.json"  # an output given again replaces the stored one
    train_enwik8.main(["--resume", str(ckpt), "--steps", "5", "--log", str(other)])
    assert json.loads(other.read_text())["steps_done"] == 5
    assert json.loads(log.read_text())["steps_done"] == 4
    with pytest.raises(SystemExit, match="step 5 already"):
        train_enwik8.main(["--resume", str(ckpt), "--steps", "5"])


def test_outputs_are_prepared_before_the_first_step(text, tmp_path):
    """Missing folders of --save, --log and --plot are made before training; an output that
    cannot be written stops the run before its first step (no checkpoint was saved)."""
    ckpt, log, plot = tmp_path / "a" / "ckpt.pt", tmp_path / "b" / "c" / "run.json", tmp_path / "d" / "curve.png"
    train_enwik8.main(["--data", str(text), *TINY, "--steps", "1", "--test-batches", "0",
                       "--save", str(ckpt), "--log", str(log), "--plot", str(plot)])
    assert ckpt.is_file() and log.is_file() and png_size(plot) == (600, 400)
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file, not a folder")
    late = tmp_path / "late.pt"
    for option, path in (("--log", blocker / "run.json"), ("--plot", tmp_path), ("--save", blocker / "x" / "c.pt")):
        with pytest.raises(SystemExit, match=option):
            train_enwik8.main(["--data", str(text), *TINY, "--steps", "1", "--test-batches", "0",
                               "--save-every", "1", *(["--save", str(late)] if option != "--save" else []),
                               option, str(path)])
        assert not late.exists()  # stopped before the first step, which would have saved


def test_default_threads_are_the_usable_cores_less_the_busy_ones_where_threads_spin(monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(train_enwik8, "usable_cores", lambda: 4)
    monkeypatch.setattr(train_enwik8.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    for busy, want in ((0.0, 4), (0.4, 4), (1.0, 3), (2.6, 1), (7.0, 1)):
        monkeypatch.setattr(train_enwik8, "busy_cores", lambda: busy)
        threads, why = train_enwik8.choose_threads(0, openmp_sleeps=False)
        assert threads == want, (busy, threads)
        assert "4 usable cores" in why and f"{busy:.1f} busy" in why
        # idle threads that sleep: every usable core, whatever the load
        assert train_enwik8.choose_threads(0, openmp_sleeps=True)[0] == 4
    monkeypatch.setattr(train_enwik8.os, "cpu_count", lambda: 8)  # affinity: 4 of 8 cores, load spread over 8
    monkeypatch.setattr(train_enwik8, "busy_cores", lambda: 4.0)
    assert train_enwik8.choose_threads(0, openmp_sleeps=False)[0] == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # never above torch's own count
    monkeypatch.setattr(train_enwik8, "busy_cores", lambda: 0.0)
    assert train_enwik8.choose_threads(0, openmp_sleeps=False)[0] == 3
    assert train_enwik8.choose_threads(0, openmp_sleeps=True)[0] == 3
    assert train_enwik8.choose_threads(5) == (5, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's setting for each process it starts
    assert train_enwik8.choose_threads(0) == (3, "OMP_NUM_THREADS=1")


def test_busy_cores_counts_the_other_runnable_threads(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.52 0.58 0.59 3/467 12345\n")  # 3 running, one of them the reader
    assert train_enwik8.busy_cores(samples=3, interval=0, source=loadavg) == 2.0
    assert train_enwik8.busy_cores(samples=1, source=tmp_path / "missing") >= 0  # the load average instead


def option_help(parser):
    """{option: its help text as --help prints it} for every option but -h."""
    formatter = parser._get_formatter()
    return {a.option_strings[-1]: formatter._expand_help(a) for a in parser._actions
            if a.option_strings and a.dest != "help"}


@pytest.mark.parametrize("script", ["train_enwik8", "compare_variants", "compare_improvements", "image_attention"])
def test_help_describes_every_option_and_shows_each_default_once(script):
    parser = sys.modules[script].build_parser()
    text = parser.format_help()
    assert "(default: None)" not in text
    for option, help_text in option_help(parser).items():
        action = next(a for a in parser._actions if option in a.option_strings)
        assert help_text.strip(), f"{script} {option}: no help"
        assert help_text.count("(default") <= 1, f"{script} {option}: {help_text}"
        if action.default not in (None, False) and action.nargs != 0:
            assert "(default" in help_text, f"{script} {option}: the default {action.default!r} is not shown"


def test_compare_scripts_default_to_the_built_in_corpus(tmp_path):
    cache = tmp_path / "corpus.txt"
    cache.write_text("a cached corpus " * 100)  # builtin_corpus reads a cache that exists
    args = compare_improvements.build_parser().parse_args(["--corpus-cache", str(cache)])
    assert args.data is None and compare_improvements.shared_options(args).data == str(cache)
    assert compare_variants.build_parser().parse_args([]).data is None


def tiny_llama_folder(tmp_path):
    """A tiny random Llama checkpoint with a byte tokenizer, saved as transformers saves one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from linear_attention_transformer.hf import byte_tokenizer

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    source = tmp_path / "llama"
    llama.save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    return source


@pytest.mark.requires("transformers", "safetensors")
def test_linearize_script_converts_trains_measures_and_saves(tmp_path):
    """The recipe end to end on a tiny random Llama (the SmolLM2 run's figures are in
    docs/pretrained.md): perplexities for the five models, the curve, a folder that reloads."""
    from transformers import AutoModelForCausalLM

    source = tiny_llama_folder(tmp_path)
    out, figures = tmp_path / "linear", tmp_path / "figures.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(EXAMPLES / "linearize.py"), "--checkpoint-from", str(source), "--window", "8",
           "--sinks", "1", "--steps", "4", "3", "--minutes", "2", "--eval-at", "0.5", "--transfer-minutes", "1",
           "--checkpoint", str(tmp_path / "run"),
           "--seq-len", "48", "--train-chars", "20000", "--eval-windows", "1", "--eval-len", "64", "--new-tokens",
           "4", "--threads", "1", "--out", str(out), "--json", str(figures)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    report = json.loads(figures.read_text())
    ppl = report["perplexity"]
    assert set(ppl) == {"original", "window 8 alone", "window 8 and 1 sinks alone", "linearized, before transfer",
                        "linearized, after training"}
    assert all(1 < value < 1e4 for value in ppl.values())
    curve = report["curve"]
    assert [point["minutes"] for point in curve] == [0.5, 2]
    assert curve[0]["steps"] == {"transfer": 4} and curve[-1]["steps"] == {"transfer": 4, "finetune": 3}
    assert (tmp_path / "run.transfer.pt").exists() and (tmp_path / "run.finetune.pt").exists()
    import linear_attention_transformer.hf  # noqa: F401  (registers the model with transformers)

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.model.options["local_attn_older_keys"] == "linear" and loaded.model.options["local_attn_sinks"] == 1


@pytest.mark.requires("transformers", "safetensors")
def test_linearize_script_makes_the_librarys_mixed_layer_with_mixed(tmp_path):
    """--mixed: global heads without gates add nothing for attention transfer, so all the
    training is fine-tuning; the folder holds the mixed model."""
    from transformers import AutoModelForCausalLM

    source, out, figures = tiny_llama_folder(tmp_path), tmp_path / "mixed", tmp_path / "figures.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(EXAMPLES / "linearize.py"), "--checkpoint-from", str(source), "--window", "8",
           "--mixed", "2", "--feature-map", "elu", "--steps", "4", "3", "--minutes", "1", "--seq-len", "48",
           "--train-chars", "20000", "--eval-windows", "1", "--eval-len", "64", "--new-tokens", "4", "--threads", "1",
           "--out", str(out), "--json", str(figures)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    report = json.loads(figures.read_text())
    assert set(report["perplexity"]) == {"original", "window 8 alone", "linearized, before transfer",
                                         "linearized, after training"}
    assert report["curve"][-1]["steps"] == {"finetune": 3}
    import linear_attention_transformer.hf  # noqa: F401  (registers the model with transformers)

    options = AutoModelForCausalLM.from_pretrained(out).model.options
    assert (options["n_local_attn_heads"], options["feature_map"], options["local_attn_window_size"]) == (2, "elu", 8)
    for extra, message in ((["--mixed", "2", "--sinks", "2"], "--sinks and --feature-dim"),
                           (["--gates"], "settings of --mixed's global heads")):
        refused = subprocess.run(cmd[:6] + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and message in refused.stderr
    refused = subprocess.run(cmd + ["--transfer-minutes", "1"], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=600)  # (nothing for attention transfer to train)
    assert refused.returncode == 2 and "--transfer-minutes" in refused.stderr
