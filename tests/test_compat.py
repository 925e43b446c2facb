"""compat.py: the upstream packages' names; seed_names, its former module name, still importing
(with a DeprecationWarning); upstream's autoregressive_wrapper import path; __version__."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torch

import linear_attention_transformer
from linear_attention_transformer import compat


def _import_seed_names():
    """A fresh import of the deprecated module (the warning fires when the module first runs)."""
    sys.modules.pop("linear_attention_transformer.seed_names", None)
    with pytest.warns(DeprecationWarning, match=r"linear_attention_transformer\.compat") as record:
        module = importlib.import_module("linear_attention_transformer.seed_names")
    return module, record


def test_importing_seed_names_warns_naming_compat():
    sys.modules.pop("linear_attention_transformer.seed_names", None)
    with pytest.warns(DeprecationWarning, match=r"linear_attention_transformer\.compat") as record:
        from linear_attention_transformer.seed_names import Linformer  # noqa: F401
    (warning,) = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert "seed_names is deprecated" in str(warning.message)
    assert warning.filename == __file__  # points at the import statement, not inside the package


def test_old_module_gives_the_same_objects():
    old, _ = _import_seed_names()
    for name in ("Linformer", "LinformerLM", "LinearImageAttention"):
        assert getattr(old, name) is getattr(compat, name)
        assert getattr(linear_attention_transformer, name) is getattr(compat, name)
    sys.modules.pop("linear_attention_transformer.seed_names", None)
    with pytest.warns(DeprecationWarning):
        from linear_attention_transformer.seed_names import Linformer, LinformerLM  # the import users wrote

    assert Linformer is compat.Linformer and LinformerLM is compat.LinformerLM


def test_old_module_lists_the_same_public_names():
    old, _ = _import_seed_names()
    assert sorted(old.__all__) == sorted(compat.__all__)


def test_compat_names_build_the_package_models():
    encoder = compat.Linformer(dim=32, seq_len=64, depth=1, heads=4, k=16)
    assert isinstance(encoder, linear_attention_transformer.LinearAttentionTransformer)
    assert encoder(torch.randn(2, 40, 32)).shape == (2, 40, 32)
    lm = compat.LinformerLM(num_tokens=50, dim=32, seq_len=64, depth=1, heads=4, k=16)
    assert isinstance(lm, linear_attention_transformer.LinearAttentionTransformerLM)
    assert lm(torch.randint(0, 50, (1, 64))).shape == (1, 64, 50)
    assert compat.LinearImageAttention is linear_attention_transformer.ImageLinearAttention


def test_positional_arguments_keep_the_linformer_package_order():
    # linformer's order: (dim, seq_len, depth, k, heads, ...): the fourth positional argument is k
    encoder = compat.Linformer(32, 64, 1, 16, 4)
    attention = encoder.layers.blocks[0][0].fn
    assert attention.heads == 4 and attention.k == 16
    lm = compat.LinformerLM(50, 32, 64, 1, 8, 2)
    attention = lm.transformer.layers.blocks[0][0].fn
    assert attention.heads == 2 and attention.k == 8


def test_linformer_lm_positions_are_absolute_as_upstream():
    from linear_attention_transformer.positional import AbsolutePositionalEmbedding, AxialPositionalEmbedding

    assert isinstance(compat.LinformerLM(50, 32, 64, 1, k=8).pos_emb, AbsolutePositionalEmbedding)
    lm = compat.LinformerLM(50, 32, 64, 1, k=8, use_axial_pos_emb=True, local_attn_window_size=16)
    assert isinstance(lm.pos_emb, AxialPositionalEmbedding)


def test_dropout_sets_both_rates_and_refuses_a_second_rate():
    encoder = compat.Linformer(32, 64, 1, k=16, heads=4, dropout=0.25)
    rates = {m.p for m in encoder.modules() if isinstance(m, torch.nn.Dropout)}
    assert 0.25 in rates
    feedforward = encoder.layers.blocks[0][1].fn
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.25 for m in feedforward.modules())
    with pytest.raises(ValueError, match="not both"):
        compat.Linformer(32, 64, 1, k=16, heads=4, dropout=0.1, attn_dropout=0.2)
    with pytest.raises(ValueError, match="dropout"):
        compat.Linformer(32, 64, 1, k=16, heads=4, dropout=1.5)


def test_upstream_autoregressive_wrapper_import_path_gives_the_same_objects():
    from linear_attention_transformer import autoregressive
    from linear_attention_transformer.autoregressive_wrapper import AutoregressiveWrapper, top_k, top_p

    assert AutoregressiveWrapper is autoregressive.AutoregressiveWrapper is linear_attention_transformer.AutoregressiveWrapper
    assert top_k is autoregressive.top_k and top_p is autoregressive.top_p


def test_version_agrees_with_setup_py():
    root = Path(linear_attention_transformer.__file__).parent.parent
    assert re.fullmatch(r"\d+\.\d+\.\d+", linear_attention_transformer.__version__)
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=root, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == linear_attention_transformer.__version__


def test_python_requires_agrees_with_the_cuda_extra():
    """setup.py's python_requires admits no Python that the cuda extra's fla-core refuses
    (every fla-core line it admits needs 3.10; the installed one's metadata says so too), and
    the extra admits both tested lines, 0.5 and 0.6."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    text = (Path(linear_attention_transformer.__file__).parent.parent / "setup.py").read_text(encoding="utf-8")
    python = SpecifierSet(re.search(r'python_requires="([^"]+)"', text).group(1))
    fla = SpecifierSet(re.search(r'"cuda": \["fla-core([^"]+)"\]', text).group(1))
    needs = [">=3.10"]
    try:
        needs.append(metadata.metadata("fla-core")["Requires-Python"])
    except metadata.PackageNotFoundError:
        pass
    for version in ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13"):
        if version in python:
            assert all(version in SpecifierSet(need) for need in needs), f"Python {version}: fla-core refuses it"
    assert "3.10" in python
    assert all(v in fla for v in ("0.5.1", "0.5.2", "0.6.0")) and "0.7.0" not in fla and "0.5.0" not in fla
