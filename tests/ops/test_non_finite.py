"""A later token never changes an earlier output, whatever its value (NaN and inf included).

A non-finite key, value or decay at position t must leave every output before t as it was
(exactly), and the outputs of other packed segments as they were; the queries that do see it
get NaN (the plain sum's own answer). Backward: the gradient of the earlier outputs reaches no
non-finite value. Each form of the chunked kernel, blindspots, decays, masks and segments."""

import zlib

import pytest
import torch

from linear_attention_transformer.ops import causal_linear_attention
from linear_attention_transformer.ops.windowed_attention import Window, windowed_attention

DOUBLE = torch.float64
B, H, N, D, E, CHUNK = 2, 2, 29, 4, 3, 8


def _inputs(seed, exp_features, decay):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, dtype=DOUBLE, generator=g)
    k = torch.randn(B, H, N, D, dtype=DOUBLE, generator=g)
    if not exp_features:
        q, k = q.abs() + 0.05, k.abs() + 0.05
    v = torch.randn(B, H, N, E, dtype=DOUBLE, generator=g)
    log_decay = None
    if decay is not None:
        shape = (B, H, N) if decay == "head" else (B, H, N, D)
        log_decay = -torch.rand(*shape, dtype=DOUBLE, generator=g)
    return q, k, v, log_decay


def _segments(seed):
    g = torch.Generator().manual_seed(seed + 7)
    starts = torch.rand(B, N, generator=g) < 0.15
    starts[:, 0] = False
    return starts.long().cumsum(dim=1)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["q", "k", "v", "log_decay"])
@pytest.mark.parametrize("exp_features", [True, False])
@pytest.mark.parametrize("decay", [None, "head", "feature"])
@pytest.mark.parametrize("blindspot_size", [1, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_a_later_non_finite_token_leaves_earlier_outputs(causal_form, bad_value, where, exp_features, decay,
                                                         blindspot_size, packed):
    if where == "log_decay" and decay is None:
        where = "v"
    seed = zlib.crc32(repr((bad_value, where, exp_features, decay, blindspot_size, packed)).encode()) % 1000
    q, k, v, log_decay = _inputs(seed, exp_features, decay)
    segments = _segments(seed) if packed else None
    if blindspot_size > 1 and packed:
        segments = None  # (the attention layer aligns segments to blocks; the kernel counts blocks from 0)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 5] = False  # a padded token in the other row
    kwargs = dict(mask=mask, blindspot_size=blindspot_size, chunk_size=CHUNK, exp_features=exp_features,
                  segments=segments)
    clean = causal_linear_attention(q, k, v, log_decay, **kwargs)
    g = torch.Generator().manual_seed(seed + 11)
    t = int(torch.randint(1, N, (1,), generator=g))
    inputs = {"q": q, "k": k, "v": v, "log_decay": log_decay}
    poisoned = inputs[where].clone()
    if where == "log_decay":
        poisoned[0, 1, t] = bad_value if bad_value != float("inf") else float("nan")
    else:
        poisoned[0, 1, t, 1] = bad_value
    inputs[where] = poisoned
    inputs = {name: None if x is None else x.clone().requires_grad_() for name, x in inputs.items()}
    out = causal_linear_attention(*inputs.values(), **kwargs)

    # before t: exactly as without the bad token, and finite
    assert torch.isfinite(out[:, :, :t]).all()
    torch.testing.assert_close(out[:, :, :t], clean[:, :, :t], rtol=1e-12, atol=1e-12)
    # rows and heads that never hold it: as without it everywhere
    torch.testing.assert_close(out[1], clean[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0, 0], clean[0, 0], rtol=1e-12, atol=1e-12)
    if segments is not None:  # other documents of its row: as without it
        other = segments[0] != segments[0, t]
        torch.testing.assert_close(out[0, 1, other], clean[0, 1, other], rtol=1e-12, atol=1e-12)
    # a query that sees a bad key or value (or lies after a bad decay) does not hide it
    first_seen = t if where in ("q", "log_decay") or blindspot_size == 1 else (t // blindspot_size + 1) * blindspot_size
    if first_seen < N and (segments is None or segments[0, first_seen] == segments[0, t]):
        assert torch.isnan(out[0, 1, first_seen]).all()
    # backward from the outputs before t reaches no non-finite value
    out[:, :, :t].sum().backward()
    for name, x in inputs.items():
        if x is not None:
            assert torch.isfinite(x.grad).all(), f"non-finite gradient of {name}"
    assert (inputs[where].grad[0, 1, t] == 0).all()


@pytest.mark.parametrize("exp_features", [True, False])
def test_state_after_a_non_finite_token_is_not_finite(causal_form, exp_features):
    """A decode continuing from the returned state must not silently differ from the full
    forward (which is NaN after the bad token)."""
    q, k, v, _ = _inputs(3, exp_features, None)
    v = v.clone()
    v[0, 1, 20, 0] = float("nan")
    _, state = causal_linear_attention(q, k, v, chunk_size=CHUNK, exp_features=exp_features, return_state=True)
    assert torch.isnan(state.kv[0, 1]).all()
    assert torch.isfinite(state.kv[1]).all() and torch.isfinite(state.kv[0, 0]).all()


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("window", [Window(4, 1, 0, True, False), Window(4, 2, 0, True, True),
                                    Window(32, 1, 0, True, True)], ids=str)  # (the last: longer than the sequence)
@pytest.mark.parametrize("packed", [False, True])
def test_windowed_heads_keep_a_later_non_finite_token_out(bad_value, window, packed):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, 23, D, dtype=DOUBLE, generator=g) for _ in range(3))
    segments = torch.tensor([[0] * 9 + [1] * 14, [0] * 23]) if packed else None
    clean = windowed_attention(q, k, v, window, segments=segments)
    for t in (1, 6, 10, 22):
        for name in ("q", "k", "v"):
            x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
            x[name][0, 1, t, 2] = bad_value
            x = {key: t_.requires_grad_() for key, t_ in x.items()}
            out = windowed_attention(x["q"], x["k"], x["v"], window, segments=segments)
            torch.testing.assert_close(out[:, :, :t], clean[:, :, :t], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out[1], clean[1], rtol=0, atol=0)
            if packed and t < 9:
                torch.testing.assert_close(out[0, :, 9:], clean[0, :, 9:], rtol=1e-12, atol=1e-12)
            assert torch.isnan(out[0, 1, t]).all()
            out[:, :, :t].sum().backward()
            assert all(torch.isfinite(x_.grad).all() for x_ in x.values())
