"""A trained-looking model: every weight matrix of a small causal LinearAttentionTransformer
scaled x100, so that query and key logits reach hundreds (as trained models' do). With the
default softmax map the float32 model must stay as close to its float64 copy as the rounding
of its own logits allows, forward and backward, with and without the gate and convolution,
and stay finite under half-precision autocast."""

import copy

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformer

N = 2048


def scaled_model(scale, **settings):
    torch.manual_seed(0)
    model = LinearAttentionTransformer(dim=32, depth=2, heads=4, max_seq_len=N, causal=True, **settings)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(scale)
    return model


def relative_error(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("settings", [{}, dict(use_gate=True), dict(use_gate=True, use_local_conv=True, kv_heads=2)],
                         ids=["plain", "gate", "gate+conv+kv_heads"])
def test_weights_x100_float32_matches_float64_forward_and_backward(settings):
    model = scaled_model(100.0, **settings)
    model64 = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, N, 32, generator=g)
    grad_out = torch.randn(1, N, 32, generator=g, dtype=torch.float64)
    x32, x64 = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    out32, out64 = model(x32), model64(x64)
    assert relative_error(out32, out64) <= 1e-3
    out32.backward(grad_out.float())
    out64.backward(grad_out)
    pairs = [(x32.grad, x64.grad)] + [(p.grad, p64.grad) for p, p64 in zip(model.parameters(), model64.parameters())]
    # the worst gradient (the first layer's q / kv projections, whose logits reach hundreds)
    # measured 3e-4 to 2.6e-3 from float64 over initial seeds 0-3, the forward 4e-5 to 2e-4;
    # the kernel's own exactness at such spreads is held to 1e-9 in tests/ops/test_stability.py
    for g32, g64 in pairs:
        assert torch.isfinite(g32).all()
        if g64.abs().max() > 0:
            assert relative_error(g32, g64) <= 5e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [10.0, 100.0])
def test_weights_scaled_under_autocast_finite_and_close(dtype, scale):
    """Finite at any scale; within 1e-1 of float64 where half precision can hold the logits
    to better than ~0.1 (at x100 bfloat16 rounds logits of hundreds by whole units, which
    moves the attention itself: the kernels' own error is checked on the rounded inputs in
    tests/ops/test_stability.py)."""
    model = scaled_model(scale, use_gate=True)
    x = torch.randn(1, 512, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
    assert torch.isfinite(out).all()
    if scale <= 10:
        assert relative_error(out, ref) <= 1e-1


def test_weights_x1000_finite_forward_and_backward():
    model = scaled_model(1000.0, use_gate=True)
    x = torch.randn(1, 512, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
