"""Shared helpers for the ops tests, handed out as fixtures so that they work under any
pytest import mode."""

import types

import pytest
import torch
import torch.nn.functional as F

DOUBLE = torch.float64


def assert_matches(actual, reference, rtol=1e-9, what="output"):
    """|actual - reference| <= rtol * max|reference| everywhere (both finite, same shape)."""
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert torch.isfinite(reference).all(), f"{what}: non-finite reference"
    scale = reference.abs().max().item() if reference.numel() else 0.0
    err = (actual.to(DOUBLE) - reference.to(DOUBLE)).abs().max().item() if reference.numel() else 0.0
    assert err <= rtol * max(scale, 1e-300), f"{what}: max error {err:.3e} vs scale {scale:.3e} (rtol {rtol:g})"


def feature_inputs(b, h, n, d, e, seed, dtype=DOUBLE, m=None):
    """Non-negative query/key features (bounded away from 0) and signed values."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.rand(b, h, n, d, dtype=dtype, generator=g) + 0.05
    k = torch.rand(b, h, m, d, dtype=dtype, generator=g) + 0.05
    v = torch.randn(b, h, m, e, dtype=dtype, generator=g)
    return q, k, v


def logit_inputs(b, h, n, d, e, seed, scale=1.0, dtype=DOUBLE, m=None):
    """Raw (signed) query/key logits and values, as a projection would produce them."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.randn(b, h, n, d, dtype=dtype, generator=g)
    k = torch.randn(b, h, m, d, dtype=dtype, generator=g) * scale
    v = torch.randn(b, h, m, e, dtype=dtype, generator=g)
    return q, k, v


def random_mask(b, n, seed, keep=0.7, empty_row=False):
    """Random (b, n) bool mask with at least one real token per row; optionally the
    last row is all padding."""
    g = torch.Generator().manual_seed(seed + 1000)
    mask = torch.rand(b, n, generator=g) < keep
    mask[:, torch.randint(n, (1,), generator=g)] = True
    if empty_row:
        mask[-1] = False
    return mask


def random_log_decay(kind, b, h, n, d, seed, dtype=DOUBLE, strength=1.0):
    """log a_t <= 0: None, per position (b, h, n) or per position and feature (b, h, n, d)."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed + 2000)
    shape = (b, h, n) if kind == "scalar" else (b, h, n, d)
    return -strength * torch.rand(*shape, dtype=dtype, generator=g)


def squared_relu_map(x):
    """A user-given (callable) feature map: non-negative, strictly positive."""
    return F.relu(x) ** 2 + 1e-3


@pytest.fixture
def helpers():
    return types.SimpleNamespace(
        assert_matches=assert_matches,
        feature_inputs=feature_inputs,
        logit_inputs=logit_inputs,
        random_mask=random_mask,
        random_log_decay=random_log_decay,
        squared_relu_map=squared_relu_map,
    )
