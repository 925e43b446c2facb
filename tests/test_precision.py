"""Precision: training steps under bfloat16 / float16 autocast stay finite when the attention
logits are large, and float64 holds end to end (finite differences agree with autograd, and
the cached decoding path agrees with the full forward to float64 accuracy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linear_attention_transformer import LinearAttentionTransformer, LinearAttentionTransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 24
LM = dict(num_tokens=NUM_TOKENS, dim=32, depth=2, max_seq_len=64, heads=4, causal=True, chunk_size=8)
CONFIGS = {
    "plain": dict(),
    "local": dict(n_local_attn_heads=2, local_attn_window_size=8),
    "gate_conv": dict(use_gate=True, use_local_conv=True),
    "reversible": dict(reversible=True, shift_tokens=True, n_local_attn_heads=1, local_attn_window_size=8),
    "elu": dict(feature_map="elu"),
    "delta_gate_conv": dict(update_rule="delta", use_gate=True, use_local_conv=True),
    "noncausal": dict(causal=False, chunk_size=None),  # a chunk size belongs to causal models
}
# Query/key projections scaled by these factors: x100 gives causal softmax-feature logits of
# standard deviation ~60, which the kernel's safe chunks keep exact (ops/causal/chunk.py).
SCALES = (10.0, 30.0, 100.0)


def scaled_model(name, scale):
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(**{**LM, **CONFIGS[name]})
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith(("to_q.weight", "to_kv.weight")):
                p.mul_(scale)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name, scale", [(n, s) for n in CONFIGS for s in SCALES]
)
def test_autocast_training_step_is_finite_with_large_logits(name, scale, dtype):
    model = scaled_model(name, scale)
    x = torch.randint(0, NUM_TOKENS, (2, 41), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:])
    assert logits.dtype == dtype, "autocast did not reach the logits: the test would prove nothing"
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not bad, f"missing or non-finite gradients: {bad}"


@pytest.mark.parametrize("name", ["local_gate_conv", "reversible"])
def test_float64_gradients_match_finite_differences(name):
    settings = {
        "local_gate_conv": dict(n_local_attn_heads=1, local_attn_window_size=4, use_gate=True, use_local_conv=True),
        "reversible": dict(reversible=True, shift_tokens=True, n_local_attn_heads=1, local_attn_window_size=4),
    }[name]
    torch.manual_seed(0)
    model = LinearAttentionTransformer(
        dim=8, depth=1, max_seq_len=8, heads=2, causal=True, chunk_size=4, **settings
    ).double()
    x = torch.randn(1, 7, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False, True, True, True, True]])
    assert model(x, input_mask=mask).dtype == torch.float64
    # finite differences at eps 1e-6 agree to 1e-5 only if every step is float64
    assert torch.autograd.gradcheck(lambda t: model(t, input_mask=mask), (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_float64_cached_decoding_equals_full_forward():
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(
        **{**LM, **CONFIGS["local"]}, use_gate=True, use_local_conv=True
    ).double().eval()
    x = torch.randint(0, NUM_TOKENS, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x)
        cache, steps = None, []
        for t in range(x.shape[1]):
            logits, cache = model(x[:, t : t + 1], cache=cache, return_cache=True)
            steps.append(logits)
    steps = torch.cat(steps, dim=1)
    assert full.dtype == steps.dtype == torch.float64
    # float32 anywhere on either path would leave differences of ~1e-7
    assert (steps - full).abs().max().item() <= 1e-11 * full.abs().max().item()
