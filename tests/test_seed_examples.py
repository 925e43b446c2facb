"""The usage examples of the seed READMEs, at CPU size, with the keyword meanings they document."""

import torch
import torch.nn.functional as F

from linear_attention_transformer import (
    LinearAttentionTransformer,
    LinearAttentionTransformerLM,
    LinearSelfAttention,
    LinformerContextSettings,
    LinformerSettings,
)
from linear_attention_transformer.images import ImageLinearAttention


def test_language_model_with_full_keyword_list():
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(
        num_tokens=300, dim=64, heads=8, depth=1, max_seq_len=512, causal=True, ff_dropout=0.1,
        attn_layer_dropout=0.1, attn_dropout=0.1, emb_dim=16, dim_head=16, blindspot_size=16,
        n_local_attn_heads=4, local_attn_window_size=32, reversible=True, ff_chunks=2, ff_glu=True,
        attend_axially=False, shift_tokens=True,
    )
    x = torch.randint(0, 300, (1, 500))
    logits = model(x)
    assert logits.shape == (1, 500, 300)  # logits over the vocabulary, not (1, n, dim)
    assert model.token_emb.weight.shape == (300, 16)  # emb_dim factorisation
    assert model.transformer.layers.blocks[0][0].fn.dim_head == 16
    loss = F.cross_entropy(logits.transpose(1, 2), x)
    loss.backward()
    assert torch.isfinite(loss) and model.token_emb.weight.grad.abs().sum() > 0
    model.eval()
    torch.testing.assert_close(model(x), model(x))  # dropout off in eval: deterministic


def test_transformer():
    model = LinearAttentionTransformer(dim=64, heads=8, depth=1, max_seq_len=512, n_local_attn_heads=4,
                                       local_attn_window_size=32)
    x = torch.randn(1, 300, 64)
    out = model(x)
    assert out.shape == (1, 300, 64) and torch.isfinite(out).all()


def test_encoder_decoder():
    torch.manual_seed(1)
    kw = dict(num_tokens=300, dim=64, heads=8, depth=2, max_seq_len=256, reversible=True, n_local_attn_heads=4,
              local_attn_window_size=32)
    enc = LinearAttentionTransformerLM(return_embeddings=True, **kw)
    dec = LinearAttentionTransformerLM(causal=True, receives_context=True, **kw)
    src, tgt = torch.randint(0, 300, (1, 256)), torch.randint(0, 300, (1, 256))
    src_mask, tgt_mask = torch.ones_like(src).bool(), torch.ones_like(tgt).bool()
    context = enc(src, input_mask=src_mask)
    assert context.shape == (1, 256, 64)
    logits = dec(tgt, context=context, input_mask=tgt_mask, context_mask=src_mask)
    assert logits.shape == (1, 256, 300)
    logits.sum().backward()
    assert enc.token_emb.weight.grad.abs().sum() > 0  # gradients reach the encoder through the context


def test_linformer_and_linformer_context():
    enc = LinearAttentionTransformerLM(num_tokens=300, dim=64, heads=8, depth=2, max_seq_len=256,
                                       linformer_settings=LinformerSettings(k=32))
    assert enc(torch.randint(0, 300, (1, 256))).shape == (1, 256, 300)
    assert enc(torch.randint(0, 300, (1, 100))).shape == (1, 100, 300)  # shorter than max_seq_len
    dec = LinearAttentionTransformerLM(num_tokens=300, dim=64, heads=8, depth=2, max_seq_len=256, causal=True,
                                       context_linformer_settings=LinformerContextSettings(seq_len=128, k=32),
                                       receives_context=True)
    out = dec(torch.randint(0, 300, (1, 256)), context=torch.randn(1, 128, 64))
    assert out.shape == (1, 256, 300)


def test_images():
    attn = ImageLinearAttention(chan=32, heads=8, key_dim=64)
    img = torch.randn(1, 32, 32, 32)
    assert attn(img).shape == (1, 32, 32, 32)


def test_seed_001_linear_self_attention():
    attn = LinearSelfAttention(dim=64, heads=8, causal=True, one_kv_head=True, psi_fn=lambda x: F.relu(x))
    x = torch.randn(1, 200, 64)
    out = attn(x)
    assert out.shape == (1, 200, 64)
    # causal: the first 100 outputs do not depend on the rest
    torch.testing.assert_close(attn(x[:, :100]), out[:, :100], rtol=1e-5, atol=1e-6)


def test_seed_001_linear_image_attention_name():
    from linear_attention_transformer import LinearImageAttention

    attn = LinearImageAttention(chan=8, heads=2, key_dim=16)
    assert isinstance(attn, ImageLinearAttention)
    assert attn(torch.randn(1, 8, 12, 12)).shape == (1, 8, 12, 12)


def test_seed_002_linformer_options_under_our_names():
    torch.manual_seed(2)
    settings = LinformerSettings(k=16, parameter_sharing="layerwise")  # seed 002's dim_k, parameter_sharing
    model = LinearAttentionTransformer(
        dim=16, depth=2, heads=4, max_seq_len=128, linformer_settings=settings, ff_mult=2, ff_activation="relu",
        ff_dropout=0.15, attn_dropout=0.1, checkpoint=True,  # dim_ff = 2 * dim, activation, dropouts, C1
    )
    ff = model.layers.blocks[0][1].fn
    assert ff.proj_in.out_features == 32 and ff.activation is F.relu
    x = torch.randn(1, 128, 16, requires_grad=True)
    y = model(x)
    assert y.shape == (1, 128, 16)
    y.sum().backward()
    assert x.grad.abs().sum() > 0
    reduced = LinformerSettings(k=16, k_reduce_by_layer=8)
    model = LinearAttentionTransformer(dim=16, depth=3, heads=4, max_seq_len=128, linformer_settings=reduced)
    assert [f.fn.k for f, _ in model.layers.blocks] == [16, 8, 1]


def test_seed_003_linformer_names():
    from linear_attention_transformer import Linformer, LinformerLM, LinformerSelfAttention

    lm = LinformerLM(num_tokens=200, dim=32, seq_len=64, depth=2, heads=4, k=16, one_kv_head=True, share_kv=False)
    assert isinstance(lm, LinearAttentionTransformerLM)
    assert lm(torch.randint(0, 200, (1, 64))).shape == (1, 64, 200)
    model = Linformer(dim=32, seq_len=64, depth=2, heads=4, k=16, one_kv_head=True, share_kv=True)
    attn = model.layers.blocks[0][0].fn
    assert isinstance(attn, LinformerSelfAttention) and attn.k == 16 and attn.kv_heads == 1 and attn.proj_v is None
    assert model(torch.randn(1, 64, 32)).shape == (1, 64, 32)
    attn = LinformerSelfAttention(dim=32, seq_len=128, heads=4, k=16, one_kv_head=True, share_kv=True)
    assert attn(torch.randn(1, 32, 32), torch.randn(1, 128, 32)).shape == (1, 32, 32)  # contextual keys


def test_seed_004_local_window_options_under_our_names():
    torch.manual_seed(4)
    model = LinearAttentionTransformer(
        dim=32, depth=1, heads=4, max_seq_len=64, causal=True, n_local_attn_heads=4, local_attn_window_size=16,
        local_attn_look_backward=1, local_attn_look_forward=0, local_attn_exact_windowsize=True,
    )
    x = torch.randn(2, 64, 32, requires_grad=True)
    out = model(x)
    # exact window: output 40 depends on inputs 25..40 only (through the local heads)
    (grad,) = torch.autograd.grad(out[:, 40].sum(), x)
    seen = grad.abs().sum(dim=(0, 2)) > 0
    assert seen[25:41].all() and not seen[:25].any() and not seen[41:].any()
