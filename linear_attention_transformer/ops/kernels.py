"""Which kernel runs: one public choice, a layer's ``kernel=`` (also ``causal_linear_attention``'s).

* 'auto': the fused kernels where they serve the call, this library's elsewhere. On CUDA the
  causal global heads run on flash-linear-attention (``causal/fla.py``, the ``[cuda]`` extra)
  and the local heads on ``flex_attention`` (``windowed_flex.py``); where fla cannot serve a
  call, the torch kernel runs and warns once per reason.
* 'torch': this library's kernels only: the chunked causal kernel (``causal/chunk.py``) and
  the windowed softmax in blocks of the window (``windowed_attention.py``).
* 'fla': the causal global heads on fla, or a ValueError naming why it cannot run the call;
  the local heads as 'auto'.

The table of what each choice runs for the global and the local heads on each device is in
docs/kernels.md ("Which kernel runs"), whose code checks it against the two pickers:
``causal/forms.py``'s ``pick_form`` (the global heads, and the torch kernel's form there)
and ``windowed_flex.py``'s ``local_implementation`` (the local heads). Global heads without a causal
order are two matmuls on every device: a non-causal layer refuses ``kernel='fla'``.
"""

from __future__ import annotations

__all__ = ["KERNELS", "check_kernel"]

KERNELS = ("auto", "torch", "fla")


def check_kernel(kernel):
    """``kernel`` if it is one of ``KERNELS``, else a ValueError naming the choices."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    return kernel
