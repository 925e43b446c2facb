"""LinformerSelfAttention against an explicit, step-by-step computation; settings; validation."""

import dataclasses
import math

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformer
from linear_attention_transformer.linformer import (
    LinformerContextSettings,
    LinformerSelfAttention,
    LinformerSettings,
)

DIM, SEQ_LEN, K, HEADS, DIM_HEAD = 12, 10, 4, 3, 5


def make(seed=0, **kwargs):
    torch.manual_seed(seed)
    args = dict(dim=DIM, seq_len=SEQ_LEN, k=K, heads=HEADS, dim_head=DIM_HEAD)
    args.update(kwargs)
    return LinformerSelfAttention(**args).double().eval()


def rand(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g)


def naive_linformer(attn, x, context=None, kv_mask=None):
    """Zero-pad the key/value sequence to seq_len, build E and F as (seq_len, k) matrices,
    and compute every head with an explicit softmax, one batch element at a time."""
    src = x if context is None else context
    b, m, dim = src.shape
    L, dh = attn.seq_len, attn.dim_head
    padded = torch.zeros(b, L, dim, dtype=src.dtype)
    padded[:, :m] = src
    if kv_mask is not None:
        keep = torch.zeros(b, L, dtype=torch.bool)
        keep[:, :m] = kv_mask
        padded = padded * keep[..., None]
    E = attn.proj_k.detach()
    Fm = E if attn.share_kv else attn.proj_v.detach()
    assert E.shape[-2:] == (L, attn.k) and Fm.shape == E.shape
    Wq, Wk, Wv = attn.to_q.weight.detach(), attn.to_k.weight.detach(), attn.to_v.weight.detach()
    Wo, bo = attn.to_out.weight.detach(), attn.to_out.bias.detach()

    outs = []
    for bi in range(b):
        head_outs = []
        for h in range(attn.heads):
            kvh = 0 if attn.one_kv_head else h
            Eh, Fh = (P[kvh] if P.ndim == 3 else P for P in (E, Fm))  # a projection per head, or one
            qh = x[bi] @ Wq[h * dh : (h + 1) * dh].T  # (n, dh)
            kh = Eh.T @ (padded[bi] @ Wk[kvh * dh : (kvh + 1) * dh].T)  # (k, dh)
            vh = Fh.T @ (padded[bi] @ Wv[kvh * dh : (kvh + 1) * dh].T)
            logits = qh @ kh.T / math.sqrt(dh)
            w = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
            w = w / w.sum(dim=1, keepdim=True)
            head_outs.append(w @ vh)
        outs.append(torch.cat(head_outs, dim=1) @ Wo.T + bo)
    return torch.stack(outs)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------ equals the naive form


@pytest.mark.parametrize("one_kv_head", [False, True])
@pytest.mark.parametrize("share_kv", [False, True])
@pytest.mark.parametrize("n", [SEQ_LEN, 7, 1])
def test_self_attention_matches_naive(one_kv_head, share_kv, n):
    attn = make(one_kv_head=one_kv_head, share_kv=share_kv)
    x = rand(2, n, DIM)
    out = attn(x)
    assert out.shape == (2, n, DIM)
    assert rel_err(out, naive_linformer(attn, x)) <= 1e-9


@pytest.mark.parametrize("one_kv_head", [False, True])
@pytest.mark.parametrize("share_kv", [False, True])
def test_masked_self_attention_matches_naive(one_kv_head, share_kv):
    attn = make(one_kv_head=one_kv_head, share_kv=share_kv)
    x = rand(3, 8, DIM)
    mask = torch.rand(3, 8, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[:, 0] = True
    out = attn(x, input_mask=mask)
    assert rel_err(out, naive_linformer(attn, x, kv_mask=mask)) <= 1e-9
    # the mask matters
    assert rel_err(attn(x), out) > 1e-6


@pytest.mark.parametrize("one_kv_head", [False, True])
@pytest.mark.parametrize("m", [SEQ_LEN, 6])
def test_context_matches_naive(one_kv_head, m):
    attn = make(one_kv_head=one_kv_head)
    x = rand(2, 13, DIM, seed=4)  # queries may be longer than seq_len with context
    context = rand(2, m, DIM, seed=5)
    mask = torch.ones(2, m, dtype=torch.bool)
    mask[1, -3:] = False
    out = attn(x, context=context, context_mask=mask)
    assert out.shape == (2, 13, DIM)
    assert rel_err(out, naive_linformer(attn, x, context=context, kv_mask=mask)) <= 1e-9
    assert rel_err(attn(x, context=context), naive_linformer(attn, x, context=context)) <= 1e-9


def test_default_dim_head_and_k_larger_than_seq_len():
    torch.manual_seed(0)
    attn = LinformerSelfAttention(dim=8, seq_len=5, k=9, heads=2).double()
    assert attn.dim_head == 4 and attn.proj_k.shape == (5, 9)
    x = rand(1, 5, 8)
    assert rel_err(attn(x), naive_linformer(attn, x)) <= 1e-9


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize("one_kv_head", [False, True])
@pytest.mark.parametrize("share_kv", [False, True])
def test_parameter_count(one_kv_head, share_kv):
    attn = make(one_kv_head=one_kv_head, share_kv=share_kv)
    inner = HEADS * DIM_HEAD
    kv_inner = DIM_HEAD if one_kv_head else inner
    expected = (
        DIM * inner  # to_q
        + 2 * DIM * kv_inner  # to_k, to_v
        + (1 if share_kv else 2) * SEQ_LEN * K  # E (and F)
        + inner * DIM
        + DIM  # to_out
    )
    assert sum(p.numel() for p in attn.parameters()) == expected
    assert (attn.proj_v is None) == share_kv
    assert attn.to_k.weight.shape == (kv_inner, DIM)


def test_sharing_saves_exactly_the_expected_parameters():
    def count(**kw):
        return sum(p.numel() for p in make(**kw).parameters())

    base = count()
    assert base - count(share_kv=True) == SEQ_LEN * K
    assert base - count(one_kv_head=True) == 2 * DIM * (HEADS - 1) * DIM_HEAD


def test_projection_init_is_xavier():
    torch.manual_seed(0)
    attn = LinformerSelfAttention(dim=8, seq_len=400, k=300, heads=2)
    bound = math.sqrt(6 / (400 + 300))
    for p in (attn.proj_k, attn.proj_v):
        assert p.abs().max() <= bound
        assert p.abs().max() > 0.9 * bound  # uniform, not a tiny or constant init
    assert not torch.equal(attn.proj_k, attn.proj_v)


def test_gradients_reach_every_parameter():
    attn = make(share_kv=False)
    x = rand(2, 6, DIM).requires_grad_()
    attn(x).square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0
    # rows of E and F beyond the sequence length stay untouched (they see zero padding)
    assert attn.proj_k.grad[6:].abs().sum() == 0


# ------------------------------------------------------------------ padding and masking


def test_garbage_at_masked_positions_changes_nothing():
    attn = make()
    x = rand(2, SEQ_LEN, DIM)
    mask = torch.ones(2, SEQ_LEN, dtype=torch.bool)
    mask[0, 2] = mask[0, 7] = mask[1, 5:] = False
    dirty = x.clone()
    dirty[~mask] = 1e6 * rand(int((~mask).sum()), DIM, seed=9)
    clean_out, dirty_out = attn(x, input_mask=mask), attn(dirty, input_mask=mask)
    assert rel_err(dirty_out[mask], clean_out[mask]) <= 1e-12
    # without the mask the garbage does leak into every output
    assert rel_err(attn(dirty)[mask], clean_out[mask]) > 1e-3


def test_nan_at_masked_positions_changes_nothing():
    attn = make()
    x = rand(1, 6, DIM)
    mask = torch.tensor([[True, True, False, True, True, True]])
    dirty = x.clone()
    dirty[0, 2] = float("nan")
    out = attn(dirty, input_mask=mask)
    assert torch.isfinite(out[mask]).all()
    assert rel_err(out[mask], attn(x, input_mask=mask)[mask]) <= 1e-12


def test_short_sequence_equals_padded_and_masked_full_length():
    attn = make(one_kv_head=True)
    n = 6
    x = rand(2, n, DIM)
    padded = torch.cat((x, 1e3 * rand(2, SEQ_LEN - n, DIM, seed=7)), dim=1)
    mask = torch.zeros(2, SEQ_LEN, dtype=torch.bool)
    mask[:, :n] = True
    assert rel_err(attn(padded, input_mask=mask)[:, :n], attn(x)) <= 1e-12


def test_context_garbage_at_masked_positions_changes_nothing():
    attn = make(share_kv=True)
    x, context = rand(2, 4, DIM), rand(2, 8, DIM, seed=2)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False
    dirty = context.clone()
    dirty[~mask] = -1e5
    out = attn(x, context=dirty, context_mask=mask)
    assert rel_err(out, attn(x, context=context, context_mask=mask)) <= 1e-12
    assert rel_err(out, attn(x, context=dirty)) > 1e-3


def test_inputs_are_not_modified():
    attn = make()
    x, context = rand(2, 5, DIM), rand(2, 8, DIM, seed=2)
    mask = torch.tensor([[True, False, True, True, False]] * 2)
    cmask = torch.ones(2, 8, dtype=torch.bool)
    cmask[:, -1] = False
    copies = [t.clone() for t in (x, context, mask, cmask)]
    attn(x, input_mask=mask)
    attn(x, context=context, context_mask=cmask)  # (input_mask with a context is refused)
    for t, c in zip((x, context, mask, cmask), copies):
        assert torch.equal(t, c)


def test_dropout_on_attention_weights():
    attn = make(dropout=0.5).train()
    x = rand(2, SEQ_LEN, DIM)
    torch.manual_seed(0)
    a = attn(x)
    torch.manual_seed(1)
    b = attn(x)
    assert rel_err(a, b) > 1e-6
    attn.eval()
    assert rel_err(attn(x), naive_linformer(attn, x)) <= 1e-9


# ------------------------------------------------------------------ half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_context", [False, True])
@pytest.mark.parametrize("scale", [100, 1000])
def test_autocast_finite_with_large_inputs(dtype, use_context, scale):
    # at scale 1000 the attention logits (~1e6) would overflow float16: they must not be
    # formed in half precision
    torch.manual_seed(0)
    attn = LinformerSelfAttention(dim=64, seq_len=128, k=32, heads=4)
    x = torch.randn(2, 128, 64) * scale
    context = torch.randn(2, 100, 64) * scale if use_context else None
    with torch.autocast("cpu", dtype=dtype):
        out = attn(x, context=context)
    assert out.dtype == dtype
    assert out.shape == (2, 128, 64)
    assert torch.isfinite(out).all()
    # at this scale the softmax is nearly one-hot and rounding the inputs to half precision
    # may flip its winner, so accuracy is checked at ordinary scale
    x, context = x / scale, None if context is None else context / scale
    with torch.autocast("cpu", dtype=dtype):
        out = attn(x, context=context)
    ref = attn(x, context=context)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.05


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(dim=10, heads=3, dim_head=None), ValueError, "dim"),
        (dict(k=0), ValueError, "k"),
        (dict(k=2.0), TypeError, "k"),
        (dict(seq_len=0), ValueError, "seq_len"),
        (dict(heads=0), ValueError, "heads"),
        (dict(dim_head=0), ValueError, "dim_head"),
        (dict(one_kv_head=1), TypeError, "one_kv_head"),
        (dict(share_kv="yes"), TypeError, "share_kv"),
        (dict(dropout=1.0), ValueError, "dropout"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        make(**kwargs)


def test_bad_forward_inputs():
    attn = make()
    x = rand(2, 6, DIM)
    ctx = rand(2, 8, DIM)
    good_mask = torch.ones(2, 6, dtype=torch.bool)
    cases = [
        (lambda: attn(rand(2, SEQ_LEN + 1, DIM)), ValueError, "x"),
        (lambda: attn(rand(2, 6, DIM + 1)), ValueError, "x"),
        (lambda: attn(rand(6, DIM)), ValueError, "x"),
        (lambda: attn(torch.ones(2, 6, DIM, dtype=torch.long)), TypeError, "x"),
        (lambda: attn(x, context=rand(2, SEQ_LEN + 1, DIM)), ValueError, "context"),
        (lambda: attn(x, context=rand(2, 8, DIM - 1)), ValueError, "context"),
        (lambda: attn(x, context=rand(3, 8, DIM)), ValueError, "context"),
        (lambda: attn(x, input_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, "input_mask"),
        (lambda: attn(x, input_mask=torch.ones(2, 6)), TypeError, "input_mask"),
        (lambda: attn(x, context=ctx, context_mask=torch.ones(2, 6, dtype=torch.bool)), ValueError, "context_mask"),
        (lambda: attn(x, context=ctx, context_mask=torch.ones(2, 8, dtype=torch.int64)), TypeError, "context_mask"),
        (lambda: attn(x, context_mask=torch.ones(2, 6, dtype=torch.bool)), ValueError, "context_mask"),
        (lambda: attn(x, context=ctx, input_mask=torch.ones(2, 8, dtype=torch.bool)), ValueError, "input_mask"),
    ]
    for fn, exc, name in cases:
        with pytest.raises(exc, match=rf"^{name}\b"):
            fn()
    assert attn(x, input_mask=good_mask).shape == x.shape


# ------------------------------------------------------------------ settings


def test_settings_defaults_frozen_and_from_settings():
    s = LinformerSettings()
    assert (s.k, s.one_kv_head, s.share_kv) == (256, False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.k = 3
    c = LinformerContextSettings(seq_len=16, k=4, one_kv_head=True, share_kv=True)
    attn = LinformerSelfAttention.from_settings(8, None, c, heads=2)
    assert (attn.seq_len, attn.k, attn.kv_heads, attn.proj_v) == (16, 4, 1, None)
    attn = LinformerSelfAttention.from_settings(8, 32, LinformerSettings(k=5), heads=4)
    assert (attn.seq_len, attn.k, attn.kv_heads) == (32, 5, 4)
    with pytest.raises(TypeError, match="settings"):
        LinformerSelfAttention.from_settings(8, 32, dict(k=5))


@pytest.mark.parametrize(
    "factory, exc, name",
    [
        (lambda: LinformerSettings(k=0), ValueError, "k"),
        (lambda: LinformerSettings(k="256"), TypeError, "k"),
        (lambda: LinformerSettings(one_kv_head=None), TypeError, "one_kv_head"),
        (lambda: LinformerContextSettings(seq_len=0), ValueError, "seq_len"),
        (lambda: LinformerContextSettings(seq_len=2.5), TypeError, "seq_len"),
        (lambda: LinformerContextSettings(seq_len=8, k=-1), ValueError, "k"),
        (lambda: LinformerContextSettings(seq_len=8, share_kv=0), TypeError, "share_kv"),
    ],
)
def test_bad_settings(factory, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        factory()


# ------------------------------------------------------------------ seed 002's sharing and k reduction


@pytest.mark.parametrize("one_kv_head", [False, True])
@pytest.mark.parametrize("share_kv", [False, True])
@pytest.mark.parametrize("n", [SEQ_LEN, 7])
def test_projection_per_head_matches_naive(one_kv_head, share_kv, n):
    attn = make(one_kv_head=one_kv_head, share_kv=share_kv, per_head=True)
    assert attn.proj_k.shape == (1 if one_kv_head else HEADS, SEQ_LEN, K)
    mask = torch.rand(2, n) > 0.3
    x = rand(2, n, DIM)
    assert rel_err(attn(x, input_mask=mask), naive_linformer(attn, x, kv_mask=mask)) <= 1e-9


def linformer_model(**settings):
    torch.manual_seed(0)
    return LinearAttentionTransformer(dim=DIM, depth=3, heads=HEADS, max_seq_len=SEQ_LEN,
                                      linformer_settings=LinformerSettings(k=K, **settings)).double()


def projections(model):
    """The distinct sequence projections of a model, by identity."""
    found = {}
    for module in model.modules():
        if isinstance(module, LinformerSelfAttention):
            for p in (module.proj_k, module.proj_v):
                if p is not None:
                    found[id(p)] = p
    return list(found.values())


def test_parameter_sharing_modes_count_and_strictly_decrease():
    counts = []
    for sharing, matrices in [("none", 3 * HEADS * 2), ("headwise", 3 * 2), ("kv", 3), ("layerwise", 1)]:
        model = linformer_model(parameter_sharing=sharing)
        assert sum(p.shape[0] if p.ndim == 3 else 1 for p in projections(model)) == matrices, sharing
        counts.append(sum(p.numel() for p in model.parameters()))
        x = rand(2, 7, DIM)
        assert model(x).shape == (2, 7, DIM)
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == 4
    layerwise = linformer_model(parameter_sharing="layerwise")
    (shared,) = projections(layerwise)
    layerwise(rand(2, 7, DIM)).sum().backward()
    assert shared.grad is not None and shared.grad.abs().sum() > 0  # learned, one tensor for every layer


def test_k_reduce_by_layer():
    model = linformer_model(k_reduce_by_layer=2)
    ks = [m.k for m in model.modules() if isinstance(m, LinformerSelfAttention)]
    assert ks == [K, K - 2, 1]  # 4, 2, then at least 1
    assert [p.shape[-1] for p in projections(model)][::2] == ks
    assert model(rand(1, SEQ_LEN, DIM)).shape == (1, SEQ_LEN, DIM)
    with pytest.raises(ValueError, match="k_reduce_by_layer.*layerwise"):
        LinformerSettings(k=8, parameter_sharing="layerwise", k_reduce_by_layer=1)
    with pytest.raises(ValueError, match="parameter_sharing"):
        LinformerSettings(parameter_sharing="heads")
    with pytest.raises(ValueError, match="k_reduce_by_layer"):
        LinformerSettings(k_reduce_by_layer=-1)
