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
from .transformer import LinearAttentionTransformer, refuse_unknown_keywords

__all__ = ["LinearImageAttention", "Linformer", "LinformerLM"]

LinearImageAttention = ImageLinearAttention


def _linformer_options(k, one_kv_head, share_kv, dropout, options):
    """The model keywords the ``linformer`` package's arguments stand for (the Linformer layers check ``dropout``)."""
    for name in ("attn_dropout", "ff_dropout"):
        if name in options and dropout:
            raise ValueError(f"give dropout (the linformer package's one rate) or {name}, not both")
    settings = LinformerSettings(k=k, one_kv_head=one_kv_head, share_kv=share_kv)
    return settings, {"attn_dropout": dropout, "ff_dropout": dropout, **options}


def Linformer(dim, seq_len, depth, k=256, heads=8, dim_head=None, one_kv_head=False, share_kv=False,
              reversible=False, dropout=0.0, **options):
    """The ``linformer`` package's ``Linformer`` (a non-causal encoder), with its argument order
    and meanings (``k``, ``one_kv_head``, ``share_kv`` as ``LinformerSettings``; ``dropout`` both
    ``attn_dropout`` and ``ff_dropout``); ``options``: any other ``LinearAttentionTransformer``
    keyword. Shapes: x (b, n, dim), n <= seq_len -> (b, n, dim)."""
    refuse_unknown_keywords("Linformer", options, LinearAttentionTransformer.option_names())
    settings, options = _linformer_options(k, one_kv_head, share_kv, dropout, options)
    return LinearAttentionTransformer(dim, depth, seq_len, heads=heads, dim_head=dim_head, reversible=reversible,
                                      linformer_settings=settings, _keywords_checked=True, **options)


def LinformerLM(num_tokens, dim, seq_len, depth, k=256, heads=8, dim_head=None, one_kv_head=False,
                share_kv=False, reversible=False, dropout=0.0, **options):
    """The ``linformer`` package's ``LinformerLM``: arguments as ``Linformer``; positions a learned
    absolute embedding, as there, unless ``use_axial_pos_emb=True``; ``options``: any other
    ``LinearAttentionTransformerLM`` keyword. Shapes: tokens (b, n), n <= seq_len -> (b, n, num_tokens)."""
    refuse_unknown_keywords("LinformerLM", options, LinearAttentionTransformerLM.option_names())
    settings, options = _linformer_options(k, one_kv_head, share_kv, dropout, options)
    options.setdefault("use_axial_pos_emb", False)
    return LinearAttentionTransformerLM(num_tokens, dim, depth, seq_len, heads=heads, dim_head=dim_head,
                                        reversible=reversible, linformer_settings=settings, _keywords_checked=True,
                                        **options)
