"""The delta rule in chunks of C tokens: the WY representation of DeltaNet's chunked form
(Yang et al., 2024), gated as in Gated DeltaNet. Equal to ``naive.py``.

Inside a chunk that starts from S_0, let G_t be the cumulative log gate from the chunk's
start and write the update as an additive state, S_t = a_t S_{t-1} + k_t δ_tᵀ, whose values
δ_t = b_t (v_t - a_t S_{t-1}ᵀ k_t) depend on the state. Unrolled,
a_t S_{t-1} = exp(G_t) S_0 + sum_{j<t} exp(G_t - G_j) k_j δ_jᵀ, so the chunk's Δ solves

    (I + diag(b) A) Δ = diag(b) (V - diag(exp G) K S_0),    A_tj = exp(G_t - G_j) k_t·k_j, j < t,

a unit lower-triangular system: Δ = U - W S_0, with U = T diag(b) V and W = T diag(b exp G) K,
T = (I + diag(b) A)^-1, formed for every chunk at once. Then, chunk after chunk,

    O = diag(exp G) Q S_0 + (QKᵀ ⊙ D) Δ,           D_ij = exp(G_i - G_j) for j <= i, else 0,
    S_C = exp(G_C) S_0 + (K ⊙ exp(G_C - G))ᵀ Δ.

Every decay factor is the exponential of a number <= 0: none overflows, at any gate.

A masked token writes nothing and does not decay (b = 0, a = 1): its Δ row is 0. With
``segments`` a pair across segments is dropped from D and A, S_0 reaches a token only when no
segment starts in its chunk up to it, and the state after the chunk holds the keys of the
chunk's last segment (with S_0 only when no segment starts in the chunk): the recurrence with
a_t = 0 at each segment's first token. Half precision is computed in float32 (the triangular
solve has no half form) and cast back.

``kernel`` picks fla's kernels (``fla.py``) or this form, as for the additive rule
(``ops/kernels.py``): 'fla' runs fla's or raises a ValueError naming why it cannot; 'auto'
runs fla's on CUDA where they serve the call, else this form (saying why once, unless the call
itself is out of fla's reach: float64, wide keys); the CPU's 'auto' never asks for fla.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..causal.fla import KERNEL_DTYPES, warn_unavailable
from ..causal.forms import CHUNK_SIZE
from ..common import NEG_INF, check_int, check_mask, compute_dtype
from ..kernels import check_kernel
from .fla import MAX_KEY_FEATURES, fla_chunk_delta_rule, fla_missing

__all__ = ["chunk_delta_rule"]


def chunk_delta_rule(q, k, v, beta, log_decay=None, mask=None, state=None, return_state=False, segments=None,
                     chunk_size=CHUNK_SIZE, kernel="auto"):
    """The delta rule (``ops/delta/__init__.py``) chunk by chunk, in O(n) memory.

    Args:
        q, k: (b, h, n, d), of norm <= 1 for a bounded state; v: (b, h, n, e).
        beta: (b, h, n) writing strengths b_t in [0, 1]; log_decay: (b, h, n) log a_t <= 0, or None.
        mask: (b, n) bool or None, True for real tokens (a masked one leaves the state).
        state: (b, h, d, e) S before the first token, or None (zeros).
        return_state: also return S after the last token (in the compute dtype).
        segments: (b, n) ids or None: each segment starts from an empty state. Not with ``state``.
        chunk_size: C of this form (fla's kernels take chunks of 64).
        kernel: 'auto', 'torch' or 'fla' (the module docstring).
    Returns:
        (b, h, n, e), and the state when ``return_state``.
    """
    _check_shapes(q, k, v, beta, log_decay, state)
    b, h, n, d = q.shape
    check_mask(mask, b, n)
    check_int("chunk_size", chunk_size)
    check_kernel(kernel)
    if segments is not None and state is not None:
        raise ValueError("segments cannot be combined with a state: a state continues one sequence")
    out_dtype, dtype = v.dtype, compute_dtype(q)
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                               for t in (q, k, v, beta, log_decay, state))
    on_fla = _runs_on_fla(q.device, kernel, dtype, backward, d)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
        log_decay = None if log_decay is None else log_decay.to(dtype)
        if mask is not None:
            beta = beta.masked_fill(~mask[:, None], 0.0)
            log_decay = None if log_decay is None else log_decay.masked_fill(~mask[:, None], 0.0)
        if on_fla:
            out, state = fla_chunk_delta_rule(q, k, v, beta, log_decay, None if state is None else state.to(dtype),
                                              return_state, segments)
        else:
            out, state = _chunks(q, k, v, beta, log_decay, state, segments, chunk_size)
    out = out.to(out_dtype)
    return (out, state) if return_state else out


def _check_shapes(q, k, v, beta, log_decay, state):
    """A ValueError naming the first argument whose shape does not fit q's (b, h, n, d)."""
    if q.ndim != 4:
        raise ValueError(f"q must have shape (b, h, n, d), got {tuple(q.shape)}")
    b, h, n, d = q.shape
    e = v.shape[-1] if v.ndim else 0
    wanted = dict(k=(b, h, n, d), v=(b, h, n, e), beta=(b, h, n), log_decay=(b, h, n), state=(b, h, d, e))
    for (name, shape), t in zip(wanted.items(), (k, v, beta, log_decay, state)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for q of shape {tuple(q.shape)}, got {tuple(t.shape)}")


def _runs_on_fla(device, kernel, dtype, backward, d):
    """Whether fla's kernels run the call (the module docstring): for 'fla', True or a ValueError
    naming why not; for 'auto', only on CUDA."""
    if kernel == "torch" or (kernel == "auto" and not (device.type == "cuda" and torch.cuda.is_available())):
        return False
    why_not = fla_missing(device, dtype, backward, d)
    if why_not is None:
        return True
    if kernel == "fla":
        raise ValueError(f"kernel='fla' cannot run this call: {why_not}")
    if dtype in KERNEL_DTYPES and d <= MAX_KEY_FEATURES:  # (float64 and wide keys are the caller's choice)
        warn_unavailable(why_not)
    return False


def _chunks(q, k, v, beta, log_decay, state, segments, C):
    b, h, n, d = q.shape
    pad = -n % C  # padding tokens write nothing (b = 0) and do not decay
    c = (n + pad) // C
    q, k, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (c, C)) for t in (q, k, v))  # (b, h, c, C, ·)
    beta = F.pad(beta, (0, pad)).unflatten(2, (c, C))
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if segments is not None:
        starts = F.pad(segments[:, 1:] != segments[:, :-1], (1, pad))
        run = starts.unflatten(1, (c, C)).long().cumsum(dim=-1)[:, None]  # (b, 1, c, C): starts so far
        causal = causal & (run[..., :, None] == run[..., None, :])
    # gamma: how much of S_0 reaches each token; to_end: how much of each key reaches the
    # chunk's end (None: all of it)
    gamma = to_end = None
    if log_decay is None:
        D = causal.to(q.dtype)
    else:
        G = F.pad(log_decay, (0, pad)).unflatten(2, (c, C)).cumsum(dim=-1)  # (b, h, c, C)
        D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, NEG_INF).exp()
        gamma, to_end = G.exp(), (G[..., -1:] - G).exp()
    if segments is not None:  # S_0 reaches the chunk's first segment only, the end sees its last only
        gamma = _times(gamma, (run == 0).to(q.dtype))
        to_end = _times(to_end, (run == run[..., -1:]).to(q.dtype))
    # the solve reads only the strict lower triangle and takes the diagonal as 1
    system = beta[..., None] * (k @ k.transpose(-1, -2)) * D
    U = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    written = _times(gamma, beta)
    W = torch.linalg.solve_triangular(system, written[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * D
    q_start = q if gamma is None else q * gamma[..., None]
    k_end = k if to_end is None else k * to_end[..., None]

    S = q.new_zeros(b, h, d, v.shape[-1]) if state is None else state.to(q.dtype)
    # chunk by chunk through unbind, whose backward is one stack (an index per chunk would
    # fill a full-size zero gradient for each: quadratic in n)
    per_chunk = [t.unbind(2) for t in (U, W, q_start, scores, k_end.transpose(-1, -2))]
    kept = [None] * c if gamma is None else gamma[..., -1, None, None].unbind(2)  # S_0's share at the end
    outs = []
    for U_i, W_i, q_i, scores_i, k_end_i, kept_i in zip(*per_chunk, kept):  # three products per chunk
        delta = U_i - W_i @ S
        outs.append(q_i @ S + scores_i @ delta)
        S = (S if kept_i is None else kept_i * S) + k_end_i @ delta
    return torch.stack(outs, dim=2).flatten(2, 3)[:, :, :n], S


def _times(factor, t):
    """factor * t, where a factor of None stands for 1."""
    return t if factor is None else factor * t
