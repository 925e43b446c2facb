"""Rows padded on the left: positions count per row from the row's first real token, so each
row of a padded batch computes what it computes alone (float64): the forward, a prompt read
into a cache and continued in chunks, one-token steps and generate."""

import pytest
import torch

from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM

D = torch.float64
BASE = dict(num_tokens=20, dim=16, depth=2, heads=4, max_seq_len=64, causal=True)
LOCAL = dict(n_local_attn_heads=2, local_attn_window_size=4)
CONFIGS = {
    "axial": dict(),
    "absolute": dict(use_axial_pos_emb=False),
    "rotary": dict(use_rotary_emb=True),
    "local+conv+shift+gate": dict(**LOCAL, use_local_conv=True, shift_tokens=True, use_gate=True),
    "recommended+rotary": dict(**LOCAL, use_local_conv=True, shift_tokens=True, use_gate=True, feature_map="taylor",
                               dim_qk=4, use_rotary_emb=True),
    "delta+local+conv+shift+gate+rotary": dict(**LOCAL, update_rule="delta", use_local_conv=True, shift_tokens=True,
                                               use_gate=True, use_rotary_emb=True),
    "reversible+exact window": dict(reversible=True, n_local_attn_heads=2, local_attn_window_size=3,
                                    local_attn_exact_windowsize=True),
}
PADS = (0, 3, 6)  # each row's padding; 6 > the window (4) and not a multiple of it


def make(cfg):
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(**BASE, **cfg).to(D).eval()
    with torch.no_grad():  # gates and convolutions start near identity: move them
        for name, p in model.named_parameters():
            if "gate" in name or "conv" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def padded(n):
    x = torch.randint(1, 20, (len(PADS), n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(len(PADS), n, dtype=torch.bool)
    for row, pad in enumerate(PADS):
        mask[row, :pad] = False
        x[row, :pad] = 0  # (what padding holds must not matter)
    return x, mask


def assert_rows_alone(model, together, x, last=None):
    for row, pad in enumerate(PADS):
        alone = model(x[row : row + 1, pad:last])[0]
        torch.testing.assert_close(together[row, pad:], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_and_cache_of_a_left_padded_batch_equal_each_row_alone(name):
    model = make(CONFIGS[name])
    x, mask = padded(21)
    assert_rows_alone(model, model(x, input_mask=mask), x)
    # a prompt of 9 columns read into a cache, continued by a chunk of 5, then one token at a time
    with torch.no_grad():
        first, cache = model(x[:, :9], input_mask=mask[:, :9], return_cache=True)
        outs = [first, model(x[:, 9:14], cache=cache, return_cache=True)[0]]
        assert cache.row_starts.tolist() == list(PADS)
        for t in range(14, 21):
            logits, cache = model(x[:, t : t + 1], cache=cache, return_cache=True)
            outs.append(logits)
    assert_rows_alone(model, torch.cat(outs, dim=1), x)


@pytest.mark.parametrize("name", ["axial", "recommended+rotary"])
def test_a_row_whose_padding_outlasts_the_first_call_starts_at_its_first_real_token(name):
    model = make(CONFIGS[name])
    x, mask = padded(12)
    outs, cache = [], None
    for t in range(12):  # one column a call: row 2 has no real token for the first 6
        logits, cache = model(x[:, t : t + 1], input_mask=mask[:, t : t + 1], cache=cache, return_cache=True)
        outs.append(logits)
    assert cache.row_starts.tolist() == list(PADS)
    assert_rows_alone(model, torch.cat(outs, dim=1), x)


@pytest.mark.parametrize("name", ["axial", "absolute", "local+conv+shift+gate", "recommended+rotary"])
def test_generate_of_a_left_padded_batch_equals_each_row_alone(name):
    model = make(CONFIGS[name])
    wrapper = AutoregressiveWrapper(model)
    x, mask = padded(8)
    together = wrapper.generate(x, 10, temperature=0, input_mask=mask)
    for row, pad in enumerate(PADS):
        assert torch.equal(together[row], wrapper.generate(x[row : row + 1, pad:], 10, temperature=0)[0])
    assert torch.equal(together, wrapper.generate(x, 10, temperature=0, input_mask=mask, use_cache=False))


def test_blindspot_blocks_with_left_padding():
    model = make(dict(blindspot_size=4, **LOCAL))
    x, mask = padded(13)
    assert_rows_alone(model, model(x, input_mask=mask), x)  # the full forward aligns each row's blocks
    with pytest.raises(ValueError, match="blindspot_size=4 with rows padded on the left"):
        model(x, input_mask=mask, return_cache=True)
    right = torch.ones_like(mask)
    right[1, 10:] = False  # padding on the right keeps the cache
    model(x, input_mask=right, return_cache=True)


def test_a_decoder_with_a_context_generates_each_left_padded_row_as_alone():
    model = make(dict(receives_context=True, **LOCAL))
    wrapper = AutoregressiveWrapper(model)
    x, mask = padded(8)
    context = torch.randn(len(PADS), 7, 16, dtype=D, generator=torch.Generator().manual_seed(2))
    context_mask = torch.rand(len(PADS), 7, generator=torch.Generator().manual_seed(3)) > 0.3
    together = wrapper.generate(x, 10, temperature=0, input_mask=mask, context=context, context_mask=context_mask)
    for row, pad in enumerate(PADS):
        alone = wrapper.generate(x[row : row + 1, pad:], 10, temperature=0, context=context[row : row + 1],
                                 context_mask=context_mask[row : row + 1])
        assert torch.equal(together[row], alone[0])
