"""``exp_ratio`` (ops/common.py), the one exp(a - b) of a log reference that every causal form
uses, at its edges in float64: 0 when either argument is -inf (or b is +inf), a zero
gradient there, never NaN."""

import math

import pytest
import torch

from linear_attention_transformer.ops.common import exp_ratio, log_ratio

INF = math.inf

# (a, b, exp(a - b), d/da, d/db)
EDGES = [
    (-INF, -INF, 0.0, 0.0, 0.0),  # no key on either side
    (-INF, 0.0, 0.0, 0.0, 0.0),
    (-INF, 3.0, 0.0, 0.0, 0.0),
    (0.0, -INF, 0.0, 0.0, 0.0),  # b not reached: 0 whatever a
    (-INF, INF, 0.0, 0.0, 0.0),
    (0.0, INF, 0.0, 0.0, 0.0),
    (0.0, 0.0, 1.0, 1.0, -1.0),
    (-1.0, 0.0, math.exp(-1), math.exp(-1), -math.exp(-1)),
    (-800.0, 0.0, 0.0, 0.0, 0.0),  # underflows to an exact 0 (and so does its gradient)
    (5.0, 7.5, math.exp(-2.5), math.exp(-2.5), -math.exp(-2.5)),
]


@pytest.mark.parametrize("a, b, value, grad_a, grad_b", EDGES)
def test_exp_ratio_at_its_edges(a, b, value, grad_a, grad_b):
    ta, tb = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (a, b))
    out = exp_ratio(ta, tb)
    out.backward()
    assert out.item() == pytest.approx(value, rel=1e-15, abs=0.0)
    assert ta.grad.item() == pytest.approx(grad_a, rel=1e-15, abs=0.0)
    assert tb.grad.item() == pytest.approx(grad_b, rel=1e-15, abs=0.0)
    # its log form (the blocked scan's coefficients): a - b, -inf where b is not finite
    assert log_ratio(ta.detach(), tb.detach()).item() == (a - b if math.isfinite(b) else -INF)


def test_exp_ratio_mixed_and_broadcast():
    """All edges in one call, a (5, 3) against a broadcast b (3,): the same values and
    gradients as one by one, every gradient finite."""
    a = torch.tensor([[-INF, 0.0, -1.0], [-INF, -INF, 2.0], [0.0, -2.0, -INF],
                      [-3.0, 0.0, 0.0], [-INF, -1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([-INF, 0.0, INF], dtype=torch.float64, requires_grad=True)
    weight = torch.arange(1.0, 16.0, dtype=torch.float64).view(5, 3)
    (weight * exp_ratio(a, b)).sum().backward()
    expected = torch.where(torch.isfinite(b) & (a > -INF), (a - b).exp(), torch.zeros(()))
    torch.testing.assert_close(exp_ratio(a, b), expected, rtol=0, atol=0)
    torch.testing.assert_close(a.grad, weight * expected, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, -(weight * expected).sum(dim=0), rtol=0, atol=0)
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
