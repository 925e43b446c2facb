"""Linear attention over the pixels of a feature map ("Efficient Attention", Shen et al.):

    w_ij = sum_d softmax_d(q_i)[d] * softmax_j(k_{:, d})[j]

computed as q (kᵀ v) per head (rows already sum to one: ``normalize=False``). Queries and keys
are scaled by key_dim ** -0.25 before their softmaxes, as in the original.
"""

from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange
from torch import nn

from .ops import linear_attention
from .ops.common import check_bool, check_float_tensor, check_int

__all__ = ["ImageLinearAttention"]


def _pair(name, value, minimum):
    items = value if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if any(v < minimum for v in items):
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return tuple(items)


class ImageLinearAttention(nn.Module):
    """Multi-head linear attention between the positions of an image (feature map).

    Args:
        chan, chan_out: input and output channels (``chan_out`` default ``chan``).
        kernel_size, padding, stride: int or pair, of the Conv2d ``to_q``, ``to_k``, ``to_v``;
            ``to_out`` (heads * value_dim -> chan_out) takes the same kernel and padding, stride 1.
        key_dim, value_dim: query/key and value features per head. heads: number of heads.
        norm_queries: softmax the queries over their features (else raw: rows need not sum to 1).

    Shapes (forward):
        img: (b, chan, H, W).
        context: optional (b, chan, *spatial): key/value positions appended to the image's
            (through the same ``to_k`` / ``to_v``): a 4-d context is convolved like ``img``,
            any other is flattened to a one-pixel-high image (b, chan, 1, L) first.
        returns: (b, chan_out, H_out, W_out): the q/k/v grid H' = (H + 2 padding -
            kernel_size) // stride + 1, then ``to_out``: H_out = H' + 2 padding - kernel_size
            + 1 (H itself with stride 1 and padding = kernel_size // 2, odd kernel).
    """

    def __init__(self, chan: int, chan_out: Optional[int] = None, kernel_size=1, padding=0, stride=1, key_dim: int = 64,
                 value_dim: int = 64, heads: int = 8, norm_queries: bool = True):
        super().__init__()
        chan_out = chan if chan_out is None else chan_out
        for name, value in (("chan", chan), ("chan_out", chan_out), ("key_dim", key_dim), ("value_dim", value_dim),
                            ("heads", heads)):
            check_int(name, value)
        check_bool("norm_queries", norm_queries)
        self.kernel_size = _pair("kernel_size", kernel_size, 1)
        self.padding = _pair("padding", padding, 0)
        self.stride = _pair("stride", stride, 1)

        self.chan, self.chan_out = chan, chan_out
        self.key_dim, self.value_dim, self.heads = key_dim, value_dim, heads
        self.norm_queries = norm_queries

        conv = dict(kernel_size=self.kernel_size, padding=self.padding, stride=self.stride)
        self.to_q = nn.Conv2d(chan, key_dim * heads, **conv)
        self.to_k = nn.Conv2d(chan, key_dim * heads, **conv)
        self.to_v = nn.Conv2d(chan, value_dim * heads, **conv)
        self.to_out = nn.Conv2d(value_dim * heads, chan_out, self.kernel_size, padding=self.padding)

    def extra_repr(self):
        return (f"chan={self.chan}, chan_out={self.chan_out}, heads={self.heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, norm_queries={self.norm_queries}")

    def _grid(self, name, size, stride=True):
        """Spatial size after a convolution with this module's kernel and padding (ValueError
        naming ``name`` when nothing is left)."""
        s = self.stride if stride else (1, 1)
        grid = tuple((n + 2 * p - k) // st + 1 for n, p, k, st in zip(size, self.padding, self.kernel_size, s))
        if min(grid) < 1:
            raise ValueError(f"{name} of spatial size {tuple(size)} is too small for kernel_size={self.kernel_size}, "
                             f"padding={self.padding}, stride={self.stride}")
        return grid

    def _check_input(self, name, t, b=None):
        check_float_tensor(name, t)
        if t.ndim < 3 or t.shape[1] != self.chan:
            raise ValueError(f"{name} must have shape (batch, chan = {self.chan}, ...), got {tuple(t.shape)}")
        if b is not None and t.shape[0] != b:
            raise ValueError(f"{name} has batch size {t.shape[0]}, img has {b}")

    def forward(self, img, context=None):
        self._check_input("img", img)
        if img.ndim != 4:
            raise ValueError(f"img must have shape (batch, chan, height, width), got {tuple(img.shape)}")
        b = img.shape[0]
        grid = self._grid("img", img.shape[-2:])
        self._grid("img's q/k/v grid", grid, stride=False)  # (to_out's)

        q, k, v = self.to_q(img), self.to_k(img), self.to_v(img)
        q, k, v = (rearrange(t, "b (h d) x y -> b h (x y) d", h=self.heads) for t in (q, k, v))

        if context is not None:
            self._check_input("context", context, b)
            if context.ndim != 4:
                context = rearrange(context, "b c ... -> b c 1 (...)")
            self._grid("context (after flattening)", context.shape[-2:])
            ck, cv = (rearrange(f(context), "b (h d) x y -> b h (x y) d", h=self.heads) for f in (self.to_k, self.to_v))
            k, v = torch.cat((k, ck), dim=2), torch.cat((v, cv), dim=2)

        out_dtype = v.dtype
        dtype = torch.promote_types(q.dtype, torch.float32)
        scale = self.key_dim**-0.25
        with torch.autocast(img.device.type, enabled=False):
            q, k = (t.to(dtype) * scale for t in (q, k))
            k = k.softmax(dim=2)  # over the positions
            if self.norm_queries:
                q = q.softmax(dim=-1)  # over the key features
            out = linear_attention(q, k, v.to(dtype), normalize=False)  # (b, h, positions, e)
        out = rearrange(out.to(out_dtype), "b h (x y) e -> b (h e) x y", x=grid[0], y=grid[1])
        return self.to_out(out)
