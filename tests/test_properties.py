"""Property tests: random configurations and inputs (hypothesis), each checked against what
must hold whatever the configuration. In float64, so that "equal" can mean to ~1e-9.

* causality: an output never depends on a later input (its gradient there is exactly 0);
* padding invariance: what padded positions hold changes no real position's output, and
  padding appended at the end changes nothing before it;
* chunked = naive: the chunked causal kernel equals the explicit weight matrix (ops level);
* cached token-by-token decoding equals the full forward;
* batch members are independent: each row alone gives its row of the batch;
* shapes and finiteness, in all of the above.

Examples are derandomized (the same ones on every run, so CI cannot flake) and few per
property: the whole file is meant to take well under two minutes on two busy cores.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from linear_attention_transformer import LinearAttentionTransformer, LinearAttentionTransformerLM
from linear_attention_transformer.ops import causal_linear_attention, naive_causal_linear_attention

pytestmark = pytest.mark.usefixtures("one_thread")

DOUBLE = torch.float64
# no shrinking phase: shrinking a failing model example can take minutes; the failure is
# reported as generated
SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate],
)
DIM_HEAD = 4


@st.composite
def configs(draw, causal=True):
    """Options of a LinearAttentionTransformer (causal unless told)."""
    heads = draw(st.sampled_from([1, 2, 4]))
    depth = draw(st.integers(1, 2))
    options = dict(
        dim=8, depth=depth, heads=heads, dim_head=DIM_HEAD, causal=causal,
        n_local_attn_heads=tuple(draw(st.integers(0, heads)) for _ in range(depth)),
        local_attn_window_size=draw(st.integers(1, 8)),
        kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
        feature_map=draw(st.sampled_from(["softmax", "elu", "relu"])),
        use_gate=draw(st.booleans()),
        use_local_conv=draw(st.booleans()),
        shift_tokens=draw(st.booleans()),
        reversible=draw(st.booleans()),
    )
    if not any(options["n_local_attn_heads"]):
        del options["local_attn_window_size"]  # a window without local heads is refused
    if causal:  # chunks and blindspots belong to causal layers (refused otherwise)
        options["blindspot_size"] = draw(st.sampled_from([1, 1, 2, 3, 5]))
        options["chunk_size"] = draw(st.sampled_from([4, 8, 16]))
    if options["use_gate"]:
        options["gate_rank"] = draw(st.sampled_from([1, 4]))
        options["gate_granularity"] = draw(st.sampled_from(["feature", "head"]))
    if options["use_local_conv"]:
        # a non-causal convolution is centred: odd kernels only
        options["local_conv_kernel"] = draw(st.sampled_from([1, 2, 3, 4] if causal else [1, 3]))
    return options


@st.composite
def inputs(draw, max_len=300, max_batch=3):
    """(batch, length, seed, mask or None): masks keep at least one real token per row."""
    b = draw(st.integers(1, max_batch))
    n = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2**16))
    mask = None
    if draw(st.booleans()):
        g = torch.Generator().manual_seed(seed + 1)
        mask = torch.rand(b, n, generator=g) < draw(st.sampled_from([0.3, 0.7, 0.95]))
        mask[torch.arange(b), torch.randint(n, (b,), generator=g)] = True
    return b, n, seed, mask


def transformer(options, max_seq_len):
    torch.manual_seed(0)
    return LinearAttentionTransformer(max_seq_len=max_seq_len, **options).double().eval()


def randn(*shape, seed):
    return torch.randn(*shape, dtype=DOUBLE, generator=torch.Generator().manual_seed(seed))


def assert_close(actual, expected, what, rtol=1e-9):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), f"{what}: not finite"
    scale = max(expected.abs().max().item(), 1e-12) if expected.numel() else 1.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= rtol * scale, f"{what}: max error {err:.2e} vs scale {scale:.2e}"


# --------------------------------------------------------------------------- model level


@settings(max_examples=25, **SETTINGS)
@given(options=configs(), data=inputs(), position=st.floats(0, 1))
def test_no_gradient_from_the_future(options, data, position):
    b, n, seed, mask = data
    model = transformer(options, n)
    x = randn(b, n, 8, seed=seed).requires_grad_()
    out = model(x, input_mask=mask)
    assert out.shape == (b, n, 8) and torch.isfinite(out).all()
    t = min(int(position * n), n - 1)
    (grad,) = torch.autograd.grad(out[:, t].sum(), x)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[:, t + 1 :], torch.zeros_like(grad[:, t + 1 :])), f"output {t} reads a later input"


@settings(max_examples=25, **SETTINGS)
@given(options=st.one_of(configs(causal=True), configs(causal=False)), data=inputs(), extra=st.integers(1, 20))
def test_padding_changes_no_real_output(options, data, extra):
    b, n, seed, mask = data
    mask = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    model = transformer(options, n + extra)
    x = randn(b, n, 8, seed=seed)
    out = model(x, input_mask=mask)
    # other values in the padded positions
    noise = randn(b, n, 8, seed=seed + 7) * 10
    changed = model(torch.where(mask[..., None], x, noise), input_mask=mask)
    assert_close(changed[mask], out[mask], "outputs after changing padded positions")
    # padding appended at the end
    padded = model(torch.cat((x, randn(b, extra, 8, seed=seed + 9)), dim=1),
                   input_mask=torch.cat((mask, torch.zeros(b, extra, dtype=torch.bool)), dim=1))
    assert_close(padded[:, :n][mask], out[mask], "outputs after appending padding")


@settings(max_examples=20, **SETTINGS)
@given(options=st.one_of(configs(causal=True), configs(causal=False)), data=inputs(max_batch=4))
def test_batch_members_are_independent(options, data):
    b, n, seed, mask = data
    model = transformer(options, n)
    x = randn(b, n, 8, seed=seed)
    out = model(x, input_mask=mask)
    assert out.shape == (b, n, 8)
    for i in range(b):
        alone = model(x[i : i + 1], input_mask=None if mask is None else mask[i : i + 1])
        assert_close(alone[0], out[i], f"batch member {i} alone")


@settings(max_examples=15, **SETTINGS)
@given(options=configs(), data=inputs(max_len=40, max_batch=2), split=st.integers(0, 3))
def test_cached_decoding_equals_the_full_forward(options, data, split):
    """The LM decodes token by token (after a prefix of ``split`` tokens given at once)."""
    b, n, seed, mask = data
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(num_tokens=16, max_seq_len=n, **options).double().eval()
    x = torch.randint(0, 16, (b, n), generator=torch.Generator().manual_seed(seed))
    cut = lambda m, i, j: None if m is None else m[:, i:j]  # noqa: E731
    if options.get("blindspot_size", 1) > 1 and mask is not None and not bool(mask[:, 0].all()):
        with pytest.raises(ValueError, match="blindspot_size.*padded on the left"):  # refused in a cache
            model(x, input_mask=mask, return_cache=True)
        mask = mask.clone()
        mask[:, 0] = True  # (no row starts with padding: the cache is kept)
    with torch.no_grad():
        full = model(x, input_mask=mask)
        split = min(split, n)
        pieces, cache = [], None
        if split:
            logits, cache = model(x[:, :split], input_mask=cut(mask, 0, split), return_cache=True)
            pieces.append(logits)
        for t in range(split, n):
            logits, cache = model(x[:, t : t + 1], input_mask=cut(mask, t, t + 1), cache=cache, return_cache=True)
            pieces.append(logits)
    steps = torch.cat(pieces, dim=1)
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    assert_close(steps[real], full[real], "cached decoding", rtol=1e-8)


# --------------------------------------------------------------------------- ops level


@settings(max_examples=40, **SETTINGS)
@given(
    data=inputs(),
    heads=st.integers(1, 3),
    dims=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    chunk_size=st.integers(1, 20),
    blindspot_size=st.sampled_from([1, 1, 2, 3, 7]),
    decay=st.sampled_from([None, "scalar", "feature"]),
    exp_features=st.booleans(),
)
def test_chunked_kernel_equals_the_weight_matrix(data, heads, dims, chunk_size, blindspot_size, decay, exp_features):
    b, n, seed, mask = data
    d, e = dims
    q, k = randn(b, heads, n, d, seed=seed), randn(b, heads, n, d, seed=seed + 1)
    if not exp_features:  # given features: non-negative
        q, k = q.abs() + 0.05, k.abs() + 0.05
    v = randn(b, heads, n, e, seed=seed + 2)
    log_decay = None
    if decay is not None:
        shape = (b, heads, n) if decay == "scalar" else (b, heads, n, d)
        log_decay = -randn(*shape, seed=seed + 3).abs()
    args = (q, k, v, log_decay, mask)
    fast = causal_linear_attention(*args, blindspot_size=blindspot_size, chunk_size=chunk_size,
                                   exp_features=exp_features)
    naive = naive_causal_linear_attention(*args, blindspot_size=blindspot_size, exp_features=exp_features)
    assert_close(fast, naive, "chunked vs naive")
