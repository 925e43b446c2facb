"""Position-wise feed-forward network, optionally GLU-gated and applied in chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops.common import check_int

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


class FeedForward(nn.Module):
    """Linear -> activation (or its GLU form) -> dropout -> Linear, applied to each position.

    A model passes its ``ff_*`` keywords here with the prefix removed (``ff_mult`` -> ``mult``).

    Args:
        dim: model width. mult: hidden width = dim * mult (a positive int).
        hidden_dim: the hidden width itself, any positive int (with mult left at 4).
        dropout: dropout on the hidden activations.
        glu: use the GLU variant (Shazeer 2020): hidden = act(gate) * value; with 'silu',
            SwiGLU (Llama's feed-forward: ``proj_in`` holds the value rows, then the gate's).
        activation: 'gelu' (default), 'relu' (``linformer-pytorch``'s two choices) or 'silu'.
        chunks: run over this many slices of the sequence in turn (one slice's hidden at a time).
        bias: biases on both projections (the model's ``bias``).
    Shapes: x (b, n, dim) -> (b, n, dim).
    """

    def __init__(self, dim, mult=4, dropout=0.0, glu=False, chunks=1, activation="gelu", hidden_dim=None,
                 bias=True):
        super().__init__()
        if int(chunks) != chunks or chunks < 1:
            raise ValueError(f"ff_chunks must be a positive integer, got {chunks!r}")
        check_int("ff_mult", mult)
        if hidden_dim is not None and mult != 4:
            raise ValueError(f"ff_mult={mult} and ff_hidden_dim={hidden_dim} both set the hidden width: give one")
        if hidden_dim is None:
            hidden_dim = dim * mult
        check_int("ff_hidden_dim", hidden_dim)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ff_activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.glu = glu
        self.activation = _ACTIVATIONS[activation]
        self.chunks = int(chunks)
        self.proj_in = nn.Linear(dim, hidden_dim * (2 if glu else 1), bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.proj_out = nn.Linear(hidden_dim, dim, bias=bias)

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
