"""place.py: the one object that says where a sequence sits, and the one check of its modes."""

import pytest
import torch

from linear_attention_transformer import Attention, LinearAttentionTransformerLM
from linear_attention_transformer.context_parallel import ContextParallel
from linear_attention_transformer.ops.segments import positions_in_segment, segment_runs
from linear_attention_transformer.place import PLAIN, Place, check_modes


class _Cache:
    position = torch.tensor(5)  # (a cache's count: a long tensor of no dimension)


def test_positions_in_each_mode():
    x = torch.zeros(2, 4, 8)
    assert torch.equal(Place.of(x).positions(4), torch.arange(4))
    assert torch.equal(Place.of(x, cache=_Cache()).positions(4), torch.arange(5, 9))
    ids = torch.tensor([[3, 3, 7, 7], [1, 2, 2, 2]])
    packed = Place.of(x, segment_ids=ids)
    assert torch.equal(packed.segments, segment_runs(ids))
    assert torch.equal(packed.positions(4), torch.tensor([[0, 1, 0, 1], [0, 0, 1, 2]]))
    assert torch.equal(packed.positions(4), positions_in_segment(segment_runs(ids)))
    slice_ = Place(group=ContextParallel(None, rank=2, world_size=4, length=4))
    assert slice_.start == 8 and torch.equal(slice_.positions(4), torch.arange(8, 12))
    assert Place.of(x, return_cache=True).cached and not Place.of(x).cached
    # one token per row with a cache and no gradient recorded: the step, its position from the
    # cache's tensor (on a CPU, and eagerly, also the count on the host)
    with torch.no_grad():
        step = Place.of(x[:, :1], cache=_Cache())
    assert step.step and step.tensor is _Cache.position and step.position == 5
    assert torch.equal(step.positions(1), torch.tensor([5]))
    assert not Place.of(x[:, :1], cache=_Cache()).step  # (a gradient recorded: the general cached path)
    with torch.no_grad():
        assert not Place.of(x[:, :2], cache=_Cache()).step


@pytest.mark.parametrize("modes, named", [
    (dict(packed=True, cached=True), "segment_ids cannot be combined with a cache"),
    (dict(packed=True, parallel=True), "context_parallel is not supported with packed sequences"),
    (dict(cached=True, parallel=True), "context_parallel is not supported with a cache"),
])
def test_modes_that_exclude_each_other_are_refused(modes, named):
    with pytest.raises(ValueError, match=named):
        check_modes(**modes)


@pytest.mark.parametrize("modes", [{}, dict(packed=True), dict(cached=True), dict(parallel=True)])
def test_each_mode_alone_is_accepted(modes):
    check_modes(**modes)


def test_the_models_check_runs_before_the_group_is_asked_anything():
    seen = []

    def check(place, length, parallel):
        seen.append((place.group, length, parallel))
        raise ValueError("refused by the model")

    # not a process group: ContextParallel.of would raise TypeError, had it been reached
    with pytest.raises(ValueError, match="refused by the model"):
        Place.of(torch.zeros(1, 6, 8), context_parallel=object(), check=check)
    assert seen == [(None, 6, True)]


def test_every_layer_and_model_refuses_a_mix_with_the_same_words():
    ids = torch.zeros(1, 4, dtype=torch.long)
    lm = LinearAttentionTransformerLM(16, 8, 1, 32, heads=2, causal=True).eval()
    layer = Attention(8, heads=2, causal=True).eval()
    for call in (lambda: lm(torch.zeros(1, 4, dtype=torch.long), segment_ids=ids, return_cache=True),
                 lambda: lm.transformer(torch.zeros(1, 4, 8), segment_ids=ids, return_cache=True),
                 lambda: layer(torch.zeros(1, 4, 8), segment_ids=ids, return_cache=True)):
        with pytest.raises(ValueError, match="segment_ids cannot be combined with a cache"):
            call()


def test_a_layer_reads_the_place_it_is_handed():
    torch.manual_seed(0)
    layer = Attention(8, heads=2, causal=True, n_local_attn_heads=1, local_attn_window_size=2).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [4, 4, 5, 5, 5, 5]])
    assert torch.equal(layer.attend(x, Place.of(x, segment_ids=ids)), layer(x, segment_ids=ids))
    assert torch.equal(layer.attend(x, PLAIN), layer(x))
    # the packed place really is read: each segment equals the segment run alone
    alone = layer(x[:1, 3:])
    torch.testing.assert_close(layer.attend(x, Place.of(x, segment_ids=ids))[:1, 3:], alone)
