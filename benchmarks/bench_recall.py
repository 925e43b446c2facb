#!/usr/bin/env python
"""Associative recall (MQAR) of the linear-attention LM against a same-size softmax transformer.

Multi-query associative recall, written from the description in Zoology (Arora et al. 2023):
a sequence opens with ``pairs`` key-value pairs ``k1 v1 k2 v2 ...``; after them, in a region
filled with the token 0, every key is asked once more, at the first token of a random
two-token slot. The model reads the sequence causally and is scored where it stands on a
query key: its next-token prediction there must be the value bound to that key. Keys are
distinct within a sequence and come from [1, vocab/2); values are distinct too and come from
[vocab/2, vocab); token 0 is the filler. The answer is never written into the sequence
(Zoology's layout): this script's first generator wrote each value after its query, which
lets a model that binds nothing reach 21.7 % at 128 tokens and 16 pairs by guessing among the
values not yet shown (benchmarks/README.md, "Recall"). Each training step draws a fresh batch from
a seeded generator (the step number and the seed fix it), so every model of one seed sees the
same data; the held-out set comes from a seed no training batch uses.

Models, all dim 64, depth 2, 2 heads, vocabulary 256 (see ``--help`` to change them):
    softmax        a reference transformer: pre-norm blocks of causal softmax attention
                   (scaled_dot_product_attention, rotary positions, the same q / kv / out
                   projections as ``Attention``) and the library's FeedForward; no axial
                   positions; untied logits.
    softmax+shift  the same with each branch's input token-shifted as ``shift_tokens=True``
                   does (no parameter added): plain softmax attention stayed at chance in
                   2000 steps here, this one reaches 100 % at 128 tokens and 16 pairs.
    the rest       ``LinearAttentionTransformerLM(causal=True, ...)`` with the options of VARIANTS.

Training: AdamW (lr 1e-3, linear warm-up over 100 steps, then constant), batch 32, cross
entropy at the query positions only, gradient norm clipped to 1. Printed per (difficulty,
variant, seed): accuracy over the query positions of the held-out sequences, parameters (and
their ratio to the softmax reference: comparisons hold at +-10 %), training seconds, steps;
and the square matmul rate of the same run, the drift reference of every benchmark here.

Every model trains in a fresh subprocess; ``--jobs`` runs that many at once (keep 1 on a
shared CPU, where the seconds are only comparable within one run at one load).

Usage:  python benchmarks/bench_recall.py --threads 1 --sizes 128:16 --variants softmax+shift default conv
        python benchmarks/bench_recall.py --list
See benchmarks/README.md ("Recall") for the figures and docs/layers.md for what they mean.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    default_device,
    default_matmul_size,
    emit_result,
    load_average,
    print_header,
    run_in_subprocess,
    set_threads,
    square_matmul_desc,
    square_matmul_rate,
    synchronize,
    table,
)

IGNORE = -100  # the target of every position that is not a query

# ---------------------------------------------------------------------------------- data


def mqar_batch(batch, seq_len, pairs, vocab, generator):
    """One batch of MQAR sequences: (tokens (batch, seq_len), targets (batch, seq_len)).

    tokens: ``k1 v1 ... kP vP`` then a region of 0s in which each key appears once more, at
    the first token of one of the region's two-token slots (slots chosen at random, keys in a
    random order). targets: the value bound to the key at each query position (what the model
    must predict there), IGNORE everywhere else. The values are in the targets only, never in
    the region: a value written after its query would tell the later queries which values
    are left."""
    if vocab % 2 or vocab < 4:
        raise ValueError(f"vocab must be an even number >= 4, got {vocab}")
    n_keys = vocab // 2 - 1  # keys 1 .. vocab/2 - 1; 0 is the filler
    if pairs > n_keys:
        raise ValueError(f"pairs ({pairs}) needs {pairs} distinct keys, vocab {vocab} has {n_keys}")
    slots = (seq_len - 2 * pairs) // 2
    if slots < pairs:
        raise ValueError(f"seq_len {seq_len} has room for {slots} queries after {pairs} pairs; needs {pairs}")
    g = generator
    keys = torch.rand(batch, n_keys, generator=g).argsort(dim=1)[:, :pairs] + 1
    values = torch.rand(batch, vocab - vocab // 2, generator=g).argsort(dim=1)[:, :pairs] + vocab // 2
    slot = torch.rand(batch, slots, generator=g).argsort(dim=1)[:, :pairs]  # slot of key i's query
    query_pos = 2 * pairs + 2 * slot

    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    tokens[:, : 2 * pairs] = rearrange(torch.stack((keys, values), dim=-1), "b p two -> b (p two)")
    tokens.scatter_(1, query_pos, keys)
    targets = torch.full((batch, seq_len), IGNORE, dtype=torch.long)
    targets.scatter_(1, query_pos, values)
    return tokens, targets


def batch_generator(seed, step):
    """The generator of training batch ``step`` under ``seed`` (held-out data: step < 0)."""
    return torch.Generator().manual_seed(1_000_003 * seed + step + 7)


HELD_OUT_SEED = 10_000  # no training seed reaches it with step >= 0 in practice


# --------------------------------------------------------------------- softmax reference


class SoftmaxBlock(nn.Module):
    """Pre-norm causal softmax attention (rotary) and feed-forward, each with a residual;
    ``shift``: each branch's normed input is token-shifted as ``shift_tokens=True`` does in
    the library (half of the features from the token before)."""

    def __init__(self, dim, heads, dim_head, shift=False):
        super().__init__()
        from linear_attention_transformer.feedforward import FeedForward

        self.heads, self.shift = heads, shift
        self.attn_norm, self.ff_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)  # the projections of Attention
        self.to_kv = nn.Linear(dim, 2 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)
        self.ff = FeedForward(dim)

    def _branch_input(self, norm, x):
        from linear_attention_transformer.token_shift import shift_tokens, token_shifts

        h = norm(x)
        return shift_tokens(h, token_shifts(causal=True)) if self.shift else h

    def forward(self, x, rotary):
        from linear_attention_transformer.positional import apply_rotary

        h = self._branch_input(self.attn_norm, x)
        q = rearrange(self.to_q(h), "b n (h d) -> b h n d", h=self.heads)
        k, v = rearrange(self.to_kv(h), "b n (two h d) -> two b h n d", two=2, h=self.heads)
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.to_out(rearrange(out, "b h n d -> b n (h d)"))
        return x + self.ff(self._branch_input(self.ff_norm, x))


class SoftmaxLM(nn.Module):
    """The reference: token embedding, SoftmaxBlocks, a final norm and the logits."""

    def __init__(self, num_tokens, dim, depth, heads, dim_head=None, shift=False):
        super().__init__()
        from linear_attention_transformer.positional import RotaryEmbedding

        dim_head = dim_head or dim // heads
        self.token_emb = nn.Embedding(num_tokens, dim)
        nn.init.normal_(self.token_emb.weight, std=0.02)
        self.rotary = RotaryEmbedding(dim_head)
        self.blocks = nn.ModuleList([SoftmaxBlock(dim, heads, dim_head, shift) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, tokens):
        x = self.token_emb(tokens)
        rotary = self.rotary(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, rotary)
        return self.to_logits(self.norm(x))


# ------------------------------------------------------------------------------ variants

# name -> LinearAttentionTransformerLM options on top of the shape (dim, depth, heads); the
# softmax reference is "softmax". An entry may override the shape (depth, dim_head).
VARIANTS = {
    "default": {},
    "rotary": dict(use_rotary_emb=True),
    "elu": dict(feature_map="elu"),
    "gate": dict(use_gate=True),
    "conv": dict(use_local_conv=True),
    "shift": dict(shift_tokens=True),
    "gate+conv": dict(use_gate=True, use_local_conv=True),
    "gate+shift": dict(use_gate=True, shift_tokens=True),
    "conv+shift": dict(use_local_conv=True, shift_tokens=True),
    "conv5": dict(use_local_conv=True, local_conv_kernel=5),
    "conv+rotary": dict(use_local_conv=True, use_rotary_emb=True),
    "dh64": dict(dim_head=64),
    "conv+dh64": dict(use_local_conv=True, dim_head=64),
    "conv+dh16": dict(use_local_conv=True, dim_head=16),
    "gate+conv+rotary": dict(use_gate=True, use_local_conv=True, use_rotary_emb=True),
    "gate+conv+dh64": dict(use_gate=True, use_local_conv=True, dim_head=64),
    "local16": dict(n_local_attn_heads=1, local_attn_window_size=16),
    "conv+local16": dict(use_local_conv=True, n_local_attn_heads=1, local_attn_window_size=16),
    "gate+conv+local16": dict(use_gate=True, use_local_conv=True, n_local_attn_heads=1, local_attn_window_size=16),
    "conv+depth3": dict(use_local_conv=True, depth=3),
    "gate+conv+depth3": dict(use_gate=True, use_local_conv=True, depth=3),
    "taylor": dict(feature_map="taylor"),
    "taylor+conv": dict(feature_map="taylor", use_local_conv=True),
    "taylor+gate+conv": dict(feature_map="taylor", use_gate=True, use_local_conv=True),
    "taylor+conv+dh16": dict(feature_map="taylor", use_local_conv=True, dim_head=16),
    "taylor+conv+local16": dict(feature_map="taylor", use_local_conv=True, n_local_attn_heads=1,
                                local_attn_window_size=16),
}
REFERENCE = "softmax"
# softmax references: name -> SoftmaxLM options. Plain causal softmax attention has to form an
# induction circuit across its two layers (a head finding the token before, then one matching
# on it), which it had not done in 2000 steps here; with token shift one layer can bind a key
# to the value after it (benchmarks/README.md, "Recall").
SOFTMAX_REFERENCES = {REFERENCE: {}, "softmax+shift": dict(shift=True)}


def build_model(variant, vocab, dim, depth, heads, seq_len):
    if variant in SOFTMAX_REFERENCES:
        return SoftmaxLM(vocab, dim, depth, heads, **SOFTMAX_REFERENCES[variant])
    from linear_attention_transformer import LinearAttentionTransformerLM

    options = dict(VARIANTS[variant])
    depth = options.pop("depth", depth)
    return LinearAttentionTransformerLM(num_tokens=vocab, dim=dim, depth=depth, max_seq_len=seq_len, heads=heads,
                                        causal=True, **options)


def parameters(model):
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------- one model


def accuracy(model, tokens, targets, device, batch=250):
    """Fraction of the query positions whose argmax is the value bound to the query key."""
    model.eval()
    right = total = 0
    with torch.no_grad():
        for i in range(0, tokens.shape[0], batch):
            x, y = tokens[i : i + batch].to(device), targets[i : i + batch].to(device)
            asked = y != IGNORE
            right += (model(x).argmax(dim=-1)[asked] == y[asked]).sum().item()
            total += asked.sum().item()
    model.train()
    return right / total


def train_one(args):
    """Worker: train (variant, seed) at one difficulty, emit its figures."""
    set_threads(args.threads)
    device = args.device
    seq_len, pairs = args.size
    torch.manual_seed(args.seed)
    model = build_model(args.variant, args.vocab, args.dim, args.depth, args.heads, seq_len).to(device)
    n_params = parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    held_out = mqar_batch(args.held_out, seq_len, pairs, args.vocab, batch_generator(HELD_OUT_SEED, -1))
    load_before = load_average()

    synchronize(device)
    start = time.perf_counter()
    losses = []
    for step in range(args.steps):
        tokens, targets = mqar_batch(args.batch, seq_len, pairs, args.vocab, batch_generator(args.seed, step))
        tokens, targets = tokens.to(device), targets.to(device)
        logits = model(tokens)
        loss = F.cross_entropy(rearrange(logits, "b n v -> (b n) v"), targets.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 99 or step == args.steps - 1:
            losses.append(round(loss.item(), 3))
    synchronize(device)
    seconds = time.perf_counter() - start
    acc = accuracy(model, *held_out, device)
    emit_result(dict(accuracy=acc, params=n_params, seconds=seconds, steps=args.steps, losses=losses,
                     load_before=load_before, load_after=load_average()))


# -------------------------------------------------------------------------------- driver


def parse_size(text):
    try:
        seq_len, pairs = (int(t) for t in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is SEQ_LEN:PAIRS, e.g. 128:16, got {text!r}") from None
    return seq_len, pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[(128, 16), (256, 32), (512, 64)],
                        help="difficulties as SEQ_LEN:PAIRS (default 128:16 256:32 512:64)")
    parser.add_argument("--variants", nargs="+",
                        default=["softmax+shift", REFERENCE, "default", "conv", "taylor+conv+dh16"],
                        help=f"{', '.join(SOFTMAX_REFERENCES)} and names of VARIANTS (--list)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--held-out", type=int, default=1000, help="held-out sequences per difficulty")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--threads", type=int, default=None, help="torch threads per model (1 on a shared CPU)")
    parser.add_argument("--jobs", type=int, default=1, help="models trained at once, each in its own process")
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--worker", nargs=3, metavar=("SIZE", "VARIANT", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.list:
        for name, options in SOFTMAX_REFERENCES.items():
            print(f"{name:22s} SoftmaxLM {options}")
        for name, options in VARIANTS.items():
            print(f"{name:22s} {options}")
        return
    if args.worker:
        args.size, args.variant, args.seed = parse_size(args.worker[0]), args.worker[1], int(args.worker[2])
        return train_one(args)
    unknown = [v for v in args.variants if v not in SOFTMAX_REFERENCES and v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; see --list")

    set_threads(args.threads)
    print_header(args.device, args.threads, [
        f"MQAR, vocab {args.vocab}; dim {args.dim}, depth {args.depth}, heads {args.heads}; "
        f"AdamW lr {args.lr} (warm-up {args.warmup}), batch {args.batch}, {args.steps} steps, jobs {args.jobs}",
        f"held-out: {args.held_out} sequences per difficulty",
    ])
    size = default_matmul_size(args.device)
    rate_before = square_matmul_rate(args.device, size)
    print(f"{square_matmul_desc(size)}: {rate_before / 1e9:.1f} GFLOP/s (before)", flush=True)

    shared = ["--steps", args.steps, "--batch", args.batch, "--lr", args.lr, "--warmup", args.warmup,
              "--held-out", args.held_out, "--dim", args.dim, "--depth", args.depth, "--heads", args.heads,
              "--vocab", args.vocab, "--device", args.device]
    if args.threads is not None:
        shared += ["--threads", args.threads]
    runs = [(s, v, seed) for s in args.sizes for seed in args.seeds for v in args.variants]

    def run(job):
        (seq_len, pairs), variant, seed = job
        label = f"{seq_len}:{pairs} {variant} seed {seed}"
        result, error = run_in_subprocess(__file__, ["--worker", f"{seq_len}:{pairs}", variant, seed] + shared, label)
        if error:
            print(error, flush=True)
        else:
            print(f"done {label}: {result}", flush=True)
        return job, result

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(run, runs))

    rows = []
    for job in runs:
        (seq_len, pairs), variant, seed = job
        result = results[job]
        if result is None:
            rows.append([f"{seq_len}:{pairs}", variant, seed, "failed", "", "", "", ""])
            continue
        reference = results.get(((seq_len, pairs), REFERENCE, seed))
        ratio = "" if reference is None else f"{result['params'] / reference['params']:.2f}"
        rows.append([f"{seq_len}:{pairs}", variant, seed, f"{100 * result['accuracy']:.1f}", result["params"], ratio,
                     f"{result['seconds']:.0f}", result["steps"]])
    print()
    print(table(["tokens:pairs", "variant", "seed", "acc %", "params", "params/softmax", "train s", "steps"], rows))
    rate_after = square_matmul_rate(args.device, size)
    print(f"\n{square_matmul_desc(size)}: {rate_before / 1e9:.1f} GFLOP/s before, {rate_after / 1e9:.1f} after")
    print(f"load:    {load_average()} (end)")


if __name__ == "__main__":
    main()
