"""Window + linear attention in one head (``ops/window_linear.py``): the explicit form against a
loop written from the definition, the chunked form, the continued form and the one-token step
against the explicit one, in float64; large logits in float32."""

import math

import pytest
import torch

from linear_attention_transformer.ops.window_linear import (naive_window_linear_attention, window_linear_attention,
                                                            window_linear_attention_by_position,
                                                            window_linear_attention_step)

D = torch.float64


def inputs(b, h, n, d, e, features, seed, scale=1.0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, dtype=dtype, generator=g) * scale
    k = torch.randn(b, h, n, d, dtype=dtype, generator=g) * scale
    v = torch.randn(b, h, n, e, dtype=dtype, generator=g)
    fq = torch.rand(b, h, n, features, dtype=dtype, generator=g)
    fk = torch.rand(b, h, n, features, dtype=dtype, generator=g)
    return q, k, v, fq, fk


def mask_of(b, n, seed):
    return torch.rand(b, n, generator=torch.Generator().manual_seed(seed)) > 0.3


def by_the_definition(q, k, v, fq, fk, window, mask, sinks=0):
    """One query at a time: softmax weights over the window and the sinks, shifted by their
    largest score, feature products over the other older keys, one normalisation."""
    b, h, n, d = q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=D)
    for r in range(b):
        for head in range(h):
            for i in range(n):
                real = [j for j in range(i + 1) if mask is None or mask[r, j]]
                recent = [j for j in real if j > i - window or j < sinks]
                older = [j for j in real if j <= i - window and j >= sinks]
                if not real:
                    continue
                scores = {j: float(q[r, head, i] @ k[r, head, j]) / math.sqrt(d) for j in recent}
                top = max(scores.values(), default=0.0)
                weights = {j: math.exp(s - top) for j, s in scores.items()}
                weights.update({j: float(fq[r, head, i] @ fk[r, head, j]) for j in older})
                total = sum(weights.values())
                out[r, head, i] = sum(w * v[r, head, j] for j, w in weights.items()) / total
    return out


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("sinks", [0, 2])
def test_explicit_form_follows_the_definition(masked, sinks):
    q, k, v, fq, fk = inputs(2, 2, 11, 3, 2, 4, seed=0, scale=2.0)
    mask = mask_of(2, 11, 1) if masked else None
    torch.testing.assert_close(naive_window_linear_attention(q, k, v, fq, fk, 4, mask, sinks),
                               by_the_definition(q, k, v, fq, fk, 4, mask, sinks), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, window, chunk", [(16, 4, 8), (17, 5, 4), (3, 8, 64), (40, 8, 6), (33, 1, 5)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_chunked_form_equals_explicit(n, window, chunk, masked, sinks):
    q, k, v, fq, fk = inputs(2, 3, n, 4, 5, 6, seed=n, scale=2.0)
    mask = mask_of(2, n, n) if masked else None
    torch.testing.assert_close(window_linear_attention(q, k, v, fq, fk, window, mask, sinks, chunk=chunk),
                               naive_window_linear_attention(q, k, v, fq, fk, window, mask, sinks),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sinks", [0, 2])
def test_rows_padded_on_the_left_equal_each_row_alone(sinks):
    n, window = 19, 4
    q, k, v, fq, fk = inputs(3, 2, n, 3, 4, 5, seed=11, scale=2.0)
    starts = torch.tensor([0, 3, 18])
    mask = torch.arange(n) >= starts[:, None]
    for form in (window_linear_attention, naive_window_linear_attention):
        out = form(q, k, v, fq, fk, window, mask, sinks, starts)
        for r, start in enumerate(starts.tolist()):
            alone = naive_window_linear_attention(*(t[r : r + 1, :, start:] for t in (q, k, v, fq, fk)), window,
                                                  sinks=sinks)
            torch.testing.assert_close(out[r : r + 1, :, start:], alone, rtol=1e-12, atol=1e-12)


def test_chunked_gradients_equal_explicit():
    tensors = inputs(1, 2, 21, 4, 3, 5, seed=3)
    mask = mask_of(1, 21, 4)
    grads = []
    for form in (lambda *t: window_linear_attention(*t, 6, mask, 2, chunk=4),
                 lambda *t: naive_window_linear_attention(*t, 6, mask, 2)):
        leaves = [t.clone().requires_grad_() for t in tensors]
        form(*leaves).pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def older_state(fk, v, upto, mask=None):
    """S and z of the keys before column ``upto``."""
    keep = torch.ones(fk.shape[0], upto, dtype=D) if mask is None else mask[:, :upto].to(D)
    fk = fk[:, :, :upto] * keep[:, None, :, None]
    return fk.transpose(-1, -2) @ v[:, :, :upto], fk.sum(dim=2)


@pytest.mark.parametrize("split", [1, 6, 13])
@pytest.mark.parametrize("masked", [False, True])
def test_continued_from_a_ring_and_a_state_equals_the_whole(split, masked):
    """Queries from ``split`` on, over the last ``window`` keys before them (a ring), their own
    keys, and the state of every key before the ring."""
    n, window = 20, 5
    q, k, v, fq, fk = inputs(2, 2, n, 3, 4, 5, seed=split)
    mask = mask_of(2, n, split) if masked else None
    whole = naive_window_linear_attention(q, k, v, fq, fk, window, mask)
    first = max(split - window, 0)  # the ring: columns first .. split - 1
    positions = torch.arange(n)
    k_positions = positions[first:].expand(2, -1) if mask is None else torch.where(mask[:, first:], positions[first:], -1)
    part = window_linear_attention_by_position(q[:, :, split:], k[:, :, first:], v[:, :, first:], fq[:, :, split:],
                                               fk[:, :, first:], positions[split:], k_positions, window,
                                               older_state(fk, v, first, mask))
    torch.testing.assert_close(part, whole[:, :, split:], rtol=1e-12, atol=1e-12)


def test_step_equals_the_explicit_form():
    n, window = 14, 4
    q, k, v, fq, fk = inputs(2, 3, n, 4, 5, 6, seed=7, scale=3.0)
    whole = naive_window_linear_attention(q, k, v, fq, fk, window)
    for i in range(n):
        ring = slice(max(i - window + 1, 0), i + 1)
        bias = torch.zeros(1, 1, ring.stop - ring.start, dtype=D)
        kv, z = older_state(fk, v, ring.start)
        out = window_linear_attention_step(q[:, :, i], k[:, :, ring], v[:, :, ring], bias, fq[:, :, i], kv, z)
        torch.testing.assert_close(out, whole[:, :, i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", [10.0, 100.0])
def test_large_logits_stay_finite_and_accurate_in_float32(scale):
    tensors = inputs(1, 2, 37, 8, 4, 6, seed=5, scale=scale)
    reference = window_linear_attention(*tensors, 8)
    out = window_linear_attention(*(t.float() for t in tensors), 8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-4)
