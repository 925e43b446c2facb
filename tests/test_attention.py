"""The attention layer equals an explicit computation: local heads as a windowed softmax with
an (n x n) mask, global heads as an explicit linear-attention weight matrix."""

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from linear_attention_transformer import (Attention, LinearAttentionTransformer, LinearAttentionTransformerLM,
                                          LinearSelfAttention, LinformerSettings)
from linear_attention_transformer.ops.causal.forms import use_form
from linear_attention_transformer.positional import RotaryEmbedding

D = torch.float64


def naive_attention(layer: Attention, x, mask=None, context=None, context_mask=None):
    """Everything written out: projections, (n x n) weights per head kind, output projection."""
    source = x if context is None else context
    key_mask = mask if context is None else context_mask
    h, dh = layer.heads, layer.dim_head
    q, k, v = explicit_projections(layer, x, source)
    n, m = q[0].shape[1], k[0].shape[1]
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    keep = torch.ones(x.shape[0], 1, n, m, dtype=torch.bool)
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, :]
    outs = []
    if layer.n_local:
        w = layer.local_heads.window.size
        if layer.causal:
            visible = (j <= i) & (j // w >= i // w - 1)
        else:
            visible = (j // w >= i // w - 1) & (j // w <= i // w + 1)
        ql, kl, vl = (torch.stack(t[: layer.n_local], dim=1) for t in (q, k, v))
        sim = torch.einsum("bhid,bhjd->bhij", ql, kl) * dh**-0.5
        sim = sim.masked_fill(~(visible & keep), float("-inf"))
        outs.append(sim.softmax(-1) @ vl)
    if layer.n_local < h:
        qg, kg, vg = (torch.stack(t[layer.n_local :], dim=1) for t in (q, k, v))
        if layer.global_heads.local_conv is not None:
            qg = explicit_conv(qg, layer.global_heads.local_conv[0], mask)
            kg = explicit_conv(kg, layer.global_heads.local_conv[1], key_mask)
            vg = explicit_conv(vg, layer.global_heads.local_conv[2], key_mask)
        gate = None
        if layer.global_heads.forget_gate is not None:
            fg = layer.global_heads.forget_gate
            pre = source @ fg.gate_down.weight.T @ fg.gate_up.weight.T + fg.gate_up.bias
            gate = rearrange(F.logsigmoid(pre) / fg.temperature, "b n (h d) -> b h n d", h=h - layer.n_local)
            gate = gate.expand(-1, -1, -1, qg.shape[-1])  # per head: the same decay for every feature
        qf = qg.softmax(-1)
        if layer.causal:
            B = layer.global_heads.blindspot_size
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


def explicit_projections(layer, x, source):
    """Each query head's q, k, v (b, n, d) as three lists: to_q holds the local heads' queries
    (dim_head each), then the global heads' (dim_qk); to_kv every key head's key, of its query
    heads' width, then every head's value (dim_head); key head g serves query heads g r ..
    g r + r - 1."""
    h, dh, dqk, local, kv_heads = layer.heads, layer.dim_head, layer.dim_qk, layer.n_local, layer.kv_heads
    r = h // kv_heads
    q = torch.split(x @ layer.to_q.weight.T, [dh if i < local else dqk for i in range(h)], dim=-1)
    kv = torch.split(source @ layer.to_kv.weight.T,
                     [dh if g * r < local else dqk for g in range(kv_heads)] + [dh] * kv_heads, dim=-1)
    k, v = [kv[i // r] for i in range(h)], [kv[kv_heads + i // r] for i in range(h)]
    return q, k, v


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
    # the global heads' q and k narrower (2) or wider (10) than dim_head (6)
    dict(causal=True, n_local_attn_heads=2, local_attn_window_size=8, dim_qk=2, use_gate=True,
         gate_granularity="feature", use_local_conv=True),
    dict(causal=True, blindspot_size=4, dim_qk=10, kv_heads=2, use_gate=True, use_local_conv=True),
    dict(causal=False, n_local_attn_heads=2, local_attn_window_size=8, dim_qk=10, kv_heads=2, use_gate=True,
         gate_granularity="feature", use_local_conv=True),
    dict(causal=False, dim_qk=2, one_kv_head=True),
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


@pytest.mark.parametrize("dim_qk", [None, 2, 7])
def test_cross_attention_equals_explicit_computation(dim_qk):
    torch.manual_seed(1)
    layer = Attention(dim=16, heads=4, receives_context=True, dim_qk=dim_qk).to(D)
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


def test_the_output_gate_starts_open_over_delta_rule_heads_alone():
    """Over delta-rule heads the output gate starts at sigmoid(3) for every input near 0 (from
    gates near 0.5 the gated heads did not learn recall); the local heads beside them, and
    additive heads, keep PyTorch's initialisation, biases within 1 / sqrt(dim)."""
    torch.manual_seed(0)
    x = torch.zeros(1, 5, 32)
    delta = Attention(dim=32, heads=4, n_local_attn_heads=2, causal=True, update_rule="delta", use_gate=True)
    local_channels = 2 * 8
    torch.testing.assert_close(delta.output_gate(x)[..., local_channels:],
                               torch.full((1, 5, 2 * 8), torch.sigmoid(torch.tensor(3.0)).item()))
    assert delta.output_gate.gate_out.bias[:local_channels].abs().max() <= 32 ** -0.5
    additive = Attention(dim=32, heads=4, n_local_attn_heads=2, causal=True, use_gate=True)
    assert additive.output_gate.gate_out.bias.abs().max() <= 32 ** -0.5


@pytest.mark.parametrize("bias", [-50.0, 50.0])
@pytest.mark.parametrize("causal", [True, False])
def test_extreme_gate_preactivations(bias, causal):
    """Gate pre-activations of +-50: exact in float64, finite in float32 and half autocast."""
    torch.manual_seed(9)
    chunking = dict(chunk_size=4) if causal else {}  # a non-causal layer refuses chunk_size
    layer = Attention(dim=16, heads=4, causal=causal, use_gate=True, use_local_conv=True, **chunking).to(D)
    with torch.no_grad():
        layer.global_heads.forget_gate.gate_up.weight.zero_()
        layer.global_heads.forget_gate.gate_up.bias.fill_(bias)
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


# ------------------------------------------------------------------ dim_qk: the global heads' query/key width


def rotary_angles(positions, d, base=10000):
    """RoFormer's angles for heads of d features: features i and i + d/2 turn by positions * base^(-2i/d)."""
    return positions[:, None].to(D) * base ** (-torch.arange(0, d, 2, dtype=D) / d)


def rotate(t, positions):
    """RoFormer's rotation of t (b, h, n, d), written out."""
    angles = rotary_angles(positions, t.shape[-1])
    cos, sin, (t1, t2) = angles.cos(), angles.sin(), t.chunk(2, dim=-1)
    return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)


# the weight of key j for query i, from the global heads' q_i and k_j (dim_qk each), and for
# the softmax map without a causal order from every key (a softmax over the sequence)
EXPLICIT_WEIGHTS = {
    "taylor": lambda q, k, key_mask: 1 + (s := q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5) + s.square() / 2,
    "elu": lambda q, k, key_mask: (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2),
    "softmax causal": lambda q, k, key_mask: q.softmax(-1) @ k.exp().transpose(-1, -2),
    "softmax": lambda q, k, key_mask: q.softmax(-1) @ k.masked_fill(~key_mask[:, None, :, None], float("-inf"))
    .softmax(dim=-2).transpose(-1, -2),
}


@pytest.mark.parametrize("feature_map", ["taylor", "elu", "softmax"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dim_qk, rotary", [(3, False), (4, True), (12, False), (12, True)])
def test_global_heads_of_dim_qk_equal_their_explicit_weights(feature_map, causal, dim_qk, rotary):
    """Global heads (dim_head 8) with q and k of dim_qk features, shared key heads: every causal
    form at lengths that are (16) and are not (13) a multiple of the chunk (8), with a key mask,
    equals out_i = sum_j w_ij v_j / sum_j w_ij with the weights written out (Taylor's
    1 + s + s²/2 with s = q·k / sqrt(dim_qk)), rotated by a dim_qk-wide rotation."""
    torch.manual_seed(3)
    chunking = dict(chunk_size=8) if causal else {}
    layer = Attention(dim=16, heads=4, dim_head=8, dim_qk=dim_qk, kv_heads=2, causal=causal, feature_map=feature_map,
                      **chunking).to(D)
    weights = EXPLICIT_WEIGHTS[feature_map + (" causal" if causal and feature_map == "softmax" else "")]
    for n in (16, 13):
        x = torch.randn(2, n, 16, dtype=D)
        mask = torch.rand(2, n) > 0.3
        mask[:, 0] = True  # every query sees a key
        q, k, v = (torch.stack(t, dim=1) for t in explicit_projections(layer, x, x))
        assert q.shape[-1] == k.shape[-1] == dim_qk and v.shape[-1] == 8
        tables = None
        if rotary:
            positions = torch.arange(n) + 5
            q, k = rotate(q, positions), rotate(k, positions)
            # the layer's tables: the local heads' angles (dim_head), then the global heads' (dim_qk)
            angles = torch.cat([rotary_angles(positions, d).repeat(1, 2) for d in (8, dim_qk)], dim=-1)
            tables = angles.cos(), angles.sin()
        w = weights(q, k, mask) * mask[:, None, None, :]
        if causal:
            w = w.tril()
        ref = layer.to_out(rearrange(w @ v / w.sum(-1, keepdim=True), "b h n d -> b n (h d)"))
        for form in ("sequential", "parallel", "compiled") if causal else (None,):
            with use_form(form):
                out = layer(x, input_mask=mask, rotary=tables)
            torch.testing.assert_close(out[mask], ref[mask], rtol=1e-9, atol=1e-12, msg=f"n={n}, form {form}")


DIM_QK_SHAPES = [  # (layer options, to_q rows, to_kv rows): dim 16, heads 4, dim_head 6
    (dict(dim_qk=2), 4 * 2, 4 * 2 + 4 * 6),
    (dict(dim_qk=10, kv_heads=2), 4 * 10, 2 * 10 + 2 * 6),
    (dict(dim_qk=3, n_local_attn_heads=2, local_attn_window_size=4, kv_heads=2), 2 * 6 + 2 * 3, 6 + 3 + 2 * 6),
    (dict(dim_qk=5, receives_context=True, one_kv_head=True), 4 * 5, 5 + 6),
]


@pytest.mark.parametrize("options, q_rows, kv_rows", DIM_QK_SHAPES)
def test_dim_qk_sizes_the_global_projections_gate_and_convolution(options, q_rows, kv_rows):
    """The global heads' q and k have dim_qk features, their values and the local heads dim_head:
    the projections, the per-feature forget gate (one decay per key feature: Taylor's 1 + d +
    d (d + 1) / 2 of d = dim_qk) and the convolutions of q, k (dim_qk) and v (dim_head)."""
    dim_qk, n_global = options["dim_qk"], 4 - options.get("n_local_attn_heads", 0)
    sequence = {} if options.get("receives_context") else dict(use_local_conv=True)
    for feature_map, features in (("elu", dim_qk), ("taylor", 1 + dim_qk + dim_qk * (dim_qk + 1) // 2)):
        layer = Attention(dim=16, heads=4, dim_head=6, feature_map=feature_map, use_gate=True, gate_granularity="feature",
                          **sequence, **options)
        assert layer.to_q.weight.shape == (q_rows, 16) and layer.to_kv.weight.shape == (kv_rows, 16)
        assert layer.to_out.weight.shape == (16, 4 * 6) and layer.output_gate.gate_out.out_features == 4 * 6
        assert layer.global_heads.forget_gate.gate_up.out_features == n_global * features
        if sequence:
            assert [c.conv_weight.shape[0] for c in layer.global_heads.local_conv] == [n_global * dim_qk] * 2 + [n_global * 6]


@pytest.mark.parametrize("options", [
    dict(), dict(n_local_attn_heads=1, local_attn_window_size=4, kv_heads=2, use_gate=True, use_local_conv=True,
                 causal=True),
    dict(receives_context=True, one_kv_head=True),
])
def test_dim_qk_unset_or_dim_head_keeps_todays_layer(options):
    """dim_qk=None (and dim_qk=dim_head) build today's parameters, every head's q, k and v of
    dim_head, and compute the same output bit for bit."""
    layers = []
    for given in ({}, dict(dim_qk=None), dict(dim_qk=6)):
        torch.manual_seed(4)
        layers.append(Attention(dim=16, heads=4, dim_head=6, **options, **given).to(D))
    kv_heads = layers[0].kv_heads
    shapes = [{name: tuple(t.shape) for name, t in layer.state_dict().items()} for layer in layers]
    assert shapes[0] == shapes[1] == shapes[2]
    assert shapes[0]["to_q.weight"] == (4 * 6, 16) and shapes[0]["to_kv.weight"] == (2 * kv_heads * 6, 16)
    x = torch.randn(2, 9, 16, dtype=D)
    kw = dict(context=torch.randn(2, 5, 16, dtype=D)) if options.get("receives_context") else {}
    outs = [layer(x, **kw) for layer in layers]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("value, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                          ("8", TypeError)])
def test_bad_dim_qk_values_are_refused_naming_it(value, error):
    with pytest.raises(error, match="dim_qk"):
        Attention(dim=16, heads=4, dim_qk=value)
    with pytest.raises(error, match="dim_qk"):
        LinearAttentionTransformer(dim=16, depth=1, max_seq_len=8, heads=4, dim_qk=value)


def test_dim_qk_refusals():
    """What dim_qk cannot mean is refused naming it: a layer of local heads only (no global
    heads to size), a key head shared by local and global query heads (two widths), an odd
    dim_qk under rotary embeddings, rotary tables without the dim_qk angles."""
    with pytest.raises(ValueError, match="dim_qk.*every head of this layer is local"):
        Attention(dim=16, heads=4, dim_qk=2, n_local_attn_heads=4, local_attn_window_size=4)
    with pytest.raises(ValueError, match="dim_qk=2 with kv_heads=2.*multiple of 2"):
        Attention(dim=16, heads=4, dim_qk=2, kv_heads=2, n_local_attn_heads=1, local_attn_window_size=4)
    with pytest.raises(ValueError, match="even dim_qk"):
        LinearAttentionTransformer(dim=16, depth=1, max_seq_len=8, heads=4, dim_qk=3, use_rotary_emb=True)
    layer = Attention(dim=16, heads=4, dim_qk=2, causal=True)
    tables = RotaryEmbedding(4)(torch.arange(5))
    with pytest.raises(ValueError, match=r"rotary tables must have 6 features.*dim_head \+ dim_qk"):
        layer(torch.randn(1, 5, 16), rotary=tables)
    with pytest.raises(ValueError, match="dim_qk"):  # Linformer layers have no global linear heads to size
        LinearAttentionTransformer(dim=16, depth=1, max_seq_len=8, heads=4, dim_qk=2,
                                   linformer_settings=LinformerSettings(k=4))


def test_dim_qk_flows_from_the_models_to_every_linear_attention_layer():
    """The models hand dim_qk to every layer that builds global heads: self-attention,
    axial and cross-attention layers, and LinearSelfAttention takes it."""
    lm = LinearAttentionTransformerLM(num_tokens=10, dim=16, depth=2, max_seq_len=16, heads=4, causal=True, dim_qk=2,
                                      attend_axially=True, receives_context=True, local_attn_window_size=4,
                                      n_local_attn_heads=(2, 0))
    layers = [m for m in lm.modules() if isinstance(m, Attention)]
    assert len(layers) == 6 and all(layer.dim_qk == 2 for layer in layers)
    assert all(layer.to_q.out_features == layer.n_local * 4 + (4 - layer.n_local) * 2 for layer in layers)
    attn = LinearSelfAttention(dim=16, heads=4, dim_qk=3, causal=True)
    assert attn.to_q.out_features == 4 * 3 and attn.to_kv.out_features == 4 * 3 + 4 * 4


def test_a_decoding_step_calls_each_projection_as_a_module():
    """A wrapped or adapted Linear (a forward hook here; LoRA or quantisation alike) acts on every
    path, the one-token step included: no projection is read as a bare weight."""
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(num_tokens=16, dim=16, depth=1, max_seq_len=32, heads=2, causal=True,
                                         n_local_attn_heads=1, local_attn_window_size=4).eval()
    layer = model.transformer.attention_layers[0]
    feedforward = model.transformer.layers.blocks[0][1].fn
    seen = []
    for name, module in [(n, getattr(layer, n)) for n in ("to_q", "to_kv", "to_out")] + \
            [(n, getattr(feedforward, n)) for n in ("proj_in", "proj_out")] + [("to_logits", model.to_logits)]:
        module.register_forward_hook(lambda m, args, out, name=name: seen.append(name))
    with torch.no_grad():
        _, cache = model(torch.randint(0, 16, (1, 5)), return_cache=True)
        seen.clear()
        model(torch.randint(0, 16, (1, 1)), cache=cache, return_cache=True)
    assert sorted(seen) == ["proj_in", "proj_out", "to_kv", "to_logits", "to_out", "to_q"]
