"""The GPU cost MODEL of benchmarks/estimate_gpu.py: on op mixes whose costs are worked out by
hand, each op's FLOPs, bytes, time and binding limit, the totals, the floor and the launch
share are what the model says; views and metadata cost nothing; the fake-tensor trace of an
LM step costs the same as a real one; the command line refuses bad input."""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import estimate_gpu  # noqa: E402
from estimate_gpu import GpuCostModel, Hardware, Summary  # noqa: E402

# round figures so that every expected time below is a short hand computation
HW = Hardware(name="test", launch_s=1e-6, peak_bf16=4e12, peak_tf32=2e12, peak_fp32=1e12, peak_fp64=0.5e12,
              bandwidth=1e11)


def costs(fn, hw=HW):
    with GpuCostModel(hw) as mode:
        fn()
    return mode


def test_mm_elementwise_mix_per_op_and_totals():
    a, b = torch.randn(64, 128), torch.randn(128, 256)  # mm: flop-bound
    x, y = torch.randn(1000), torch.randn(1000)  # add: launch-bound
    big = torch.randn(1_000_000)  # exp: byte-bound
    mode = costs(lambda: (a @ b, x + y, big.exp()))
    mm, add, exp = mode.ops
    assert [op.name for op in mode.ops] == ["aten::mm", "aten::add.Tensor", "aten::exp"]

    assert mm.matmul and mm.flops == 2 * 64 * 128 * 256
    assert mm.bytes == 4 * (64 * 128 + 128 * 256 + 64 * 256)
    assert mm.flop_s == pytest.approx(2 * 64 * 128 * 256 / 1e12)  # 4.19 us
    assert mm.byte_s == pytest.approx(4 * (64 * 128 + 128 * 256 + 64 * 256) / 1e11)  # 2.29 us
    assert mm.seconds == mm.flop_s and mm.bound == "flops"

    assert not add.matmul and add.flops == 1000 and add.bytes == 3 * 1000 * 4
    assert add.seconds == 1e-6 and add.bound == "launch"

    assert exp.bytes == 2 * 4_000_000 and exp.flops == 1_000_000
    assert exp.seconds == pytest.approx(8e-5) and exp.bound == "bytes"

    s = mode.summary()
    total = 2 * 64 * 128 * 256 / 1e12 + 1e-6 + 8e-5
    assert s.ops == 3 and s.syncs == 0
    assert s.seconds == pytest.approx(total)
    assert s.floor_s == pytest.approx(2 * 64 * 128 * 256 / 1e12)  # only the matmul is floor
    assert s.ratio == pytest.approx(total / (2 * 64 * 128 * 256 / 1e12))
    assert s.launch_share == pytest.approx(1e-6 / total)
    assert s.share("bytes") == pytest.approx(8e-5 / total)
    assert s.count_by_bound == {"launch": 1, "flops": 1, "bytes": 1}
    assert s.matmul_flops == 2 * 64 * 128 * 256
    assert s.floor_by_dtype == {"float32": pytest.approx(2 * 64 * 128 * 256 / 1e12)}


def test_views_and_metadata_cost_nothing():
    x = torch.randn(8, 6)
    mode = costs(lambda: (x.view(48), x.t(), x[::2], x.unsqueeze(0).expand(3, 8, 6), x.reshape(6, 8),
                          x.transpose(0, 1), x.detach(), torch.empty(5), torch.empty_like(x)))
    assert mode.ops == [] and mode.summary().seconds == 0.0
    # a reshape that must copy is a kernel
    mode = costs(lambda: x.t().reshape(48))
    assert [op.name for op in mode.ops] == ["aten::clone"] and mode.ops[0].bytes == 2 * 48 * 4


def test_batched_and_biased_contractions_count_2mnk_at_their_dtype_peak():
    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 11)
    bias, m1, m2 = torch.randn(11), torch.randn(5, 7), torch.randn(7, 11)
    mode = costs(lambda: (torch.bmm(a, b), torch.baddbmm(torch.randn(3, 5, 11), a, b), torch.addmm(bias, m1, m2),
                          torch.einsum("bij,bjk->bik", a, b)))
    flops = {op.name: op.flops for op in mode.ops if op.matmul}
    assert flops == {"aten::bmm": 2 * 3 * 5 * 7 * 11, "aten::baddbmm": 2 * 3 * 5 * 7 * 11,
                     "aten::addmm": 2 * 5 * 7 * 11}
    # einsum reaches the dispatcher as a bmm: two bmms in all
    assert sum(op.name == "aten::bmm" for op in mode.ops) == 2
    # addmm: the bias (11,), both factors, the output
    addmm = next(op for op in mode.ops if op.name == "aten::addmm")
    assert addmm.bytes == 4 * (11 + 5 * 7 + 7 * 11 + 5 * 11)

    big_a, big_b = torch.randn(256, 256), torch.randn(256, 256)
    fl = 2 * 256 ** 3
    for dtype, peak, tf32 in [(torch.bfloat16, 4e12, False), (torch.float32, 1e12, False),
                              (torch.float32, 2e12, True), (torch.float64, 0.5e12, False)]:
        hw = Hardware(**{**HW.__dict__, "tf32": tf32})
        x, y = big_a.to(dtype), big_b.to(dtype)
        (op,) = costs(lambda: x @ y, hw).ops
        assert op.flops == fl and op.peak == peak and op.flop_s == pytest.approx(fl / peak)


def test_linear_forward_and_backward_three_matmuls():
    lin = nn.Linear(32, 48)
    x = torch.randn(16, 32, requires_grad=True)
    mode = costs(lambda: lin(x).sum().backward())
    mm = [op for op in mode.ops if op.matmul]
    assert len(mm) == 3 and sum(op.flops for op in mm) == 3 * 2 * 16 * 32 * 48
    assert mode.summary().floor_s == pytest.approx(3 * 2 * 16 * 32 * 48 / 1e12)


def test_attention_and_convolution_flops():
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    mode = costs(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward())
    attn = [op for op in mode.ops if op.matmul]
    forward = 2 * 2 * 16 * 16 * (8 + 8) // 2  # q kᵀ and p v, half of them under the causal mask
    assert [op.flops for op in attn] == [forward, forward * 5 // 2]

    x, w = torch.randn(2, 4, 10, requires_grad=True), torch.randn(4, 1, 3, requires_grad=True)
    mode = costs(lambda: F.conv1d(x, w, padding=1, groups=4).sum().backward())
    conv = [op.flops for op in mode.ops if op.matmul]
    assert conv == [2 * 80 * 3, 2 * 2 * 80 * 3]  # forward; backward: input and weight gradients


def test_broadcast_reads_write_only_fills_and_gathers():
    row, full = torch.randn(1, 100), torch.randn(50, 100)
    (mul,) = costs(lambda: row.expand(50, 100) * full).ops
    assert mul.bytes == 4 * (100 + 5000 + 5000)
    dst, src = torch.empty(1000), torch.randn(1000)
    (copy,) = costs(lambda: dst.copy_(src)).ops
    assert copy.bytes == 2 * 4000  # the destination is written, not read
    table, ids = torch.randn(10_000, 64), torch.randint(0, 10_000, (32,))
    (emb,) = costs(lambda: F.embedding(ids, table)).ops
    assert emb.bytes == 32 * 8 + 2 * 32 * 64 * 4  # ids, the 32 rows read, the 32 rows written
    rows, cols, values = torch.arange(20), torch.randint(0, 64, (20,)), torch.ones(20)
    (put,) = costs(lambda: table.index_put_((rows, cols), values)).ops
    assert put.name == "aten::index_put_" and put.bytes == 2 * 20 * 8 + 20 * 4 + 20 * 4  # not the 2.6 MB table


def test_host_syncs_are_counted():
    x = torch.randn(100)
    mode = costs(lambda: (x.sum().item(), x[x > 0], torch.nonzero(x)))
    assert mode.syncs == ["aten::_local_scalar_dense", "aten::index.Tensor", "aten::nonzero"]
    assert mode.summary().syncs == 3
    assert costs(lambda: x * 2).syncs == []


def test_bound_order_and_empty_summary():
    op = estimate_gpu.OpCost("x", 1, 1, False, 1.0, launch_s=2.0, flop_s=2.0, byte_s=1.0)
    assert op.bound == "launch"  # a tie goes to the first of launch, flops, bytes
    s = Summary.of([])
    assert s.seconds == 0 and s.ratio == math.inf and s.launch_share == 0.0


def test_hardware_figures_must_be_positive():
    with pytest.raises(ValueError, match="launch_s"):
        Hardware(launch_s=0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        Hardware(bandwidth=float("nan"))


TINY = dict(num_tokens=64, dim=32, heads=2, depth=1, max_seq_len=48, causal=True, use_gate=True,
            n_local_attn_heads=1, local_attn_window_size=16, reversible=True, ff_glu=True, shift_tokens=True)


@pytest.mark.parametrize("loss", ["wrapper"])
def test_fake_trace_costs_what_a_real_one_does(loss):
    """The estimator traces on fake tensors: on real ones the same ops cost the same."""
    with estimate_gpu.causal_form("gpu"):
        fake = estimate_gpu.trace_lm_step(TINY, 48, loss=loss, hw=HW).ops
        real = estimate_gpu.trace_lm_step(TINY, 48, loss=loss, hw=HW, real=True).ops
    assert len(fake) > 100
    assert [(o.name, o.flops, o.bytes) for o in fake] == [(o.name, o.flops, o.bytes) for o in real]


def test_causal_form_is_scoped_and_restored():
    forms = pytest.importorskip("linear_attention_transformer.ops.causal.forms")
    before = forms.scoped_form()
    with estimate_gpu.causal_form("sequential"):
        assert forms.scoped_form() == "sequential"
    with estimate_gpu.causal_form("gpu"):
        assert forms.scoped_form() == "parallel"
    assert forms.scoped_form() == before


def test_loss_chunks_as_on_a_gpu_are_restored():
    ar = pytest.importorskip("linear_attention_transformer.autoregressive")
    before = ar.LOSS_CHUNK_ELEMENTS
    with estimate_gpu.loss_chunks("gpu") as note:
        assert ar.LOSS_CHUNK_ELEMENTS == ar.LOSS_CHUNK_ELEMENTS_ACCELERATOR and "as on cuda" in note
    assert ar.LOSS_CHUNK_ELEMENTS == before
    with estimate_gpu.loss_chunks("sequential"):
        assert ar.LOSS_CHUNK_ELEMENTS == before


def test_command_line_prints_a_labelled_model(capsys):
    assert estimate_gpu.main(["--lengths", "64", "--dim", "32", "--loss", "plain", "--top", "3",
                              "--set", "heads=2", "--set", "n_local_attn_heads=1", "--launch-us", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("*** MODEL, not a timing")
    assert "launch 5 us/op" in out and "estimate/floor" in out and "launch share" in out
    assert "plain, n = 64: estimate" in out


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "0"], "positive finite number (int)"),
    (["--launch-us", "-3"], "positive finite"),
    (["--bandwidth", "fast"], "positive finite number (float)"),
    (["--set", "dim"], "KEY=VALUE"),
    (["--set", "heads=four"], "the LM rejects"),
    (["--set", "no_such_option=1"], "the LM rejects"),
])
def test_command_line_refuses_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        estimate_gpu.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------- benchmarks/gpu_check.py


def test_gpu_check_dry_run_on_the_cpu(tmp_path, capsys):
    """The GPU check's dry run goes through every section on the CPU and writes its JSON and
    markdown: each correctness row within tolerance or refused with its reason (fla needs CUDA
    here), the delta rule's too, decoding equal to the full forward (an LM with delta-rule heads
    too), timing rows with tokens per second."""
    import json

    import gpu_check

    code = gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path), "--budget", "600"])  # (none skipped: busy CPU)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, capsys.readouterr().out
    assert {"torch", "cuda", "triton", "fla-core", "device", "fla kernel", "fla delta-rule kernel, backward"} <= \
        set(report["versions"])
    rows = {row["name"]: row for row in report["rows"]}
    assert {row["section"] for row in report["rows"]} == {"correctness", "decoding", "timing"}
    for name in ("default", "gated", "given-feature", "seed-like", "delta", "gated delta"):
        for dtype in ("fp32", "bf16"):
            assert rows[f"{name}, kernel=torch, {dtype}"]["status"] == "ok"
            assert rows[f"{name}, kernel=fla, {dtype}"]["status"] in ("ok", "unavailable")
    assert float(rows["default, kernel=torch, fp32"]["out_err"]) < 1e-5
    for name in ("delta", "gated delta"):  # (float32 against float64: far inside the row's 1e-3)
        assert max(float(rows[f"{name}, kernel=torch, fp32"][key]) for key in ("out_err", "grad_err")) < 1e-5
    for rule in ("", "delta rule, "):
        for mode in ("eager", "compiled (CUDA graphs)"):
            assert rows[f"cached decoding, {rule}{mode}"]["status"] == "ok"
    assert float(rows["layer, torch, n=64"]["tokens_per_s"].replace(",", "")) > 0
    delta = rows["layer, delta, torch, n=64"]
    assert min(float(delta[key].replace(",", "")) for key in ("tokens_per_s", "forward_tokens_per_s")) > 0
    assert rows["lm, sdpa, n=64"]["status"] == "ok"
    assert "| default, kernel=torch, fp32 | ok |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.requires("fla", "triton")
def test_gpu_check_times_the_same_normalised_attention_both_ways():
    """The timing rows that weigh the normaliser's column against the normaliser apart time the
    same function: on fla's real kernels (in Triton's interpreter), the layer with v one column
    wider equals the layer with the keys' decayed sum apart (fla's chunk_hgrn), and both differ
    from fla alone (no normaliser)."""
    script = (
        "import torch\n"
        "import fla_interpreted  # (sets TRITON_INTERPRET, and its interpreter shims for fla's kernels)\n"
        "import gpu_check\n"
        "outs = []\n"
        "for name in ('fla, v + 1 column', 'fla, normaliser apart', 'fla alone'):\n"
        "    torch.manual_seed(0)\n"
        "    outs.append(gpu_check.PlainLayer(32, 2, 16, name)(torch.randn(1, 70, 32)))\n"
        "column, apart, alone = outs\n"
        "print((column - apart).abs().max().item() / column.abs().max().item(), (column - alone).abs().max().item())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folders = (root, os.path.join(root, "benchmarks"), os.path.join(root, "tests", "ops"), os.environ.get("PYTHONPATH"))
    path = os.pathsep.join(filter(None, folders))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr[-3000:]
    apart_error, without = map(float, result.stdout.split()[-2:])
    assert apart_error < 1e-5 and without > 1e-2


def test_gpu_check_guards_each_row(tmp_path):
    """A row that raises is recorded with its error and the check goes on; past the section's
    budget the rows are skipped, and so is a row that needs more time than is left."""
    import gpu_check

    report = gpu_check.Report(str(tmp_path), budget=60)
    report.begin("s", 60)
    report.row("raises", lambda: 1 / 0)
    report.row("goes on", lambda: dict(value=1))
    report.row("needs more than is left", lambda: dict(value=2), needs=120)
    report.deadline = 0
    report.row("late", lambda: dict(value=3))
    statuses = [(row["name"], row["status"]) for row in report.rows]
    assert statuses == [("raises", "error"), ("goes on", "ok"), ("needs more than is left", "skipped"),
                        ("late", "skipped")]
    assert "ZeroDivisionError" in report.rows[0]["note"]
    assert "goes on" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_refuses_a_machine_without_cuda(capsys, monkeypatch):
    import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main([])
    assert exit_info.value.code == 2 and "--cpu-dry-run" in capsys.readouterr().err


def test_default_device_is_the_opt_in_one(test_device):
    """Under LAT_TEST_DEVICE / --lat-device (tests/conftest.py) new tensors land on that device;
    without it, on the CPU as always."""
    assert torch.empty(1).device.type == test_device.type
    if not os.environ.get("LAT_TEST_DEVICE"):
        assert test_device.type == "cpu"


def test_the_device_option_sets_the_default_device(monkeypatch):
    """Not vacuous: conftest's configure hook, given --lat-device meta, makes meta the default."""
    import importlib.util

    # loaded from its file: the name "conftest" may be another folder's module by now
    spec = importlib.util.spec_from_file_location("lat_tests_conftest", os.path.join(os.path.dirname(__file__),
                                                                                      "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    class Config:
        def getoption(self, name):
            assert name == "--lat-device"
            return "meta"

        def addinivalue_line(self, name, line):  # (the hook also registers the requires marker)
            assert name == "markers"

    monkeypatch.delenv("LAT_TEST_DEVICE", raising=False)  # restored (to unset) afterwards
    before = torch.get_default_device()
    try:
        conftest.pytest_configure(Config())
        assert torch.empty(1).device.type == "meta"
        assert os.environ["LAT_TEST_DEVICE"] == "meta"  # for subprocesses
    finally:
        torch.set_default_device(None if before.type == "cpu" else before)
    assert torch.empty(1).device == before

    class Bad(Config):
        def getoption(self, name):
            return "no-such-device"

    with pytest.raises(pytest.UsageError, match="not a torch device"):
        conftest.pytest_configure(Bad())
