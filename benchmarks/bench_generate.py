#!/usr/bin/env python
"""Cached decoding against recomputing the whole sequence at every step.

The model, in eval mode, batch 1, fp32, greedy (temperature 0):

    LinearAttentionTransformerLM(num_tokens=256, dim=256, depth=2, heads=4, n_local_attn_heads=2,
                                 local_attn_window_size=64, blindspot_size=64, causal=True,
                                 max_seq_len=2048)

generates 1024 tokens after a 16-token prompt, with
``AutoregressiveWrapper(model).generate(prompt, 1024, temperature=0, use_cache=...)``:

1. check: cached and recompute paths produce the same tokens over a short run (64 tokens),
   and the largest difference between their logits;
2. cached path: the real total time of ``generate(..., use_cache=True)``; then the same
   decoding driven step by step (``model.start_decoding(prompt)``, then ``decoder.step(token)``
   per token, each step timed: what generate() runs) for the per-token time over the first
   and the last 256 generated tokens (flat cost: ratio near 1) and over each quarter of the
   positions; and, for comparison, one step of the general cached form
   ``model(token[:, None], cache=cache, return_cache=True)``;
3. recompute path (``use_cache=False``, each step a full forward over the sequence so far,
   O(n^2) in all): single forwards timed at a few lengths, interpolated linearly in n and
   summed over the steps to estimate the total; when that estimate is below
   --max-recompute-seconds (or with --recompute full) the real generate() is timed too,
   and the speed-up uses the real time; otherwise it uses the estimate and says so.

4. batch: the cached generate() of the same length for a batch of ``--batch`` prompts (8),
   against the batch-1 time (target: at most 2x; the per-step work is tiny, so a batch should
   cost little more than one sequence).

5. floor: every ``nn.Linear`` of the model applied to one token, back to back. A decoding
   step reads each weight once in a matrix-vector product, which runs at memory speed, not at
   the square matmul rate: this is the step's floor (the best of 200), measured in the same run, and
   recompute / (new tokens x floor) is the most any cached decoder could reach here.
   ``--compare-compile`` also times the first feed-forward on one token, eager and compiled.

6. compiled step (``--compile-step``): ``generate(..., use_cache=True, compile_step={"backend":
   BACKEND})`` (``torch.compile(decoder.step, fullgraph=True)``: one graph for every
   position). Its first call (compilation and 8 tokens) is timed on its own; then the full
   generate() is timed against the eager cached generate() of the same run, alternating
   (``--compile-rounds`` pairs, best of each), with a check that the tokens are the same.

The square matmul rate is measured at the start and at the end as the drift reference.

Usage:  python benchmarks/bench_generate.py [--device cpu] [--threads 1] [--new-tokens 1024]
See benchmarks/README.md for what each figure means and the targets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    default_device,
    default_matmul_size,
    kwargs_text,
    load_average,
    print_header,
    set_threads,
    square_matmul_desc,
    square_matmul_rate,
    synchronize,
    table,
)

MODEL = dict(num_tokens=256, dim=256, depth=2, heads=4, n_local_attn_heads=2, local_attn_window_size=64,
             blindspot_size=64, causal=True, max_seq_len=2048)
SPEEDUP_TARGET = 50.0  # recompute total / cached total
FLAT_TARGET = 1.3  # per-token time, last 256 / first 256 generated tokens
BATCH_TARGET = 2.0  # cached generate() of a batch of prompts / of one prompt


def build_model(device):
    from linear_attention_transformer import LinearAttentionTransformerLM

    torch.manual_seed(0)
    return LinearAttentionTransformerLM(**MODEL).to(device).eval()


def timed(fn, device):
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def greedy(logits):
    """The token generate(temperature=0) picks from (b, n, vocab) logits."""
    return logits[:, -1].float().argmax(dim=-1)


@torch.inference_mode()
def stepwise_cached(model, prompt, new_tokens, device):
    """Greedy decoding driven by hand with the model's decoder, every step timed.

    Returns (tokens (1, new_tokens), seconds of the prompt call, seconds per later step):
    step i (i = 1 .. new_tokens - 1) feeds token i - 1 and yields token i."""
    (logits, decoder), t_prompt = timed(lambda: model.start_decoding(prompt), device)
    token = logits.argmax(dim=-1)
    tokens, steps = [token], []
    for _ in range(new_tokens - 1):
        synchronize(device)
        t0 = time.perf_counter()
        token = decoder.step(token).argmax(dim=-1)
        synchronize(device)
        steps.append(time.perf_counter() - t0)
        tokens.append(token)
    return torch.stack(tokens, dim=1), t_prompt, steps


# aten ops that only make a view (their cost is the dispatch, not the data)
VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "transpose", "t", "permute",
            "as_strided", "alias", "narrow", "reshape", "unbind", "split", "chunk", "detach", "view_as"}


@torch.inference_mode()
def ops_per_step(model, prompt, steps=200):
    """The aten ops one eager decoder step runs (a TorchDispatchMode over it), views and the
    rest, at the position ``steps`` tokens after the prompt (a step that completes no block)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    logits, decoder = model.start_decoding(prompt)
    token = logits.argmax(dim=-1)
    for _ in range(steps):
        token = decoder.step(token).argmax(dim=-1)
    with Count() as count:
        decoder.step(token)
    views = sum(name in VIEW_OPS for name in count.names)
    return len(count.names) - views, views


@torch.inference_mode()
def general_step_seconds(model, prompt, device, reps=50):
    """Median seconds of one step of the general cached form (model(..., cache=...)) after
    the prompt, for comparison with the decoder's step (each call advances the cache in
    place: the steps run at positions after the prompt)."""
    _, cache = model(prompt, return_cache=True)
    token = prompt[:, -1:]
    model(token, cache=cache, return_cache=True)  # warm
    return statistics.median(timed(lambda: model(token, cache=cache, return_cache=True), device)[1]
                             for _ in range(reps))


@torch.no_grad()
def forward_seconds(model, seq, length, device, reps):
    """Median seconds of one recompute step at ``length`` tokens: a full forward over them
    and the greedy pick (what generate(use_cache=False) does per step)."""
    x = seq[:, :length]
    greedy(model(x))  # warm
    return statistics.median(timed(lambda: greedy(model(x)), device)[1] for _ in range(reps))


@torch.inference_mode()
def matvec_floor_seconds(model, device, reps=200):
    """Seconds of every ``nn.Linear`` of the model applied to one token (batch 1), back to
    back, and the bytes of their weights: what one decoding step cannot avoid (it reads every
    weight once, at the memory speed of a matrix-vector product), measured in the same run as
    the step. The best of ``reps``, like the square matmul rate: a floor is the fastest the
    machine went (memory-bound work is the first to slow down when other processes run)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, m.in_features, device=device) for m in linears]

    def chain():
        for m, x in zip(linears, inputs):
            F.linear(x, m.weight, m.bias)

    for _ in range(10):
        chain()
    seconds = min(timed(chain, device)[1] for _ in range(reps))
    return seconds, sum(m.weight.numel() * m.weight.element_size() for m in linears)


@torch.no_grad()
def compiled_feedforward_seconds(model, device, reps=300):
    """Median seconds of the first feed-forward (its module, eval mode) on one token, eager and
    under ``torch.compile``: whether compiling a decoding step's parts pays at batch 1."""
    from linear_attention_transformer.feedforward import FeedForward

    ff = next(m for m in model.modules() if isinstance(m, FeedForward))
    x = torch.randn(1, 1, ff.proj_in.in_features, device=device)
    compiled = torch.compile(ff)
    out = {}
    for name, fn in (("eager", ff), ("compiled", compiled)):
        for _ in range(10):  # (the first compiled call compiles)
            fn(x)
        out[name] = statistics.median(timed(lambda: fn(x), device)[1] for _ in range(reps))
    return out


def compiled_generate(wrapper, prompt, new_tokens, cached_tokens, device, args):
    """The cached generate() with ``compile_step`` against the eager one, alternating."""
    options = {"backend": args.compile_backend}

    def run(compile_step):
        return wrapper.generate(prompt, new_tokens, temperature=0, use_cache=True, compile_step=compile_step)

    _, t_first = timed(lambda: wrapper.generate(prompt, 8, temperature=0, use_cache=True, compile_step=options),
                       device)
    eager, compiled, same = [], [], True
    for _ in range(args.compile_rounds):
        tokens, t = timed(lambda: run(False), device)
        eager.append(t)
        tokens_c, t = timed(lambda: run(options), device)
        compiled.append(t)
        same = same and torch.equal(tokens_c, cached_tokens) and torch.equal(tokens, cached_tokens)
    return dict(first=t_first, eager=min(eager), compiled=min(compiled), same=same, backend=args.compile_backend,
                rounds=args.compile_rounds)


def print_compiled(result, t_cached, new_tokens, t_recompute, t_floor):
    if result is None:
        return
    e, c = result["eager"], result["compiled"]
    print(f"compiled step (generate(compile_step={{'backend': '{result['backend']}'}})): first call (compile + 8 "
          f"tokens) {result['first']:.1f} s; then, best of {result['rounds']} alternating pairs: eager "
          f"{e:.2f} s ({1e3 * e / new_tokens:.2f} ms/token, {e / (new_tokens * t_floor):.1f}x the matvec floor), "
          f"compiled {c:.2f} s ({1e3 * c / new_tokens:.2f} ms/token, {c / (new_tokens * t_floor):.1f}x the floor): "
          f"compiled / eager = {c / e:.2f}; tokens {'same' if result['same'] else 'DIFFER'}")
    if t_recompute is not None:
        print(f"  speed-up over recompute with the compiled step: {t_recompute / c:.1f}x (eager, same pairs: "
              f"{t_recompute / e:.1f}x; first cached run above: {t_recompute / t_cached:.1f}x)")


def estimate_recompute(points, prompt_len, new_tokens):
    """Sum over the steps of the forward time at the step's length (prompt_len + i for step i),
    interpolated linearly between the measured (length, seconds) points (and extrapolated
    linearly from the last two beyond them)."""
    points = sorted(points)

    def at(n):
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = points[-2:]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)

    return sum(at(prompt_len + i) for i in range(new_tokens))


def first_difference(a, b):
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else int(diff[0, -1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:1 ... (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=1024, help="tokens to generate (default: %(default)s)")
    p.add_argument("--window", type=int, default=256,
                   help="per-token times over the first and the last WINDOW generated tokens (default: %(default)s)")
    p.add_argument("--check-tokens", type=int, default=64,
                   help="length of the cached-vs-recompute identity check (default: %(default)s)")
    p.add_argument("--recompute", choices=["auto", "full", "estimate"], default="auto",
                   help="auto: time the real recompute generate() when its estimate is below "
                        "--max-recompute-seconds; full: always; estimate: never (default: auto)")
    p.add_argument("--max-recompute-seconds", type=float, default=180.0)
    p.add_argument("--estimate-lengths", type=int, nargs="+", default=None,
                   help="lengths of the timed single forwards (default: prompt, 256, 512, 768, prompt + new tokens)")
    p.add_argument("--estimate-reps", type=int, default=3, help="timed forwards per length, median (default: 3)")
    p.add_argument("--matmul-size", type=int, default=None, help="square matmul size (default 2048 cpu, 8192 cuda)")
    p.add_argument("--batch", type=int, default=8, help="prompts in the batched cached run (default: %(default)s)")
    p.add_argument("--compare-compile", action="store_true",
                   help="also time the first feed-forward on one token eager and under torch.compile")
    p.add_argument("--compile-step", action="store_true",
                   help="also time generate(compile_step=...) against the eager cached generate()")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: %(default)s)")
    p.add_argument("--compile-rounds", type=int, default=3,
                   help="alternating eager / compiled generate() pairs, best of each (default: %(default)s)")
    p.add_argument("--skip-recompute", action="store_true",
                   help="skip the recompute path, the batch and the floor (with --compile-step: the comparison alone)")
    args = p.parse_args(argv)
    size = args.matmul_size or default_matmul_size(args.device)
    device, P, N = args.device, args.prompt_len, args.new_tokens
    if P + N > MODEL["max_seq_len"]:
        p.error(f"prompt + new tokens ({P + N}) exceed max_seq_len={MODEL['max_seq_len']}")
    W = min(args.window, (N - 1) // 2)

    set_threads(args.threads)
    print_header(device, args.threads, [
        f"LinearAttentionTransformerLM({kwargs_text(MODEL)}), eval, batch 1, fp32",
        f"AutoregressiveWrapper(model).generate(prompt ({P} tokens), {N}, temperature=0, use_cache=True/False)",
    ])
    t_start = time.perf_counter()
    ref_start = square_matmul_rate(device, size)

    from linear_attention_transformer import AutoregressiveWrapper

    model = build_model(device)
    wrapper = AutoregressiveWrapper(model)
    g = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, MODEL["num_tokens"], (1, P), generator=g).to(device)

    def generate(n, use_cache):
        return wrapper.generate(prompt, n, temperature=0, use_cache=use_cache)

    def generate_for(prompts, n):
        return wrapper.generate(prompts, n, temperature=0, use_cache=True)

    generate(8, True)  # warm both paths
    generate(8, False)

    # 1. identity check on a short run, and the logits of both paths side by side
    short = min(args.check_tokens, N)
    cached_short, recomputed_short = generate(short, True), generate(short, False)
    same = torch.equal(cached_short, recomputed_short)
    with torch.inference_mode():  # the logits that chose each token: decoder steps vs one full forward
        logits, decoder = model.start_decoding(prompt)
        step_logits = [logits]
        for i in range(short - 1):
            step_logits.append(decoder.step(cached_short[:, i]))
        full_logits = model(torch.cat((prompt, cached_short[:, :-1]), dim=1))[:, P - 1:]
        max_logit_diff = (torch.stack(step_logits, dim=1) - full_logits).abs().max().item()
    print(f"check ({short} tokens): cached and recompute tokens "
          + ("IDENTICAL" if same else f"DIFFER (first at generated token {first_difference(cached_short, recomputed_short)})")
          + f"; max |logit difference| cached steps vs one full forward: {max_logit_diff:.2e}\n")

    # 2. cached path: the real generate(), then the same decoding step by step
    cached_tokens, t_cached = timed(lambda: generate(N, True), device)
    step_tokens, t_prompt, steps = stepwise_cached(model, prompt, N, device)
    t_general = general_step_seconds(model, prompt, device)
    t_stepwise = t_prompt + sum(steps)
    stepwise_same = torch.equal(step_tokens, cached_tokens)
    first, last = steps[:W], steps[-W:]  # generated tokens 1 .. W and N - W .. N - 1

    ops, views = ops_per_step(model, prompt)

    compiled = compiled_generate(wrapper, prompt, N, cached_tokens, device, args) if args.compile_step else None
    if args.skip_recompute:
        t_floor, _ = matvec_floor_seconds(model, device)
        print(f"decoder step: {ops} aten ops + {views} views; matvec floor {1e3 * t_floor:.3f} ms")
        print_compiled(compiled, t_cached, N, None, t_floor)
        return 0

    # 3. recompute path: single forwards at a few lengths -> estimate; the real run if affordable
    lengths = args.estimate_lengths or sorted({P, 256, 512, 768, P + N - 1})
    lengths = [n for n in lengths if 1 <= n <= P + N - 1]
    seq = torch.cat((prompt, cached_tokens), dim=1)
    points = [(n, forward_seconds(model, seq, n, device, args.estimate_reps)) for n in lengths]
    t_estimate = estimate_recompute(points, P, N)
    run_full = args.recompute == "full" or (args.recompute == "auto" and t_estimate <= args.max_recompute_seconds)
    t_recompute = recompute_same = None
    if run_full:
        recompute_tokens, t_recompute = timed(lambda: generate(N, False), device)
        recompute_same = torch.equal(recompute_tokens, cached_tokens)
    # 4. a batch of prompts through the cached generate()
    prompts = torch.randint(0, MODEL["num_tokens"], (args.batch, P), generator=g).to(device)
    wrapper.generate(prompts, 8, temperature=0, use_cache=True)  # warm
    batch_tokens, t_batch = timed(lambda: wrapper.generate(prompts, N, temperature=0, use_cache=True), device)
    batch_row0_same = torch.equal(batch_tokens[:1], generate_for(prompts[:1], N))
    t_floor, weight_bytes = matvec_floor_seconds(model, device)
    t_ff = compiled_feedforward_seconds(model, device) if args.compare_compile else None
    ref_end = square_matmul_rate(device, size)

    print(f"matmul reference (drift): {square_matmul_desc(size)}, fp32, best of 5: "
          f"{ref_start / 1e9:.1f} GFLOP/s at the start, {ref_end / 1e9:.1f} GFLOP/s at the end\n")

    print(f"recompute step = one full forward over the sequence so far + greedy pick, median of {args.estimate_reps}:")
    print(table(["length", "ms per step"], [[n, f"{1e3 * t:.1f}"] for n, t in points]))
    print()

    ms = lambda ts: f"{1e3 * statistics.mean(ts):.2f} / {1e3 * statistics.median(ts):.2f}"  # noqa: E731
    print(f"generating {N} tokens after a {P}-token prompt, greedy:")
    rows = [
        ["cached: generate(use_cache=True)", f"{t_cached:.2f}", f"{1e3 * t_cached / N:.2f}", "measured"],
        ["cached: stepwise (decoder.step)", f"{t_stepwise:.2f}", f"{1e3 * t_stepwise / N:.2f}",
         f"measured; tokens {'same as' if stepwise_same else 'DIFFER FROM'} generate()"],
        ["recompute: generate(use_cache=False)", f"{t_estimate:.2f}", f"{1e3 * t_estimate / N:.2f}",
         "ESTIMATE (forwards at the lengths above, interpolated)"],
    ]
    if t_recompute is not None:
        rows.append(["recompute: generate(use_cache=False)", f"{t_recompute:.2f}", f"{1e3 * t_recompute / N:.2f}",
                     f"measured; tokens {'same as' if recompute_same else 'DIFFER FROM'} cached"])
    print(table(["path", "total s", "ms/token", "how"], rows))
    print()

    print(f"cached per-token time (stepwise; ms mean / median; prompt call {1e3 * t_prompt:.1f} ms, not included):")
    print(table(["generated tokens", "ms mean / median"], [
        [f"first {W} (1 .. {W})", ms(first)],
        [f"last {W} ({N - W} .. {N - 1})", ms(last)],
    ]))
    quarter = len(steps) // 4
    print(f"per-token ms by position (median of each quarter of the generated tokens; after the "
          f"{P}-token prompt): " + ", ".join(
              f"{P + 1 + i * quarter}-{P + (i + 1) * quarter}: {1e3 * statistics.median(steps[i * quarter:(i + 1) * quarter]):.2f}"
              for i in range(4)))
    print(f"one step of the general cached form model(token, cache=cache, return_cache=True): "
          f"{1e3 * t_general:.2f} ms (median) = {t_general / statistics.median(steps):.1f}x the decoder's step")
    step_median = statistics.median(steps)
    print(f"matvec floor of a step (every nn.Linear of the model on one token, back to back, best of 200): "
          f"{1e3 * t_floor:.3f} ms ({weight_bytes / 1e6:.1f} MB of weights, {weight_bytes / t_floor / 1e9:.1f} GB/s); "
          f"the decoder's step is {step_median / t_floor:.1f}x it; {ops} aten ops per step, and {views} views")
    if t_ff is not None:
        print(f"the first feed-forward on one token: eager {1e6 * t_ff['eager']:.0f} us, torch.compile "
              f"{1e6 * t_ff['compiled']:.0f} us (median; {t_ff['compiled'] / t_ff['eager']:.2f}x)")
    flat_median = statistics.median(last) / statistics.median(first)
    flat_mean = statistics.mean(last) / statistics.mean(first)
    print()

    measured = t_recompute is not None
    t_re = t_recompute if measured else t_estimate
    speedup = t_re / t_cached
    print(f"speed-up, recompute / cached total: {speedup:.1f}x "
          f"({'measured' if measured else 'recompute total is an ESTIMATE'}: {t_re:.2f} s / {t_cached:.2f} s; "
          f"target >= {SPEEDUP_TARGET:.0f}x: {'ok' if speedup >= SPEEDUP_TARGET else 'BELOW TARGET'})")
    print(f"  the most a decoder at the matvec floor could reach: {t_re / (N * t_floor):.0f}x "
          f"(recompute total / ({N} x the floor); generate() at {t_cached / (N * t_floor):.1f}x the floor per token)")
    if measured:
        print(f"  (with the estimated recompute total instead: {t_estimate / t_cached:.1f}x; "
              f"estimate / measured = {t_estimate / t_recompute:.2f})")
    print(f"per-token ms, first {W} / last {W} generated: {1e3 * statistics.median(first):.2f} / "
          f"{1e3 * statistics.median(last):.2f} (medians), ratio last/first {flat_median:.2f} "
          f"(means: {flat_mean:.2f}; target <= {FLAT_TARGET}: {'ok' if flat_median <= FLAT_TARGET else 'ABOVE TARGET'})")
    batch_ratio = t_batch / t_cached
    print(f"batch of {args.batch} prompts, cached generate(): {t_batch:.2f} s = {batch_ratio:.2f}x the batch-1 time "
          f"(target <= {BATCH_TARGET:.0f}x: {'ok' if batch_ratio <= BATCH_TARGET else 'ABOVE TARGET'}); its first row "
          f"{'equals' if batch_row0_same else 'DIFFERS FROM'} that prompt generated alone")
    print(f"tokens: cached == recompute over {short} tokens: {'yes' if same else 'NO'}"
          + ("" if recompute_same is None else f"; over all {N}: {'yes' if recompute_same else 'NO'}"))
    if compiled is not None:
        print_compiled(compiled, t_cached, N, t_re, t_floor)
    print(f"matmul reference: {ref_start / 1e9:.1f} / {ref_end / 1e9:.1f} GFLOP/s (start / end)")
    print(f"(total benchmark time {time.perf_counter() - t_start:.0f} s; {load_average()} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
