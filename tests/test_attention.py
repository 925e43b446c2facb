"""The attention layer equals an explicit computation: local heads as a windowed softmax with
an (n x n) mask, global heads as an explicit linear-attention weight matrix."""

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from linear_attention_transformer import Attention, LinearSelfAttention

D = torch.float64


def naive_attention(layer: Attention, x, mask=None, context=None, context_mask=None):
    """Everything written out: projections, (n x n) weights per head kind, output projection."""
    source = x if context is None else context
    key_mask = mask if context is None else context_mask
    h, dh = layer.heads, layer.dim_head
    q = rearrange(x @ layer.to_q.weight.T, "b n (h d) -> b h n d", h=h)
    k, v = rearrange(source @ layer.to_kv.weight.T, "b n (two h d) -> two b h n d", two=2, h=layer.kv_heads)
    k, v = (repeat(t, "b g n d -> b (g r) n d", r=h // layer.kv_heads) for t in (k, v))
    n, m = q.shape[2], k.shape[2]
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    keep = torch.ones(x.shape[0], 1, n, m, dtype=torch.bool)
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, :]
    outs = []
    if layer.n_local:
        w = layer.window
        if layer.causal:
            visible = (j <= i) & (j // w >= i // w - 1)
        else:
            visible = (j // w >= i // w - 1) & (j // w <= i // w + 1)
        sim = torch.einsum("bhid,bhjd->bhij", q[:, : layer.n_local], k[:, : layer.n_local]) * dh**-0.5
        sim = sim.masked_fill(~(visible & keep), float("-inf"))
        outs.append(sim.softmax(-1) @ v[:, : layer.n_local])
    if layer.n_local < h:
        qg, kg, vg = (t[:, layer.n_local :] for t in (q, k, v))
        qf = qg.softmax(-1)
        if layer.causal:
            B = layer.blindspot_size
            visible = (j <= i) if B == 1 else (j // B < i // B)
            wts = torch.einsum("bhid,bhjd->bhij", qf, kg.exp()) * (visible & keep)
            den = wts.sum(-1, keepdim=True)
            outs.append(torch.where(den > 0, wts @ vg / den.clamp(min=1e-300), 0))
        else:
            if key_mask is not None:
                kg = kg.masked_fill(~key_mask[:, None, :, None], float("-inf"))
            kf = kg.softmax(dim=-2)
            outs.append(qf @ (kf.transpose(-1, -2) @ vg))
    out = rearrange(torch.cat(outs, dim=1), "b h n d -> b n (h d)")
    return layer.to_out(out)


CONFIGS = [
    dict(causal=True, n_local_attn_heads=2, local_attn_window_size=8),
    dict(causal=True, n_local_attn_heads=2, local_attn_window_size=8, blindspot_size=8),
    dict(causal=True, n_local_attn_heads=0, blindspot_size=5, kv_heads=2),
    dict(causal=False, n_local_attn_heads=2, local_attn_window_size=8),
    dict(causal=False, n_local_attn_heads=0, one_kv_head=True),
    dict(causal=True, n_local_attn_heads=4, local_attn_window_size=6),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("n", [16, 21])
@pytest.mark.parametrize("masked", [False, True])
def test_layer_equals_explicit_computation(cfg, n, masked):
    torch.manual_seed(0)
    layer = Attention(dim=16, heads=4, dim_head=6, chunk_size=4, **cfg).to(D)
    x = torch.randn(2, n, 16, dtype=D) * 2
    mask = None
    if masked:
        mask = torch.rand(2, n) > 0.3
        mask[:, 0] = True  # keep every local window query with at least one key in causal mode
    out = layer(x, input_mask=mask)
    ref = naive_attention(layer, x, mask)
    if mask is not None:  # outputs at padding positions are not defined
        out, ref = out[mask], ref[mask]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)


def test_cross_attention_equals_explicit_computation():
    torch.manual_seed(1)
    layer = Attention(dim=16, heads=4, receives_context=True).to(D)
    x, ctx = torch.randn(2, 9, 16, dtype=D), torch.randn(2, 13, 16, dtype=D)
    cmask = torch.rand(2, 13) > 0.4
    torch.testing.assert_close(
        layer(x, context=ctx, context_mask=cmask), naive_attention(layer, x, context=ctx, context_mask=cmask)
    )


def test_linear_self_attention_seed_api_and_psi_fn():
    torch.manual_seed(2)
    attn = LinearSelfAttention(dim=32, heads=4, causal=True, one_kv_head=True, psi_fn=lambda t: F.relu(t))
    assert attn.kv_heads == 1 and attn.to_kv.out_features == 2 * 8
    x = torch.randn(1, 50, 32)
    out = attn(x)
    assert out.shape == (1, 50, 32)
    # relu features: changing a later position must not change an earlier output
    x2 = x.clone()
    x2[:, 30:] += 1
    torch.testing.assert_close(attn(x2)[:, :30], out[:, :30])
    with pytest.raises(ValueError, match="psi_fn"):
        LinearSelfAttention(dim=32, feature_map="elu", psi_fn=F.relu)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=30, heads=4), "divisible"),
        (dict(dim=32, heads=4, n_local_attn_heads=5), "n_local_attn_heads"),
        (dict(dim=32, heads=4, kv_heads=3), "kv_heads"),
        (dict(dim=32, heads=4, feature_map="tanh"), "feature_map"),
        (dict(dim=32, heads=4, blindspot_size=0), "blindspot_size"),
    ],
)
def test_bad_layer_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(**kwargs)
