#!/usr/bin/env python
"""One command for a CUDA machine: the test suite on CUDA, then our kernel, layer and LM
against ``torch.nn.functional.scaled_dot_product_attention`` (and flash-linear-attention's
``chunk_simple_gla`` / ``chunk_gla`` when ``fla`` is importable).

    python benchmarks/cuda_report.py                    # on a CUDA machine: everything
    python benchmarks/cuda_report.py --device cpu --dry-run   # tiny sizes, checks the command

Steps (``--skip`` leaves any out):

``tests``     ``python -m pytest -q tests`` with ``LAT_TEST_DEVICE=<device>``: tests/conftest.py
              makes it torch's default device for the run (unset, the suite is unchanged).
``kernel``    attention alone on (b, h, n, d), causal, forward + backward of ``out.sum()``:
              SDPA (softmax); ours, ``causal_linear_attention`` with exponential features (the
              default map), without decay, with a per-head decay and with a per-feature decay,
              in today's form (``forms.device_form``) and, where fla runs, in the fla form
              (``ops/causal/fla.py``: fla's kernels behind the adapter); fla's
              ``chunk_simple_gla`` (per-head decay) and ``chunk_gla`` (per-feature decay) called
              directly on the same q, k, v in their (b, n, h, d) layout: the fla form's rows
              against these are the adapter's own cost (its references, the normaliser column,
              the layout copies). Ours normalises (divides by q.z), fla's kernels alone do not.
``layer``     a whole attention layer on (b, n, h d): ours ``LinearSelfAttention`` (default map),
              ours with ``use_gate=True`` (each in today's form and, where fla runs, in the fla
              form, ``use_form``), ours with half the heads local (window 128) with
              ``kernel='torch'`` (the blocked local form) and ``'auto'`` (flex_attention on
              CUDA, ``ops/windowed_flex.py``), and a softmax layer with the same q/k/v/out
              projections around SDPA.
``lm``        one training step (cross-entropy of the logits, backward) of upstream's README LM at
              dim ``--lm-dim`` with ``use_gate=True`` (``bench_seed_lm.SEED_LM``; today's form and
              the fla form where fla runs) against a
              softmax LM of the same width, heads, embedding factorisation and GLU feed-forward,
              with SDPA attention and plain residual blocks.
``existing``  ``bench_layer.py`` and ``bench_lm.py`` on the device (their own floors).

Every row: median ms per step, tokens/s, peak memory over the inputs and model, and beside
them the reference of the same run: the step's matmul FLOPs (counted by ``estimate_gpu``'s
dispatch mode over one extra step) as TFLOP/s and as a share of the square matmul rate of
``--dtype`` measured here. On CUDA, "H100 model ms" is ``estimate_gpu``'s roofline MODEL of
that same step (an H100, whatever the card): a model beside a measurement. fla's Triton
kernels are not aten ops, so their FLOP columns read n/a.

Layer and LM rows run under autocast in ``--dtype`` (bf16 by default on CUDA); the kernel rows
take q, k, v in ``--dtype`` (ours computes in float32 inside). Sizes: b 1, h 8, d 128 (the
seed-like width 1024), n 4096 16384 65536; ``--dry-run`` uses tiny ones and one step.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from linear_attention_transformer.ops.causal.forms import device_form, use_form
from linear_attention_transformer.ops.windowed_flex import local_form

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    PeakMemory,
    best_seconds,
    default_device,
    print_header,
    set_threads,
    synchronize,
    table,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("tests", "kernel", "layer", "lm", "existing")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------- helpers


def load_fla(device="cuda"):
    """(chunk_simple_gla, chunk_gla, None) from fla, or (None, None, why not): why the fla form
    (``ops/causal/fla.py``) cannot run on ``device`` (on the CPU: not in Triton's interpreter)."""
    from linear_attention_transformer.ops.causal.fla import fla_missing

    why = fla_missing(torch.device(device))
    if why is not None:
        return None, None, why
    try:
        simple = importlib.import_module("fla.ops.simple_gla").chunk_simple_gla
        gla = importlib.import_module("fla.ops.gla").chunk_gla
    except Exception as e:  # ImportError, or triton failing to find a GPU
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return simple, gla, None


def fla_call(fn, q, k, v, g):
    """fla's kernel on (b, n, h, d) tensors, whatever its version's layout argument."""
    params = inspect.signature(fn).parameters
    extra = {"head_first": False} if "head_first" in params else {}
    out = fn(q=q, k=k, v=v, g=g, **extra)
    return out[0] if isinstance(out, tuple) else out


def matmul_rate(device, dtype, size):
    """FLOP/s of a square (size x size) matmul in ``dtype``, best of 3."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size ** 3 / best_seconds(lambda: a @ b, device, reps=3)


def autocast_for(device, dtype):
    device_type = torch.device(device).type
    if dtype == torch.float32:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


class SoftmaxLayer(nn.Module):
    """q/k/v/out projections around causal SDPA: the softmax layer of the same shape as ours."""

    def __init__(self, dim, heads, dim_head):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, self.dim_head).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class SoftmaxLM(nn.Module):
    """Embedding (factorised through emb_dim) -> depth x [norm, SDPA layer, norm, GLU
    feed-forward] with residuals -> norm -> emb_dim -> logits: that README LM's shape in softmax."""

    def __init__(self, num_tokens, dim, depth, heads, dim_head, emb_dim, ff_mult=4):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, emb_dim)
        self.project_in = nn.Linear(emb_dim, dim)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(nn.ModuleDict(dict(
                norm1=nn.LayerNorm(dim), attn=SoftmaxLayer(dim, heads, dim_head), norm2=nn.LayerNorm(dim),
                ff_in=nn.Linear(dim, 2 * ff_mult * dim), ff_out=nn.Linear(ff_mult * dim, dim))))
        self.norm = nn.LayerNorm(dim)
        self.project_out = nn.Linear(dim, emb_dim)
        self.to_logits = nn.Linear(emb_dim, num_tokens)

    def forward(self, x):
        h = self.project_in(self.token_emb(x))
        for blk in self.blocks:
            h = h + blk["attn"](blk["norm1"](h))
            a, gate = blk["ff_in"](blk["norm2"](h)).chunk(2, dim=-1)
            h = h + blk["ff_out"](a * F.gelu(gate))
        return self.to_logits(self.project_out(self.norm(h)))


# -------------------------------------------------------------------------- measuring


class Row:
    """One case at one length; ``reference``: the softmax (SDPA) case the others are read against."""

    def __init__(self, group, name, n, tokens, reference=False):
        self.group, self.name, self.n, self.tokens, self.reference = group, name, n, tokens, reference
        self.seconds = self.peak = self.flops = self.model_s = self.ops = None
        self.error = None


def measure(row, step, device, steps, warmup, trace=True, hw=None):
    """Time ``step`` (forward + backward, grads cleared by the step itself), its peak memory
    over the moment before its first call, and, with ``trace``, count one more step under
    ``estimate_gpu.GpuCostModel``."""
    from estimate_gpu import GpuCostModel, H100

    try:
        mem = PeakMemory(device)
        times = []
        for i in range(warmup + steps):
            synchronize(device)
            t0 = time.perf_counter()
            step()
            synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        row.peak = mem.increase()
        row.seconds = statistics.median(times)
        if trace:
            with GpuCostModel(hw or H100) as mode:
                step()
            synchronize(device)
            s = mode.summary()
            row.flops, row.model_s, row.ops = s.matmul_flops, s.seconds, s.ops
    except torch.cuda.OutOfMemoryError:
        row.error = "out of memory"
    except Exception as e:  # one case failing must not stop the report
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    finally:
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return row


def _leaf(t):
    return t.detach().requires_grad_()


def kernel_rows(args, n, fla):
    """The attention-alone cases at one length."""
    from linear_attention_transformer.ops import causal_linear_attention

    dev, dt, b, h, d = args.device, args.dtype_t, args.batch, args.heads, args.dim_head
    g = torch.Generator(device="cpu").manual_seed(n)
    q, k, v = (_leaf(torch.randn(b, h, n, d, generator=g, device="cpu").to(dev, dt)) for _ in range(3))
    head_ld = _leaf(F.logsigmoid(torch.randn(b, h, n, generator=g, device="cpu") + 4).to(dev))
    feat_ld = _leaf(F.logsigmoid(torch.randn(b, h, n, d, generator=g, device="cpu") + 4).to(dev))
    leaves = [q, k, v, head_ld, feat_ld]

    def step_of(fn):
        def step():
            for t in leaves:
                t.grad = None
            fn().float().sum().backward()
        return step

    cases = [("sdpa (softmax, causal)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), True)]
    simple, gla, _ = fla
    for form, label in [(args.today, ""), ("fla", "fla form, ")][:2 if simple is not None else 1]:
        cases += [
            (f"ours, {label}exp features", lambda f=form: causal_linear_attention(q, k, v, exp_features=True, form=f),
             True),
            (f"ours, {label}+ per-head decay",
             lambda f=form: causal_linear_attention(q, k, v, head_ld, exp_features=True, form=f), True),
            (f"ours, {label}+ per-feature decay",
             lambda f=form: causal_linear_attention(q, k, v, feat_ld, exp_features=True, form=f), True),
        ]
    if simple is not None:
        qt, kt, vt = (_leaf(t.detach().transpose(1, 2).contiguous()) for t in (q, k, v))
        gh = _leaf(head_ld.detach().transpose(1, 2).contiguous())
        gf = _leaf(feat_ld.detach().transpose(1, 2).contiguous())
        leaves += [qt, kt, vt, gh, gf]
        cases += [("fla chunk_simple_gla (head decay)", lambda: fla_call(simple, qt, kt, vt, gh), False),
                  ("fla chunk_gla (feature decay)", lambda: fla_call(gla, qt, kt, vt, gf), False)]
    rows = []
    for i, (name, fn, trace) in enumerate(cases):
        row = Row("kernel", name, n, b * n, reference=i == 0)
        rows.append(measure(row, step_of(fn), dev, args.steps, args.warmup, trace))
    return rows


def layer_rows(args, n, fla):
    from linear_attention_transformer import Attention, LinearSelfAttention

    dev, b, h, d = args.device, args.batch, args.heads, args.dim_head
    dim = h * d
    torch.manual_seed(0)
    layers = [
        ("softmax layer (SDPA)", SoftmaxLayer(dim, h, d), args.today),
        ("ours LinearSelfAttention", LinearSelfAttention(dim, heads=h, dim_head=d, causal=True), args.today),
        ("ours, use_gate=True", LinearSelfAttention(dim, heads=h, dim_head=d, causal=True, use_gate=True), args.today),
    ]
    if fla[0] is not None:
        layers += [(f"{name}, fla form", layer, "fla") for name, layer, _ in layers[1:]]
    # half the heads local (window 128): their blocked form against flex_attention ('auto' on CUDA)
    local = dict(heads=h, dim_head=d, causal=True, n_local_attn_heads=h // 2, local_attn_window_size=128)
    flex_or_not = local_form(torch.device(dev), args.dtype_t, head_dim=d)
    layers += [(f"ours, {h // 2} local heads, kernel={kernel!r} ({form})", Attention(dim, **local, kernel=kernel),
                args.today) for kernel, form in (("torch", "blocked"), ("auto", flex_or_not))]
    x = _leaf(torch.randn(b, n, dim, generator=torch.Generator(device="cpu").manual_seed(n), device="cpu").to(dev))
    rows = []
    for i, (name, layer, form) in enumerate(layers):
        layer = layer.to(dev)

        def step(layer=layer, form=form):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with autocast_for(dev, args.dtype_t), use_form(form):
                out = layer(x)
            out.float().sum().backward()

        rows.append(measure(Row("layer", name, n, b * n, reference=i == 0), step, dev, args.steps, args.warmup))
        del layer
    return rows


def lm_rows(args, n, fla):
    from bench_seed_lm import SEED_LM

    from linear_attention_transformer import LinearAttentionTransformerLM

    dev, b = args.device, args.batch
    kw = {**SEED_LM, "dim": args.lm_dim, "use_gate": True, "max_seq_len": n}
    torch.manual_seed(0)
    models = [
        ("softmax LM (SDPA)", lambda: SoftmaxLM(kw["num_tokens"], kw["dim"], kw["depth"], kw["heads"], kw["dim_head"],
                                                kw["emb_dim"]), args.today),
        ("ours, seed LM + use_gate", lambda: LinearAttentionTransformerLM(**kw), args.today),
    ]
    if fla[0] is not None:
        models.append(("ours, seed LM + use_gate, fla form", models[1][1], "fla"))
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, kw["num_tokens"], (b, n + 1), generator=g, device="cpu").to(dev)
    rows = []
    for i, (name, build, form) in enumerate(models):
        row = Row("lm", name, n, b * n, reference=i == 0)
        try:
            model = build().to(dev).train()
        except torch.cuda.OutOfMemoryError:
            row.error = "out of memory"
            rows.append(row)
            continue

        def step(model=model, form=form):
            model.zero_grad(set_to_none=True)
            with autocast_for(dev, args.dtype_t), use_form(form):
                logits = model(x[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()

        rows.append(measure(row, step, dev, args.steps, args.warmup))
        del model
    return rows


def print_rows(group, rows, rate, cuda):
    reference = {r.n: r.seconds for r in rows if r.reference and r.seconds}
    lines = []
    for r in rows:
        if r.error:
            lines.append([r.name, r.n, r.error] + [""] * (8 if cuda else 7))
            continue
        ref = reference.get(r.n)
        tflops = r.flops / r.seconds / 1e12 if r.flops is not None else None
        cells = [r.name, r.n, f"{r.seconds * 1e3:.2f}", f"{r.tokens / r.seconds:,.0f}",
                 f"{r.peak / 2 ** 20:,.0f}", "n/a" if r.flops is None else f"{r.flops / 1e9:.1f}",
                 "n/a" if tflops is None else f"{tflops:.3g}",
                 "n/a" if tflops is None else f"{100 * tflops * 1e12 / rate:.0f}%",
                 f"{r.seconds / ref:.2f}x" if ref else "-"]
        if cuda:
            cells.append("n/a" if r.model_s is None else f"{r.model_s * 1e3:.2f}")
        lines.append(cells)
    headers = ["case", "n", "ms/step", "tokens/s", "peak MiB", "matmul GFLOP", "TFLOP/s", "of matmul rate",
               "time / softmax's"] + (["H100 model ms"] if cuda else [])
    print(table(headers, lines))
    print()


# ------------------------------------------------------------------------------ steps


def run_tests(args):
    target = ["tests/test_benchmarks.py"] if args.dry_run else ["tests"]
    cmd = [sys.executable, "-m", "pytest", "-q", *target, *args.pytest_args]
    env = {**os.environ, "LAT_TEST_DEVICE": args.device}
    note = "   (dry run: one small file)" if args.dry_run else ""
    print(f"$ LAT_TEST_DEVICE={args.device} {' '.join(cmd[1:])}{note}", flush=True)
    t0 = time.perf_counter()
    code = subprocess.call(cmd, cwd=REPO, env=env)
    print(f"tests on {args.device}: exit code {code} ({'passed' if code == 0 else 'FAILURES, see above'}), "
          f"{time.perf_counter() - t0:.0f} s\n", flush=True)
    return code


def run_existing(args):
    codes = []
    for script in ("bench_layer.py", "bench_lm.py"):
        cmd = [sys.executable, os.path.join("benchmarks", script), "--device", args.device]
        if args.dry_run:
            cmd += ["--lengths", "256", "--steps", "1", "--matmul-size", "256"]
        print("$ " + " ".join(cmd[1:]), flush=True)
        codes.append(subprocess.call(cmd, cwd=REPO))
        print(flush=True)
    return max(codes)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(), help="cuda, cuda:1, cpu ... (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes, one step, one test file: checks the command (e.g. on a CPU)")
    p.add_argument("--skip", nargs="+", choices=STEPS, default=[], help="steps to leave out")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="default 4096 16384 65536 (dry: 64 128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="default 8 (dry: 2)")
    p.add_argument("--dim-head", type=int, default=None, help="default 128 (dry: 16)")
    p.add_argument("--lm-dim", type=int, default=None, help="default 1024 (dry: 64)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on cuda, fp32 elsewhere")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case (default 5; dry: 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; dry: 1)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the command line goes to pytest (e.g. -x -k gate)")
    args = p.parse_args(argv)
    dry = args.dry_run
    for name, full, small in [("lengths", [4096, 16384, 65536], [64, 128]), ("heads", 8, 2), ("dim_head", 128, 16),
                              ("lm_dim", 1024, 64), ("steps", 5, 1), ("warmup", 2, 1)]:
        if getattr(args, name) is None:
            setattr(args, name, small if dry else full)
    for name in ("batch", "heads", "dim_head", "lm_dim", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if any(n < 2 for n in args.lengths):
        p.error(f"--lengths must all be >= 2, got {args.lengths}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r} is not a torch device")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False: on a machine without CUDA, "
                "check the command with --device cpu --dry-run")
    if device.type != "cuda" and not dry:
        p.error(f"this report is for a CUDA device; on {args.device} run it with --dry-run (tiny sizes)")
    cuda = device.type == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.dtype_t = DTYPES[args.dtype]
    args.cuda = cuda
    return args


def main(argv=None):
    args = parse(argv)
    set_threads(args.threads)
    dims = f"b {args.batch}, h {args.heads}, d {args.dim_head}, n {' '.join(map(str, args.lengths))}"
    print_header(args.device, args.threads, [
        f"cuda_report{' (DRY RUN: tiny sizes, not figures to report)' if args.dry_run else ''}: {dims}, "
        f"LM dim {args.lm_dim}, {args.dtype}, {args.steps} steps after {args.warmup} warmup",
        "forward + backward; reference: the square matmul rate in the same dtype, measured below",
    ])
    failures = 0
    if "tests" not in args.skip:
        failures += run_tests(args) != 0

    fla = load_fla(args.device)
    # "today's form": what 'auto' takes on the device without fla (forms.device_form), the rows
    # that the fla form's are read against
    args.today = device_form(torch.device(args.device))
    size = 8192 if args.cuda else 256 if args.dry_run else 2048
    rate = matmul_rate(args.device, args.dtype_t, size)
    print(f"reference: square matmul ({size} x {size}) in {args.dtype}: {rate / 1e12:.3g} TFLOP/s")
    if fla[0] is None:
        print(f"note: fla not importable or not runnable on {args.device} ({fla[2]}): the fla form's rows and "
              f"chunk_simple_gla / chunk_gla's are skipped")
    if args.cuda:
        print("note: 'H100 model ms' is estimate_gpu's roofline MODEL of the same step on an H100, not a timing")
    print()

    groups = [("kernel", "attention alone, (b, h, n, d), causal", lambda n: kernel_rows(args, n, fla)),
              ("layer", f"one attention layer, (b, n, {args.heads * args.dim_head})",
               lambda n: layer_rows(args, n, fla)),
              ("lm", f"LM training step, dim {args.lm_dim}", lambda n: lm_rows(args, n, fla))]
    for key, title, fn in groups:
        if key in args.skip:
            continue
        rows = []
        for n in args.lengths:
            rows += fn(n)
        print(f"{key}: {title}, forward + backward ({'peak: ' + PeakMemory(args.device).method})")
        print_rows(key, rows, rate, args.cuda)
        failures += sum(r.error is not None and r.error != "out of memory" for r in rows)

    if "existing" not in args.skip:
        failures += run_existing(args) != 0
    print(f"cuda_report: {'done' if not failures else f'{failures} step(s) or case(s) failed, see above'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
