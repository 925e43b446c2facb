#!/usr/bin/env python
"""Associative recall (MQAR) of the linear-attention LM against same-size softmax transformers.

Multi-query associative recall as Zoology (Arora et al. 2023) lays it out, written from its
description: a sequence opens with ``pairs`` key-value pairs ``k1 v1 k2 v2 ...``; the rest is
cut into two-token slots and every key is asked once, at the first token of a slot drawn
without replacement with probability proportional to g ** (power_a - 1), g = 1, 2, ...
counting slots from the pairs (most queries come soon after the pairs, a few far; ``power_a=1``
is uniform). Every other position after the pairs holds a token drawn uniformly from the whole
vocabulary. Keys are distinct within a sequence and come from [1, vocab/2), values are
distinct too and come from [vocab/2, vocab). The model reads causally and is scored only where
it stands on a query key: its next-token prediction must be the value bound to that key.

Past the training length (``--lengths 1 2 4 8 16``): after training at SEQ_LEN, the same model
reads held-out sequences of each factor times SEQ_LEN, with the same number of pairs. Their
layout stretches the training one: the pairs open the sequence as before, each key's slot is
drawn exactly as at SEQ_LEN (the same power law over SEQ_LEN's S slots), and then moved to a
uniformly drawn slot of its own share of the longer sequence's S' slots: training slot s
becomes a slot of [floor(s S' / S), floor((s + 1) S' / S)). Every query therefore stands about
S' / S times as far from the pairs as it would at SEQ_LEN (at 128 tokens and 16 pairs, S = 48
and S' = 112, 240, 496, 1008: 2.3 to 21 times), with that much more filler between, and the
queries keep their order. The held-out sets of all factors come from one generator seed and
draw the pairs and the training slots first, so they hold the same pairs, asked in the same
order, and at factor 1 the set is the usual held-out set. (Zoology's way to a longer sequence,
the same power law over all S' slots, keeps most queries near the pairs: at 128:16 and 16x half
of them still stand within the first 128 tokens, where a causal model reads what it read in
training, and the mean distance from a key to its query is 346 tokens against 664 stretched
and 47 at 1x.) The figures: the accuracy at each factor, and the accuracy among the queries
at or past SEQ_LEN, positions no training sequence had (at 128:16, 30 % of the queries at
2x, 86 % at 16x).

Keys in the filler: the filler draws from the whole vocabulary, so an asked key may also stand
in the filler between its pair and its query, followed by a random token, a second binding of
that key; the further the query, the more often. At each factor the figures also give the share
of queries whose key does so (``reappear_share``), the accuracy of a memory that keeps only each
key's latest binding (``recency_oracle``: the token after the key's most recent earlier
occurrence), and the model's accuracy on the queries whose key reappears and on the others.
With ``--clean-filler`` the same model also reads each factor's held-out set once more with its
filler cleaned: every filler token equal to one of the sequence's keys redrawn uniformly from
the rest of the vocabulary (from a generator of its own), the pairs, the queries and every other
token unchanged (``clean_accuracy``, ``clean_past_accuracy``; ``seconds`` then times both
readings). Training data is Zoology's layout either way.

Each training step draws a fresh batch from a generator fixed by (seed, step), so every model
of one seed sees the same data; the held-out set comes from a generator seed no training batch
uses. Held-out accuracy is measured every ``--eval-every`` steps: the figures are the first
step at which it reached 90 % (how fast recall is learned) and the accuracy at the end of the
run (the budget, or with ``--stop-at`` the second measurement in a row at that accuracy).

Models (dim 64, depth 2, 2 heads, vocabulary 512 by default):
    softmax-mlp   ``SoftmaxTransformer`` as in Zoology's MQAR runs: pre-norm attention blocks
                  alone (causal SDPA, learned absolute positions, biases, tied output layer).
    softmax       the same with a GELU MLP of 4 x dim in every block (GPT-2's block).
    softmax-rotary, softmax-untied, softmax-rotary-untied
                  ``softmax`` with one change or both: rotary positions on every block's
                  queries and keys instead of the learned absolute ones; an output layer of
                  its own instead of the one tied to the token embedding.
    softmax-emb1, softmax-rotary-emb1, softmax-untied-emb1, softmax-rotary-untied-emb1
                  those with the embeddings drawn from PyTorch's N(0, 1) instead of GPT-2's
                  N(0, 0.02): the token embedding as large as what a block adds to it.
    softmax-nobias
                  ``softmax`` without biases in its linear layers and LayerNorms.
    softmax+conv  ``softmax`` with a short causal convolution before attention in every block
                  (``ShortConv``, Zoology's BaseConv), which hands each position its
                  previous tokens.
    the rest      ``LinearAttentionTransformerLM(causal=True, ...)`` with the options of VARIANTS
                  (their names: +rotary for rotary positions, +nopos for none, otherwise the
                  axial position table, which reads no sequence past SEQ_LEN).

Training, the same for every model: AdamW (lr 1e-3, linear warm-up over 100 steps, then
constant, weight decay 0.01: ``--weight-decay``), batch 32, cross entropy at the query
positions only, gradient norm clipped to 1 (``--clip``);
every model ties its output layer to its token embedding, as Zoology's LM does. Each model
trains in a fresh subprocess; ``--out`` writes every result (the held-out curve included) as
JSON after each model, so a cut run keeps what it finished.

Usage:  python benchmarks/bench_recall.py --threads 1 --sizes 128:16 --variants softmax+conv gate --seeds 0 --out r.json
        python benchmarks/bench_recall.py --threads 1 --sizes 128:16 --variants gate+delta+conv+rotary --seeds 0
               --lengths 1 2 4 8 16 --clean-filler --out recall_length.json
See docs/layers.md ("Recall") for the figures and what they mean.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from linear_attention_transformer.positional import RotaryEmbedding, apply_rotary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    default_device, emit_result, load_average, print_header, run_in_subprocess, set_threads, synchronize, table)

IGNORE = -100  # the target of every position that is not a query
POWER_A = 0.01  # Zoology's default: the slot after the pairs is ~1/g as likely as slot g
PASS = 0.9  # the held-out accuracy whose first step is reported

# ---------------------------------------------------------------------------------- data


def slot_weights(slots, power_a=POWER_A):
    """Unnormalised probability of each query slot, g = 1 .. slots: g ** (power_a - 1)."""
    return torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)


def stretched_slots(slot, train_slots, slots, generator):
    """Slots of a longer sequence for the training ``slot``s (of ``train_slots``): training slot
    s becomes a uniform draw from [floor(s slots / train_slots), floor((s + 1) slots /
    train_slots)), one share of ``slots``. The shares do not overlap, so distinct slots stay
    distinct, in the same order."""
    low = slot * slots // train_slots
    high = (slot + 1) * slots // train_slots
    return low + (torch.rand(slot.shape, generator=generator, dtype=torch.float64) * (high - low)).long()


def mqar_batch(batch, seq_len, pairs, vocab, generator, power_a=POWER_A, train_len=None):
    """One batch of MQAR sequences: (tokens (batch, seq_len), targets (batch, seq_len)).

    tokens: ``k1 v1 ... kP vP``, then (seq_len - 2P) / 2 two-token slots; key i is asked at the
    first token of slot s_i, the slots drawn without replacement by ``slot_weights``; every
    other position after the pairs is a uniform random token of [0, vocab). targets: the value
    bound to the key at each query position, IGNORE everywhere else.

    ``train_len`` (a held-out set past the training length, seq_len > train_len): the slots are
    drawn as at train_len, then stretched over seq_len's (``stretched_slots``). The pairs and
    the slots before stretching do not depend on seq_len: from generators in the same state,
    every seq_len gets the same pairs and the same order of queries; with train_len = seq_len
    the batch is the one without train_len."""
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
    slot = torch.multinomial(slot_weights(train_slots, power_a).expand(batch, train_slots), pairs, generator=g)
    if train_slots < slots:
        slot = stretched_slots(slot, train_slots, slots, g)
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
# the generator that redraws the clean held-out sets' filler (--clean-filler)
CLEAN_FILLER_SEED = 20_011


def query_places(targets):
    """Every query, row by row (the order of ``query_hits``): (its row, its position)."""
    return (targets != IGNORE).nonzero(as_tuple=True)


def key_reappears(tokens, targets, pairs):
    """For every query (row by row): does its key occur as filler, at a position of [2 pairs,
    query)? Then the filler has bound that key to another token after its pair."""
    rows, positions = query_places(targets)
    index = torch.arange(tokens.shape[1])
    same = tokens[rows] == tokens[rows, positions].unsqueeze(1)  # (queries, seq_len)
    return (same & (index >= 2 * pairs) & (index < positions.unsqueeze(1))).any(dim=1)


def recency_oracle(tokens, targets):
    """For every query (row by row): is the token after the key's most recent earlier occurrence
    its value? The answer of a memory that keeps only the latest binding of each key."""
    rows, positions = query_places(targets)
    index = torch.arange(tokens.shape[1])
    same = (tokens[rows] == tokens[rows, positions].unsqueeze(1)) & (index < positions.unsqueeze(1))
    last = torch.where(same, index, -1).max(dim=1).values  # >= 0: the key's own pair comes first
    return tokens[rows, last + 1] == targets[rows, positions]


def clean_filler(tokens, targets, pairs, vocab):
    """A copy of ``tokens`` whose filler holds none of its row's keys: every filler token (after
    the pairs, not a query) equal to one of them is redrawn uniformly from the rest of the
    vocabulary (from a generator of its own, ``CLEAN_FILLER_SEED``). The pairs, the queries and
    every other filler token stay as they are."""
    generator = torch.Generator().manual_seed(CLEAN_FILLER_SEED)
    tokens = tokens.clone()
    keys = tokens[:, 0 : 2 * pairs : 2]
    filler = torch.arange(tokens.shape[1]) >= 2 * pairs
    filler = filler & (targets == IGNORE)
    while True:
        bad = filler & (tokens.unsqueeze(-1) == keys.unsqueeze(1)).any(dim=-1)
        if not bad.any():
            return tokens
        tokens[bad] = torch.randint(0, vocab, (int(bad.sum()),), generator=generator)


# --------------------------------------------------------------------- softmax reference


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
    """A standard causal softmax LM: token embedding plus learned absolute positions (GPT-2's
    recipe), pre-norm ``SoftmaxBlock``s (with ``mlp=False`` attention alone, as in Zoology's
    MQAR runs), a final LayerNorm, an output layer tied to the embedding; ``output_features``
    and ``output_layer`` split the logits, so the loss reads only the query positions.
    ``rotary=True``: no position embedding, rotary positions on every block's queries and keys;
    ``tied=False``: an output layer of its own; ``emb_std``: the embeddings' initial standard
    deviation (GPT-2's 0.02, or PyTorch's default of 1); ``bias=False``: no biases in the
    linear layers and LayerNorms."""

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


# ------------------------------------------------------------------------------ variants

# softmax transformers: name -> SoftmaxTransformer options
SOFTMAX = {
    "softmax": {}, "softmax+conv": dict(short_conv=True), "softmax-mlp": dict(mlp=False),
    "softmax-nobias": dict(bias=False),
    # positions, output layer and embedding scale, one at a time and together
    "softmax-rotary": dict(rotary=True), "softmax-untied": dict(tied=False),
    "softmax-rotary-untied": dict(rotary=True, tied=False),
    "softmax-emb1": dict(emb_std=1.0), "softmax-rotary-emb1": dict(rotary=True, emb_std=1.0),
    "softmax-untied-emb1": dict(tied=False, emb_std=1.0),
    "softmax-rotary-untied-emb1": dict(rotary=True, tied=False, emb_std=1.0),
}
# name -> LinearAttentionTransformerLM options on top of the shape (dim, depth, heads); an
# entry may override dim_head.
VARIANTS = {
    "gate": dict(use_gate=True), "gate+conv": dict(use_gate=True, use_local_conv=True),
    "taylor+conv+dh16": dict(feature_map="taylor", use_local_conv=True, dim_head=16),
    "gate+taylor+conv+dh16": dict(use_gate=True, feature_map="taylor", use_local_conv=True, dim_head=16),
    "taylor+conv+qk16": dict(feature_map="taylor", use_local_conv=True, dim_qk=16),
    "gate+taylor+conv+qk16": dict(use_gate=True, feature_map="taylor", use_local_conv=True, dim_qk=16),
    # positions that read past the training length (--lengths): rotary, or none at all
    "gate+conv+rotary": dict(use_gate=True, use_local_conv=True, use_rotary_emb=True),
    "gate+taylor+conv+qk16+rotary": dict(use_gate=True, feature_map="taylor", use_local_conv=True, dim_qk=16,
                                         use_rotary_emb=True),
    "gate+taylor+conv+qk16+nopos": dict(use_gate=True, feature_map="taylor", use_local_conv=True, dim_qk=16,
                                        use_pos_emb=False),
    "delta+conv+rotary": dict(update_rule="delta", use_local_conv=True, use_rotary_emb=True),
    "delta+conv+nopos": dict(update_rule="delta", use_local_conv=True, use_pos_emb=False),
    "gate+delta+conv+rotary": dict(update_rule="delta", use_gate=True, use_local_conv=True, use_rotary_emb=True),
    "gate+delta+conv+nopos": dict(update_rule="delta", use_gate=True, use_local_conv=True, use_pos_emb=False),
    # wider keys: a state of 64 or 128 rows (the recommended heads' has 153 rows of Taylor features)
    "delta+conv+nopos+qk64": dict(update_rule="delta", use_local_conv=True, use_pos_emb=False, dim_qk=64),
    "delta+conv+nopos+qk128": dict(update_rule="delta", use_local_conv=True, use_pos_emb=False, dim_qk=128),
    "delta+conv+rotary+qk128": dict(update_rule="delta", use_local_conv=True, use_rotary_emb=True, dim_qk=128),
    "gate+delta+conv+nopos+qk128": dict(update_rule="delta", use_gate=True, use_local_conv=True, use_pos_emb=False,
                                        dim_qk=128),
}


def build_model(variant, vocab, dim, depth, heads, seq_len):
    if variant in SOFTMAX:
        return SoftmaxTransformer(vocab, dim, depth, heads, seq_len, **SOFTMAX[variant])
    from linear_attention_transformer import LinearAttentionTransformerLM

    return LinearAttentionTransformerLM(num_tokens=vocab, dim=dim, depth=depth, max_seq_len=seq_len, heads=heads,
                                        causal=True, tie_embedding=True, **VARIANTS[variant])


def length_limit(model):
    """The longest sequence ``model`` reads (its position table's), or None: any length."""
    if isinstance(model, SoftmaxTransformer):
        return None if model.pos_emb is None else model.pos_emb.num_embeddings
    return model.length_limit


def parameters(model, vocab=None):
    """All parameters, or with ``vocab`` those of no (vocab, ...) matrix or (vocab,) bias:
    the sequence mixing and MLPs, which a large vocabulary would otherwise hide."""
    return sum(p.numel() for p in model.parameters() if vocab is None or p.shape[0] != vocab)


# ---------------------------------------------------------------------------- one model


def query_logits(model, tokens, asked):
    """Logits (number of query positions, vocab) at the positions where ``asked`` is True."""
    return model.output_layer(model.output_features(tokens)[asked])


def accuracy(model, tokens, targets, device, batch=250):
    """Fraction of the query positions whose argmax is the value bound to the query key."""
    model.eval()
    right = total = 0
    with torch.no_grad():
        for i in range(0, tokens.shape[0], batch):
            x, y = tokens[i : i + batch].to(device), targets[i : i + batch].to(device)
            asked = y != IGNORE
            right += (query_logits(model, x, asked).argmax(dim=-1) == y[asked]).sum().item()
            total += asked.sum().item()
    model.train()
    return right / total


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


def held_out_past(count, factor, seq_len, pairs, vocab, power_a=POWER_A):
    """The held-out set of ``factor`` times the training length (the module docstring's layout)."""
    return mqar_batch(count, factor * seq_len, pairs, vocab, batch_generator(*HELD_OUT), power_a, train_len=seq_len)


def past_training_length(model, args, seq_len, pairs):
    """Figures at each factor of ``args.lengths``: the accuracy, the mean distance from a key to
    its query, and the accuracy and share of the queries at or past ``seq_len``; None for a
    length the model's position table does not reach."""
    figures, limit = {}, length_limit(model)
    for factor in args.lengths:
        if limit is not None and factor * seq_len > limit:
            figures[f"{factor}x"] = None
            continue
        start = time.perf_counter()
        count = args.held_out if factor == 1 or args.held_out_past is None else args.held_out_past
        try:
            held_out = held_out_past(count, factor, seq_len, pairs, args.vocab, args.power_a)
            positions, hits = query_hits(model, *held_out, args.device)
            if args.clean_filler:
                clean_positions, clean_hits = query_hits(
                    model, clean_filler(*held_out, pairs, args.vocab), held_out[1], args.device)
        except (RuntimeError, ValueError) as error:  # (out of memory, say): keep the training's figures
            figures[f"{factor}x"] = dict(error=repr(error))
            print(f"{args.variant} seed {args.seed} at {factor}x failed: {error!r}", flush=True)
            continue
        past = positions >= seq_len
        reappears = key_reappears(*held_out, pairs)
        figures[f"{factor}x"] = dict(
            accuracy=round(hits.float().mean().item(), 4), sequences=count,
            mean_distance=round(positions.double().mean().item() - (pairs - 1), 1),  # keys at 0, 2, .., 2P - 2
            past_accuracy=round(hits[past].float().mean().item(), 4) if past.any() else None,
            past_share=round(past.float().mean().item(), 4), seconds=round(time.perf_counter() - start, 1),
            # the filler's bindings of the asked keys: the data's figures, then the model's on either side
            reappear_share=round(reappears.float().mean().item(), 4),
            recency_oracle=round(recency_oracle(*held_out).float().mean().item(), 4),
            reappear_accuracy=round(hits[reappears].float().mean().item(), 4) if reappears.any() else None,
            no_reappear_accuracy=round(hits[~reappears].float().mean().item(), 4) if (~reappears).any() else None)
        if args.clean_filler:
            clean_past = clean_positions >= seq_len
            figures[f"{factor}x"].update(
                clean_accuracy=round(clean_hits.float().mean().item(), 4),
                clean_past_accuracy=round(clean_hits[clean_past].float().mean().item(), 4) if clean_past.any()
                else None,
                seconds=round(time.perf_counter() - start, 1))  # (both readings)
        line = f"{args.variant} seed {args.seed} at {factor}x: {figures[f'{factor}x']}"
        print(line, flush=True)
        if args.progress:
            with open(args.progress, "a") as f:
                print(line, file=f)
    return figures


def first_pass(curve, level=PASS):
    """The first step of ``curve`` ([(step, accuracy), ...]) with accuracy >= level, or None."""
    return next((step for step, acc in curve if acc >= level), None)


def train_one(args):
    """Worker: train (variant, seed) at one difficulty, emit its figures."""
    set_threads(args.threads)
    device = args.device
    seq_len, pairs = args.size
    torch.manual_seed(args.seed)
    model = build_model(args.variant, args.vocab, args.dim, args.depth, args.heads, seq_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    held_out = mqar_batch(args.held_out, seq_len, pairs, args.vocab, batch_generator(*HELD_OUT), args.power_a)
    load_before = load_average()

    curve, losses, train_seconds = [], [], 0.0
    for step in range(1, args.steps + 1):
        synchronize(device)
        start = time.perf_counter()
        tokens, targets = mqar_batch(args.batch, seq_len, pairs, args.vocab, batch_generator(args.seed, step),
                                     args.power_a)
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
            line = f"{args.variant} seed {args.seed} step {step}: loss {losses[-1]}, held-out {curve[-1][1]:.1%}"
            print(line, flush=True)
            if args.progress:  # the driver reads a worker's output only at its end
                with open(args.progress, "a") as f:
                    print(line, file=f)
            if args.stop_at is not None and len(curve) >= 2 and min(a for _, a in curve[-2:]) >= args.stop_at:
                break  # learned: the rest of the budget would only cost CPU time
    result = dict(accuracy=curve[-1][1], steps_to_pass=first_pass(curve), curve=curve, losses=losses,
                  params=parameters(model), mixing_params=parameters(model, args.vocab),
                  seconds=round(train_seconds, 1), steps=step, load_before=load_before, load_after=load_average())
    if args.lengths:
        result["lengths"] = past_training_length(model, args, seq_len, pairs)
    emit_result(result)


# -------------------------------------------------------------------------------- driver


def length_cell(figures):
    """A table cell of one factor of --lengths: the accuracy in %, or why there is none."""
    if figures is None:
        return "position table"
    return "failed" if "error" in figures else f"{100 * figures['accuracy']:.1f}"


def parse_size(text):
    try:
        seq_len, pairs = (int(t) for t in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is SEQ_LEN:PAIRS, e.g. 128:16, got {text!r}") from None
    return seq_len, pairs


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[(64, 4), (128, 16), (256, 32)],
                        help="difficulties as SEQ_LEN:PAIRS (default 64:4 128:16 256:32)")
    parser.add_argument("--variants", nargs="+",
                        default=["softmax", "softmax+conv", "gate", "taylor+conv+dh16", "gate+taylor+conv+dh16"],
                        help=f"{', '.join(SOFTMAX)} and names of VARIANTS (--list)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out measurements")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (default: %(default)s, AdamW's own)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipped to this (0: off)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--held-out", type=int, default=500, help="held-out sequences per difficulty")
    parser.add_argument("--lengths", nargs="+", type=int, default=None, metavar="FACTOR",
                        help="after training, also score held-out sequences of these multiples of the training "
                             "length (e.g. 1 2 4 8 16; see the module docstring for their layout)")
    parser.add_argument("--held-out-past", type=int, default=None,
                        help="held-out sequences at each factor above 1 (default: --held-out)")
    parser.add_argument("--clean-filler", action="store_true",
                        help="with --lengths, also score each factor's held-out set with no asked key in its filler "
                             "(see the module docstring)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512,
                        help="vocabulary (Zoology's 8192 needs far more steps just to learn each value's embedding)")
    parser.add_argument("--power-a", type=float, default=POWER_A, help="query slot power law (1: uniform)")
    parser.add_argument("--stop-at", type=float, default=None,
                        help="stop a model once two held-out measurements in a row reach this accuracy (0-1)")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--threads", type=int, default=None, help="torch threads per model (1 on a shared CPU)")
    parser.add_argument("--out", help="write every result as JSON here")
    parser.add_argument("--progress", help="append each held-out measurement to this file as it is made")
    parser.add_argument("--list", action="store_true", help="print the models and exit")
    parser.add_argument("--worker", nargs=3, metavar=("SIZE", "VARIANT", "SEED"), help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.list:
        return print("\n".join(f"{name:28s} {'SoftmaxTransformer ' * (name in SOFTMAX)}{options}"
                               for name, options in {**SOFTMAX, **VARIANTS}.items()))
    if args.worker:
        args.size, args.variant, args.seed = parse_size(args.worker[0]), args.worker[1], int(args.worker[2])
        return train_one(args)
    unknown = [v for v in args.variants if v not in SOFTMAX and v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; see --list")

    set_threads(args.threads)
    config = (f"MQAR, vocab {args.vocab}, power_a {args.power_a}; dim {args.dim}, depth {args.depth}, "
              f"heads {args.heads}; AdamW lr {args.lr} (warm-up {args.warmup}, weight decay {args.weight_decay}), "
              f"gradient norm clipped to {args.clip or 'off'}, batch {args.batch}, "
              f"{args.steps} steps (stop at {args.stop_at}); "
              f"held-out: {args.held_out} sequences every {args.eval_every} steps")
    if args.lengths:
        config += (f"; after training, held-out at {', '.join(f'{f}x' for f in args.lengths)} the training length "
                   f"({args.held_out if args.held_out_past is None else args.held_out_past} sequences past 1x), "
                   "query slots stretched" + ("; and again with no asked key in the filler" * args.clean_filler))
    print_header(args.device, args.threads, [config])
    shared = ["--steps", args.steps, "--eval-every", args.eval_every, "--batch", args.batch, "--lr", args.lr,
              "--weight-decay", args.weight_decay, "--clip", args.clip,
              "--warmup", args.warmup, "--held-out", args.held_out, "--dim", args.dim, "--depth", args.depth,
              "--heads", args.heads, "--vocab", args.vocab, "--power-a", args.power_a, "--device", args.device]
    for flag, value in (("--stop-at", args.stop_at), ("--progress", args.progress), ("--threads", args.threads),
                        ("--held-out-past", args.held_out_past)):
        if value is not None:
            shared += [flag, value]
    if args.lengths:
        shared += ["--lengths"] + args.lengths
    if args.clean_filler:
        shared += ["--clean-filler"]
    record = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), config=config,
                  started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), runs=[])

    rows, factors = [], args.lengths or []
    for seq_len, pairs in args.sizes:
        for seed in args.seeds:
            for variant in args.variants:
                label = f"{seq_len}:{pairs} {variant} seed {seed}"
                result, error = run_in_subprocess(__file__, ["--worker", f"{seq_len}:{pairs}", variant, seed] + shared,
                                                  label)
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
                            + [length_cell(result["lengths"][f"{f}x"]) for f in factors])
    print()
    print(table(["tokens:pairs", "variant", "seed", "final acc %", f"steps to {PASS:.0%}", "params",
                 "non-vocab params", "train s", "steps"] + [f"{f}x acc %" for f in factors], rows))
    print(f"load:    {load_average()} (end)")


if __name__ == "__main__":
    main()
