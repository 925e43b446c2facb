"""A causal model never lets a later token change an earlier output, NaN and inf included:
global heads (every feature map, gates), local heads, the convolution and token shift, with
packed documents. The earlier outputs stay exactly as without the bad token.

(Backward is held to the same rule op by op, in tests/ops/test_non_finite.py. A whole model's
backward is not: a per-position op such as LayerNorm or GELU gives 0 * NaN = NaN in backward at
a row whose activation is NaN even when no loss reads that row, as in any PyTorch model, and
a window or the convolution then carries that NaN to earlier rows.)"""

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformer

CONFIGS = {
    "default": {},
    "elu": dict(feature_map="elu"),
    "gate-head": dict(use_gate=True),
    "gate-feature": dict(use_gate=True, gate_granularity="feature"),
    "local": dict(n_local_attn_heads=2, local_attn_window_size=8),
    "local-exact": dict(n_local_attn_heads=2, local_attn_window_size=8, local_attn_exact_windowsize=True),
    "conv+shift": dict(use_local_conv=True, shift_tokens=True),
    "blindspot": dict(n_local_attn_heads=2, local_attn_window_size=8, blindspot_size=8),
}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_bad_token_stays_in_its_future(config, packed):
    torch.manual_seed(0)
    model = LinearAttentionTransformer(dim=16, depth=2, heads=4, max_seq_len=128, causal=True,
                                       **CONFIGS[config]).double()
    n = 70
    x = torch.randn(2, n, 16, dtype=torch.float64)
    segment_ids = None
    if packed:
        segment_ids = torch.tensor([[0] * 24 + [1] * 30 + [2] * 16, [0] * n])
    with torch.no_grad():
        clean = model(x, segment_ids=segment_ids)
    g = torch.Generator().manual_seed(len(config) + packed)
    for bad in (float("nan"), float("inf")):
        t = int(torch.randint(1, n, (1,), generator=g))
        y = x.clone()
        y[0, t, int(torch.randint(16, (1,), generator=g))] = bad
        with torch.no_grad():
            out = model(y, segment_ids=segment_ids)
        torch.testing.assert_close(out[:, :t], clean[:, :t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[1], clean[1], rtol=1e-12, atol=1e-12)
        if packed:  # the other documents of its row, later ones included
            other = segment_ids[0] != segment_ids[0, t]
            torch.testing.assert_close(out[0, other], clean[0, other], rtol=1e-12, atol=1e-12)
        assert torch.isnan(out[0, t]).all()  # the bad token's own output is not hidden
