"""compat.py: the upstream packages' names, and seed_names, its former module name, still importing."""

import importlib

import torch

import linear_attention_transformer
from linear_attention_transformer import compat


def test_old_module_gives_the_same_objects():
    old = importlib.import_module("linear_attention_transformer.seed_names")
    for name in ("Linformer", "LinformerLM", "LinearImageAttention"):
        assert getattr(old, name) is getattr(compat, name)
        assert getattr(linear_attention_transformer, name) is getattr(compat, name)
    from linear_attention_transformer.seed_names import Linformer, LinformerLM  # the import users wrote

    assert Linformer is compat.Linformer and LinformerLM is compat.LinformerLM


def test_old_module_lists_the_same_public_names():
    old = importlib.import_module("linear_attention_transformer.seed_names")
    assert sorted(old.__all__) == sorted(compat.__all__)


def test_compat_names_build_the_package_models():
    encoder = compat.Linformer(dim=32, seq_len=64, depth=1, heads=4, k=16)
    assert isinstance(encoder, linear_attention_transformer.LinearAttentionTransformer)
    assert encoder(torch.randn(2, 40, 32)).shape == (2, 40, 32)
    lm = compat.LinformerLM(num_tokens=50, dim=32, seq_len=64, depth=1, heads=4, k=16)
    assert isinstance(lm, linear_attention_transformer.LinearAttentionTransformerLM)
    assert lm(torch.randint(0, 50, (1, 64))).shape == (1, 64, 50)
    assert compat.LinearImageAttention is linear_attention_transformer.ImageLinearAttention
