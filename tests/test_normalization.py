"""RMSNorm against its definition, in every dtype; the Llama-style options of the models, refused by name
where they cannot act."""

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformer, LinearAttentionTransformerLM
from linear_attention_transformer.feedforward import FeedForward
from linear_attention_transformer.normalization import RMSNorm

D = torch.float64


def test_rmsnorm_equals_its_definition():
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-3).to(D)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, 6, dtype=D)
    expected = norm.weight * x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-3)
    torch.testing.assert_close(norm(x), expected, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_is_finite_where_half_precision_squares_overflow(dtype):
    norm = RMSNorm(8)
    x = torch.full((1, 3, 8), 3e4).to(dtype)  # 3e4 squared is past float16's largest value
    x[0, 1] = -x[0, 1]
    out = norm.to(dtype)(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), torch.sign(x.float()), rtol=1e-2, atol=1e-2)


def test_rmsnorm_under_autocast_is_finite_and_accurate():
    torch.manual_seed(0)
    norm = RMSNorm(8)
    x = torch.randn(2, 4, 8) * 1e3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x.bfloat16())
    torch.testing.assert_close(out.float(), norm(x), rtol=1e-2, atol=1e-2)


def test_swiglu_feedforward_equals_llamas_form():
    """down(silu(gate(x)) * up(x)), with ``proj_in`` the up rows, then the gate's; any hidden width."""
    torch.manual_seed(0)
    ff = FeedForward(6, glu=True, activation="silu", hidden_dim=10, bias=False).to(D)
    up, gate = ff.proj_in.weight[:10], ff.proj_in.weight[10:]
    x = torch.randn(2, 3, 6, dtype=D)
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ ff.proj_out.weight.T
    torch.testing.assert_close(ff(x), expected, rtol=1e-13, atol=1e-13)
    assert ff.proj_in.bias is None and ff.proj_out.bias is None


def test_bias_false_leaves_no_bias_in_a_llama_style_model():
    model = LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=2, max_seq_len=32, heads=4, causal=True,
                                         emb_dim=8, n_local_attn_heads=4, local_attn_window_size=32, kv_heads=2,
                                         use_rotary_emb=True, norm="rmsnorm", bias=False, ff_glu=True,
                                         ff_activation="silu", ff_hidden_dim=24)
    names = [name for name, _ in model.named_parameters()]
    assert not [name for name in names if name.endswith("bias")]
    assert isinstance(model.norm, RMSNorm)
    assert all(isinstance(block.norm, RMSNorm) for pair in model.transformer.layers.blocks for block in pair)


def test_rotary_base_sets_the_angles():
    model = LinearAttentionTransformer(dim=16, depth=1, max_seq_len=8, heads=2, use_rotary_emb=True, rotary_base=500)
    d = 8
    expected = 1.0 / 500 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    torch.testing.assert_close(model.rotary.inv_freq[: d // 2], expected)


@pytest.mark.parametrize("options, error, match", [
    (dict(norm="batchnorm"), ValueError, "norm must be one of"),
    (dict(norm_eps=0.0), ValueError, "norm_eps"),
    (dict(norm_eps="small"), ValueError, "norm_eps"),
    (dict(bias=0), TypeError, "bias"),
    (dict(rotary_base=1e4), ValueError, "rotary_base .*use_rotary_emb=True"),
    (dict(rotary_base=1, use_rotary_emb=True), ValueError, "rotary_base must be a number above 1"),
    (dict(ff_hidden_dim=0), ValueError, "ff_hidden_dim"),
    (dict(ff_hidden_dim=24, ff_mult=2), ValueError, "ff_mult=2 and ff_hidden_dim=24"),
    (dict(ff_activation="swish"), ValueError, "ff_activation"),
])
def test_llama_style_options_refused_by_name(options, error, match):
    with pytest.raises(error, match=match):
        LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, max_seq_len=32, heads=4, **options)
