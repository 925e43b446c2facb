"""Positions: rotary angles stay exact past 2048 under float16 autocast; embeddings by position."""

import pytest
import torch
from axial_positional_embedding import AxialPositionalEmbedding as UpstreamAxial

from linear_attention_transformer.positional import (
    AxialPositionalEmbedding,
    RotaryEmbedding,
    apply_rotary,
)


def test_rotary_angles_exact_past_2048_under_float16_autocast():
    rotary = RotaryEmbedding(64)
    positions = torch.arange(2040, 4100)
    with torch.autocast("cpu", dtype=torch.float16):
        cos, sin = rotary(positions)
    assert cos.dtype == torch.float32  # never computed in half precision
    ref = positions.double()[:, None] * (1.0 / 10000 ** (torch.arange(0, 64, 2).double() / 64))[None]
    ref = torch.cat((ref, ref), dim=-1)
    torch.testing.assert_close(cos.double(), ref.cos(), atol=2e-3, rtol=0)
    # float16 positions would merge 2049 into 2048 (and 4097 into 4096); these stay distinct
    assert not torch.equal(cos[9], cos[8]) and not torch.equal(cos[-3], cos[-4])


def test_rotary_preserves_norms_and_relative_positions():
    rotary = RotaryEmbedding(16).double()
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(i, j):
        qi = apply_rotary(q, rotary(torch.tensor([i])))
        kj = apply_rotary(k, rotary(torch.tensor([j])))
        return (qi * kj).sum()

    torch.testing.assert_close(apply_rotary(q, rotary(torch.tensor([7]))).norm(), q.norm())
    torch.testing.assert_close(score(10, 3), score(1000, 993))  # depends on i - j only


def test_axial_lookup_by_position_equals_upstream_table():
    torch.manual_seed(0)
    ours = AxialPositionalEmbedding(8, max_seq_len=50, axial_width=16)
    upstream_table = ours.axial(torch.zeros(1, 64, 8))[0]
    positions = torch.tensor([0, 15, 16, 49, 33])
    torch.testing.assert_close(ours(positions), upstream_table[positions])
    assert isinstance(ours.axial, UpstreamAxial)


def test_lm_position_scheme_by_option():
    """Axial by default (seed 000), rotary instead when asked, absolute when both are off."""
    from linear_attention_transformer import LinearAttentionTransformerLM
    from linear_attention_transformer.positional import AbsolutePositionalEmbedding

    def lm(**options):
        return LinearAttentionTransformerLM(num_tokens=10, dim=8, depth=1, heads=2, max_seq_len=16, **options)

    assert isinstance(lm().pos_emb, AxialPositionalEmbedding)
    assert isinstance(lm(use_axial_pos_emb=True).pos_emb, AxialPositionalEmbedding)
    assert lm(use_rotary_emb=True).pos_emb is None
    assert isinstance(lm(use_axial_pos_emb=False).pos_emb, AbsolutePositionalEmbedding)


def test_rotary_tables_for_a_dim_qk_are_the_two_widths_side_by_side():
    """RotaryEmbedding(dim_head, dim_qk=...) gives the dim_head tables, then the dim_qk ones
    (what the global heads of that width read); dim_qk equal to dim_head or None: one table."""
    positions = torch.arange(37)
    both = RotaryEmbedding(6, dim_qk=10)(positions)
    for got, local, wide in zip(both, RotaryEmbedding(6)(positions), RotaryEmbedding(10)(positions)):
        assert got.shape == (37, 16)
        assert torch.equal(got[:, :6], local) and torch.equal(got[:, 6:], wide)
    for dim_qk in (None, 6):
        assert all(torch.equal(a, b) for a, b in zip(RotaryEmbedding(6, dim_qk=dim_qk)(positions),
                                                     RotaryEmbedding(6)(positions)))
    with pytest.raises(ValueError, match="even dim_qk"):
        RotaryEmbedding(6, dim_qk=5)
