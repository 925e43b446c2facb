"""Names that users of the upstream packages know, as thin constructors over this package's models.

``Linformer`` and ``LinformerLM`` (the names of lucidrains' ``linformer`` package) build a
``LinearAttentionTransformer`` / ``LinearAttentionTransformerLM`` whose self-attention is
Linformer: there is no second implementation, and every other option of those models is
accepted as a keyword. ``LinearImageAttention`` (the name used by the ``linear-attention``
package) is ``ImageLinearAttention``.
"""

from __future__ import annotations

from .images import ImageLinearAttention
from .linformer import LinformerSettings
from .lm import LinearAttentionTransformerLM
from .transformer import LinearAttentionTransformer

__all__ = ["LinearImageAttention", "Linformer", "LinformerLM"]

LinearImageAttention = ImageLinearAttention


def Linformer(dim, seq_len, depth, heads=8, k=256, one_kv_head=False, share_kv=False, **options):
    """The ``linformer`` package's ``Linformer``: a non-causal Linformer encoder.

    x (b, n, dim), n <= seq_len -> (b, n, dim). ``k`` is the projected length, ``one_kv_head``
    shares one key/value head, ``share_kv`` uses one projection for keys and values.
    ``options``: any ``LinearAttentionTransformer`` keyword.
    """
    settings = LinformerSettings(k=k, one_kv_head=one_kv_head, share_kv=share_kv)
    return LinearAttentionTransformer(dim, depth, seq_len, heads=heads, linformer_settings=settings, **options)


def LinformerLM(num_tokens, dim, seq_len, depth, heads=8, k=256, one_kv_head=False, share_kv=False, **options):
    """The ``linformer`` package's ``LinformerLM``: tokens (b, n), n <= seq_len -> logits (b, n, num_tokens).

    ``k``, ``one_kv_head``, ``share_kv`` as in ``Linformer``. ``options``: any
    ``LinearAttentionTransformerLM`` keyword.
    """
    settings = LinformerSettings(k=k, one_kv_head=one_kv_head, share_kv=share_kv)
    return LinearAttentionTransformerLM(
        num_tokens, dim, depth, seq_len, heads=heads, linformer_settings=settings, **options
    )
