"""Former name of :mod:`linear_attention_transformer.compat`, kept so that old imports work.

``from linear_attention_transformer.seed_names import Linformer`` gives the very objects that
``linear_attention_transformer.compat`` defines; new code should import from ``compat``.
"""

from .compat import LinearImageAttention, Linformer, LinformerLM

__all__ = ["LinearImageAttention", "Linformer", "LinformerLM"]
