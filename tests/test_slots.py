"""Many sequences continued from the slots of one pool (``slots.py``), as a serving engine
schedules them: prompts read whole or in chunks, one-token steps of requests at different
positions taken together, slots reused without clearing. Each token's logits equal those of
its sequence's full forward alone (float64)."""

import random

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformerLM
from linear_attention_transformer.slots import continue_in_slots, empty_pool, slot_layout

D = torch.float64
BASE = dict(num_tokens=20, dim=16, depth=2, heads=4, max_seq_len=64, causal=True)
LOCAL = dict(n_local_attn_heads=2, local_attn_window_size=4)
CONFIGS = {
    "axial": dict(**LOCAL),
    "recommended+rotary": dict(**LOCAL, use_local_conv=True, shift_tokens=True, use_gate=True, feature_map="taylor",
                               dim_qk=4, use_rotary_emb=True),
    "shift+reversible+glu+gates": dict(**LOCAL, shift_tokens=True, reversible=True, ff_glu=True, use_gate=True),
    "delta+local+conv+gate+rotary": dict(**LOCAL, update_rule="delta", use_local_conv=True, use_gate=True,
                                         use_rotary_emb=True),
    "no positions+kv_heads+blindspot": dict(**LOCAL, use_axial_pos_emb=False, kv_heads=2, blindspot_size=2,
                                            use_local_conv=True),
    "exact window+elu": dict(n_local_attn_heads=2, local_attn_window_size=3, local_attn_exact_windowsize=True,
                             feature_map="elu"),
    "window+linear+sinks": dict(n_local_attn_heads=2, local_attn_window_size=3, local_attn_exact_windowsize=True,
                                local_attn_older_keys="linear", local_attn_sinks=2, local_attn_feature_dim=3,
                                use_rotary_emb=True),
}


def make(cfg, **overrides):
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(**{**BASE, **overrides}, **cfg).to(D).eval()
    with torch.no_grad():  # gates and convolutions start near identity: move them
        for name, p in model.named_parameters():
            if "gate" in name or "conv" in name or "local_heads" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def garbage_pool(model, num_slots):
    """A pool whose slots hold random numbers: a request at position 0 must not read them."""
    pool = empty_pool(model, num_slots)
    for block in pool:
        for t in block:
            t.copy_(torch.randint(-5, 5, t.shape) if not t.is_floating_point() else torch.randn(t.shape, dtype=t.dtype))
    return pool


def serve(model, sequences, num_slots, seed, max_chunk=7):
    """Run ``sequences`` through a pool of ``num_slots`` slots under a random schedule: at each
    call a random set of the live requests takes a chunk (prefill) or one token; a finished
    request frees its slot for a waiting one. Returns each sequence's logits, in order."""
    rng = random.Random(seed)
    pool = garbage_pool(model, num_slots)
    waiting, live, done = list(range(len(sequences))), {}, {}
    free = list(range(num_slots))
    rng.shuffle(free)
    outs = {i: [] for i in range(len(sequences))}
    while waiting or live:
        while waiting and free:
            live[waiting.pop(0)] = [free.pop(), 0]  # slot, tokens read
        chosen = [i for i in live if rng.random() < 0.8] or [next(iter(live))]
        rng.shuffle(chosen)
        tokens, starts, slots, positions = [], [0], [], []
        for i in chosen:
            slot, at = live[i]
            left = len(sequences[i]) - at
            take = 1 if rng.random() < 0.5 else rng.randint(1, max_chunk)
            take = min(take, left)
            tokens.append(sequences[i][at : at + take])
            starts.append(starts[-1] + take)
            slots.append(slot)
            positions.append(at)
        features = continue_in_slots(model, pool, torch.cat(tokens), torch.tensor(starts), torch.tensor(slots),
                                     torch.tensor(positions))
        logits = model.logits_of(features)
        for r, i in enumerate(chosen):
            outs[i].append(logits[starts[r] : starts[r + 1]])
            live[i][1] += starts[r + 1] - starts[r]
            if live[i][1] == len(sequences[i]):
                free.append(live.pop(i)[0])
                done[i] = True
    return [torch.cat(outs[i]) for i in range(len(sequences))]


def sequences_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 20, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("name", CONFIGS)
def test_each_request_gets_what_its_sequence_gets_alone(name):
    model = make(CONFIGS[name])
    sequences = sequences_of([23, 1, 9, 17, 30, 5, 12])
    # 3 slots for 7 requests: requests wait and join mid-flight, into slots others used
    got = serve(model, sequences, num_slots=3, seed=2)
    for seq, logits in zip(sequences, got):
        torch.testing.assert_close(logits, model(seq[None])[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["recommended+rotary", "delta+local+conv+gate+rotary"])
def test_requests_continue_past_max_seq_len_with_rotary_positions(name):
    model = make(CONFIGS[name], max_seq_len=16)
    sequences = sequences_of([40, 7, 33], seed=3)
    got = serve(model, sequences, num_slots=2, seed=4)
    with torch.no_grad():  # a sequence alone, streamed past max_seq_len in chunks of 8
        for seq, logits in zip(sequences, got):
            cache, alone = None, []
            for a in range(0, len(seq), 8):
                out, cache = model(seq[None, a : a + 8], cache=cache, return_cache=True)
                alone.append(out[0])
            torch.testing.assert_close(logits, torch.cat(alone), rtol=0, atol=1e-12)


def test_steps_at_different_positions_are_taken_together():
    model = make(CONFIGS["recommended+rotary"])
    pool = garbage_pool(model, 4)
    seqs = sequences_of([9, 4, 6])
    for slot, seq in enumerate(seqs):  # prompts of different lengths, less their last token
        continue_in_slots(model, pool, seq[:-1], torch.tensor([0, len(seq) - 1]), torch.tensor([slot]),
                          torch.tensor([0]))
    calls = []
    original = model.continue_features
    model.continue_features = lambda x, cache: calls.append(tuple(x.shape)) or original(x, cache)
    last = torch.stack([s[-1] for s in seqs])
    features = continue_in_slots(model, pool, last, torch.arange(4), torch.tensor([0, 1, 2]),
                                 torch.tensor([len(s) - 1 for s in seqs]))
    assert calls == [(3, 1)]  # one step for the three rows
    for r, seq in enumerate(seqs):
        torch.testing.assert_close(model.logits_of(features[r]), model(seq[None])[0, -1], rtol=0, atol=1e-12)


def test_slot_layout_lists_each_blocks_tensors():
    model = make(CONFIGS["recommended+rotary"])
    layout = slot_layout(model)
    pool = empty_pool(model, 5)
    assert len(layout) == len(pool) == BASE["depth"]
    for shapes, block in zip(layout, pool):
        assert [(tuple(t.shape[1:]), t.dtype) for t in block] == shapes
        assert all(t.shape[0] == 5 for t in block)


def test_bad_batches_are_refused_by_name():
    model = make(CONFIGS["axial"])
    pool = empty_pool(model, 2)
    x = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="query_starts"):
        continue_in_slots(model, pool, x, torch.tensor([0, 2]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="query_starts"):
        continue_in_slots(model, pool, x, torch.tensor([0, 3]), torch.tensor([0, 1]), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="LinearAttentionTransformerLM"):
        slot_layout(model.transformer)
    bidirectional = LinearAttentionTransformerLM(**{**BASE, "causal": False})
    with pytest.raises(ValueError, match="causal"):
        slot_layout(bidirectional)


@pytest.mark.parametrize("options, why", [
    (dict(attend_axially=True), "attend_axially"),
    (dict(receives_context=True), "receives_context"),
    (dict(return_embeddings=True), "return_embeddings"),
    (dict(causal=False), "causal"),
])
def test_models_a_slot_cannot_hold_are_refused_by_name(options, why):
    model = LinearAttentionTransformerLM(**{**BASE, **options}).eval()
    with pytest.raises(ValueError, match=why):
        slot_layout(model)


def test_left_over_dropout_is_refused():
    model = LinearAttentionTransformerLM(**BASE, attn_dropout=0.1)  # (still in training mode)
    with pytest.raises(ValueError, match="dropout"):
        slot_layout(model)


@pytest.mark.parametrize("slots", [[3, 1, 2], [0, 2, 5]])  # consecutive once sorted (views), or not (copies)
def test_steps_in_any_slots_equal_each_sequence_alone(slots):
    model = make(CONFIGS["recommended+rotary"])
    pool = garbage_pool(model, 6)
    seqs = sequences_of([9, 1, 6])
    for slot, seq in zip(slots, seqs):  # prompts less their last token (the second: none, a new sequence)
        if len(seq) > 1:
            continue_in_slots(model, pool, seq[:-1], torch.tensor([0, len(seq) - 1]), torch.tensor([slot]),
                              torch.tensor([0]))
    last = torch.stack([s[-1] for s in seqs])
    features = continue_in_slots(model, pool, last, torch.arange(4), torch.tensor(slots),
                                 torch.tensor([len(s) - 1 for s in seqs]))
    for r, seq in enumerate(seqs):
        torch.testing.assert_close(model.logits_of(features[r]), model(seq[None])[0, -1], rtol=0, atol=1e-12)
