"""Gradient checkpointing: the same gradients as without it, with dropout replayed, and every
block really run again in backward."""

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformer, LinearAttentionTransformerLM, LinformerSettings

D = torch.float64
DROPOUT = dict(attn_layer_dropout=0.3, ff_dropout=0.3, attn_dropout=0.2)
CONFIGS = {
    "causal, gates, local heads, shift": dict(
        causal=True, use_gate=True, use_local_conv=True, n_local_attn_heads=2, local_attn_window_size=4,
        shift_tokens=True, chunk_size=4,
    ),
    "Linformer": dict(linformer_settings=LinformerSettings(k=5)),
    "decoder, axial": dict(causal=True, receives_context=True, attend_axially=True, local_attn_window_size=4),
}


def gradients(model, x, context):
    torch.manual_seed(7)  # the same dropout masks for both models
    out = model(x, context=context)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=D)).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, x.grad.clone()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpointed_gradients_equal_plain_ones(name):
    kw = dict(dim=16, depth=2, heads=4, max_seq_len=20, **DROPOUT, **CONFIGS[name])
    torch.manual_seed(0)
    plain = LinearAttentionTransformer(**kw).to(D).train()
    checkpointed = LinearAttentionTransformer(checkpoint=True, **kw).to(D).train()
    checkpointed.load_state_dict(plain.state_dict())
    torch.manual_seed(1)
    x = torch.randn(2, 13, 16, dtype=D)
    context = torch.randn(2, 6, 16, dtype=D) if plain.receives_context else None

    calls = []
    first = checkpointed.layers.blocks[0][0]
    first.register_forward_hook(lambda *args: calls.append(1))
    out_a, grads_a, dx_a = gradients(plain, x.clone().requires_grad_(), context)
    out_b, grads_b, dx_b = gradients(checkpointed, x.clone().requires_grad_(), context)
    assert len(calls) == 2  # the forward, then its recomputation in backward
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    torch.testing.assert_close(dx_b, dx_a, rtol=1e-12, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for key in grads_a:
        torch.testing.assert_close(grads_b[key], grads_a[key], rtol=1e-12, atol=1e-12, msg=key)
    # dropout was on: a second call without reseeding gives other masks
    assert not torch.equal(plain(x, context=context), plain(x, context=context))


def test_checkpoint_is_not_used_without_gradients():
    model = LinearAttentionTransformer(dim=16, depth=1, heads=4, max_seq_len=8, checkpoint=True).eval()
    calls = []
    model.layers.blocks[0][0].register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        model(torch.randn(1, 8, 16))
    assert len(calls) == 1


def test_lm_checkpoint_and_reversible_refused():
    lm = LinearAttentionTransformerLM(num_tokens=10, dim=16, depth=1, heads=4, max_seq_len=8, checkpoint=True)
    assert lm.transformer.layers.checkpoint
    with pytest.raises(ValueError, match="reversible"):
        LinearAttentionTransformerLM(num_tokens=10, dim=16, depth=1, heads=4, max_seq_len=8, checkpoint=True,
                                     reversible=True)
    with pytest.raises(TypeError, match="checkpoint"):
        LinearAttentionTransformer(dim=16, depth=1, heads=4, max_seq_len=8, checkpoint="C1")
