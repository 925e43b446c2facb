"""Deprecated former name of :mod:`linear_attention_transformer.compat`, kept so that old imports work.

``from linear_attention_transformer.seed_names import Linformer`` gives the very objects that
``linear_attention_transformer.compat`` defines, and warns (``DeprecationWarning``) once per
process, when the module is first imported; new code should import from ``compat``.
"""

import warnings

from .compat import LinearImageAttention, Linformer, LinformerLM

__all__ = ["LinearImageAttention", "Linformer", "LinformerLM"]

# stacklevel 2: the import statement (Python skips importlib's own frames)
warnings.warn(
    "linear_attention_transformer.seed_names is deprecated: import from linear_attention_transformer.compat",
    DeprecationWarning,
    stacklevel=2,
)
