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
        w = layer.local_window.size
        if layer.causal:
            visible = (j <= i) & (j // w >= i // w - 1)
        else:
            visible = (j // w >= i // w - 1) & (j // w <= i // w + 1)
        sim = torch.einsum("bhid,bhjd->bhij", q[:, : layer.n_local], k[:, : layer.n_local]) * dh**-0.5
        sim = sim.masked_fill(~(visible & keep), float("-inf"))
        outs.append(sim.softmax(-1) @ v[:, : layer.n_local])
    if layer.n_local < h:
        qg, kg, vg = (t[:, layer.n_local :] for t in (q, k, v))
        if layer.local_conv is not None:
            qg = explicit_conv(qg, layer.local_conv[0], mask)
            kg = explicit_conv(kg, layer.local_conv[1], key_mask)
            vg = explicit_conv(vg, layer.local_conv[2], key_mask)
        gate = None
        if layer.forget_gate is not None:
            fg = layer.forget_gate
            pre = source @ fg.gate_down.weight.T @ fg.gate_up.weight.T + fg.gate_up.bias
            gate = rearrange(F.logsigmoid(pre) / fg.temperature, "b n (h d) -> b h n d", h=h - layer.n_local)
            gate = gate.expand(-1, -1, -1, qg.shape[-1])  # per head: the same decay for every feature
        qf = qg.softmax(-1)
        if layer.causal:
            B = layer.blindspot_size
            visible = (j <= i) if B == 1 else (j // B < i // B)
            if gate is None:
                wts = torch.einsum("bhid,bhjd->bhij", qf, kg.exp())
            else:  # w_ij = sum_d q_id exp(k_jd) prod_{t=j+1..i} a_td, with padding not decaying
                if key_mask is not None:
                    gate = gate.masked_fill(~key_mask[:, None, :, None], 0.0)
                G = gate.cumsum(dim=2)
                decay = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~visible[..., None], float("-inf"))
                wts = torch.einsum("bhid,bhjd,bhijd->bhij", qf, kg.exp(), decay.exp())
            wts = wts * (visible & keep)
            den = wts.sum(-1, keepdim=True)
            outs.append(torch.where(den > 0, wts @ vg / den.clamp(min=1e-300), 0))
        elif gate is not None:
            if key_mask is not None:
                kg = kg.masked_fill(~key_mask[:, None, :, None], float("-inf"))
            kf = kg.softmax(dim=-2) * gate.exp()
            wts = torch.einsum("bhid,bhjd->bhij", qf, kf)
            outs.append(wts @ vg / wts.sum(-1, keepdim=True))
        else:
            if key_mask is not None:
                kg = kg.masked_fill(~key_mask[:, None, :, None], float("-inf"))
            kf = kg.softmax(dim=-2)
            outs.append(qf @ (kf.transpose(-1, -2) @ vg))
    out = rearrange(torch.cat(outs, dim=1), "b h n d -> b n (h d)")
    if layer.output_gate is not None:
        out = out * torch.sigmoid(layer.output_gate.gate_out(x))
    return layer.to_out(out)


def explicit_conv(t, conv, mask):
    """out[t] = sum_i w_i x[t - left + i], zero outside the sequence and at padding."""
    if mask is not None:
        t = t * mask[:, None, :, None]
    b, h, n, d = t.shape
    w = rearrange(conv.conv_weight[:, 0], "(h d) k -> h d k", h=h)
    out = torch.zeros_like(t)
    for pos in range(n):
        for tap in range(conv.kernel_size):
            src = pos - conv.left_context + tap
            if 0 <= src < n:
                out[:, :, pos] += w[None, :, :, tap] * t[:, :, src]
    return out


CONFIGS = [
    dict(causal=True, n_local_attn_heads=2, local_attn_window_size=8),
    dict(causal=True, n_local_attn_heads=2, local_attn_window_size=8, blindspot_size=8),
    dict(causal=True, n_local_attn_heads=0, blindspot_size=5, kv_heads=2),
    dict(causal=False, n_local_attn_heads=2, local_attn_window_size=8),
    dict(causal=False, n_local_attn_heads=0, one_kv_head=True),
    dict(causal=True, n_local_attn_heads=4, local_attn_window_size=6),
    dict(causal=True, n_local_attn_heads=1, local_attn_window_size=8, use_gate=True, use_local_conv=True),
    dict(causal=True, blindspot_size=4, use_gate=True, use_local_conv=True, local_conv_kernel=4, kv_heads=2),
    dict(causal=False, n_local_attn_heads=1, local_attn_window_size=8, use_gate=True, use_local_conv=True),
    dict(causal=False, use_gate=True, use_local_conv=True, local_conv_kernel=5),
    dict(causal=True, n_local_attn_heads=1, local_attn_window_size=8, use_gate=True, gate_granularity="feature", kv_heads=2),
    dict(causal=True, blindspot_size=4, use_gate=True, gate_granularity="feature", use_local_conv=True),
    dict(causal=False, use_gate=True, gate_granularity="feature"),
]


def randomize_improvements(layer):
    """The gate and conv start near identity; move them away so the test sees them work."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "gate" in name or "conv" in name:
                p.add_(torch.randn_like(p) * 0.5)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("n", [16, 21])
@pytest.mark.parametrize("masked", [False, True])
def test_layer_equals_explicit_computation(cfg, n, masked):
    torch.manual_seed(0)
    chunking = dict(chunk_size=4) if cfg.get("causal") else {}  # a non-causal layer refuses chunk_size
    layer = Attention(dim=16, heads=4, dim_head=6, **chunking, **cfg).to(D)
    randomize_improvements(layer)
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
        (dict(dim=32, heads=4, use_local_conv=True, local_conv_kernel=0), "local_conv_kernel"),
        (dict(dim=32, heads=4, use_local_conv=True, local_conv_kernel=4, causal=False), "local_conv_kernel"),
        (dict(dim=32, heads=4, n_local_attn_heads=4, use_local_conv=True, local_conv_kernel=2), "local_conv_kernel"),
        (dict(dim=32, heads=4, use_gate=True, gate_rank=0), "gate_rank"),
        (dict(dim=32, heads=4, use_gate=True, gate_temperature=-1.0), "gate_temperature"),
        (dict(dim=32, heads=4, use_gate="yes"), "use_gate"),
        (dict(dim=32, heads=4, receives_context=True, use_local_conv=True), "use_local_conv"),
        (dict(dim=32, heads=4, gate_rank=8), "use_gate"),
        (dict(dim=32, heads=4, gate_granularity="head"), "use_gate"),
        (dict(dim=32, heads=4, use_gate=True, gate_granularity="channel"), "gate_granularity.*'channel'"),
        (dict(dim=32, heads=4, local_conv_kernel=5), "use_local_conv"),
    ],
)
def test_bad_layer_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(**kwargs)


@pytest.mark.parametrize("bias", [-50.0, 50.0])
@pytest.mark.parametrize("causal", [True, False])
def test_extreme_gate_preactivations(bias, causal):
    """Gate pre-activations of +-50: exact in float64, finite in float32 and half autocast."""
    torch.manual_seed(9)
    chunking = dict(chunk_size=4) if causal else {}  # a non-causal layer refuses chunk_size
    layer = Attention(dim=16, heads=4, causal=causal, use_gate=True, use_local_conv=True, **chunking).to(D)
    with torch.no_grad():
        layer.forget_gate.gate_up.weight.zero_()
        layer.forget_gate.gate_up.bias.fill_(bias)
        layer.output_gate.gate_out.bias.fill_(bias)
    x = torch.randn(2, 19, 16, dtype=D)
    torch.testing.assert_close(layer(x), naive_attention(layer, x), rtol=1e-9, atol=1e-12)
    layer = layer.float()
    for dtype in (None, torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = layer(x.float() * 10)
        out.float().sum().backward()
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
