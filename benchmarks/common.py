"""Helpers shared by the benchmark scripts of this folder (bench_lm, bench_gate, bench_generate).

Devices and threads, a description of the machine, peak memory over a baseline, the best
time of a short call, the square matmul rate that every script prints as its drift reference,
the header every script starts with, plain-text tables, and running one measurement in a
fresh Python subprocess (so that its peak memory is its own) and reading back its result.

The scripts import this file as ``common`` from their own folder: run them as
``python benchmarks/<script>.py``.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GiB = 2 ** 30
RESULT_TAG = "BENCH_RESULT "


# ------------------------------------------------------------------------------ devices


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(threads):
    if threads is not None:
        torch.set_num_threads(threads)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def load_average():
    """1/5/15-minute load averages: above the thread count, other processes compete for the
    cores and the timings (most of all those of many small ops) suffer."""
    try:
        return "1/5/15 min load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unavailable"


def device_name(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_name()} ({os.cpu_count()} logical cores visible)"


# ------------------------------------------------------------------ host memory (Linux)


def _proc_status_kib(field):
    """A 'VmXXX:  1234 kB' field of /proc/self/status in KiB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss():
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0). True if done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_bytes():
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # KiB on Linux, bytes on macOS


class PeakMemory:
    """Peak memory above a baseline taken at construction.

    CUDA: torch.cuda.max_memory_allocated over memory_allocated at the baseline.
    CPU: the peak resident set size (VmHWM, reset to the current RSS at the baseline through
    /proc/self/clear_refs) over the RSS at the baseline. Without clear_refs, ru_maxrss is
    the peak since the process started, so the increase is only a lower bound (flagged).
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.exact = True
        if self.cuda:
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            self.method = "torch.cuda.max_memory_allocated"
            return
        rss = _proc_status_kib("VmRSS")
        if rss is not None and _reset_peak_rss():
            self.base = rss * 1024
            self.method = "VmHWM - VmRSS at baseline"
        else:
            self.base = _maxrss_bytes()
            self.exact = False
            self.method = "ru_maxrss increase (lower bound)"

    def increase(self):
        if self.cuda:
            synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        if self.exact:
            hwm = _proc_status_kib("VmHWM")
            if hwm is not None:
                return hwm * 1024 - self.base
        return _maxrss_bytes() - self.base


# --------------------------------------------------------------------- matmul reference


def best_seconds(fn, device, reps, min_time=0.05):
    """Best-of-``reps`` seconds per call of fn; each sample loops fn enough times to last
    about ``min_time`` so that timer resolution and launch overhead do not count."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_time / once))
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def causal_kernel_flops(heads, n, d, e, chunk):
    """Matmul FLOPs of one forward of the chunked causal kernel on n tokens (one sequence; a
    multiply-add counts 2). Per head, with C = chunk and v carrying the normaliser's column
    of ones (hence e + 1): intra-chunk q kᵀ 2 n C d and weights @ v 2 n C (e + 1) (the full
    C x C block, upper half masked: work the kernel does), q @ state 2 n d (e + 1), chunk
    states kᵀ v 2 n d (e + 1). n is padded to a multiple of C."""
    n_pad = -(-n // chunk) * chunk
    return heads * (2 * n_pad * chunk * d + 2 * n_pad * chunk * (e + 1) + 4 * n_pad * d * (e + 1))


class _MatmulRecorder(TorchDispatchMode):
    """Notes every matmul that runs under it (forward and backward): the op, and each tensor
    operand's shape, strides and dtype. Keyword arguments (beta, alpha, out=) are not noted: the
    replay runs the plain op, which does the same multiply-adds. Ops outside ``_REPLAY_OPS``
    (addbmm, mv, addmv, dot, fused attention) are not seen; this package runs none of them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")  # addmm_ is timed as addmm
        if name in _REPLAY_OPS:
            operands = tuple((tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a
                             for a in args)
            self.calls.append((name, operands))
        return func(*args, **kwargs)


_REPLAY_OPS = {"mm": torch.mm, "addmm": torch.addmm, "bmm": torch.bmm, "baddbmm": torch.baddbmm}


def _matmul_flops(name, operands):
    """2 m n k for mm/addmm (times the batch for bmm/baddbmm), from the operand shapes."""
    a, b = (operands[0], operands[1]) if name in ("mm", "bmm") else (operands[1], operands[2])
    (*batch, m, k), n = a[0], b[0][-1]
    return 2 * math.prod(batch) * m * n * k


def _random_like(spec, device):
    """A random tensor of a noted (shape, strides, dtype); anything else is returned as is."""
    if not isinstance(spec, tuple):
        return spec
    shape, stride, dtype = spec
    size = 1 + sum((d - 1) * st for d, st in zip(shape, stride)) if all(shape) else 0
    return torch.randn(size, dtype=dtype, device=device).as_strided(shape, stride)


def matmul_replay(fn, device, reps=3):
    """The matmuls that one call of ``fn`` runs, each replayed alone at its own shapes.

    ``fn`` runs once under a dispatch mode that notes every mm / addmm / bmm / baddbmm, with
    the operands' shapes, strides (a transposed weight stays transposed) and dtypes. Each
    distinct call is then timed on fresh random operands of the same layout (best of
    ``reps``, see ``best_seconds``) and counted as often as it ran. The sum is what the
    step's matmuls cost at their own shapes, thin and batched ones included, with nothing
    between them: a ceiling that the square-matmul floor can be read against.
    Returns (seconds, FLOPs, number of matmul calls)."""
    with _MatmulRecorder() as recorder:
        fn()
    counts = collections.Counter(recorder.calls)
    seconds = flops = 0.0
    for (name, operands), count in counts.items():
        args = [_random_like(spec, device) for spec in operands]
        seconds += count * best_seconds(lambda: _REPLAY_OPS[name](*args), device, reps)
        flops += count * _matmul_flops(name, operands)
    return seconds, flops, len(recorder.calls)


def default_matmul_size(device):
    """Side of the square reference matmul: 2048 on CPU, 8192 on CUDA."""
    return 8192 if torch.device(device).type == "cuda" else 2048


def random_matrices(device, *shapes, seed=0):
    """fp32 standard normal tensors of the given shapes, drawn on the CPU from ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(device) for shape in shapes]


def square_matmul_rate(device, size=None, reps=5):
    """fp32 FLOP/s of (size x size) @ (size x size), best of ``reps`` (2 size^3 FLOPs)."""
    size = size or default_matmul_size(device)
    a, b = random_matrices(device, (size, size), (size, size))
    t = best_seconds(lambda: a @ b, device, reps)
    return 2 * size ** 3 / t


def square_matmul_desc(size):
    return f"square matmul ({size} x {size}) @ ({size} x {size})"


# -------------------------------------------------------------------------------- output


def print_header(device, threads_arg, model_lines=()):
    """Date, versions, device, threads (and whether --threads set them), load average, and
    one 'model:' line per entry of ``model_lines`` (continuation lines indented)."""
    print(f"date:    {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch:   {torch.__version__}   python {platform.python_version()}")
    print(f"device:  {device} ({device_name(device)})")
    print(f"threads: {torch.get_num_threads()} (torch.get_num_threads)"
          + ("" if threads_arg is None else f", set by --threads {threads_arg}"))
    print(f"load:    {load_average()}")
    for i, line in enumerate([model_lines] if isinstance(model_lines, str) else model_lines):
        print(("model:   " if i == 0 else "         ") + line)
    print()


def table(headers, rows):
    """Right-aligned plain-text table with a dashed rule under the headers."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    lines = [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    return "\n".join(lines)


def kwargs_text(kwargs):
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


# ----------------------------------------------------------------------- subprocess runs


def emit_result(result):
    """Worker side: print ``result`` (JSON-serialisable) as the tagged line the driver reads."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_in_subprocess(script, argv, label, python=None, env=None):
    """Run ``python script *argv`` in a fresh process and read the result it emitted.

    ``python``: the interpreter (default: this one); ``env``: its environment (default: this
    process's). Returns (result dict, None), or (None, an error text naming ``label`` with the
    tail of the worker's output) when the worker printed no result."""
    cmd = [python or sys.executable, os.path.abspath(script)] + [str(a) for a in argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):]), None
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return None, f"worker for {label} failed (exit {proc.returncode}):\n{tail}"
