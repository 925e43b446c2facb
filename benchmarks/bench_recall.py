#!/usr/bin/env python
"""Associative recall (MQAR) of the linear-attention LM against softmax transformers of the same
width and depth. Usage, models and training: benchmarks/README.md ("Recall"); figures:
docs/layers.md ("Recall").

The data, as Zoology (Arora et al. 2023) lays it out: a sequence opens with ``pairs`` key-value
pairs ``k1 v1 k2 v2 ...`` (distinct keys from [1, vocab/2), distinct values from [vocab/2,
vocab)); the rest is cut into two-token slots, and every key is asked once, at the first token
of a slot drawn without replacement with weight g ** (power_a - 1), g = 1, 2, ... from the
pairs (most queries come soon after them). Every other token is uniform filler from the whole
vocabulary. Only the queries are scored: the prediction there must be the key's value.

Past the training length (``--lengths``): held-out sequences of each factor times SEQ_LEN, with
the same number of pairs. Each key's slot is drawn as at SEQ_LEN (over its S slots), then moved
to a uniform slot of its own share of the longer sequence's S' slots: slot s becomes a slot of
[floor(s S' / S), floor((s + 1) S' / S)). Every query then stands about S' / S times as far
from the pairs (at 128:16, S = 48 and S' = 112 to 1008: 2.3 to 21 times), behind that much more
filler, in the same order. The sets of all factors come from one generator and draw the pairs
and the training slots first: the same pairs, asked in the same order; factor 1 is the usual
held-out set. (Zoology's power law over all S' slots would keep half the queries at 128:16 and
16x within the first 128 tokens.)

Usage:  python benchmarks/bench_recall.py --threads 1 --sizes 128:16 --variants softmax+conv gate --seeds 0 --out r.json
        (with --lengths 1 2 4 8 16 --clean-filler: past the training length)
"""

import argparse
import datetime
import itertools
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from linear_attention_transformer.positional import RotaryEmbedding, apply_rotary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    default_device, emit_result, load_average, run_in_subprocess, set_threads, start, synchronize, table)

IGNORE = -100  # the target of every position that is not a query
POWER_A = 0.01  # Zoology's default: the slot after the pairs is ~1/g as likely as slot g
PASS = 0.9  # the held-out accuracy whose first step is reported


def mqar_batch(batch, seq_len, pairs, vocab, generator, power_a=POWER_A, train_len=None):
    """One batch of MQAR sequences as the module docstring lays them out (``train_len``: past the
    training length): (tokens, targets), each (batch, seq_len), the targets IGNORE but at the queries."""
    if vocab % 2 or vocab < 4:
        raise ValueError(f"vocab must be an even number >= 4, got {vocab}")
    n_keys = vocab // 2 - 1  # keys 1 .. vocab/2 - 1, as in Zoology (which uses 0 to mark filler)
    if pairs > n_keys:
        raise ValueError(f"pairs ({pairs}) needs {pairs} distinct keys, vocab {vocab} has {n_keys}")
    slots = (seq_len - 2 * pairs) // 2
    if slots < pairs:
        raise ValueError(f"seq_len {seq_len} has room for {slots} queries after {pairs} pairs; needs {pairs}")
    train_slots = slots if train_len is None else (train_len - 2 * pairs) // 2
    if not pairs <= train_slots <= slots:
        raise ValueError(f"train_len {train_len} must hold {pairs} queries and be at most seq_len {seq_len}")
    g = generator
    # the top ``pairs`` of i.i.d. uniforms: a random subset in random order (cheaper than argsort)
    keys = torch.rand(batch, n_keys, generator=g).topk(pairs, dim=1).indices + 1
    values = torch.rand(batch, vocab - vocab // 2, generator=g).topk(pairs, dim=1).indices + vocab // 2
    # key i's slot: sequential draws without replacement, so earlier pairs tend to be asked sooner
    weights = torch.arange(1, train_slots + 1, dtype=torch.float64) ** (power_a - 1)
    slot = torch.multinomial(weights.expand(batch, train_slots), pairs, generator=g)
    if train_slots < slots:  # slot s to [floor(s slots / train_slots), floor((s + 1) slots / train_slots))
        low, high = slot * slots // train_slots, (slot + 1) * slots // train_slots
        slot = low + (torch.rand(slot.shape, generator=g, dtype=torch.float64) * (high - low)).long()
    query_pos = 2 * pairs + 2 * slot

    tokens = torch.randint(0, vocab, (batch, seq_len), generator=g)
    tokens[:, : 2 * pairs] = rearrange(torch.stack((keys, values), dim=-1), "b p two -> b (p two)")
    tokens.scatter_(1, query_pos, keys)
    targets = torch.full((batch, seq_len), IGNORE, dtype=torch.long)
    targets.scatter_(1, query_pos, values)
    return tokens, targets


def batch_generator(seed, step):
    """The generator of training batch ``step`` under ``seed``."""
    return torch.Generator().manual_seed(1_000_003 * seed + step + 7)


# the held-out set's generator: no (seed, step) of training reaches it (step would be negative)
HELD_OUT = (10_000, -1)
CLEAN_FILLER_SEED = 20_011  # the generator that redraws the clean held-out sets' filler (--clean-filler)


def earlier_keys(tokens, targets):
    """For every query (row by row): its row, its position, the sequence's positions, and where
    its key stands before it (queries, seq_len)."""
    rows, positions = (targets != IGNORE).nonzero(as_tuple=True)
    index = torch.arange(tokens.shape[1])
    same = tokens[rows] == tokens[rows, positions].unsqueeze(1)
    return rows, positions, index, same & (index < positions.unsqueeze(1))


def key_reappears(tokens, targets, pairs):
    """For every query (row by row): does its key occur as filler, at a position of [2 pairs,
    query)? Then the filler has bound that key to another token after its pair."""
    _, _, index, earlier = earlier_keys(tokens, targets)
    return (earlier & (index >= 2 * pairs)).any(dim=1)


def recency_oracle(tokens, targets):
    """For every query (row by row): is the token after the key's most recent earlier occurrence
    its value? The answer of a memory that keeps only the latest binding of each key."""
    rows, positions, index, earlier = earlier_keys(tokens, targets)
    last = torch.where(earlier, index, -1).max(dim=1).values  # >= 0: the key's own pair comes first
    return tokens[rows, last + 1] == targets[rows, positions]


def clean_filler(tokens, targets, pairs, vocab):
    """A copy of ``tokens`` whose filler holds none of its row's keys: each such token redrawn
    uniformly (``CLEAN_FILLER_SEED``) until none is left; every other token stays as it is."""
    generator = torch.Generator().manual_seed(CLEAN_FILLER_SEED)
    tokens = tokens.clone()
    keys = tokens[:, 0 : 2 * pairs : 2]
    filler = (torch.arange(tokens.shape[1]) >= 2 * pairs) & (targets == IGNORE)
    while True:
        bad = filler & (tokens.unsqueeze(-1) == keys.unsqueeze(1)).any(dim=-1)
        if not bad.any():
            return tokens
        tokens[bad] = torch.randint(0, vocab, (int(bad.sum()),), generator=generator)


class ShortConv(nn.Module):
    """Zoology's BaseConv, which precedes attention in every block of its attention model: a
    projection of LN(x) times a causal depthwise convolution of 3 taps over it, added to x."""

    def __init__(self, dim, taps=3, bias=True):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(dim, bias=bias), nn.Linear(dim, dim, bias=bias)
        self.conv = nn.Conv1d(dim, dim, taps, groups=dim, padding=taps - 1, bias=bias)

    def forward(self, x):
        u = self.norm(x)
        return x + self.proj(u) * self.conv(u.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class SoftmaxBlock(nn.Module):
    """Pre-norm block: x + attn(LN(x)) (causal SDPA), then x + MLP(LN(x)) unless ``mlp`` is
    False; with ``short_conv`` a ``ShortConv`` first."""

    def __init__(self, dim, heads, short_conv=False, mlp=True, bias=True):
        super().__init__()
        self.heads = heads
        self.short_conv = ShortConv(dim, bias=bias) if short_conv else nn.Identity()
        self.attn_norm = nn.LayerNorm(dim, bias=bias)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.mlp_norm = nn.LayerNorm(dim, bias=bias) if mlp else None
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=bias), nn.GELU(),
                                 nn.Linear(4 * dim, dim, bias=bias)) if mlp else None

    def forward(self, x, cos_sin=None):
        x = self.short_conv(x)
        q, k, v = rearrange(self.to_qkv(self.attn_norm(x)), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        if cos_sin is not None:
            q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.to_out(rearrange(out, "b h n d -> b n (h d)"))
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))


class SoftmaxTransformer(nn.Module):
    """A causal softmax LM as GPT-2 builds it: token embedding plus learned positions, pre-norm
    ``SoftmaxBlock``s, a final LayerNorm, an output layer tied to the embedding; the options change it."""

    def __init__(self, num_tokens, dim, depth, heads, max_seq_len, short_conv=False, mlp=True, rotary=False,
                 tied=True, emb_std=0.02, bias=True):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        nn.init.normal_(self.token_emb.weight, std=emb_std)  # (in this order: the recorded runs' draws)
        self.pos_emb = None if rotary else nn.Embedding(max_seq_len, dim)
        self.rotary = RotaryEmbedding(dim // heads) if rotary else None
        if self.pos_emb is not None:
            nn.init.normal_(self.pos_emb.weight, std=emb_std)
        self.blocks = nn.ModuleList([SoftmaxBlock(dim, heads, short_conv, mlp, bias) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, bias=bias)
        self.output_layer = nn.Linear(dim, num_tokens, bias=bias)
        if tied:
            self.output_layer.weight = self.token_emb.weight  # tied, as in GPT-2 and Zoology's LM

    def output_features(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        cos_sin = None if self.rotary is None else self.rotary(positions)
        for block in self.blocks:
            x = block(x, cos_sin)
        return self.norm(x)

    def forward(self, tokens):
        return self.output_layer(self.output_features(tokens))


# A model's name: "softmax" and changes to it (a SoftmaxTransformer), or LinearAttentionTransformerLM's
# options joined by "+" ("qkN": dim_qk=N); benchmarks/README.md, "Recall", says what each one is.
SOFTMAX_CHANGES = {"+conv": dict(short_conv=True), "-mlp": dict(mlp=False), "-nobias": dict(bias=False),
                   "-rotary": dict(rotary=True), "-untied": dict(tied=False), "-emb1": dict(emb_std=1.0)}
PARTS = {"gate": dict(use_gate=True), "taylor": dict(feature_map="taylor"), "conv": dict(use_local_conv=True),
         "delta": dict(update_rule="delta"), "dh16": dict(dim_head=16),
         # positions that read past the training length (--lengths): rotary, or none at all
         "rotary": dict(use_rotary_emb=True), "nopos": dict(use_pos_emb=False)}


def model_options(name):
    """(whether ``name`` is a softmax transformer, the options it names)."""
    if name.startswith("softmax"):
        changes = re.findall(r"[-+][a-z0-9]+", name[len("softmax"):])
        if "".join(changes) == name[len("softmax"):] and all(c in SOFTMAX_CHANGES for c in changes):
            return True, {k: v for c in changes for k, v in SOFTMAX_CHANGES[c].items()}
    elif all(p in PARTS or re.fullmatch(r"qk[1-9]\d*", p) for p in name.split("+")):
        parts = [PARTS[p] if p in PARTS else dict(dim_qk=int(p[2:])) for p in name.split("+")]
        return False, {k: v for part in parts for k, v in part.items()}
    raise argparse.ArgumentTypeError(f"unknown model {name!r}: softmax with changes {', '.join(SOFTMAX_CHANGES)}, "
                                     f"or parts {', '.join(PARTS)}, qkN joined by +")


def build_model(variant, vocab, dim, depth, heads, seq_len):
    softmax, options = model_options(variant)
    if softmax:
        return SoftmaxTransformer(vocab, dim, depth, heads, seq_len, **options)
    from linear_attention_transformer import LinearAttentionTransformerLM

    return LinearAttentionTransformerLM(num_tokens=vocab, dim=dim, depth=depth, max_seq_len=seq_len, heads=heads,
                                        causal=True, tie_embedding=True, **options)


def length_limit(model):
    """The longest sequence ``model`` reads (its position table's), or None: any length."""
    if isinstance(model, SoftmaxTransformer):
        return None if model.pos_emb is None else model.pos_emb.num_embeddings
    return model.length_limit


def parameters(model, vocab=None):
    """All parameters, or with ``vocab`` those of no (vocab, ...) matrix or (vocab,) bias:
    the sequence mixing and MLPs, which a large vocabulary would otherwise hide."""
    return sum(p.numel() for p in model.parameters() if vocab is None or p.shape[0] != vocab)


def query_logits(model, tokens, asked):
    """Logits (number of query positions, vocab) at the positions where ``asked`` is True."""
    return model.output_layer(model.output_features(tokens)[asked])


def query_hits(model, tokens, targets, device, batch_tokens=32_000):
    """The position of every query (row by row) and whether the argmax there is its value;
    batches of about ``batch_tokens`` tokens, so long sequences go a few at a time."""
    model.eval()
    batch, positions, hits = max(1, batch_tokens // tokens.shape[1]), [], []
    with torch.no_grad():
        for i in range(0, tokens.shape[0], batch):
            x, y = tokens[i : i + batch].to(device), targets[i : i + batch].to(device)
            asked = y != IGNORE
            hits.append((query_logits(model, x, asked).argmax(dim=-1) == y[asked]).cpu())
            positions.append(asked.nonzero()[:, 1].cpu())
    model.train()
    return torch.cat(positions), torch.cat(hits)


def accuracy(model, tokens, targets, device, batch=250):
    """Fraction of the queries whose argmax is the value bound to the key."""
    hits = query_hits(model, tokens, targets, device, batch * tokens.shape[1])[1]
    return hits.sum().item() / hits.numel()


def share(flags):
    """The share of True among ``flags`` (4 decimals), or None where there are none."""
    return round(flags.float().mean().item(), 4) if flags.numel() else None


def held_out_past(count, factor, seq_len, pairs, vocab, power_a=POWER_A):
    """The held-out set of ``factor`` times the training length (the module docstring's layout)."""
    return mqar_batch(count, factor * seq_len, pairs, vocab, batch_generator(*HELD_OUT), power_a, train_len=seq_len)


def progress(args, line):
    """Print ``line``, and with ``--progress`` append it to that file (the driver sees it at the end)."""
    print(line, flush=True)
    if args.progress:
        with open(args.progress, "a") as f:
            print(line, file=f)


def past_training_length(model, args, seq_len, pairs):
    """Accuracy and the data's figures at each factor of ``args.lengths`` (with ``--clean-filler``, read
    again without the asked keys in the filler); None for a length the model's position table does not reach."""
    figures, limit = {}, length_limit(model)
    for factor in args.lengths:
        if limit is not None and factor * seq_len > limit:
            figures[f"{factor}x"] = None
            continue
        start = time.perf_counter()
        try:
            held_out = held_out_past(args.held_out, factor, seq_len, pairs, args.vocab)
            positions, hits = query_hits(model, *held_out, args.device)
            if args.clean_filler:
                clean = query_hits(model, clean_filler(*held_out, pairs, args.vocab), held_out[1], args.device)
        except (RuntimeError, ValueError) as error:  # (out of memory, say): keep the training's figures
            figures[f"{factor}x"] = dict(error=repr(error))
            print(f"{args.variant} seed {args.seed} at {factor}x failed: {error!r}", flush=True)
            continue
        reappears = key_reappears(*held_out, pairs)
        figures[f"{factor}x"] = dict(
            accuracy=share(hits), sequences=args.held_out,
            mean_distance=round(positions.double().mean().item() - (pairs - 1), 1),  # keys at 0, 2, .., 2P - 2
            past_accuracy=share(hits[positions >= seq_len]), past_share=share(positions >= seq_len),
            seconds=round(time.perf_counter() - start, 1),
            # the filler's bindings of the asked keys: the data's figures, then the model's on either side
            reappear_share=share(reappears), recency_oracle=share(recency_oracle(*held_out)),
            reappear_accuracy=share(hits[reappears]), no_reappear_accuracy=share(hits[~reappears]))
        if args.clean_filler:
            figures[f"{factor}x"].update(clean_accuracy=share(clean[1]), clean_past_accuracy=share(
                clean[1][clean[0] >= seq_len]), seconds=round(time.perf_counter() - start, 1))  # (both readings)
        progress(args, f"{args.variant} seed {args.seed} at {factor}x: {figures[f'{factor}x']}")
    return figures


def train_one(args):
    """Worker: train (variant, seed) at one difficulty, emit its figures."""
    set_threads(args.threads)
    device, (seq_len, pairs) = args.device, args.size
    torch.manual_seed(args.seed)
    model = build_model(args.variant, args.vocab, args.dim, args.depth, args.heads, seq_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    held_out = mqar_batch(args.held_out, seq_len, pairs, args.vocab, batch_generator(*HELD_OUT))
    load_before = load_average()

    curve, losses, train_seconds = [], [], 0.0
    for step in range(1, args.steps + 1):
        synchronize(device)
        start = time.perf_counter()
        tokens, targets = mqar_batch(args.batch, seq_len, pairs, args.vocab, batch_generator(args.seed, step))
        tokens, targets = tokens.to(device), targets.to(device)
        asked = targets != IGNORE
        loss = F.cross_entropy(query_logits(model, tokens, asked), targets[asked])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        schedule.step()
        synchronize(device)
        train_seconds += time.perf_counter() - start  # evaluation is left out of the training time
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, round(accuracy(model, *held_out, device), 4)))
            losses.append(round(loss.item(), 3))
            progress(args, f"{args.variant} seed {args.seed} step {step}: loss {losses[-1]}, "
                           f"held-out {curve[-1][1]:.1%}")
            if args.stop_at is not None and len(curve) >= 2 and min(a for _, a in curve[-2:]) >= args.stop_at:
                break  # learned: the rest of the budget would only cost CPU time
    result = dict(accuracy=curve[-1][1], steps_to_pass=next((s for s, a in curve if a >= PASS), None), curve=curve,
                  losses=losses, params=parameters(model), mixing_params=parameters(model, args.vocab),
                  seconds=round(train_seconds, 1), steps=step, load_before=load_before, load_after=load_average())
    if args.lengths:
        result["lengths"] = past_training_length(model, args, seq_len, pairs)
    emit_result(result)


def parse_size(text):
    try:
        seq_len, pairs = (int(t) for t in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is SEQ_LEN:PAIRS, e.g. 128:16, got {text!r}") from None
    return seq_len, pairs


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[(64, 4), (128, 16), (256, 32)],
                   help="difficulties as SEQ_LEN:PAIRS (default 64:4 128:16 256:32)")
    p.add_argument("--variants", nargs="+", type=lambda name: model_options(name) and name,
                   default=["softmax", "softmax+conv", "gate", "taylor+conv+dh16", "gate+taylor+conv+dh16"],
                   help=f"softmax and changes {''.join(SOFTMAX_CHANGES)}, or parts {', '.join(PARTS)}, qkN joined by +")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--lengths", nargs="+", type=int, default=None, metavar="FACTOR",
                   help="after training, also score held-out sequences of these multiples of the training length")
    for flag, default in (("--steps", 2000), ("--batch", 32), ("--warmup", 100), ("--dim", 64), ("--depth", 2),
                          ("--heads", 2)):
        p.add_argument(flag, type=int, default=default)
    for flag, kind, default, text in (
            ("--lr", float, 1e-3, "AdamW's learning rate"),
            ("--weight-decay", float, 0.01, "AdamW's (default: AdamW's own, 0.01)"),
            ("--eval-every", int, 100, "steps between held-out measurements"),
            ("--clip", float, 1.0, "gradient norm clipped to this (0: off)"),
            ("--held-out", int, 500, "held-out sequences per difficulty and length"),
            ("--vocab", int, 512, "vocabulary (Zoology's 8192 needs far more steps to learn each value's embedding)"),
            ("--stop-at", float, None, "stop a model once two held-out measurements in a row reach this (0-1)"),
            ("--threads", int, None, "torch threads per model (1 on a shared CPU)")):
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--clean-filler", action="store_true",
                   help="with --lengths, also score each held-out set with no asked key in its filler")
    p.add_argument("--device", default=default_device())
    p.add_argument("--out", help="write every result as JSON here")
    p.add_argument("--progress", help="append each held-out measurement to this file as it is made")
    p.add_argument("--worker", type=json.loads, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        return train_one(argparse.Namespace(**args.worker))
    config = (f"MQAR, vocab {args.vocab}, power_a {POWER_A}; dim {args.dim}, depth {args.depth}, heads {args.heads}; "
              f"AdamW lr {args.lr} (warm-up {args.warmup}, weight decay {args.weight_decay}), gradient norm clipped "
              f"to {args.clip or 'off'}, batch {args.batch}, {args.steps} steps (stop at {args.stop_at}); "
              f"held-out: {args.held_out} sequences every {args.eval_every} steps")
    if args.lengths:
        config += (f"; after training, held-out at {', '.join(f'{f}x' for f in args.lengths)} the training length "
                   f"({args.held_out} sequences past 1x), query slots stretched"
                   + "; and again with no asked key in the filler" * args.clean_filler)
    start(args, [config])
    record = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), config=config,
                  started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), runs=[])

    rows, factors = [], args.lengths or []
    for (seq_len, pairs), seed, variant in itertools.product(args.sizes, args.seeds, args.variants):
        label = f"{seq_len}:{pairs} {variant} seed {seed}"
        job = dict(vars(args), size=(seq_len, pairs), variant=variant, seed=seed, worker=None)
        result, error = run_in_subprocess(__file__, ["--worker", json.dumps(job)], label)
        if error:
            print(error, flush=True)
            rows.append([f"{seq_len}:{pairs}", variant, seed, "failed"] + [""] * (5 + len(factors)))
            continue
        print(f"done {label}: {result}", flush=True)
        result.update(seq_len=seq_len, pairs=pairs, variant=variant, seed=seed,
                      finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        record["runs"].append(result)
        if args.out:  # after every model, so a cut run keeps what it finished
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        passed = result["steps_to_pass"]
        rows.append([f"{seq_len}:{pairs}", variant, seed, f"{100 * result['accuracy']:.1f}",
                     f"> {args.steps}" if passed is None else passed, result["params"],
                     result["mixing_params"], f"{result['seconds']:.0f}", result["steps"]]
                    + ["position table" if c is None else "failed" if "error" in c else
                       f"{100 * c['accuracy']:.1f}" for c in (result["lengths"][f"{f}x"] for f in factors)])
    print("\n" + table(["tokens:pairs", "variant", "seed", "final acc %", f"steps to {PASS:.0%}", "params",
                        "non-vocab params", "train s", "steps"] + [f"{f}x acc %" for f in factors], rows))
    print(f"load:    {load_average()} (end)")


if __name__ == "__main__":
    main()
