"""The delta rule on flash-linear-attention's Triton kernels (``fla-core``, the optional ``cuda``
extra; ``chunk.py``'s ``chunk_delta_rule`` picks it).

fla's ``chunk_gated_delta_rule`` runs, per head,

    S_t = exp(g_t) (I - b_t k_t k_tᵀ) S_{t-1} + b_t k_t v_tᵀ,    o_t = scale S_tᵀ q_t,

from a given state (``initial_state``) to the last one (``output_final_state``), over packed
sequences (``cu_seqlens``: the state restarts from 0 at each sequence's first token). The same
in fla-core 0.5 and 0.6; ``chunk_delta_rule`` is that recurrence with its options written in
fla's terms:

* layout: fla's tensors are (batch, time, heads, features), both lines (their ``head_first``
  is gone); the state is [N, H, K, V], keys first (``state_v_first=False``): ``S`` as it is;
* ``scale=1.0`` (fla's default is K^-0.5);
* q and k as given, ``use_qk_l2norm_in_kernel=False``: the caller normalises them (the layer),
  and ``naive.py`` takes them as they are; b_t as given (``use_beta_sigmoid_in_kernel=False``);
* ``log_decay`` is fla's g: the natural log of the per-head gate (fla sums it per chunk and
  takes exp2 of the sum over ln 2). Without one, g = 0 in the same kernels: fla's ungated
  ``chunk_delta_rule`` asserts that its inputs are not float32, the compute dtype here;
* ``mask``: a masked token has b = 0 and g = 0 (``chunk.py``, before either kernel);
* ``segments``: the batch is flattened into one row and each segment is one of fla's
  sequences (``cu_seqlens``; finding the starts reads them back to the host); the state after
  the last token is the final state of each row's last sequence.

Not mapped: float64 (the kernels are float32), keys of more than ``MAX_KEY_FEATURES`` features
(fla asserts it). Every backward runs fla's gated ``chunk_bwd_dqkwg`` (g is never None), which
fla refuses on a known-bad pair of Hopper and Triton (``causal/fla.py``'s ``known_bad_pair``):
a call that needs gradients asks for ``gated_backward``. Where fla cannot serve 'auto' on CUDA
the torch kernel runs and says why once, as for the additive rule (``warn_unavailable``).
Under torch.compile fla's entry point is ``torch.compiler.disable``d: a graph break per call.

fla's ``fused_recurrent_(gated_)delta_rule`` is not used: a decoder's one token is
``delta_rule_step`` in place, and a prefill of any length runs here in chunks.

fla is imported only when this kernel is asked for; the package imports and runs without it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..causal import fla as additive

__all__ = ["MAX_KEY_FEATURES", "fla_chunk_delta_rule", "fla_missing", "fla_unavailable"]

MAX_KEY_FEATURES = 256  # fla's state kernels hold a state of at most 256 key features


def _kernel():
    """fla's ``chunk_gated_delta_rule``: the one place this kernel reaches fla (the tests put a
    float64 recurrence with its contract here)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


@functools.lru_cache(maxsize=None)
def _import_error():
    """Why fla's delta-rule kernels do not import (a phrase), or None; tried once per process."""
    return additive.import_failure(_kernel)


@torch.compiler.assume_constant_result  # (an answer about the process: read once, constant in a trace)
def fla_unavailable(device_type: str, device_index: int, backward: bool):
    """Why fla cannot serve a delta-rule call on this machine (not installed, does not import, a
    known-bad pair when it needs gradients), or None. ``device_index``: the CUDA device's (-1
    elsewhere)."""
    why = _import_error()
    if why is None and backward and device_type == "cuda":
        why = additive.known_bad_pair(*additive._environment(device_index))
    return why


def fla_missing(device, dtype, backward, key_features):
    """Why ``fla_chunk_delta_rule`` cannot run such a call on ``device`` in compute dtype
    ``dtype`` (a phrase), or None when it can. ``backward``: the call needs gradients;
    ``key_features``: d."""
    if key_features > MAX_KEY_FEATURES:
        return f"fla's delta-rule kernels take keys of at most {MAX_KEY_FEATURES} features, not {key_features}"
    return additive.fla_missing(device, dtype, backward, unavailable=fla_unavailable)


def fla_chunk_delta_rule(q, k, v, beta, log_decay, state, return_state, segments):
    """``chunk_delta_rule`` on fla's kernel: its arguments, checked there and in the compute
    dtype, the mask already applied to ``beta`` and ``log_decay``. Returns (out (b, h, n, e),
    the state after the last token or None)."""
    b = q.shape[0]
    g = torch.zeros_like(beta) if log_decay is None else log_decay  # a_t = 1 (module docstring)
    starts = None
    if segments is not None:  # each row's first token, and each segment's, starts one of fla's sequences
        starts = F.pad(segments[:, 1:] != segments[:, :-1], (1, 0), value=True)
    (q, k, v, beta, g), cu_seqlens = additive.to_fla([q, k, v, beta[..., None], g[..., None]], starts)
    out, last = _kernel()(q, k, v, g[..., 0], beta[..., 0], scale=1.0,
                          initial_state=None if state is None else state.contiguous(), output_final_state=return_state,
                          use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
    out = additive.from_fla(out, starts, b)
    if last is not None and starts is not None:  # one state per sequence: each row's last
        last = last[starts.sum(dim=1).cumsum(dim=0) - 1]
    return out, last
