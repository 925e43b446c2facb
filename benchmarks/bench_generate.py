#!/usr/bin/env python
"""Cached decoding against recomputing the whole sequence at every step, and with rotary positions
past ``max_seq_len``: the speed-up, per-token times and peak memory (benchmarks/README.md).

Usage:  python benchmarks/bench_generate.py --threads 1 [--new-tokens 1024] [--set use_gate=True,...] [--record generate]
"""

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)
from common import weight_floors  # noqa: E402

MODEL = dict(num_tokens=256, dim=256, depth=2, heads=4, n_local_attn_heads=2, local_attn_window_size=64,
             blindspot_size=64, causal=True, max_seq_len=2048)


def build_wrapper(device, options):
    from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM

    torch.manual_seed(0)
    return AutoregressiveWrapper(LinearAttentionTransformerLM(**options).to(device).eval())


def generation_seconds(wrapper, prompts, tokens, use_cache, device):
    """(generated tokens, seconds) of one greedy generate()."""
    with torch.inference_mode():
        return common.timed(lambda: wrapper.generate(prompts, tokens, temperature=0, use_cache=use_cache), device)


def measure(args):
    """The figures of cached generation against recomputing (benchmarks/README.md), as a dict."""
    wrapper = build_wrapper(args.device, args.model)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, args.model["num_tokens"], (args.batch, args.prompt_len), generator=g).to(args.device)
    one = prompts[:1]
    run = functools.partial(generation_seconds, wrapper, device=args.device)
    for use_cache in (True, False):  # warm both paths
        run(one, 8, use_cache)
    same = torch.equal(run(one, args.check_tokens, True)[0], run(one, args.check_tokens, False)[0])
    cached_tokens, cached = run(one, args.new_tokens, True)
    _, first_quarter = run(one, args.new_tokens // 4, True)
    batch_tokens, batched = run(prompts, args.new_tokens, True)
    recomputed_tokens, recompute = run(one, args.new_tokens, False)
    warm, cold = weight_floors(wrapper.net, args.device)
    quarter = args.new_tokens // 4
    return dict(
        same_tokens=same and torch.equal(cached_tokens, recomputed_tokens)
        and torch.equal(batch_tokens[:1], cached_tokens),
        cached_s=cached, recompute_s=recompute, speedup=recompute / cached,
        flat=((cached - first_quarter) / (args.new_tokens - quarter)) / (first_quarter / quarter),
        batch_ratio=batched / cached, ms_per_token=1e3 * cached / args.new_tokens,
        warm_floor_ms=1e3 * warm, cold_floor_ms=1e3 * cold)


def past_max_seq_len(args):
    """The figures past ``max_seq_len`` (benchmarks/README.md), as a dict."""
    length = args.past_max_seq_len
    options = {**args.model, "use_rotary_emb": True, "max_seq_len": length}
    wrapper = build_wrapper(args.device, options)
    prompt = torch.randint(0, options["num_tokens"], (1, args.prompt_len), generator=torch.Generator().manual_seed(2))
    count = length - args.prompt_len  # the tokens timed on each side: up to max_seq_len, and the last ones
    if count < 2:
        raise SystemExit(f"--past-max-seq-len {length} must exceed --prompt-len + 1")
    generation_seconds(wrapper, prompt, count, True, args.device)  # warm
    peaks = []
    for tokens in (count, args.past_factor * length - args.prompt_len):
        memory = common.PeakMemory(args.device)
        whole, whole_s = generation_seconds(wrapper, prompt, tokens, True, args.device)
        peaks.append(memory.increase())
    # the same generation's last tokens: its first (factor - 1) max_seq_len tokens as the prompt
    late_prompt = torch.cat((prompt, whole), dim=1)[:, :(args.past_factor - 1) * length]
    sides = {(side, tokens): functools.partial(generation_seconds, wrapper, start, tokens, True, args.device)
             for side, start in (("within", prompt), ("past", late_prompt)) for tokens in (1, count)}
    runs = common.in_turn(sides, args.past_reps)  # a change of the machine's load hits both sides
    best = {key: min(seconds for _, seconds in side) for key, side in runs.items()}
    generated = runs["past", count][-1][0]
    # (the prompt's prefill and the first token are the one-token generation's: left out)
    within, past = ((best[side, count] - best[side, 1]) / (count - 1) for side in ("within", "past"))
    return dict(past_max_seq_len=length, past_factor=args.past_factor, tokens=whole.shape[1], whole_s=whole_s,
                same_tokens=torch.equal(generated, whole[:, late_prompt.shape[1] - args.prompt_len:][:, :count]),
                within_ms_per_token=1e3 * within, past_ms_per_token=1e3 * past, past_over_within=past / within,
                peak_bytes=peaks[1], peak_within_bytes=peaks[0], memory_method=memory.method)


def main(argv=None):
    p = common.arguments(__doc__, matmul_size=True)
    for flag, default in (("--prompt-len", 16), ("--new-tokens", 1024), ("--check-tokens", 64)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--batch", type=int, default=8, help="prompts in the batched run (default: %(default)s)")
    p.add_argument("--set", type=common.parse_settings, default={}, help="model arguments, key=value,...")
    p.add_argument("--past-max-seq-len", type=int, default=256,
                   help="max_seq_len of the rotary model that generates past it (default: %(default)s)")
    p.add_argument("--past-factor", type=int, default=16,
                   help="it generates this many times its max_seq_len (default: %(default)s)")
    p.add_argument("--past-reps", type=int, default=5, help="best of this many generations (default: %(default)s)")
    args = p.parse_args(argv)
    args.model = {**MODEL, **args.set}
    common.start(args, f"LinearAttentionTransformerLM({common.kwargs_text(args.model)}), "
                        f"eval, fp32, greedy, {args.new_tokens} tokens after {args.prompt_len}")
    rate_before = common.square_matmul_rate(args.device, args.matmul_size)
    figures = measure(args)
    figures["past"] = past = past_max_seq_len(args)
    rate_after = common.square_matmul_rate(args.device, args.matmul_size)
    print(f"tokens: cached and recomputed {'the same' if figures['same_tokens'] else 'DIFFER'}\n"
          f"cached generate(): {figures['cached_s']:.2f} s ({figures['ms_per_token']:.2f} ms/token); "
          f"recompute: {figures['recompute_s']:.1f} s; speed-up {figures['speedup']:.1f}x\n"
          f"per-token time, last three quarters / first quarter: {figures['flat']:.2f}\n"
          f"batch of {args.batch} / batch of 1: {figures['batch_ratio']:.2f}x the time")
    print(f"weights' floor per token: warm {figures['warm_floor_ms']:.3f} ms "
          f"({figures['ms_per_token'] / figures['warm_floor_ms']:.1f}x), cold {figures['cold_floor_ms']:.3f} ms "
          f"({figures['ms_per_token'] / figures['cold_floor_ms']:.1f}x)")
    print(f"rotary positions, max_seq_len {past['past_max_seq_len']}, {past['tokens']} tokens "
          f"({past['past_factor']}x) in {past['whole_s']:.1f} s: {past['within_ms_per_token']:.2f} ms/token within "
          f"max_seq_len, {past['past_ms_per_token']:.2f} at its end: {past['past_over_within']:.2f}x; the last tokens "
          f"generated again {'the same' if past['same_tokens'] else 'DIFFER'}")
    print(f"peak memory of that generation: +{past['peak_bytes'] / 2 ** 10:,.0f} KiB; of the one that stops at "
          f"max_seq_len: +{past['peak_within_bytes'] / 2 ** 10:,.0f} KiB ({past['memory_method']})")
    print(f"matmul rate: {rate_before / 1e9:.1f} GFLOP/s before, {rate_after / 1e9:.1f} after")
    common.finish(args, figures)
    return 0 if figures["same_tokens"] and past["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
