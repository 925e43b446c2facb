"""Upstream's import path: ``from linear_attention_transformer.autoregressive_wrapper import
AutoregressiveWrapper`` (used by its enwik8 example). The wrapper and its sampling filters live in
``autoregressive.py``; this module only names them."""

from .autoregressive import AutoregressiveWrapper, top_k, top_p

__all__ = ["AutoregressiveWrapper", "top_k", "top_p"]
