"""Autopadder: upstream's wrapper, kept for its users. Every model here already accepts any
length up to ``max_seq_len`` (it pads and masks internally), so it only checks what it wraps.
"""

from __future__ import annotations

from torch import nn

from .lm import LinearAttentionTransformerLM
from .transformer import LinearAttentionTransformer


class Autopadder(nn.Module):
    """Wraps a ``LinearAttentionTransformer`` or ``LinearAttentionTransformerLM``; forward calls it."""

    def __init__(self, net):
        super().__init__()
        if not isinstance(net, (LinearAttentionTransformer, LinearAttentionTransformerLM)):
            raise TypeError("Autopadder wraps a LinearAttentionTransformer or LinearAttentionTransformerLM")
        self.net = net
        self.max_seq_len = net.max_seq_len

    def forward(self, x, **kwargs):
        return self.net(x, **kwargs)
