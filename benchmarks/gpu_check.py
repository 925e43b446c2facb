#!/usr/bin/env python
"""One prepared check for a CUDA machine, with no network: versions, correctness against a
float64 reference computed on the CPU, cached decoding, and timings, in under 8 minutes.

    python benchmarks/gpu_check.py --out DIR          # on a CUDA machine
    python benchmarks/gpu_check.py --cpu-dry-run      # the whole script on a CPU, tiny sizes

Sections (each row guarded: an exception is recorded and the script goes on; each section
has a time budget, rows past it are recorded as skipped):

``versions``     torch, CUDA, Triton, fla-core, the GPU; why the fla kernel (the additive rule's,
                 the delta rule's) cannot run, if so.
``correctness``  one attention layer, forward and backward (input and parameter gradients),
                 on the device against the same layer in float64 on the CPU: the torch kernel
                 (``kernel='torch'``), the fla kernel (``kernel='fla'``) and the flex local heads
                 (a layer of local heads only), for the default, gated (``use_gate``),
                 given-feature (elu + 1 with the gate: fla's gated backward) and seed-like
                 (blindspot, local heads) configurations, and for delta-rule heads
                 (``update_rule='delta'``: plain, and gated with the local convolution, on
                 fla's ``chunk_gated_delta_rule``); float32, with tolerances that hold under
                 TF32 (fla's and flex's float32 dots run as TF32 on NVIDIA), and under bf16
                 autocast. The torch kernel's rows run first, then fla's and flex's, whose first
                 calls compile. Where fla refuses only the backward (``known_bad_pair``, Hopper
                 with Triton 3.4 to 3.7 and no tilelang: given features' gated backward, every
                 delta-rule backward), the row checks the forward alone and says why
                 (``grad_err=refused``).
``decoding``     an LM's cached decoding (the prompt, then a one-token forward a step), eager and
                 compiled (CUDA graphs: ``mode='reduce-overhead'``), against its full forward;
                 the same for an LM with delta-rule heads (gated, beside local heads, with the
                 local convolution; its full forward and prefill on fla's kernel where it runs),
                 whose compiled row starts only with as much of the budget left as the additive
                 one took.
``timing``       n = 4096 and 16384, forward + backward: one attention layer and one LM
                 training step, each with the torch kernel, the fla kernel, with fla's ``chunk_gla``
                 alone in place of the attention (in the layer also with the normaliser: v one
                 column wider, as the fla kernel feeds it, or the keys' decayed sum apart, by fla's
                 ``chunk_hgrn``), and with ``scaled_dot_product_attention`` (flash); the layer
                 with delta-rule heads on the torch and the fla kernel, also its forward alone
                 (a prefill; fla's where it refuses the backward): tokens per second and peak
                 memory.

Writes ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` after every row. Status per row: ok,
fail (over tolerance), error (an exception), unavailable (the form refuses this machine and
says why), skipped (time budget).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from importlib import metadata

import torch
import torch.nn.functional as F
from torch import nn

from linear_attention_transformer import Attention, LinearAttentionTransformerLM
from linear_attention_transformer.ops.causal.fla import fla_missing
from linear_attention_transformer.ops.delta import fla as delta_fla

SECTIONS = dict(correctness=0.3, decoding=0.2, timing=0.45)  # each section's share of the budget
FULL = dict(budget=420, lengths=(4096, 16384), batch=1, heads=8, dim_head=128, window=128, blindspot=64, check_n=512,
            lm_dim=1024, lm_depth=2, num_tokens=20000, steps=5, warmup=2)
DRY = dict(budget=55, lengths=(64,), batch=1, heads=2,
           dim_head=16, window=8, blindspot=8, check_n=40, lm_dim=32, lm_depth=1, num_tokens=50, steps=1, warmup=0)
# relative tolerances (max |error| / max |reference|): float32 under TF32 (fla, flex), float32
# (the torch kernel: PyTorch's float32 matmuls are not TF32 by default), bf16 autocast; gradients x2
TOLERANCE = {("fp32", "torch"): 1e-3, ("fp32", "fla"): 5e-3, ("fp32", "flex"): 5e-3, "bf16": 5e-2}
NORMALISERS = ("fla, v + 1 column", "fla, normaliser apart")  # fla's kernel timed with the normaliser two ways
DELTA = ("delta, torch", "delta, fla")  # the layer with delta-rule heads, on either kernel


class Report:
    """Rows of (section, name, status, fields), written as JSON and markdown after each row."""

    def __init__(self, out, budget):
        os.makedirs(out, exist_ok=True)
        self.json_path, self.md_path = os.path.join(out, "gpu_check.json"), os.path.join(out, "gpu_check.md")
        self.start, self.budget = time.monotonic(), budget
        self.versions, self.rows, self.section, self.deadline = {}, [], None, None

    def begin(self, section, seconds=None):
        seconds = round(SECTIONS[section] * self.budget) if seconds is None else seconds
        self.section = section
        self.deadline = min(time.monotonic() + seconds, self.start + self.budget)
        print(f"\n== {section} (budget {seconds} s)", flush=True)

    def row(self, name, fn, needs=0.0):
        """Run ``fn`` (-> dict of fields, with 'status' or not) as one row, guarded; only with at
        least ``needs`` seconds of the section's budget left (a row about that long)."""
        record = dict(section=self.section, name=name)
        if time.monotonic() + needs > self.deadline:
            record.update(status="skipped", note="time budget" + (f" (needs about {needs:.0f} s)" if needs else ""))
        else:
            t0 = time.monotonic()
            try:
                record.update({"status": "ok", **fn()})
            except ValueError as error:
                unavailable = "cannot run this call" in str(error)
                record.update(status="unavailable" if unavailable else "error", note=_message(error))
            except Exception as error:  # one row failing must not stop the check
                record.update(status="error", note=_message(error), where=traceback.format_exc(limit=-2)[-600:])
            record["seconds"] = round(time.monotonic() - t0, 2)
            if torch.cuda.is_available():  # (each row's memory its own)
                torch.cuda.empty_cache()
        self.rows.append(record)
        fields = "  ".join(f"{k}={v}" for k, v in record.items() if k not in ("section", "name", "status", "where"))
        print(f"  {record['status']:<11} {name}  {fields}", flush=True)
        self.write()
        return record

    def write(self):
        data = dict(versions=self.versions, elapsed_s=round(time.monotonic() - self.start, 1), rows=self.rows)
        with open(self.json_path, "w") as f:
            json.dump(data, f, indent=1, default=str)
        lines = ["# GPU check", "", *(f"- {k}: {v}" for k, v in self.versions.items())]
        for section in dict.fromkeys(r["section"] for r in self.rows):
            rows = [r for r in self.rows if r["section"] == section]
            keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("section", "name", "where")]
            lines += ["", f"## {section}", "", "| case | " + " | ".join(keys) + " |",
                      "|---" * (len(keys) + 1) + "|"]
            lines += ["| " + " | ".join([r["name"], *(str(r.get(k, "")).replace("|", "/") for k in keys)]) + " |"
                      for r in rows]
        with open(self.md_path, "w") as f:
            f.write("\n".join(lines) + "\n")


def _message(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def versions(device):
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu")
    for name in ("triton", "fla-core"):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = "not installed"
    if device.type == "cuda":
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        info["tf32 matmul (torch)"] = torch.backends.cuda.matmul.allow_tf32
    info["fla kernel"] = fla_missing(device) or "runs"
    info["fla kernel, gated backward"] = fla_missing(device, gated_backward=True) or "runs"
    for backward in (False, True):  # (fla's delta-rule kernels import on their own)
        why = delta_fla.fla_missing(device, torch.float32, backward, delta_fla.MAX_KEY_FEATURES)
        info[f"fla delta-rule kernel{', backward' if backward else ''}"] = why or "runs"
    return info


# ------------------------------------------------------------------------------ correctness


def layer_configs(s):
    h, d = s["heads"], s["dim_head"]
    base = dict(heads=h, dim_head=d, causal=True)
    return {
        "default": base, "gated": dict(base, use_gate=True),
        "given-feature": dict(base, use_gate=True, feature_map="elu"),
        "seed-like": dict(base, blindspot_size=s["blindspot"], n_local_attn_heads=h // 2,
                          local_attn_window_size=s["window"], use_gate=True),
        "local heads only": dict(base, n_local_attn_heads=h, local_attn_window_size=s["window"]),
        "delta": dict(base, update_rule="delta"),
        "gated delta": dict(base, update_rule="delta", use_gate=True, use_local_conv=True),
    }


def relative(got, want):
    return (got.detach().double().cpu() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def forward_backward(module, x, weight, autocast=contextlib.nullcontext()):
    """(output, [input gradient, parameter gradients]) of sum(module(x) * weight)."""
    x = x.detach().requires_grad_()
    with autocast:
        out = module(x)
    (out.to(weight.dtype) * weight.to(out.device)).sum().backward()
    return out, [x.grad, *(p.grad for p in module.parameters())]


_REFERENCES = {}


def check_layer(config, kernel, dtype, device, s):
    """Output and gradient errors of a layer on ``device`` against its float64 self on the CPU."""
    dim = s["heads"] * s["dim_head"]
    key = repr(sorted(config.items()))
    if key not in _REFERENCES:  # (the reference, the torch kernel in float64, once per configuration)
        torch.manual_seed(0)
        layer = Attention(dim, kernel="torch", **config).double().eval()
        with torch.no_grad():  # the convolution starts as the identity: moved, so that the rows weigh it
            for name, p in layer.named_parameters():
                if name.endswith("conv_weight"):
                    p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(3)))
        g = torch.Generator().manual_seed(1)
        x, weight = (torch.randn(2, s["check_n"], dim, dtype=torch.float64, generator=g) for _ in range(2))
        _REFERENCES[key] = layer, x, weight, forward_backward(layer, x, weight)
    layer, x, weight, (want, want_grads) = _REFERENCES[key]
    on_device = Attention(dim, kernel=kernel, **config).to(device).eval()
    on_device.load_state_dict(layer.state_dict())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    refused = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got, got_grads = forward_backward(on_device, x.float().to(device), weight.float(), autocast)
        except ValueError as error:  # fla may refuse the backward alone (known_bad_pair): check the forward
            if "cannot run this call" not in str(error):
                raise
            with torch.no_grad(), autocast:  # (raises again where the forward too is refused: unavailable)
                got = on_device(x.float().to(device))
            refused = f"backward refused: {_message(error)}"
    form = "flex" if config.get("n_local_attn_heads") == config["heads"] else kernel
    tol = TOLERANCE["bf16"] if dtype == "bf16" else TOLERANCE[("fp32", form if form != "auto" else "fla")]
    out_err = relative(got, want)
    grad_err = None if refused else max(relative(a, b) for a, b in zip(got_grads, want_grads) if b is not None)
    ok = out_err <= tol and (refused is not None or grad_err <= 2 * tol)
    note = "; ".join([*(str(w.message)[:200] for w in caught if issubclass(w.category, RuntimeWarning)),
                      *([refused] if refused else [])])
    return dict(status="ok" if ok else "fail", out_err=f"{out_err:.2e}",
                grad_err="refused" if refused else f"{grad_err:.2e}", tol=tol, **(dict(note=note) if note else {}))


# --------------------------------------------------------------------------------- decoding


def lm_options(s, n, rule="additive"):
    delta = dict(update_rule="delta", use_local_conv=True) if rule == "delta" else {}
    return dict(num_tokens=s["num_tokens"], dim=s["lm_dim"], depth=s["lm_depth"], max_seq_len=n, heads=s["heads"],
                causal=True, n_local_attn_heads=s["heads"] // 2, local_attn_window_size=s["window"], use_gate=True,
                **delta)


def check_decoding(device, s, compiled, rule="additive"):
    torch.manual_seed(0)
    n, prompt = 3 * s["window"], s["window"] + 3
    model = LinearAttentionTransformerLM(**lm_options(s, n, rule)).to(device).eval()
    tokens = torch.randint(0, s["num_tokens"], (2, n), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        full = model(tokens)
    with torch.no_grad():
        logits, cache = model(tokens[:, :prompt], return_cache=True)

    def step(x):
        return model(x, cache=cache, return_cache=True)[0][:, -1]

    if compiled:
        if not model.step_compiles:
            raise ValueError(f"{type(model).__name__} cannot run this call: no one-token forward that compiles as one graph")
        options = dict(mode="reduce-overhead") if device.type == "cuda" else dict(backend="eager")
        if device.type == "cuda":
            for tensor in cache.static_tensors():
                torch._dynamo.mark_static_address(tensor)
        step = torch.compile(step, fullgraph=True, **options)
    got, times = [logits[:, -1]], []
    for i in range(prompt, n):
        synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = step(tokens[:, i:i + 1].contiguous())
        got.append(out.clone())
        synchronize(device)
        times.append(time.perf_counter() - t0)
    err = relative(torch.stack(got[:-1], dim=1), full[:, prompt - 1:n - 1].double().cpu())
    tol = TOLERANCE[("fp32", "fla")]
    return dict(status="ok" if err <= tol else "fail", logits_err=f"{err:.2e}", tol=tol, steps=len(times),
                ms_per_token=f"{1e3 * statistics.median(times[len(times) // 2:]):.3f}")


# ----------------------------------------------------------------------------------- timing


def fla_alone(q, k, v):
    """fla's chunk_gla on (b, n, h, d), as the fla kernel calls it for the default map."""
    from fla.ops.gla import chunk_gla

    return chunk_gla(q.exp(), k.exp(), v, g=F.logsigmoid(k), scale=1.0)[0]


class PlainLayer(nn.Module):
    """q/k/v/out projections around an attention of (b, n, h, d) tensors: SDPA or fla alone."""

    def __init__(self, dim, heads, dim_head, attend):
        super().__init__()
        self.heads, self.dim_head, self.attend = heads, dim_head, attend
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, self.dim_head).unbind(2)
        if self.attend == "sdpa":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        else:  # the normaliser: none (fla alone), as a ones column of v (the fla kernel's way), or apart
            q, k, column = q.float() * 0.1, k.float() * 0.1, self.attend == "fla, v + 1 column"
            out = fla_alone(q, k, F.pad(v.float(), (0, 1), value=1.0) if column else v.float())
            out = out[..., :-1] / out[..., -1:] if column else out
            if self.attend == "fla, normaliser apart":  # the keys' decayed sum (fla's hgrn), read by q
                from fla.ops.hgrn import chunk_hgrn
                keys = chunk_hgrn(k.exp().flatten(2), F.logsigmoid(k).flatten(2))[0].view_as(k)
                out = out / (q.exp() * keys).sum(-1, keepdim=True)
        return self.to_out(out.reshape(b, n, -1).to(x.dtype))


class PlainLM(nn.Module):
    """Embedding -> depth x [norm, PlainLayer, norm, GLU feed-forward] -> logits: the LM's shape."""

    def __init__(self, num_tokens, dim, depth, heads, dim_head, attend):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.LayerNorm(dim), PlainLayer(dim, heads, dim_head, attend),
                                                   nn.LayerNorm(dim), nn.Linear(dim, 8 * dim), nn.Linear(4 * dim, dim)])
                                    for _ in range(depth))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, num_tokens)

    def forward(self, x):
        h = self.emb(x)
        for norm1, attn, norm2, ff_in, ff_out in self.blocks:
            h = h + attn(norm1(h))
            a, gate = ff_in(norm2(h)).chunk(2, dim=-1)
            h = h + ff_out(a * F.gelu(gate))
        return self.out(self.norm(h))


def time_step(step, device, s):
    """Median seconds of ``step`` over the timed steps, and the peak memory it adds (MiB)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for i in range(s["warmup"] + s["steps"]):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        if i >= s["warmup"]:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20 if device.type == "cuda" else None
    return statistics.median(times), peak


def timing_row(kind, name, n, device, s):
    torch.manual_seed(0)
    h, d = s["heads"], s["dim_head"]
    dim = h * d
    plain, delta = name in ("sdpa", "fla alone", *NORMALISERS), name in DELTA
    if plain and name != "sdpa" and fla_missing(device) is not None:
        raise ValueError(f"fla alone cannot run this call: {fla_missing(device)}")
    kernel = dict(torch="torch", fla="fla").get(name.removeprefix("delta, "), "auto")
    if kind == "layer":
        model = PlainLayer(dim, h, d, name) if plain else Attention(
            dim, heads=h, dim_head=d, causal=True, kernel=kernel, **(dict(update_rule="delta") if delta else {}))
        data = torch.randn(s["batch"], n, dim, device=device, requires_grad=True)
    else:
        model = PlainLM(s["num_tokens"], s["lm_dim"], s["lm_depth"], h, s["lm_dim"] // h, name) if plain else \
            LinearAttentionTransformerLM(**{**lm_options(s, n), "n_local_attn_heads": 0}, kernel=kernel)
        data = torch.randint(0, s["num_tokens"], (s["batch"], n + 1), device=device)
    model = model.to(device).train()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step():
        model.zero_grad(set_to_none=True)
        with autocast:
            if kind == "layer":
                loss = model(data).float().square().mean()
            else:
                logits = model(data[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        loss.backward()

    fields = dict(n=n)
    if delta:  # the forward alone too (a prefill): fla serves it where it refuses the backward (known_bad_pair)
        def forward():
            with autocast:
                model(data)

        with torch.no_grad():
            seconds, _ = time_step(forward, device, s)
        fields.update(forward_ms=f"{seconds * 1e3:.2f}", forward_tokens_per_s=f"{s['batch'] * n / seconds:,.0f}")
    try:
        seconds, peak = time_step(step, device, s)
    except ValueError as error:
        if not delta or "cannot run this call" not in str(error):
            raise
        return dict(fields, ms="refused", note=f"backward refused: {_message(error)}")
    return dict(fields, ms=f"{seconds * 1e3:.2f}", tokens_per_s=f"{s['batch'] * n / seconds:,.0f}",
                peak_mib=None if peak is None else f"{peak:,.0f}")


# ------------------------------------------------------------------------------------ main


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--cpu-dry-run", action="store_true", help="the whole check on the CPU at tiny sizes")
    p.add_argument("--budget", type=float, default=None, help="seconds in all (default 420; dry run 55)")
    args = p.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run it on a GPU machine, or check the script with --cpu-dry-run")
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget must be > 0, got {args.budget}")
    return args


def main(argv=None):
    args = parse(argv)
    s = dict(DRY if args.cpu_dry_run else FULL)
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    report = Report(args.out, args.budget or s["budget"])
    report.versions = versions(device)
    report.versions["sizes"] = "dry run (tiny)" if args.cpu_dry_run else "full"
    print("\n".join(f"{k}: {v}" for k, v in report.versions.items()), flush=True)
    report.write()

    report.begin("correctness")
    cases = [(name, config, kernel) for name, config in layer_configs(s).items()
             # ('auto' beside 'fla' where a known-bad pair may refuse fla: the torch kernel, with a warning)
             for kernel in (("auto",) if name == "local heads only" else ("torch", "fla", "auto")
                            if name == "given-feature" else ("torch", "fla"))]
    # the torch kernel's rows first: fla's and flex's first calls compile, and must not push them past the budget
    for name, config, kernel in sorted(cases, key=lambda case: case[2] != "torch"):
        for dtype in ("fp32", "bf16"):
            report.row(f"{name}, kernel={kernel}, {dtype}", lambda: check_layer(config, kernel, dtype, device, s))

    report.begin("decoding")
    for compiled in (False, True):
        for rule in ("additive", "delta"):
            mode = "compiled (CUDA graphs)" if compiled else "eager"
            # (compiling is most of a compiled row: the second needs about what the first took)
            needs = report.rows[-1].get("seconds", 0.0) if compiled and rule == "delta" else 0.0
            report.row(f"cached decoding, {'delta rule, ' if rule == 'delta' else ''}{mode}",
                       lambda: check_decoding(device, s, compiled, rule), needs=needs)

    report.begin("timing")
    for kind in ("layer", "lm"):
        names = ("torch", "fla", "fla alone", "sdpa", *(NORMALISERS + DELTA if kind == "layer" else ()))
        for n in s["lengths"]:
            for name in names:
                report.row(f"{kind}, {name}, n={n}", lambda: timing_row(kind, name, n, device, s))

    failed = [r for r in report.rows if r["status"] in ("fail", "error")]
    report.versions["elapsed_s"] = round(time.monotonic() - report.start, 1)
    report.write()
    print(f"\ngpu_check: {len(report.rows)} rows, {len(failed)} failed or errors, "
          f"{report.versions['elapsed_s']} s; {report.json_path}, {report.md_path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
