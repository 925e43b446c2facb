"""Whole-model properties: causality, padding invariance, prefix consistency, gradients,
mixed precision, bad input."""

import pytest
import torch

from linear_attention_transformer import (
    LinearAttentionTransformer,
    LinearAttentionTransformerLM,
    LinformerSettings,
)

D = torch.float64

CAUSAL_CONFIGS = {
    "exact": dict(),
    "local+blindspot": dict(n_local_attn_heads=2, local_attn_window_size=8, blindspot_size=8),
    "shift+reversible": dict(shift_tokens=True, reversible=True, n_local_attn_heads=1, local_attn_window_size=8),
    "axial+rotary+glu": dict(attend_axially=True, local_attn_window_size=8, use_rotary_emb=True, ff_glu=True),
    "per-layer local heads, kv_heads": dict(n_local_attn_heads=(4, 0), local_attn_window_size=8, kv_heads=2),
    "elu features, ff_chunks, pkm": dict(feature_map="elu", ff_chunks=3, pkm_layers=(1,), pkm_num_keys=8),
    "gate+conv, local, blindspot, shift, reversible": dict(
        use_gate=True, use_local_conv=True, n_local_attn_heads=2, local_attn_window_size=8, blindspot_size=8,
        shift_tokens=True, reversible=True,
    ),
    "gate+conv, axial, kv_heads, relu": dict(
        use_gate=True, use_local_conv=True, local_conv_kernel=4, attend_axially=True, local_attn_window_size=8,
        kv_heads=2, feature_map="relu",
    ),
}


def transformer(**kw):
    chunking = dict(chunk_size=4) if kw.get("causal") else {}  # a non-causal model refuses chunk_size
    kw = dict(dim=16, depth=2, heads=4, max_seq_len=64, **chunking, **kw)
    return LinearAttentionTransformer(**kw).to(D).eval()


@pytest.mark.parametrize("name", list(CAUSAL_CONFIGS))
def test_causality_gradient_is_exactly_zero(name):
    torch.manual_seed(0)
    model = transformer(causal=True, **CAUSAL_CONFIGS[name])
    n = 30
    x = torch.randn(2, n, 16, dtype=D, requires_grad=True)
    out = model(x)
    for i in (0, 7, 8, 17, 29):
        (grad,) = torch.autograd.grad(out[:, i].sum(), x, retain_graph=True)
        assert torch.all(grad[:, i + 1 :] == 0), f"output {i} depends on later inputs"
        assert grad[:, : i + 1].abs().sum() > 0


@pytest.mark.parametrize("name", list(CAUSAL_CONFIGS))
def test_causal_prefix_consistency(name):
    """A prefix of length 100 (no window, block or chunk divides it) gives the same outputs."""
    torch.manual_seed(1)
    cfg = dict(CAUSAL_CONFIGS[name])
    if "local_attn_window_size" in cfg:  # windows of 16: none divides 100
        cfg.update(local_attn_window_size=cfg["local_attn_window_size"] * 2)
    model = LinearAttentionTransformer(dim=16, depth=2, heads=4, max_seq_len=160, causal=True, **cfg).to(D).eval()
    x = torch.randn(1, 150, 16, dtype=D)
    torch.testing.assert_close(model(x[:, :100]), model(x)[:, :100], rtol=1e-10, atol=1e-12)


NONCAUSAL_CONFIGS = {
    "global": dict(),
    "local": dict(n_local_attn_heads=2, local_attn_window_size=8),
    "shift+axial": dict(shift_tokens=True, attend_axially=True, local_attn_window_size=8),
    "reversible+relu": dict(reversible=True, feature_map="relu", n_local_attn_heads=1, local_attn_window_size=4),
    "linformer": dict(linformer_settings=LinformerSettings(k=8)),
    "gate+conv+local+shift": dict(use_gate=True, use_local_conv=True, n_local_attn_heads=2, local_attn_window_size=8,
                                  shift_tokens=True),
}


PADDING_CASES = [(name, False) for name in NONCAUSAL_CONFIGS] + [
    (name, True) for name in NONCAUSAL_CONFIGS if name != "linformer"  # Linformer is non-causal only
]


@pytest.mark.parametrize("name, causal", PADDING_CASES)
def test_padding_never_changes_real_positions(name, causal):
    torch.manual_seed(2)
    model = transformer(causal=causal, **NONCAUSAL_CONFIGS[name])
    n = 27
    x = torch.randn(2, n, 16, dtype=D)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, 20:] = False  # right padding
    mask[1, :5] = False  # left padding
    mask[1, 12] = False  # a hole
    garbage = x.masked_fill(mask[..., None], 0) * 0 + torch.randn(2, n, 16, dtype=D) * 1e3
    x2 = torch.where(mask[..., None], x, garbage)
    out1, out2 = model(x, input_mask=mask), model(x2, input_mask=mask)
    torch.testing.assert_close(out1[mask], out2[mask], rtol=1e-9, atol=1e-9)


def test_decoder_context_padding_and_dependence():
    torch.manual_seed(3)
    dec = transformer(causal=True, receives_context=True, n_local_attn_heads=2, local_attn_window_size=8)
    x, ctx = torch.randn(1, 20, 16, dtype=D), torch.randn(1, 11, 16, dtype=D)
    cmask = torch.ones(1, 11, dtype=torch.bool)
    cmask[:, 7:] = False
    ctx2 = ctx.clone()
    ctx2[:, 7:] = 1e3
    out = dec(x, context=ctx, context_mask=cmask)
    torch.testing.assert_close(out, dec(x, context=ctx2, context_mask=cmask))
    ctx3 = ctx.clone()
    ctx3[:, 3] += 1
    assert (dec(x, context=ctx3, context_mask=cmask) - out).abs().max() > 1e-6


def test_gradcheck_tiny_reversible_model():
    torch.manual_seed(4)
    model = LinearAttentionTransformer(
        dim=8, depth=2, heads=2, max_seq_len=16, causal=True, reversible=True, n_local_attn_heads=1,
        local_attn_window_size=4, shift_tokens=True, chunk_size=4,
    ).to(D)
    x = torch.randn(1, 7, 8, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: model(t), (x,), eps=1e-6, atol=1e-6)


def test_gradcheck_tiny_model_with_gate_and_conv():
    torch.manual_seed(8)
    model = LinearAttentionTransformer(
        dim=8, depth=1, heads=2, max_seq_len=16, causal=True, use_gate=True, use_local_conv=True,
        n_local_attn_heads=1, local_attn_window_size=4, chunk_size=4, reversible=True,
    ).to(D)
    x = torch.randn(1, 9, 8, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: model(t), (x,), eps=1e-6, atol=1e-6)


def test_reversible_matches_sequential_gradients():
    torch.manual_seed(5)
    kw = dict(dim=16, depth=2, heads=4, max_seq_len=32, causal=True, n_local_attn_heads=2, local_attn_window_size=4)
    seq = LinearAttentionTransformer(**kw).to(D)
    rev = LinearAttentionTransformer(reversible=True, **kw).to(D)
    rev.load_state_dict(seq.state_dict())
    x = torch.randn(2, 13, 16, dtype=D)
    # the reversible pair computes y1 = x + f(x), y2 = x + g(y1), out = (y1 + y2) / 2:
    # a different function, so compare it with its own explicit computation instead
    out = rev(x)
    h1 = h2 = x
    for f, g in zip(*[iter([m for pair in seq.layers.blocks for m in pair])] * 2):
        h1 = h1 + f(h2)
        h2 = h2 + g(h1)
    torch.testing.assert_close(out, (h1 + h2) / 2)
    out.sum().backward()
    ((h1 + h2) / 2).sum().backward()
    for (name, p1), (_, p2) in zip(rev.named_parameters(), seq.named_parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_autocast_finite_with_large_activations(dtype, causal):
    torch.manual_seed(6)
    model = LinearAttentionTransformerLM(
        num_tokens=32, dim=32, depth=1, heads=4, max_seq_len=128, causal=causal, n_local_attn_heads=2,
        local_attn_window_size=16, use_rotary_emb=True, use_gate=causal, use_local_conv=True,
    )
    with torch.no_grad():  # large query/key weights -> logits with std ~17, |logit| up to ~60
        for m in model.modules():
            if hasattr(m, "to_q"):
                m.to_q.weight.mul_(30)
                m.to_kv.weight.mul_(30)
    x = torch.randint(0, 32, (2, 100))
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x)
    assert torch.isfinite(logits).all()
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_inputs_are_not_modified_in_place():
    torch.manual_seed(7)
    model = transformer(causal=False, shift_tokens=True, n_local_attn_heads=2, local_attn_window_size=8)
    x = torch.randn(2, 19, 16, dtype=D)
    mask = torch.rand(2, 19) > 0.2
    x0, m0 = x.clone(), mask.clone()
    model(x, input_mask=mask)
    assert torch.equal(x, x0) and torch.equal(mask, m0)


# ------------------------------------------------------------------------ bad input


def lm(**kw):
    return LinearAttentionTransformerLM(**{**dict(num_tokens=16, dim=16, depth=1, heads=4, max_seq_len=32), **kw})


def test_sequence_longer_than_max_seq_len():
    with pytest.raises(ValueError, match="max_seq_len"):
        lm()(torch.randint(0, 16, (1, 33)))
    # no position table in the transformer on vectors: max_seq_len is its training length
    assert transformer()(torch.randn(1, 65, 16, dtype=D)).shape == (1, 65, 16)


def test_float_tokens_rejected():
    with pytest.raises(TypeError, match="integer"):
        lm()(torch.rand(1, 8))


def test_mask_shape_and_dtype():
    with pytest.raises(ValueError, match="input_mask"):
        lm()(torch.randint(0, 16, (1, 8)), input_mask=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="input_mask"):
        lm()(torch.randint(0, 16, (1, 8)), input_mask=torch.ones(1, 8))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="divisible"):
        lm(dim=18)
    with pytest.raises(ValueError, match="n_local_attn_heads"):
        lm(n_local_attn_heads=5)
    with pytest.raises(ValueError, match="n_local_attn_heads"):
        lm(depth=2, n_local_attn_heads=(1, 1, 1))
    with pytest.raises(ValueError, match="causal"):
        lm(causal=True, linformer_settings=LinformerSettings(k=8))


def test_context_errors():
    dec = lm(causal=True, receives_context=True)
    x = torch.randint(0, 16, (1, 8))
    with pytest.raises(ValueError, match="context"):
        dec(x)
    with pytest.raises(ValueError, match="context"):
        dec(x, context=torch.randn(1, 5, 12))


# ------------------------------------------------------- factorised output, tied embedding


def factorised(tie=False, **kw):
    # rotary positions: no position table, so the hand count below is the whole model
    kw = {**dict(num_tokens=50, dim=16, emb_dim=6, depth=1, heads=4, max_seq_len=32, use_rotary_emb=True), **kw}
    return LinearAttentionTransformerLM(tie_embedding=tie, **kw)


@pytest.mark.parametrize("tie", [False, True])
def test_factorised_output_shapes_and_parameter_count(tie):
    torch.manual_seed(5)
    model = factorised(tie)
    V, D_, E = 50, 16, 6
    x = torch.randint(0, V, (3, 11))
    assert model(x).shape == (3, 11, V)
    assert model.token_emb.weight.shape == (V, E) and model.to_logits.weight.shape == (V, E)
    assert model.project_in.weight.shape == (D_, E) and model.project_out.weight.shape == (E, D_)
    # no (num_tokens x dim) matrix anywhere
    assert all(set(p.shape) != {V, D_} for p in model.parameters())
    body = sum(p.numel() for p in model.transformer.parameters())
    by_hand = (V * E                     # token embedding
               + E * D_ + D_             # project_in
               + body
               + 2 * D_                  # final LayerNorm
               + D_ * E + E              # project_out
               + (0 if tie else V * E)   # to_logits weight (shared when tied)
               + V)                      # to_logits bias
    assert sum(p.numel() for p in model.parameters()) == by_hand
    # the logits are the composition the docstring names
    h = model.transformer(model.project_in(model.token_emb(x)), positions=torch.arange(11))
    expected = model.to_logits(model.project_out(model.norm(h)))
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_return_embeddings_gives_dim_and_has_no_output_layers():
    model = factorised(return_embeddings=True)
    assert model(torch.randint(0, 50, (2, 7))).shape == (2, 7, 16)
    assert model.to_logits is None and model.project_out is None


def test_tied_embedding_is_one_tensor_trained_by_both_uses_and_survives_state_dict():
    torch.manual_seed(6)
    model = factorised(tie=True)
    assert model.to_logits.weight is model.token_emb.weight
    assert len([p for p in model.parameters() if p.shape == (50, 6)]) == 1
    # token 49 never appears in the input: its row's gradient comes only from the output use
    x = torch.randint(0, 40, (2, 9))
    model(x)[..., 49].sum().backward()
    assert model.token_emb.weight.grad[49].abs().sum() > 0

    fresh = factorised(tie=True)
    fresh.load_state_dict(model.state_dict())
    assert fresh.to_logits.weight is fresh.token_emb.weight
    assert torch.equal(fresh.token_emb.weight, model.token_emb.weight)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    # changing the embedding changes the output projection: they are one tensor
    with torch.no_grad():
        fresh.token_emb.weight[3] += 1.0
    assert torch.equal(fresh.to_logits.weight[3], fresh.token_emb.weight[3])


def test_tie_embedding_bad_arguments():
    with pytest.raises(TypeError, match="tie_embedding"):
        factorised(tie="yes")
    with pytest.raises(ValueError, match="tie_embedding"):
        factorised(tie=True, return_embeddings=True)
    with pytest.raises(ValueError, match="emb_dim"):
        factorised(emb_dim=0)
