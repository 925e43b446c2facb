"""Position-wise feed-forward network, optionally GLU-gated and applied in chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops.common import check_int

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


class FeedForward(nn.Module):
    """Linear -> activation (or its GLU form) -> dropout -> Linear, applied to each position.

    A model passes its ``ff_*`` keywords here with the prefix removed (``ff_mult`` -> ``mult``).

    Args:
        dim: model width. mult: hidden width = dim * mult (a positive int).
        dropout: dropout on the hidden activations.
        glu: use the GLU variant (Shazeer 2020): hidden = act(gate) * value.
        activation: 'gelu' (default) or 'relu' (``linformer-pytorch``'s two choices).
        chunks: run over this many slices of the sequence in turn (one slice's hidden at a time).
    Shapes: x (b, n, dim) -> (b, n, dim).
    """

    def __init__(self, dim, mult=4, dropout=0.0, glu=False, chunks=1, activation="gelu"):
        super().__init__()
        if int(chunks) != chunks or chunks < 1:
            raise ValueError(f"ff_chunks must be a positive integer, got {chunks!r}")
        check_int("ff_mult", mult)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ff_activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        hidden = dim * mult
        self.glu = glu
        self.activation = _ACTIVATIONS[activation]
        self.chunks = int(chunks)
        self.proj_in = nn.Linear(dim, hidden * (2 if glu else 1))
        self.dropout = nn.Dropout(dropout)
        self.proj_out = nn.Linear(hidden, dim)

    def forward(self, x):
        parts = x.chunk(self.chunks, dim=1) if self.chunks > 1 and x.shape[1] > 1 else (x,)
        outs = []
        for part in parts:
            hidden = self.proj_in(part)
            if self.glu:
                hidden, gate = hidden.chunk(2, dim=-1)
                hidden = hidden * self.activation(gate)
            else:
                hidden = self.activation(hidden)
            if self.training:
                hidden = self.dropout(hidden)
            outs.append(self.proj_out(hidden))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
