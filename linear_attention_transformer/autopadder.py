"""Autopadder: kept for users of upstream linear-attention-transformer's API.

Every model in this library already accepts any length up to ``max_seq_len``: local
windows, blindspot blocks and axial folds pad and mask internally. ``Autopadder(net)``
therefore adds nothing but upstream's wrapping, and checks that what it wraps is a model of
this library, so that wrapping keeps working the way users expect.
"""

from __future__ import annotations

from torch import nn

from .lm import LinearAttentionTransformerLM
from .transformer import LinearAttentionTransformer


class Autopadder(nn.Module):
    """Wraps a ``LinearAttentionTransformer`` or ``LinearAttentionTransformerLM``.

    Args:
        net: the model. forward(x, **kwargs) calls it unchanged and returns its output,
            of the input's length.
    """

    def __init__(self, net):
        super().__init__()
        if not isinstance(net, (LinearAttentionTransformer, LinearAttentionTransformerLM)):
            raise TypeError("Autopadder wraps a LinearAttentionTransformer or LinearAttentionTransformerLM")
        self.net = net
        self.max_seq_len = net.max_seq_len

    def forward(self, x, **kwargs):
        return self.net(x, **kwargs)
