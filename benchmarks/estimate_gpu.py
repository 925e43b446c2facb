#!/usr/bin/env python
"""A MODEL, not a timing: what one training step would cost on an H100, from the CPU.

One training step (forward, loss, backward) is traced on the CPU under a ``TorchDispatchMode``
that sees every aten op, by default on fake tensors (shapes, strides and dtypes without data, so
n = 65536 at dim 1024 traces in seconds). Each op costs

    time(op) = max(launch_s, FLOPs / peak, bytes / bandwidth)

and the estimate is the sum over the ops (one after the other, nothing overlapping). Its
reference is the floor, the step's matmul FLOPs at the tensor-core peak of their dtype; the
figures to read are estimate / floor (target <= 1.5) and the launch share, the fraction of the
estimate spent in ops too small to fill the GPU (fewer, fused ops are the cure).

What is counted: views and metadata cost nothing; contractions, convolutions and fused
attention count their matmul FLOPs (``common.contraction_flops``) at the peak of their dtype;
every other op one FLOP per element at the CUDA-core fp32 peak. Bytes are the tensors read and
written (a broadcast dimension once; write-only ops do not read their target; gathers and
in-place scatters touch only the elements they move). Host syncs (.item(), nonzero, boolean
masks) are counted, not costed: fake tensors cannot run one, so a form that syncs needs
``--real``. The ops are those the CPU dispatches (dropout is three ops here, one kernel on CUDA;
CPU autocast's op lists stand in for CUDA's).

The hardware (every figure an option): launch_s 6 us, the host cost of one eager op (an
assumption: 4-10 us is typical); H100 SXM5 datasheet peaks, dense: bf16/fp16 989.4e12, TF32
494.7e12 (float32 matmuls with ``--tf32`` only), FP32 66.9e12, FP64 66.9e12 FLOP/s; HBM3
3.35e12 B/s. No kernel reaches a peak, so estimate and floor are optimistic alike.

The default case: upstream's README LM (``bench_lm.MODELS["upstream-readme"]``) at dim 1024 with
``use_gate=True``, batch 1, training mode, bf16 autocast (the kernel computes in float32 inside),
the loss of ``AutoregressiveWrapper``, at n = 4096, 16384, 65536, the causal kernel traced in the
form it takes on a GPU.

Usage:  python benchmarks/estimate_gpu.py [--lengths 4096 16384 65536] [--dim 1024]
        python benchmarks/estimate_gpu.py --precision fp32 --tf32 --loss plain
        python benchmarks/estimate_gpu.py --set use_local_conv=True --set depth=2
        python benchmarks/estimate_gpu.py --launch-us 4 --bandwidth 3.9e12   # other figures
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (this folder, see common.py)
    bound_args, contraction_flops, kwargs_text, parse_settings, print_header, table)

LABEL = "MODEL, not a timing"
LOSSES = {"wrapper": "AutoregressiveWrapper(model)(x): chunked linear_cross_entropy",
          "plain": "F.cross_entropy(model(x).float())"}
TARGET = 1.5  # the estimate of the gated LM over its floor: above it, the step is not its matmuls


# ---------------------------------------------------------------------------- hardware


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The figures of the cost model (see the module docstring for their sources)."""

    name: str = "H100 SXM5 80GB"
    launch_s: float = 6e-6
    peak_bf16: float = 989.4e12
    peak_tf32: float = 494.7e12
    peak_fp32: float = 66.9e12
    peak_fp64: float = 66.9e12
    bandwidth: float = 3.35e12
    tf32: bool = False

    def __post_init__(self):
        for field in ("launch_s", "peak_bf16", "peak_tf32", "peak_fp32", "peak_fp64", "bandwidth"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware.{field} must be a positive finite number, got {value!r}")

    def matmul_peak(self, dtype):
        """FLOP/s of a contraction in ``dtype``."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.peak_bf16
        if dtype == torch.float32:
            return self.peak_tf32 if self.tf32 else self.peak_fp32
        if dtype == torch.float64:
            return self.peak_fp64
        return self.peak_fp32

    def describe(self):
        fp32 = f"{self.peak_tf32 / 1e12:g} TF32" if self.tf32 else f"{self.peak_fp32 / 1e12:g} FP32 (no TF32)"
        return (f"{self.name}: launch {self.launch_s * 1e6:g} us/op, matmul peak {self.peak_bf16 / 1e12:g} "
                f"TFLOP/s bf16/fp16, {fp32} for float32, {self.peak_fp64 / 1e12:g} fp64; other FLOPs at "
                f"{self.peak_fp32 / 1e12:g}; HBM {self.bandwidth / 1e12:g} TB/s")


H100 = Hardware()


# ------------------------------------------------------------------------- op classes

# metadata / allocation: no kernel runs (views are recognised by func.is_view)
FREE_OPS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
    "lift_fresh", "detach_", "promote_types", "result_type", "is_same_size", "_has_compatible_shallow_copy_type",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "unsqueeze_", "squeeze_", "transpose_", "t_",
    "as_strided_", "resize_", "set_", "record_stream", "_reshape_alias", "is_pinned", "_nested_tensor_size",
}
# ops that read a value back to the host, or size their output by one (the same wait)
SYNC_OPS = {
    "_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "_unique", "_unique2",
    "unique_dim", "unique_consecutive", "bincount", "repeat_interleave", "_assert_async",
}
BOOL_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
# ops that overwrite their first argument without reading it
WRITE_ONLY_FIRST = {"copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_", "random_", "exponential_"}
# in-place scatters: they touch self only where the values go (as many elements as the largest other input)
SCATTERS_INPLACE = {"index_put_", "_index_put_impl_", "index_add_", "index_copy_", "index_fill_", "scatter_",
                    "scatter_add_", "scatter_reduce_"}
# gathers: the source is read where the output is written, no more (argument name of the source)
GATHERS = {"index": "self", "embedding": "weight", "index_select": "self", "gather": "self", "take": "self"}


def _base(func):
    return func.overloadpacket.__name__


def tensor_bytes(t):
    """Bytes of the distinct elements of ``t``: a stride-0 (broadcast) dimension counts once."""
    if t.numel() == 0:
        return 0
    return math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0) * t.element_size()


def is_sync(func, args):
    name = _base(func)
    if name in SYNC_OPS:
        return True
    if name in BOOL_INDEXING and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return any(torch.is_tensor(t) and t.dtype == torch.bool for t in args[1])
    return False


def is_free(func):
    """Views, metadata and allocation: no kernel, no cost, not an op of the count."""
    return func.namespace == "prim" or func.is_view or _base(func) in FREE_OPS


@dataclasses.dataclass
class OpCost:
    """One costed op: its FLOPs and bytes, and the three times of the model."""

    name: str
    flops: int
    bytes: int
    matmul: bool
    peak: float
    launch_s: float
    flop_s: float
    byte_s: float
    dtype: str = ""  # of a contraction's operands

    @property
    def seconds(self):
        return max(self.launch_s, self.flop_s, self.byte_s)

    @property
    def bound(self):
        """'launch', 'flops' or 'bytes': the first of the three that reaches the op's time."""
        t = self.seconds
        return "launch" if self.launch_s == t else "flops" if self.flop_s == t else "bytes"

    @property
    def floor_s(self):
        return self.flop_s if self.matmul else 0.0


def op_cost(func, args, kwargs, out, hw=H100):
    """The model's cost of one dispatched op (None for a free op)."""
    if is_free(func):
        return None
    name = _base(func)
    a = bound_args(func, args, kwargs) if (name in GATHERS or name in WRITE_ONLY_FIRST) else {}
    tensors = [t for key, value in [*enumerate(args), *kwargs.items()] if key != "out"
               for t in tree_flatten(value)[0] if torch.is_tensor(t)]
    overwrites_first = tensors and (name in WRITE_ONLY_FIRST or name in SCATTERS_INPLACE)
    target, inputs = (tensors[0], tensors[1:]) if overwrites_first else (None, tensors)
    outputs = [t for t in tree_flatten(out)[0] if torch.is_tensor(t)]
    out_bytes = sum(tensor_bytes(t) for t in outputs)
    if name in SCATTERS_INPLACE:
        out_bytes = max([t.numel() for t in inputs] or [0]) * target.element_size()
    gathered = a.get(GATHERS.get(name))  # a gather reads no more of its source than it writes
    read = sum(min(tensor_bytes(t), out_bytes) if t is gathered else tensor_bytes(t) for t in inputs)
    moved = read + out_bytes

    flops = contraction_flops(func, args, kwargs, out)
    matmul = flops is not None
    dtype = ""
    if matmul:
        operand = next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)
        peak, dtype = hw.matmul_peak(operand), str(operand).replace("torch.", "")
    else:
        flops = max([t.numel() for t in inputs + outputs] or [0])
        peak = hw.peak_fp32
    return OpCost(name=func.name(), flops=flops, bytes=moved, matmul=matmul, peak=peak,
                  launch_s=hw.launch_s, flop_s=flops / peak, byte_s=moved / hw.bandwidth, dtype=dtype)


class GpuCostModel(TorchDispatchMode):
    """Under it, every dispatched op runs as usual and is costed by ``op_cost``.

    ``ops``: the costed ops (``OpCost``) in order; ``syncs``: the names of the ops that read a
    value back to the host (also costed, as ops). A MODEL of a GPU, not a timing."""

    def __init__(self, hw=H100):
        super().__init__()
        self.hw = hw
        self.ops = []
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sync(func, args):
            self.syncs.append(func.name())
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out, self.hw)
        if cost is not None:
            self.ops.append(cost)
        return out

    def summary(self):
        return Summary.of(self.ops, len(self.syncs))


@dataclasses.dataclass
class Summary:
    """Totals of a list of ``OpCost``."""

    ops: int
    syncs: int
    seconds: float
    floor_s: float
    matmul_flops: int
    flops: int
    bytes: int
    time_by_bound: dict
    count_by_bound: dict
    floor_by_dtype: dict

    @classmethod
    def of(cls, ops, syncs=0):
        time_by, count_by, floor_by = collections.Counter(), collections.Counter(), collections.Counter()
        for op in ops:
            time_by[op.bound] += op.seconds
            count_by[op.bound] += 1
            if op.matmul:
                floor_by[op.dtype] += op.flop_s
        return cls(ops=len(ops), syncs=syncs, seconds=sum(op.seconds for op in ops),
                   floor_s=sum(op.floor_s for op in ops), matmul_flops=sum(op.flops for op in ops if op.matmul),
                   flops=sum(op.flops for op in ops), bytes=sum(op.bytes for op in ops),
                   time_by_bound={b: time_by[b] for b in ("launch", "flops", "bytes")},
                   count_by_bound={b: count_by[b] for b in ("launch", "flops", "bytes")},
                   floor_by_dtype=dict(floor_by))

    @property
    def ratio(self):
        return self.seconds / self.floor_s if self.floor_s else math.inf

    def share(self, bound):
        return self.time_by_bound[bound] / self.seconds if self.seconds else 0.0

    @property
    def launch_share(self):
        return self.share("launch")


def by_op(ops):
    """{op name: (count, seconds, Counter of bounds)}, most expensive first."""
    table = {}
    for op in ops:
        count, seconds, bounds = table.get(op.name, (0, 0.0, collections.Counter()))
        bounds[op.bound] += 1
        table[op.name] = (count + 1, seconds + op.seconds, bounds)
    return dict(sorted(table.items(), key=lambda kv: -kv[1][1]))


# ------------------------------------------------------------------------------ the LM


@contextlib.contextmanager
def causal_form(form):
    """The causal kernel's form for the trace (``ops/causal/forms.py``'s ``use_form`` scope):
    'gpu' picks the torch kernel's form on a CUDA device; 'parallel' / 'sequential' name one.
    Yields a note saying what was done."""
    forms = importlib.import_module("linear_attention_transformer.ops.causal.forms")
    if form == "gpu":
        chosen = forms.device_form(torch.device("cuda"))
        note = f"form={chosen!r} (the torch kernel's on cuda)"
    else:
        chosen, note = form, f"form={form!r} (named)"
    with forms.use_form(chosen):
        yield note


@contextlib.contextmanager
def loss_chunks(form):
    """The wrapper loss's default chunk of logits for the trace: with 'gpu', what it holds on a
    CUDA device (fewer, larger chunks than on the CPU); otherwise as it runs on the CPU. Yields a
    note saying what was done."""
    loss_module = importlib.import_module("linear_attention_transformer.autoregressive")
    if form != "gpu":
        yield "loss chunks as on the CPU"
        return
    saved = loss_module.LOSS_CHUNK_ELEMENTS
    loss_module.LOSS_CHUNK_ELEMENTS = loss_module.loss_chunk_elements(torch.device("cuda"))
    try:
        yield f"loss chunks of {loss_module.LOSS_CHUNK_ELEMENTS} logits (as on cuda)"
    finally:
        loss_module.LOSS_CHUNK_ELEMENTS = saved


def seed_lm_kwargs(dim, n, overrides):
    from bench_lm import MODELS

    return {**MODELS["upstream-readme"], "dim": dim, "use_gate": True, "max_seq_len": n, **overrides}


def trace_lm_step(kwargs, n, batch=1, precision="bf16-autocast", loss="wrapper", real=False, hw=H100, seed=0):
    """Trace one training step of ``LinearAttentionTransformerLM(**kwargs)`` on n tokens under a
    ``GpuCostModel``; returns the model. Building the LM is not traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM

    fake = contextlib.nullcontext() if real else FakeTensorMode()
    with fake:
        torch.manual_seed(seed)
        model = LinearAttentionTransformerLM(**kwargs).train()
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        x = torch.randint(0, kwargs["num_tokens"], (batch, n + 1))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-autocast" \
            else contextlib.nullcontext()
        with GpuCostModel(hw) as mode:
            with autocast:
                if loss == "wrapper":
                    value = AutoregressiveWrapper(model)(x, return_loss=True)
                else:
                    logits = model(x[:, :-1])
                    value = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
            value.backward()
    return mode


# ------------------------------------------------------------------------------- output


_pct = "{:.0%}".format


def _ms(seconds):
    return f"{seconds * 1e3:.2f}"


def print_report(args, hw, model_text, results, form_note):
    """The header, one row per (loss, n), and a verdict line per row; ``results`` is a list of
    (loss, n, Summary, trace seconds)."""
    print(f"*** {LABEL}: a roofline estimate of a {hw.name} from a CPU trace; no GPU ran ***")
    print_header("cpu", None, [f"LinearAttentionTransformerLM({model_text})",
                               f"training mode, batch {args.batch}, {args.precision}, forward + loss + backward",
                               *(f"loss {loss}: {LOSSES[loss]}" for loss in args.loss),
                               f"traced on {'real' if args.real else 'fake'} tensors; kernel {form_note}",
                               "cost: per op max(launch, FLOPs / peak, bytes / bandwidth), summed; views free",
                               hw.describe()])
    rows = []
    for loss, n, s, seconds in results:
        rows.append([loss, n, s.ops, s.syncs, f"{s.matmul_flops / 1e12:.2f}", f"{s.bytes / 1e9:.1f}",
                     _ms(s.seconds), _ms(s.floor_s), f"{s.ratio:.2f}x", _pct(s.launch_share),
                     _pct(s.share("flops")), _pct(s.share("bytes")), f"{seconds:.1f}"])
    print(f"one training step, {LABEL} (the estimate beside its floor: the step's matmul FLOPs at peak):")
    print(table(["loss", "n", "ops", "host syncs", "matmul TFLOP", "GB moved", "estimate ms", "floor ms",
                 "estimate/floor", "launch share", "FLOP-bound", "byte-bound", "trace s"], rows))
    print("(ops: costed aten ops, views and metadata excluded; shares: of the estimated time, by the limit "
          "that set each op's cost)")
    print()
    for loss, n, s, _ in results:
        verdict = "ok" if s.ratio <= TARGET else "ABOVE TARGET"
        print(f"{loss}, n = {n}: estimate {_ms(s.seconds)} ms = {s.ratio:.2f}x the floor {_ms(s.floor_s)} ms "
              f"(target <= {TARGET}x: {verdict}); launch share {_pct(s.launch_share)} "
              f"({s.count_by_bound['launch']} of {s.ops} ops launch-bound), {s.syncs} host syncs; floor: "
              + ", ".join(f"{dtype} matmuls {_ms(t)} ms" for dtype, t in sorted(s.floor_by_dtype.items())))
    return rows


def print_top(what, ops, rows):
    total = sum(op.seconds for op in ops)
    lines = []
    for name, (count, seconds, bounds) in list(by_op(ops).items())[:rows]:
        lines.append([name, count, _ms(seconds), _pct(seconds / total),
                      ", ".join(f"{b} {c}" for b, c in bounds.most_common())])
    print(f"\n{what}, the ops that cost most ({LABEL}):")
    print(table(["op", "count", "estimate ms", "share", "bound by"], lines))


# -------------------------------------------------------------------------------- CLI


def _positive(kind):
    """An argparse type: a positive (finite) number of ``kind``."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a positive finite number ({kind.__name__}), got {text!r}")
        return value
    return parse


def _key_value(text):
    try:
        (pair,) = parse_settings(text).items()
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return pair


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=_positive(int), nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--dim", type=_positive(int), default=1024, help="model dim (default: %(default)s)")
    p.add_argument("--batch", type=_positive(int), default=1)
    p.add_argument("--set", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="override an argument of the LM (repeatable), e.g. use_local_conv=True")
    p.add_argument("--precision", choices=["bf16-autocast", "bf16", "fp32"], default="bf16-autocast",
                   help="bf16 autocast (default), a bf16 model, or fp32")
    p.add_argument("--loss", choices=list(LOSSES), nargs="+", default=list(LOSSES),
                   help="wrapper: AutoregressiveWrapper's chunked loss; plain: F.cross_entropy of the logits "
                        "(default: both)")
    p.add_argument("--chunk-form", choices=["gpu", "parallel", "sequential"], default="gpu",
                   help="the causal kernel's form in the trace (default: what it runs on a GPU)")
    p.add_argument("--real", action="store_true", help="trace real CPU tensors (slow; needed by a form that syncs)")
    p.add_argument("--top", type=int, default=12, help="ops listed for the longest n (0: none)")
    hwp = p.add_argument_group(f"hardware figures (default: {H100.name}, see the docstring)")
    hwp.add_argument("--launch-us", type=_positive(float), default=H100.launch_s * 1e6)
    for field in ("peak_bf16", "peak_tf32", "peak_fp32", "peak_fp64", "bandwidth"):
        hwp.add_argument("--" + field.replace("_", "-"), type=_positive(float), default=getattr(H100, field),
                         help="bytes/s" if field == "bandwidth" else "FLOP/s")
    hwp.add_argument("--tf32", action="store_true", help="float32 matmuls at the TF32 peak")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    figures = dict(launch_s=args.launch_us * 1e-6, peak_bf16=args.peak_bf16, peak_tf32=args.peak_tf32,
                   peak_fp32=args.peak_fp32, peak_fp64=args.peak_fp64, bandwidth=args.bandwidth, tf32=args.tf32)
    changed = {k: v for k, v in figures.items() if v != getattr(H100, k)}
    name = H100.name + (" with " + ", ".join(changed) + " changed" if changed else "")
    hw = Hardware(name=name, **figures)
    if args.top < 0:
        p.error("--top must be >= 0")

    from linear_attention_transformer import LinearAttentionTransformerLM

    overrides = dict(args.set)
    kwargs = seed_lm_kwargs(args.dim, max(args.lengths), overrides)
    try:  # bad --set names or values fail here, with the model's own message
        with torch.device("meta"):
            LinearAttentionTransformerLM(**kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "defaults"
        p.error(f"the LM rejects these arguments ({given}): {e}")

    results, traces = [], {}
    with causal_form(args.chunk_form) as form_note, loss_chunks(args.chunk_form) as loss_note:
        form_note = f"{form_note}; {loss_note}"
        for loss in args.loss:
            for n in args.lengths:
                t0 = time.perf_counter()
                try:
                    mode = trace_lm_step({**kwargs, "max_seq_len": n}, n, batch=args.batch,
                                         precision=args.precision, loss=loss, real=args.real, hw=hw)
                except Exception as e:  # a data-dependent op on fake tensors: say which way out there is
                    if args.real or type(e).__name__ not in ("DataDependentOutputException",
                                                             "DynamicOutputShapeException"):
                        raise
                    print(f"error: at n = {n} the step reads a value back to the host ({type(e).__name__}: {e}); "
                          f"fake tensors cannot trace that: use --real (real CPU tensors, slow) or another "
                          f"--chunk-form", file=sys.stderr)
                    return 2
                results.append((loss, n, mode.summary(), time.perf_counter() - t0))
                traces[loss, n] = mode.ops
    print_report(args, hw, kwargs_text({**kwargs, "max_seq_len": "n"}), results, form_note)
    if args.top:
        for loss in args.loss:
            n = max(args.lengths)
            print_top(f"{loss}, n = {n}", traces[loss, n], args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
