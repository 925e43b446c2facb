"""The delta rule (ops/delta): the chunked form and the one-token step equal the recurrence as
written (float64, with and without the gate, masks, packed segments, a state carried in, lengths
that are and are not multiples of the chunk), gradients included; what the rule is for (a key
written twice holds the last value, not the sum); half precision; bad input."""

import pytest
import torch
import torch.nn.functional as F

from linear_attention_transformer.ops.delta import chunk_delta_rule, delta_rule_step, naive_delta_rule

DOUBLE = torch.float64


def delta_inputs(b, h, n, d, e, seed, gated=True, dtype=DOUBLE):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, h, n, d, dtype=dtype, generator=g), dim=-1)
    k = F.normalize(torch.randn(b, h, n, d, dtype=dtype, generator=g), dim=-1)
    v = torch.randn(b, h, n, e, dtype=dtype, generator=g)
    beta = torch.rand(b, h, n, dtype=dtype, generator=g)
    log_decay = F.logsigmoid(2 * torch.randn(b, h, n, dtype=dtype, generator=g)) if gated else None
    return q, k, v, beta, log_decay


def masks(b, n, kind, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "random":
        return torch.rand(b, n, generator=g) > 0.3
    mask = torch.ones(b, n, dtype=torch.bool)  # rows padded on the left
    mask[-1, : n // 3] = False
    return mask


def packed(b, n, seed=4):
    """Segment ids of uneven runs, one row starting a segment in its first chunk."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (b, n), generator=g).sort(dim=1).values


def assert_close(actual, expected, rtol=1e-12):
    assert actual.shape == expected.shape
    scale = expected.abs().max().clamp(min=1e-300)
    assert (actual - expected).abs().max() <= rtol * scale, (actual - expected).abs().max() / scale


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("mask_kind", ["none", "random", "left"])
@pytest.mark.parametrize("n, chunk", [(32, 8), (37, 8), (5, 16), (1, 4)])
@pytest.mark.parametrize("with_segments", [False, True], ids=["", "packed"])
def test_chunked_equals_the_recurrence(gated, mask_kind, n, chunk, with_segments):
    q, k, v, beta, log_decay = delta_inputs(2, 3, n, 5, 4, seed=n + chunk)
    log_decay = log_decay if gated else None
    mask, segments = masks(2, n, mask_kind), packed(2, n) if with_segments else None
    expected, last = naive_delta_rule(q, k, v, beta, log_decay, mask, segments=segments)
    out, state = chunk_delta_rule(q, k, v, beta, log_decay, mask, return_state=True, segments=segments,
                                  chunk_size=chunk)
    assert_close(out, expected)
    assert_close(state, last)


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_a_state_carried_in_chunks_and_steps_equals_one_pass(gated):
    q, k, v, beta, log_decay = delta_inputs(2, 2, 30, 4, 3, seed=7, gated=gated)
    expected, last = naive_delta_rule(q, k, v, beta, log_decay)

    def part(t, sl):
        return None if t is None else t[:, :, sl]

    outs, state = [], None
    for start, stop in ((0, 11), (11, 12), (12, 25)):  # chunked prefill: 11 tokens, 1, 13 (chunk 4)
        sl = slice(start, stop)
        out, state = chunk_delta_rule(*(part(t, sl) for t in (q, k, v, beta, log_decay)), state=state,
                                      return_state=True, chunk_size=4)
        outs.append(out)
    state = state.clone()
    for t in range(25, 30):  # then the decoder's step, in place
        outs.append(delta_rule_step(state, *(part(x, t) for x in (q, k, v, beta, log_decay)))[:, :, None])
    assert_close(torch.cat(outs, dim=2), expected)
    assert_close(state, last)


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_gradients_equal_the_recurrences(gated):
    leaves = [None if t is None else t.requires_grad_(True) for t in delta_inputs(2, 2, 13, 4, 3, seed=8, gated=gated)]
    mask = masks(2, 13, "random")
    used = [t for t in leaves if t is not None]
    weights = torch.randn(2, 2, 13, 3, dtype=DOUBLE, generator=torch.Generator().manual_seed(9))
    expected = torch.autograd.grad((naive_delta_rule(*leaves, mask)[0] * weights).sum(), used)
    actual = torch.autograd.grad((chunk_delta_rule(*leaves, mask, chunk_size=4) * weights).sum(), used)
    for a, e in zip(actual, expected):
        assert_close(a, e)


def test_a_key_written_twice_holds_the_last_value():
    """With b = 1 the rule replaces: orthonormal keys, k0 written with v0, k1 with v1, then k0
    again with v2: a query along k0 reads v2 and one along k1 still reads v1 (an additive state
    would read v0 + v2)."""
    keys = torch.eye(4, dtype=DOUBLE)[:2]
    k = keys[[0, 1, 0]][None, None]
    v = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 5.0]], dtype=DOUBLE)[None, None]
    beta = torch.ones(1, 1, 3, dtype=DOUBLE)
    _, state = chunk_delta_rule(k, k, v, beta, return_state=True, chunk_size=2)
    read = torch.einsum("bhde,qd->qe", state, keys)
    assert torch.equal(read, torch.tensor([[0.0, 0.0, 5.0], [0.0, 1.0, 0.0]], dtype=DOUBLE))


def test_the_gate_forgets_and_masked_tokens_are_skipped():
    q, k, v, beta, _ = delta_inputs(1, 1, 6, 3, 2, seed=10)
    forget_all = torch.full((1, 1, 6), -800.0, dtype=DOUBLE)  # a_t = e^-800, 0 in float64: the token alone
    out = chunk_delta_rule(q, k, v, beta, forget_all, chunk_size=4)
    assert_close(out, (q * k).sum(-1, keepdim=True) * beta[..., None] * v)
    mask = torch.tensor([[True, False, True, True, False, True]])
    kept = mask[0].nonzero()[:, 0]
    alone = chunk_delta_rule(*(t[:, :, kept] for t in (q, k, v, beta)), chunk_size=4)
    assert_close(chunk_delta_rule(q, k, v, beta, mask=mask, chunk_size=4)[:, :, kept], alone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(dtype):
    q, k, v, beta, log_decay = delta_inputs(1, 2, 70, 8, 8, seed=11)
    expected = naive_delta_rule(q, k, v, beta, log_decay)[0]
    out, state = chunk_delta_rule(*(t.to(dtype) for t in (q, k, v, beta, log_decay)), return_state=True)
    assert out.dtype == dtype and state.dtype == torch.float32
    assert torch.isfinite(out).all()
    tolerance = 0.05 if dtype == torch.bfloat16 else 0.01
    assert (out.double() - expected).abs().max() <= tolerance * expected.abs().max()


def test_inputs_are_left_as_they_were():
    inputs = delta_inputs(1, 2, 9, 3, 2, seed=12)
    mask = masks(1, 9, "random")
    copies = [t.clone() for t in inputs]
    state = torch.randn(1, 2, 3, 2, dtype=DOUBLE)
    kept = state.clone()
    chunk_delta_rule(*inputs, mask, state=state, return_state=True, chunk_size=4)
    assert all(torch.equal(a, b) for a, b in zip(inputs, copies)) and torch.equal(state, kept)


def test_bad_input_is_refused_by_name():
    q, k, v, beta, log_decay = delta_inputs(2, 1, 6, 3, 2, seed=13)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_delta_rule(q, k, v, beta, chunk_size=0)
    with pytest.raises(ValueError, match="mask"):
        chunk_delta_rule(q, k, v, beta, mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        chunk_delta_rule(q, k, v, beta, mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="kernel"):
        chunk_delta_rule(q, k, v, beta, kernel="triton")
    with pytest.raises(ValueError, match="segments"):
        chunk_delta_rule(q, k, v, beta, state=torch.zeros(2, 1, 3, 2, dtype=DOUBLE), segments=packed(2, 6))
