"""The two improvements to linear attention: sigmoid gates and a short local convolution.

* ``ForgetGate``: a data-dependent decay a_t = sigmoid(x_t W + b) ** (1 / tau) of the causal
  state, S_t = diag(a_t) S_{t-1} + phi(k_t) v_tᵀ, per head (Mamba-2) or per head and key feature
  (GLA); without a causal order it gates each key's contribution.
* ``OutputGate``: sigmoid(x W_o) times the heads' output.
* ``LocalConv``: a depthwise convolution along the sequence on q, k and v (causal: padded on
  the left only), so that neighbouring tokens mix before the global feature map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .ops.common import check_int


GATE_GRANULARITIES = ("feature", "head")


class ForgetGate(nn.Module):
    """Log forget gates log a_t = logsigmoid(x W_down W_up + b) / tau, all <= 0.

    Args:
        dim: input width. heads, key_features: the heads it decays and their keys' features
            (the rows of their state: the feature map's, of dim_qk query/key dimensions).
        rank: width of the low-rank projection. temperature: tau.
        granularity: ``'head'`` (the default), one scalar decay per head and position
            (Mamba-2, Gated DeltaNet); or ``'feature'``, one per head and key feature (GLA).
            The default by measurement: the same validation BPC at equal steps on real
            text, and a cheaper step (examples/README.md).
    Shapes: x (b, n, dim) -> (b, heads, n, key_features), or (b, heads, n) per head.
    """

    def __init__(self, dim, heads, key_features, rank=16, temperature=16.0, granularity="head"):
        super().__init__()
        check_int("gate_rank", rank)
        if not temperature > 0:
            raise ValueError(f"gate_temperature must be > 0, got {temperature!r}")
        if granularity not in GATE_GRANULARITIES:
            raise ValueError(f"gate_granularity must be one of {GATE_GRANULARITIES}, got {granularity!r}")
        self.heads, self.temperature, self.granularity = heads, float(temperature), granularity
        per_head = 1 if granularity == "head" else key_features
        self.gate_down = nn.Linear(dim, rank, bias=False)
        self.gate_up = nn.Linear(rank, heads * per_head)
        # start near 1, the long memory of ungated linear attention (sigmoid(0) ** (1/16) would
        # halve every memory within 16 tokens): biases spread half-lives from ~35 to ~4500
        # tokens over each head's features, or over the heads (longest first)
        with torch.no_grad():
            self.gate_up.weight.mul_(0.1)
            spread = torch.linspace(6.0, 1.0, heads) if granularity == "head" else torch.linspace(1.0, 6.0, key_features).repeat(heads)
            self.gate_up.bias.copy_(spread)

    def forward(self, x):
        return self.log_gates(self.gate_down(x)).transpose(1, 2)  # (b, n, h[, d]) -> (b, h, n[, d])

    def log_gates(self, down):
        """The gates from the low-rank projection ``down`` (…, rank) (also what a decoder's
        fused projection gives): (…, heads), or (…, heads, key_features) per feature."""
        logits = F.linear(down, self.gate_up.weight, self.gate_up.bias)
        # logsigmoid, never log(sigmoid): stays finite and exact for pre-activations of +-50 and beyond
        log_a = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))) / self.temperature
        return log_a if self.granularity == "head" else log_a.unflatten(-1, (self.heads, -1))


class OutputGate(nn.Module):
    """sigmoid(x W_o + b) per output channel. x (b, n, dim) -> gates (b, n, channels).

    ``initial_bias``: b's starting value; PyTorch's default initialisation when None (gates
    near 0.5). A large one starts the gate open: it then passes the output nearly whole."""

    def __init__(self, dim, channels, initial_bias=None):
        super().__init__()
        self.gate_out = nn.Linear(dim, channels)
        if initial_bias is not None:
            with torch.no_grad():
                self.gate_out.bias.fill_(initial_bias)

    def forward(self, x):
        return torch.sigmoid(self.gate_out(x))


class LocalConv(nn.Module):
    """Depthwise 1-d convolution along the sequence, one filter per channel.

    Args:
        channels: heads * d of the tensors it convolves (d: dim_qk for q and k, dim_head for v).
        kernel_size: taps. causal: pad kernel_size - 1 on the left (position t sees t-k+1..t);
            otherwise centred, which needs an odd kernel.
    Starts as the identity (the current token's tap 1, the others 0). Shapes: x (b, h, n, d) with h * d == channels, mask (b, n) bool, segments (b, n) run
    index (``ops/segments.py``: no tap reaches into another segment) -> (b, h, n, d).
    """

    def __init__(self, channels, kernel_size=3, causal=True):
        super().__init__()
        check_int("local_conv_kernel", kernel_size)
        if not causal and kernel_size % 2 == 0:
            raise ValueError(f"local_conv_kernel must be odd in a non-causal model (it is centred), got {kernel_size}")
        self.kernel_size, self.causal = kernel_size, causal
        self.conv_weight = nn.Parameter(torch.zeros(channels, 1, kernel_size))
        with torch.no_grad():
            self.conv_weight[:, 0, kernel_size - 1 if causal else kernel_size // 2] = 1.0

    def taps(self, heads):
        """The filter as (heads, kernel_size, d): tap j weighs the input kernel_size - 1 - j
        positions back (causal)."""
        return rearrange(self.conv_weight, "(h d) 1 k -> h k d", h=heads)

    @property
    def left_context(self):
        """How many earlier positions each output sees (what a decoder must remember)."""
        return self.kernel_size - 1 if self.causal else self.kernel_size // 2

    def forward(self, x, mask=None, previous=None, segments=None, keep=None):
        """``previous``: (b, h, kernel_size - 1, d) inputs before x[:, :, 0] (cached decoding);
        ``keep``: a buffer of that shape, given the last inputs (masked ones zeroed) for the next call."""
        if segments is not None and previous is not None:
            raise ValueError("LocalConv: segments and previous (cached decoding) cannot be combined")
        h = x.shape[1]
        if mask is not None:  # padding never leaks into a real position
            x = x.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), 0.0)
        n, left, right = x.shape[2], self.left_context, self.kernel_size - 1 - self.left_context
        x = F.pad(x, (0, 0, left, right)) if previous is None else torch.cat((previous, x), dim=2)
        if keep is not None:
            with torch.no_grad():  # (a cache carries no gradient)
                keep.copy_(x[:, :, x.shape[2] - right - keep.shape[2] : x.shape[2] - right])
        # a few taps: a sum of shifted, scaled copies is faster than a depthwise conv1d on
        # the CPU and needs no transpose of the (b, h, n, d) layout
        weight = rearrange(self.taps(h).to(x.dtype), "h k d -> k h 1 d")
        taps = [x[:, :, tap : tap + n] for tap in range(self.kernel_size)]
        if segments is not None:  # a tap sees zero where it would cross into another segment
            runs = F.pad(segments, (left, right), value=-1)
            taps = [t.masked_fill(rearrange(runs[:, tap : tap + n] != segments, "b n -> b 1 n 1"), 0.0)
                    for tap, t in enumerate(taps)]
        out = taps[0] * weight[0]
        for tap in range(1, self.kernel_size):
            out = out + taps[tap] * weight[tap]
        return out
