"""Helpers shared by the linear-attention kernels (non-causal and causal): the compute dtype,
the normaliser column and the division by it, argument checks, and the log-space factors of
exponential features."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


NEG_INF = float("-inf")


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def append_ones(v: torch.Tensor) -> torch.Tensor:
    """(…, e) -> (…, e + 1) with a last column of ones: it accumulates the normaliser."""
    return F.pad(v, (0, 1), value=1.0)


def divide_by_normaliser(out_aug: torch.Tensor) -> torch.Tensor:
    """Split the ones column off and divide. A query that sees no key (all masked, or the
    first blindspot block) has numerator and denominator 0, and gets 0 with zero gradient."""
    return _DivideRows.apply(out_aug[..., :-1], out_aug[..., -1:])


def _row_inverse(den):
    """1 / den where den > 0, else 0, on the (…, 1) column. where(), not a clamped denominator:
    dividing by a tiny clamp would give a gradient of 1 / tiny that turns into inf further back."""
    seen = den > 0
    return torch.where(seen, 1.0 / torch.where(seen, den, 1.0), 0.0)


class _DivideRows(torch.autograd.Function):
    """num (…, e) / den (…, 1), and 0 with zero gradient where den is 0.

    One inverse of the column and one product over the rows, forward and backward. Backward is
    written out: autograd would form d(1/den) = -1/den², which overflows float32 for den <
    5e-20 while the output is finite; here d den = -sum(grad * out) / den."""

    generate_vmap_rule = True

    @staticmethod
    def forward(num, den):
        return num * _row_inverse(den)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], output)

    @staticmethod
    def backward(ctx, grad):
        den, out = ctx.saved_tensors
        inv = _row_inverse(den)
        grad_num = grad * inv if ctx.needs_input_grad[0] else None
        grad_den = -(grad * out).sum(dim=-1, keepdim=True) * inv if ctx.needs_input_grad[1] else None
        return grad_num, grad_den


def check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_float_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating point tensor, got {t.dtype}")


def check_mask(mask, b, n, name="mask"):
    if mask is None:
        return
    if not torch.is_tensor(mask) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    if tuple(mask.shape) != (b, n):
        raise ValueError(f"{name} must have shape (batch, seq_len) = {(b, n)}, got {tuple(mask.shape)}")


def apply_key_mask(k, v, log_decay, mask, exp_features):
    """Masked keys contribute nothing and do not decay the state."""
    if mask is None:
        return k, v, log_decay
    m = rearrange(mask, "b n -> b 1 n 1")
    k = k.masked_fill(~m, NEG_INF if exp_features else 0.0)
    v = v.masked_fill(~m, 0.0)
    if log_decay is not None:
        log_decay = log_decay.masked_fill(~(m if log_decay.ndim == 4 else m[..., 0]), 0.0)
    return k, v, log_decay


def log_ratio(a, b):
    """log of ``exp_ratio(a, b)``: a - b, and -inf where b is not finite."""
    return a - torch.where(torch.isfinite(b), b, float("inf"))


def exp_ratio(a, b):
    """exp(a - b) for a log reference b (-inf: no key yet) and a <= b or a = -inf: 0 when a or
    b is -inf (or b is +inf), with a zero gradient there, never 0 * NaN. The non-finite b are
    replaced on b's side (usually the small, broadcast one): no extra pass over a. (a = +inf
    is outside the domain: references and logits are finite or -inf.)"""
    return log_ratio(a, b).exp()


def queries_relative_to(q, ref):
    """exp(q_d + ref_d - M) with M = max_d (q_d + ref_d): the largest factor is exactly 1.

    q: (…, n, d) logits; ref: (…, d) or broadcastable reference of the state / keys, -inf
    for features no key has reached yet. M carries no gradient: it cancels in the ratio."""
    with torch.no_grad():
        shifted = ref - (q.detach() + ref).amax(dim=-1, keepdim=True)
        shifted = torch.where(torch.isfinite(shifted), shifted, torch.full_like(shifted, NEG_INF))
    return (q + shifted).exp()
