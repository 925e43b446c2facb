#!/usr/bin/env python
"""Throughput of vLLM serving ``MODEL`` against the library's own batched generate, greedy, on
``--requests`` prompts of mixed lengths, beside the weights' floor (benchmarks/README.md).

Usage:  python benchmarks/bench_vllm.py --threads 1 [--requests 16] [--new-tokens 64] [--record vllm]  (needs vLLM)
"""

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)

MODEL = dict(num_tokens=256, dim=512, depth=6, heads=8, n_local_attn_heads=4, local_attn_window_size=64,
             use_gate=True, use_local_conv=True, use_rotary_emb=True, causal=True, max_seq_len=2048)


def save_model(folder, options):
    from linear_attention_transformer.hf import (LinearAttentionTransformerConfig,
                                                 LinearAttentionTransformerForCausalLM, byte_tokenizer)

    torch.manual_seed(0)
    model = LinearAttentionTransformerForCausalLM(LinearAttentionTransformerConfig(**options)).eval()
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model.model


def library_generate(wrapper, prompts, new_tokens):
    """(tokens per request, seconds) of one left-padded batched greedy generate."""
    longest = max(len(p) for p in prompts)
    padded = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        padded[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = True
    with torch.inference_mode():
        out, seconds = common.timed(lambda: wrapper.generate(padded, new_tokens, temperature=0, input_mask=mask),
                                    "cpu")
    return out.tolist(), seconds


def vllm_generate(llm, prompts, new_tokens):
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs, seconds = common.timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                                                         use_tqdm=False), "cpu")
    return [list(o.outputs[0].token_ids) for o in outputs], seconds


def main(argv=None):
    p = common.arguments(__doc__, device=False)
    for flag, default in (("--requests", 16), ("--min-prompt", 16), ("--max-prompt", 256), ("--new-tokens", 64),
                          ("--rounds", 3)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--set", type=common.parse_settings, default={}, help="model arguments, key=value,...")
    args = p.parse_args(argv)
    options = {**MODEL, **args.set}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    common.start(args, f"LinearAttentionTransformerLM({common.kwargs_text(options)}), eval, fp32, "
                        f"{args.requests} requests, prompts {args.min_prompt}..{args.max_prompt}, "
                        f"{args.new_tokens} new tokens each")
    from vllm import LLM

    from linear_attention_transformer import AutoregressiveWrapper

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(0, options["num_tokens"], (n,), generator=g).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as folder:
        lm = save_model(folder, options)
        wrapper = AutoregressiveWrapper(lm)
        llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_num_seqs=args.requests,
                  num_gpu_blocks_override=args.requests + 1, seed=0)
        library_generate(wrapper, prompts, 4)  # warm both
        vllm_generate(llm, prompts, 4)
        runs = common.in_turn({"library": lambda: library_generate(wrapper, prompts, args.new_tokens),
                               "vllm": lambda: vllm_generate(llm, prompts, args.new_tokens)}, args.rounds)
        best = {name: min(seconds for _, seconds in side) for name, side in runs.items()}
        (library_tokens, _), (vllm_tokens, _) = runs["library"][-1], runs["vllm"][-1]
        floor = common.weight_floors(lm, "cpu", rows=args.requests)[0]
    generated = args.requests * args.new_tokens
    same = sum(a == b for a, b in zip(library_tokens, vllm_tokens))
    figures = dict(requests=args.requests, new_tokens=args.new_tokens, prompt_lengths=lengths,
                   library_s=best["library"], vllm_s=best["vllm"],
                   library_tokens_per_s=generated / best["library"], vllm_tokens_per_s=generated / best["vllm"],
                   vllm_over_library=best["library"] / best["vllm"], same_requests=same,
                   floor_tokens_per_s=args.requests / floor)
    print(f"library generate (left-padded batch): {best['library']:.2f} s, "
          f"{figures['library_tokens_per_s']:.0f} tokens/s\nvLLM: {best['vllm']:.2f} s, "
          f"{figures['vllm_tokens_per_s']:.0f} tokens/s ({figures['vllm_over_library']:.2f}x the library's rate)\n"
          f"floor (the weights once per step for the batch): {figures['floor_tokens_per_s']:.0f} tokens/s\n"
          f"requests with the same tokens from both: {same} of {args.requests}")
    return common.finish(args, figures)


if __name__ == "__main__":  # (vLLM's engine starts processes that import this file)
    sys.exit(main())
