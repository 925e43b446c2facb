"""Positional information: absolute and axial embeddings added to the tokens, and rotary
embeddings applied to queries and keys inside attention.

All of them are looked up by position, so cached decoding can ask for the position of the
token it is about to process, and packed sequences for each token's index inside its
segment: positions are (n,) (the same for every row) or (b, n) (one per row and token).
"""

from __future__ import annotations

import torch
from axial_positional_embedding import AxialPositionalEmbedding as _Axial
from torch import nn


class AbsolutePositionalEmbedding(nn.Module):
    """A learned vector per position. positions (n,) or (b, n) long -> (n, dim) or (b, n, dim)."""

    def __init__(self, dim, max_seq_len):
        super().__init__()
        self.emb = nn.Embedding(max_seq_len, dim)
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, positions):
        return self.emb(positions)


class AxialPositionalEmbedding(nn.Module):
    """Axial embedding (``axial_positional_embedding``), upstream linear-attention-transformer's default: position
    t = i * w + j gets emb_i + emb_j, with w the local attention window.
    positions (n,) or (b, n) long -> (n, dim) or (b, n, dim)."""

    def __init__(self, dim, max_seq_len, axial_width):
        super().__init__()
        rows = -(-max_seq_len // axial_width)
        self.width = axial_width
        self.axial = _Axial(dim, axial_shape=(rows, axial_width))
        # the tokens' scale: the package's N(0, 1) drowns them (examples/README.md: 3.88 vs 2.85 bpc)
        for weight in self.axial.weights:
            nn.init.normal_(weight, std=0.02)

    def forward(self, positions):
        # the table entry of t is row_emb[t // w] + column_emb[t % w]: gather the two rows
        # directly rather than building the whole (max_seq_len, dim) table for a few positions
        row_emb, col_emb = self.axial.weights
        if torch.compiler.is_compiling():
            # inductor (torch 2.13, CPU, dynamic shapes) fuses the two gathers' backward into a
            # kernel that indexes wrongly; the whole table and one gather compile correctly
            table = (row_emb[0, :, 0, None, :] + col_emb[0, 0, None, :, :]).flatten(0, 1)
            return nn.functional.embedding(positions, table)
        return row_emb[0, positions // self.width, 0] + col_emb[0, 0, positions % self.width]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer) for heads of size ``dim``; with a ``dim_qk`` other
    than dim, the tables of the two widths side by side, (…, dim + dim_qk): heads of dim (the
    local heads) read the first dim angles, the global heads' dim_qk-wide q and k the rest.

    Angles are computed in float32 from integer positions, so positions past 2048 keep
    their precision under float16 autocast (a float16 position is already wrong at 2049).
    positions (n,) or (b, n) long -> (cos, sin), each (n, dim) or (b, n, dim), float32
    (float64 for a float64 model).
    """

    def __init__(self, dim, base=10000, dim_qk=None):
        super().__init__()
        widths = {"dim_head": dim} if dim_qk in (None, dim) else {"dim_head": dim, "dim_qk": dim_qk}
        for name, width in widths.items():
            if width % 2:
                raise ValueError(f"rotary embeddings need an even {name}, got {width}")
        self.widths, self.base = tuple(widths.values()), base
        self.register_buffer("inv_freq", self.inverse_frequencies(), persistent=False)

    def inverse_frequencies(self, device=None):
        """The ``inv_freq`` buffer's values, float32: each width's angles per position, halves
        repeated ((cos, sin) of one width is cat(angles, angles)). Not saved with the weights:
        a model built without values (on the meta device) refills the buffer from this."""
        return torch.cat([(1.0 / self.base ** (torch.arange(0, width, 2, dtype=torch.float32, device=device) / width))
                          .repeat(2) for width in self.widths])

    def forward(self, positions):
        with torch.autocast(positions.device.type, enabled=False):
            inv_freq = self.inv_freq.to(torch.promote_types(self.inv_freq.dtype, torch.float32))
            angles = positions.to(inv_freq.dtype)[..., None] * inv_freq
            return angles.cos(), angles.sin()


def apply_rotary(x, cos_sin):
    """x (b, h, n, d) (or (..., n, d)) rotated by the angles of its positions, cos and sin
    (n, d) or per row (b, n, d) (a one-token step's x (b, h, d) takes (b, 1, d) per row);
    computed in at least float32."""
    cos, sin = cos_sin
    if cos.ndim == 3 and x.ndim == 4:  # one set of positions per row: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, cos.dtype))
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(dtype)
