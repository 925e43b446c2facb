"""What the benchmark scripts of this folder share (benchmarks/README.md): the command line, timing, peak memory,
the floors, the softmax reference, the training-step harness, tables and records. They import it from their folder.
"""

import argparse
import ast
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

GiB = 2 ** 30
RESULT_TAG = "BENCH_RESULT "
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(threads):
    if threads is not None:
        torch.set_num_threads(threads)


def load_average():
    """Above the thread count, other processes compete for the cores and the timings suffer."""
    try:
        return "1/5/15 min load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unavailable"


def device_name(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu: {cpu} ({os.cpu_count()} logical cores visible)"


def _proc_status_bytes(field):
    """A 'VmXXX:  1234 kB' field of /proc/self/status in bytes, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


class PeakMemory:
    """Peak memory above a baseline taken at construction (benchmarks/README.md); where the peak
    cannot be reset (not Linux), the process's lifetime peak is used: the increase is a lower bound."""

    def __init__(self, device):
        self.device, self.cuda = device, torch.device(device).type == "cuda"
        if self.cuda:
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base, self.method = torch.cuda.memory_allocated(device), "torch.cuda.max_memory_allocated"
            return
        rss = _proc_status_bytes("VmRSS")
        try:  # reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = rss is not None
        except OSError:
            self.exact = False
        self.base = rss if self.exact else self._lifetime_peak()
        self.method = "VmHWM over VmRSS at baseline" if self.exact else "ru_maxrss increase (lower bound)"

    @staticmethod
    def _lifetime_peak():
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux

    def increase(self):
        if self.cuda:
            synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return (_proc_status_bytes("VmHWM") if self.exact else self._lifetime_peak()) - self.base


def timed(fn, device):
    """(fn's result, its seconds), the device synchronised on both sides."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def best_seconds(fn, device, reps, min_time=0.05):
    """Best-of-``reps`` seconds per call of fn; each sample loops fn for about ``min_time`` so
    that timer resolution and launch overhead do not count."""
    fn()
    inner = max(1, int(min_time / max(timed(fn, device)[1], 1e-7)))
    return min(timed(lambda: [fn() for _ in range(inner)], device)[1] for _ in range(reps)) / inner


def square_matmul_rate(device, size=None, reps=5):
    """fp32 FLOP/s of a square matmul of side ``size`` (default 2048 on a CPU, 8192 on CUDA), best of ``reps``."""
    size = size or (8192 if torch.device(device).type == "cuda" else 2048)
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(device) for _ in range(2))
    return 2 * size ** 3 / best_seconds(lambda: a @ b, device, reps)


def in_turn(sides, rounds, alternate=False):
    """{name: [what it returned, per round]}: each round calls every one of ``sides`` ({name: a function})
    in turn, so that a change of load hits all alike (``alternate``: every other round reversed)."""
    times = {name: [] for name in sides}
    for i in range(rounds):
        for name, side in list(sides.items())[:: -1 if alternate and i % 2 else 1]:
            times[name].append(side())
    return times


def weight_floors(model, device, reps=20, rows=1):
    """(warm, cold) seconds of ``rows`` vectors through every 2-D parameter but the token embedding
    (of which a step reads one row): the best of ``reps`` passes, and their median after writing 64 MiB each."""
    weights = [p.detach() for name, p in model.named_parameters() if p.ndim == 2 and name != "token_emb.weight"]
    vectors = [torch.randn(rows, w.shape[1], device=device) for w in weights]
    flush = torch.zeros(64 << 18, device=device)

    def one_pass(cold=False):
        if cold:
            flush.add_(1.0)
        return timed(lambda: [torch.mm(x, w.t()) for x, w in zip(vectors, weights)], device)[1]

    return min(one_pass() for _ in range(reps)), sorted(one_pass(cold=True) for _ in range(reps))[reps // 2]


def bound_args(func, args, kwargs):
    """The op's arguments by their schema names."""
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs)
    return bound


SDPA_FORWARD = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
SDPA_BACKWARD = {name + "_backward" for name in SDPA_FORWARD}


def _conv_flops(a, produced, passes=1):
    """2 x produced elements x (input channels / groups) x kernel size, per pass."""
    w = a["weight"]
    return 2 * produced.numel() * w.shape[1] * math.prod(w.shape[2:]) * passes


def _sdpa_flops(name, a):
    """q kᵀ and p v of fused attention (half under a causal mask), backward 2.5 x forward."""
    q, k, v = a["query"], a["key"], a["value"]
    *batch, length, e = q.shape
    flops = 2 * math.prod(batch) * length * k.shape[-2] * (e + v.shape[-1])
    if a.get("is_causal"):
        flops //= 2
    return flops * 5 // 2 if name in SDPA_BACKWARD else flops


def contraction_flops(func, args, kwargs, out):
    """Matmul-class FLOPs of one aten op (a multiply-add counts 2), or None if it is not one: the
    single FLOP count that the matmul floor, the GPU cost model and the tests read."""
    name = func.overloadpacket.__name__
    a = bound_args(func, args, kwargs)
    if name in ("mv", "dot", "vdot"):
        return 2 * a["self"].numel()
    if name == "addmv":
        return 2 * a["mat"].numel()
    if name == "convolution":  # transposed: every input element meets the kernel
        return _conv_flops(a, a["input"] if a["transposed"] else out)
    if name == "convolution_backward":
        mask = a["output_mask"]
        return _conv_flops(a, a["input"] if a["transposed"] else a["grad_output"], int(mask[0]) + int(mask[1]))
    if name in SDPA_FORWARD or name in SDPA_BACKWARD:
        return _sdpa_flops(name, a)
    factors = {"mm": ("self", "mat2"), "bmm": ("self", "mat2"), "addmm": ("mat1", "mat2"),
               "baddbmm": ("batch1", "batch2"), "addbmm": ("batch1", "batch2")}.get(name)
    if factors is None:
        return None
    x, y = a[factors[0]], a[factors[1]]
    (*batch, m, k), n = x.shape, y.shape[-1]
    return 2 * math.prod(batch) * m * k * n


class MatmulFlops(TorchDispatchMode):
    """Counts the matmul-class FLOPs (``contraction_flops``) of everything that runs under it,
    forward and backward: the work a step really does, whatever its code."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += contraction_flops(func, args, kwargs, out) or 0
        return out


def step_flops(step):
    """Matmul FLOPs of one call of ``step``."""
    with MatmulFlops() as counter:
        step()
    return counter.flops


def measure_step(step, device, steps, warmup, matmul_size=None):
    """Seconds of ``step`` (``warmup`` untimed calls first), its peak memory, its matmul FLOPs, the
    better of the square matmul rates just before and after, and ``floor_share``: FLOPs / rate / median."""
    rate_before = square_matmul_rate(device, matmul_size)
    memory = PeakMemory(device)
    times = [timed(step, device)[1] for _ in range(warmup + steps)][warmup:]
    peak = memory.increase()
    rate = max(rate_before, square_matmul_rate(device, matmul_size))
    flops, median = step_flops(step), statistics.median(times)
    return dict(times=times, median=median, peak=peak, rate=rate, flops=flops, floor_share=flops / rate / median,
                memory_method=memory.method, threads=torch.get_num_threads())


class SoftmaxSelfAttention(nn.Module):
    """The softmax reference: ``F.scaled_dot_product_attention`` between the projections of ``LinearSelfAttention``."""

    def __init__(self, dim, heads=8, dim_head=64, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def parse_settings(text):
    """'key=value,key=value' (values Python literals; a bare word stays a string) to a dict.
    'base' or '' is the empty dict."""
    settings = {}
    for item in filter(None, text.split(",")):
        if item == "base":
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return settings


def settings_text(settings):
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "base"


def kwargs_text(kwargs):
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def arguments(doc, device=True, matmul_size=False):
    """A parser with ``doc`` as its description and the options the scripts share."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if device:
        p.add_argument("--device", default=default_device())
    if matmul_size:
        p.add_argument("--matmul-size", type=int, default=None,
                       help="square matmul side (default: %(default)s; None: 2048 on a CPU, 8192 on CUDA)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: %(default)s; None: as is)")
    p.add_argument("--record", metavar="NAME", default=None, help="write the figures to results/NAME.json")
    return p


def print_header(device, threads_arg, model_lines=()):
    """Date, versions, device, threads, load average, and one 'model:' line per model line."""
    print(f"date:    {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch:   {torch.__version__}   python {platform.python_version()}")
    print(f"device:  {device} ({device_name(device)})")
    print(f"threads: {torch.get_num_threads()} (torch.get_num_threads)"
          + ("" if threads_arg is None else f", set by --threads {threads_arg}"))
    print(f"load:    {load_average()}")
    for i, line in enumerate([model_lines] if isinstance(model_lines, str) else model_lines):
        print(("model:   " if i == 0 else "         ") + line)
    print()


def start(args, model_lines=()):
    """Set ``--threads``, then print the header (the device: ``--device``, or the CPU)."""
    set_threads(args.threads)
    print_header(getattr(args, "device", "cpu"), args.threads, model_lines)


def table(headers, rows):
    """Right-aligned plain-text table with a dashed rule under the headers."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def record(script, device, figures):
    """Write ``figures`` to results/<script>.json with the command, date and machine; returns the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{script}.json")
    entry = dict(command="python " + " ".join(["benchmarks/" + os.path.basename(sys.argv[0])] + sys.argv[1:]),
                 date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 machine=device_name(device), threads=torch.get_num_threads(), load=load_average(),
                 figures=figures)
    with open(path, "w") as f:
        json.dump(entry, f, indent=1)
        f.write("\n")
    return path


def finish(args, figures):
    """With ``--record``, write the figures; then the load average at the end. Returns 0, the exit code."""
    if args.record:
        print("recorded in", record(args.record, getattr(args, "device", "cpu"), figures))
    print(f"({load_average()} at the end)")
    return 0


def emit_result(result):
    """Worker side: print ``result`` (JSON-serialisable) as the tagged line the driver reads."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_in_subprocess(script, argv, label, env=None):
    """Run ``python script *argv`` in a fresh process: (the result it emitted, None), or (None, an
    error text naming ``label`` with the tail of its output) when it emitted none."""
    cmd = [sys.executable, os.path.abspath(script)] + [str(a) for a in argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):]), None
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return None, f"worker for {label} failed (exit {proc.returncode}):\n{tail}"


def step_arguments(doc, lengths):
    """The options of the training-step harness (bench_lm, bench_layer: every case, implementation,
    variant and length, is one step measured by ``measure_step`` in a fresh subprocess)."""
    p = arguments(doc, matmul_size=True)
    p.add_argument("--lengths", type=int, nargs="+", default=lengths)
    p.add_argument("--variants", type=parse_settings, nargs="+", default=[{}], help="'base' or key=value,...")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every case, the fastest kept (default: 1)")
    p.add_argument("--worker", type=json.loads, default=None, help=argparse.SUPPRESS)
    return p


def step_worker(job, build_step):
    """Worker side: measure the step that ``build_step(case, device)`` returns (with its model)."""
    set_threads(job["threads"])
    model, step = build_step(job["case"], job["device"])
    result = measure_step(step, job["device"], job["steps"], job["warmup"], job["matmul_size"])
    emit_result(dict(result, parameters=sum(p.numel() for p in model.parameters())))


def case_name(case):
    return f"{case['impl']} {settings_text(case['settings'])} n={case['n']}"


def run_step_cases(script, args, cases, env_for=lambda case: None):
    """Each case in a fresh subprocess of ``script``, ``args.rounds`` times round-robin: each case's result
    of least median time (None for a case whose worker failed, its error printed)."""
    options = {k: getattr(args, k) for k in ("device", "steps", "warmup", "threads", "matmul_size")}
    best = [None] * len(cases)
    for _ in range(args.rounds):
        for i, case in enumerate(cases):
            result, error = run_in_subprocess(script, ["--worker", json.dumps(dict(options, case=case))],
                                              case_name(case), env=env_for(case))
            print(f"  {case_name(case)}: " + (error if error else f"{result['median']:.3f} s/step"), flush=True)
            if result and (best[i] is None or result["median"] < best[i]["median"]):
                best[i] = result
    return best


def step_ratios(cases, results):
    """upstream / ours (speed) and ours / upstream (peak memory) per variant and length; each
    variant against the first at the same length; peak memory, longest length over shortest."""
    got = {case_name(c): r for c, r in zip(cases, results) if r}
    lengths = sorted({c["n"] for c in cases})
    out = {}
    for c in cases:
        ours, name = got.get(case_name(c)), f"{settings_text(c['settings'])} n={c['n']}"
        if c["impl"] != "ours" or ours is None:
            continue
        upstream = got.get(case_name({**c, "impl": "upstream"}))
        if upstream:
            out[f"speed vs upstream, {name}"] = upstream["median"] / ours["median"]
            out[f"peak vs upstream, {name}"] = ours["peak"] / upstream["peak"]
        first = got.get(case_name({**c, "settings": cases[0]["settings"]}))
        if first and first is not ours:
            out[f"time vs first variant, {name}"] = ours["median"] / first["median"]
            out[f"peak vs first variant, {name}"] = ours["peak"] / first["peak"]
        shortest = got.get(case_name({**c, "n": lengths[0]}))
        if c["n"] == lengths[-1] and len(lengths) > 1 and shortest:
            out[f"peak n={c['n']} / n={lengths[0]}, {settings_text(c['settings'])}"] = ours["peak"] / shortest["peak"]
    return out


def report_step_cases(args, cases, results):
    """The table, the ratios, and with --record the figures written. Returns the exit code."""
    done = [(c, r) for c, r in zip(cases, results) if r]
    if not done:
        return 1
    rows = [[c["impl"], settings_text(c["settings"]), c["n"], f"{r['median']:.3f}", f"{c['n'] / r['median']:.0f}",
             f"{r['flops'] / 1e9:.1f}", f"{r['rate'] / 1e9:.1f}", f"{100 * r['floor_share']:.0f}%",
             f"{r['peak'] / GiB:.3f}"] for c, r in done]
    print("\n" + table(["impl", "variant", "n", "s/step", "tok/s", "GFLOP/step", "matmul GFLOP/s", "of floor",
                        "peak +GiB"], rows))
    print(f"(s/step: median of {args.steps} after {args.warmup} untimed, the fastest of {args.rounds} round(s); "
          f"of floor: FLOPs at the better of the square matmul rates just before and after, over s/step; "
          f"peak memory: {done[0][1]['memory_method']})\n")
    figures = step_ratios(cases, results)
    for name, value in figures.items():
        print(f"{name}: {value:.2f}x")
    figures.update({case_name(c): {k: r[k] for k in ("median", "peak", "floor_share")} for c, r in done})
    finish(args, figures)
    return 0 if len(done) == len(cases) else 1
