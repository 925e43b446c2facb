"""The three views of causal linear attention (explicit matrix, recurrence, chunks) agree."""

import pytest
import torch

from linear_attention_transformer.ops import (
    causal_linear_attention,
    naive_causal_linear_attention,
    recurrent_causal_linear_attention,
)


@pytest.mark.parametrize("n", [1, 37, 64, 100])
@pytest.mark.parametrize("decay", [None, "scalar", "per_feature"])
@pytest.mark.parametrize("blindspot", [1, 16])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_and_recurrent_equal_naive(n, decay, blindspot, masked):
    g = torch.Generator().manual_seed(n)
    b, h, d, e = 2, 3, 8, 5
    q, k = (torch.rand(b, h, n, d, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(b, h, n, e, dtype=torch.float64, generator=g)
    shape = {None: None, "scalar": (b, h, n), "per_feature": (b, h, n, d)}[decay]
    log_decay = None if shape is None else -torch.rand(*shape, dtype=torch.float64, generator=g)
    mask = (torch.rand(b, n, generator=g) > 0.3) if masked else None

    ref = naive_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    chunked = causal_linear_attention(q, k, v, log_decay, mask, blindspot, chunk_size=16)
    recurrent, _ = recurrent_causal_linear_attention(q, k, v, log_decay, mask, blindspot)
    scale = ref.abs().max()
    assert (chunked - ref).abs().max() <= 1e-9 * scale
    assert (recurrent - ref).abs().max() <= 1e-9 * scale
