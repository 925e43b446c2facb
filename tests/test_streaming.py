"""Past max_seq_len: a model with rotary or no positions reads, and streams through its cache,
sequences of any length; a model with a position table refuses them, naming what lifts the limit.

The reference is the same weights in a model whose max_seq_len covers the whole sequence.
"""

import pytest
import torch

from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM

D = torch.float64
TRAINED_AT, WHOLE = 16, 80
# the recommended heads, local heads with a window that does not divide the chunks, the
# convolution and token shift: every buffer a cache keeps
OPTIONS = dict(num_tokens=20, dim=16, depth=2, heads=4, causal=True, n_local_attn_heads=2, local_attn_window_size=4,
               use_gate=True, use_local_conv=True, shift_tokens=True, feature_map="taylor", dim_qk=4)
POSITIONS = {"rotary": dict(use_rotary_emb=True), "none": dict(use_pos_emb=False)}
# the same with delta-rule global heads
DELTA = {**{k: v for k, v in OPTIONS.items() if k != "feature_map"}, "update_rule": "delta"}


def pair(positions, options=OPTIONS):
    """(a model trained at TRAINED_AT, the same weights with max_seq_len = WHOLE)."""
    torch.manual_seed(0)
    short = LinearAttentionTransformerLM(max_seq_len=TRAINED_AT, **options, **POSITIONS[positions]).to(D).eval()
    whole = LinearAttentionTransformerLM(max_seq_len=WHOLE, **options, **POSITIONS[positions]).to(D).eval()
    whole.load_state_dict(short.state_dict())
    return short, whole


@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("positions", POSITIONS)
def test_forward_prefill_and_decode_past_max_seq_len_equal_one_full_forward(positions, rule):
    short, whole = pair(positions, DELTA if rule == "delta" else OPTIONS)
    assert short.length_limit is None
    x = torch.randint(0, 20, (2, WHOLE), generator=torch.Generator().manual_seed(1))
    expected = whole(x)
    torch.testing.assert_close(short(x), expected, rtol=0, atol=1e-12)
    # a prompt longer than max_seq_len, chunks of 7 (not a multiple of the window), then single tokens
    logits, cache = short(x[:, :20], return_cache=True)
    outs = [logits]
    for start in range(20, 62, 7):
        logits, cache = short(x[:, start:start + 7], cache=cache, return_cache=True)
        outs.append(logits)
    for t in range(62, WHOLE):
        logits, cache = short(x[:, t:t + 1], cache=cache, return_cache=True)
        outs.append(logits)
    assert cache.position == WHOLE
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("positions", POSITIONS)
def test_generation_past_max_seq_len_equals_a_model_that_covers_it(positions):
    short, whole = pair(positions)
    prompt = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(2))
    steps = WHOLE - 5
    streamed = AutoregressiveWrapper(short).generate(prompt, steps, temperature=0)
    assert torch.equal(streamed, AutoregressiveWrapper(whole).generate(prompt, steps, temperature=0))
    assert torch.equal(streamed, AutoregressiveWrapper(short).generate(prompt, steps, temperature=0, use_cache=False))
    # the logits of the last step, read from the full forward of what was generated
    sequence = torch.cat((prompt, streamed), dim=1)
    torch.testing.assert_close(short(sequence[:, :-1])[:, -1], whole(sequence[:, :-1])[:, -1], rtol=0, atol=1e-12)
    picked = whole(sequence[:, :-1]).argmax(dim=-1)[:, 4:]
    assert torch.equal(picked, streamed)


@pytest.mark.parametrize("table, lifted", [(dict(), "axial"), (dict(use_axial_pos_emb=False), "absolute")])
def test_a_position_table_keeps_max_seq_len_and_names_what_lifts_it(table, lifted):
    model = LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=4, max_seq_len=16, causal=True,
                                         **table).eval()
    assert model.length_limit == 16
    with pytest.raises(ValueError, match=f"max_seq_len=16, the length of the {lifted} position table.*use_pos_emb=False"):
        model(torch.zeros(1, 17, dtype=torch.long))
    _, cache = model(torch.zeros(1, 16, dtype=torch.long), return_cache=True)
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len=16"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_no_positions_is_refused_where_nothing_carries_order():
    with pytest.raises(ValueError, match="use_pos_emb=False: a non-causal model"):
        LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=4, max_seq_len=16, use_pos_emb=False)
    with pytest.raises(ValueError, match="leave use_rotary_emb"):
        LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=4, max_seq_len=16, causal=True,
                                     use_pos_emb=False, use_rotary_emb=True)
    with pytest.raises(TypeError, match="use_pos_emb"):
        LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=4, max_seq_len=16, use_pos_emb=None)
    # a non-causal model whose convolution carries order, and a causal one: no position parameters
    for options in (dict(use_local_conv=True), dict(causal=True)):
        model = LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=4, max_seq_len=16,
                                             use_pos_emb=False, **options)
        assert model.pos_emb is None and not any("pos" in name for name, _ in model.named_parameters())


# stream_loss: chunks that are multiples of the local window (4) and of the kernel's chunk (8), and not
KERNEL_CHUNK = 8


def scoring_pair(positions):
    """pair(positions) with the kernel's chunk set to KERNEL_CHUNK, as wrappers."""
    torch.manual_seed(0)
    models = [LinearAttentionTransformerLM(max_seq_len=length, chunk_size=KERNEL_CHUNK, **OPTIONS,
                                           **POSITIONS[positions]).to(D).eval() for length in (TRAINED_AT, WHOLE)]
    models[1].load_state_dict(models[0].state_dict())
    return [AutoregressiveWrapper(model) for model in models]


def next_token_losses(logits, tokens):
    """-log softmax(logits)[next token], (b, n - 1), by hand."""
    log_probs = logits[:, :-1] - logits[:, :-1].logsumexp(dim=-1, keepdim=True)
    return -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("chunk_len", [1, 4, 7, KERNEL_CHUNK, 12, 16, 33, 200])
def test_stream_loss_equals_the_full_forward_loss(positions, chunk_len):
    short, whole = scoring_pair(positions)
    tokens = torch.randint(0, 20, (3, WHOLE + 1), generator=torch.Generator().manual_seed(3))
    expected = next_token_losses(whole.net(tokens), tokens)  # the full forward of a model that covers it
    # within max_seq_len, and past it: the short model streams WHOLE tokens, five times its max_seq_len
    for wrapper, length in ((short, TRAINED_AT + 1), (whole, WHOLE + 1), (short, WHOLE + 1)):
        text = tokens[:, :length]
        per_token = wrapper.stream_loss(text, chunk_len=chunk_len, reduction="none")
        assert per_token.shape == (3, length - 1) and per_token.dtype == D
        torch.testing.assert_close(per_token, expected[:, :length - 1], rtol=0, atol=1e-12)
        mean = wrapper.stream_loss(text, chunk_len=chunk_len)
        assert mean.ndim == 0
        torch.testing.assert_close(mean, expected[:, :length - 1].mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(whole.stream_loss(tokens, chunk_len=chunk_len), whole(tokens), rtol=0, atol=1e-12)


def test_stream_loss_holds_a_cache_of_one_size_and_chunks_of_chunk_len():
    """The cache after 4x the tokens holds the same bytes; no call reads more than chunk_len
    tokens; no gradient is kept and the training flags are restored."""
    short, _ = scoring_pair("rotary")
    short.train()
    from linear_attention_transformer.cache import tensors_of

    calls = []
    short.net.register_forward_hook(lambda module, args, out: calls.append(
        (args[0].shape[1], sum(t.numel() * t.element_size() for t in tensors_of(out[1])))))
    cache_bytes = []
    for length in (TRAINED_AT * 2, TRAINED_AT * 8):
        calls.clear()
        tokens = torch.randint(0, 20, (2, length + 1), generator=torch.Generator().manual_seed(length))
        loss = short.stream_loss(tokens, chunk_len=5)
        assert not loss.requires_grad
        assert [n for n, _ in calls] == [5] * (length // 5) + [length % 5] * (length % 5 > 0)
        cache_bytes.append(calls[-1][1])
        assert len({b for _, b in calls}) == 1  # the same bytes after every chunk
    assert cache_bytes[0] == cache_bytes[1] > 0
    assert all(module.training for module in short.net.modules())


def test_stream_loss_refuses_what_it_cannot_stream():
    short, _ = scoring_pair("none")
    tokens = torch.zeros(1, 10, dtype=torch.long)
    for chunk_len, error in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="chunk_len"):
            short.stream_loss(tokens, chunk_len=chunk_len)
    with pytest.raises(ValueError, match="reduction"):
        short.stream_loss(tokens, reduction="sum")
    with pytest.raises(TypeError, match="tokens"):
        short.stream_loss(tokens.float())
    with pytest.raises(ValueError, match="tokens"):
        short.stream_loss(tokens[:, :1])
    # no cache: a model that is not causal
    bidirectional = AutoregressiveWrapper(LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=4,
                                                                       max_seq_len=16))
    with pytest.raises(ValueError, match="cache"):
        bidirectional.stream_loss(tokens)
    # a position table: 16 inputs (17 tokens) fit, 17 do not, and the error names what lifts the limit
    table = AutoregressiveWrapper(LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=4,
                                                               max_seq_len=16, causal=True))
    table.stream_loss(torch.zeros(1, 17, dtype=torch.long), chunk_len=5)
    with pytest.raises(ValueError, match="reads 17 of them.*length_limit=16.*use_pos_emb=False"):
        table.stream_loss(torch.zeros(1, 18, dtype=torch.long))
