"""Which form of the chunked causal kernel runs (``chunk.py``)."""

from __future__ import annotations

import torch


# The form of ``causal_linear_attention``: "parallel" (the state across chunks as a log-depth
# scan, exponential-feature chunks exact by construction: no host sync, launches ~ log n),
# "sequential" (a loop over chunks, lost chunks recomputed after reading their count back: the
# faster form on the CPU), "blocked" (sequential's chunks, the state across them as
# ``blocked_linear_scan``: what torch.compile traces on the CPU, here run eagerly), or "auto":
# parallel except on the CPU. All equal the same naive forms. Under torch.compile the state
# across chunks is always the blocked scan: the loop would unroll (a graph ~ n, a recompile for
# every chunk count under dynamic shapes) and the log-depth scan branches on the chunk count.
CHUNK_FORM = "auto"


def _parallel_form(device):
    if CHUNK_FORM == "auto":
        return device.type != "cpu"
    if CHUNK_FORM not in ("parallel", "sequential", "blocked"):
        raise ValueError(f"CHUNK_FORM must be 'auto', 'parallel', 'sequential' or 'blocked', got {CHUNK_FORM!r}")
    return CHUNK_FORM == "parallel"


def _blocked_form():
    return CHUNK_FORM == "blocked" or torch.compiler.is_compiling()
