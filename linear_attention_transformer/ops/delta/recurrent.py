"""The delta rule, one token in place: what a decoder's step runs on its state (the math:
``__init__.py``)."""

from __future__ import annotations

__all__ = ["delta_rule_step"]


def delta_rule_step(state, q, k, v, beta, log_decay=None):
    """One token: ``state`` (b, h, d, e) becomes S_t in place; q, k (b, h, d), v (b, h, e),
    beta (b, h), log_decay (b, h) or None, all in the state's dtype. Returns o_t (b, h, e).

    Products and sums, not batched matmuls of one row (as ``read_state``): for one token they
    are fewer kernels and no copies."""
    if log_decay is not None:
        state.mul_(log_decay.exp()[..., None, None])
    predicted = (k[..., None] * state).sum(dim=-2)  # (b, h, e): what the state holds under k
    state.addcmul_(k[..., None], ((v - predicted) * beta[..., None])[..., None, :])
    return (q[..., None] * state).sum(dim=-2)
