"""ImageLinearAttention against an explicit (positions x positions) attention matrix."""

import pytest
import torch
import torch.nn.functional as F

from linear_attention_transformer.images import ImageLinearAttention


def rand(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g)


def make(seed=0, **kwargs):
    torch.manual_seed(seed)
    args = dict(chan=4, key_dim=3, value_dim=5, heads=2)
    args.update(kwargs)
    return ImageLinearAttention(**args).double()


def naive_image_attention(attn, img, context=None, kernel_size=1, padding=0, stride=1):
    """Convolutions written out with the module's weights and the given geometry, then for
    each head the explicit weight matrix W[i, j] = sum_d softmax_d(q_i) softmax_j(k_j)."""
    conv = dict(stride=stride, padding=padding)
    q = F.conv2d(img, attn.to_q.weight, attn.to_q.bias, **conv)
    k = F.conv2d(img, attn.to_k.weight, attn.to_k.bias, **conv)
    v = F.conv2d(img, attn.to_v.weight, attn.to_v.bias, **conv)
    b, _, gh, gw = q.shape
    heads, dk, dv = attn.heads, attn.key_dim, attn.value_dim
    # (b, heads, positions, features), positions in row-major order
    q = q.reshape(b, heads, dk, gh * gw).transpose(2, 3)
    k = k.reshape(b, heads, dk, gh * gw).transpose(2, 3)
    v = v.reshape(b, heads, dv, gh * gw).transpose(2, 3)
    if context is not None:
        c = context if context.ndim == 4 else context.reshape(b, context.shape[1], 1, -1)
        ck = F.conv2d(c, attn.to_k.weight, attn.to_k.bias, **conv)
        cv = F.conv2d(c, attn.to_v.weight, attn.to_v.bias, **conv)
        k = torch.cat((k, ck.reshape(b, heads, dk, -1).transpose(2, 3)), dim=2)
        v = torch.cat((v, cv.reshape(b, heads, dv, -1).transpose(2, 3)), dim=2)

    scale = dk**-0.25
    out = torch.empty(b, heads, gh * gw, dv, dtype=img.dtype)
    for bi in range(b):
        for h in range(heads):
            qh, kh, vh = q[bi, h] * scale, k[bi, h] * scale, v[bi, h]
            if attn.norm_queries:
                eq = torch.exp(qh - qh.max(dim=1, keepdim=True).values)
                qh = eq / eq.sum(dim=1, keepdim=True)
            ek = torch.exp(kh - kh.max(dim=0, keepdim=True).values)
            kh = ek / ek.sum(dim=0, keepdim=True)
            W = qh @ kh.T  # (positions, key positions)
            if attn.norm_queries:
                assert torch.allclose(W.sum(dim=1), torch.ones((), dtype=W.dtype))
            out[bi, h] = W @ vh
    out = out.transpose(2, 3).reshape(b, heads * dv, gh, gw)
    return F.conv2d(out, attn.to_out.weight, attn.to_out.bias, padding=padding)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------ equals the naive form


GEOMETRIES = [
    dict(kernel_size=1, padding=0, stride=1),
    dict(kernel_size=3, padding=1, stride=1),
    dict(kernel_size=3, padding=0, stride=1),  # output shrinks by 2 per conv
    dict(kernel_size=1, padding=0, stride=2),
    dict(kernel_size=3, padding=1, stride=2),
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("norm_queries", [True, False])
@pytest.mark.parametrize("chan_out", [None, 6])
def test_matches_naive(geometry, norm_queries, chan_out):
    attn = make(chan_out=chan_out, norm_queries=norm_queries, **geometry)
    img = rand(2, 4, 9, 7)
    out = attn(img)
    ref = naive_image_attention(attn, img, **geometry)
    assert out.shape == ref.shape
    assert out.shape[1] == (chan_out or 4)
    assert rel_err(out, ref) <= 1e-9


@pytest.mark.parametrize("geometry", [GEOMETRIES[0], GEOMETRIES[1], GEOMETRIES[4]])
@pytest.mark.parametrize("context_shape", [(2, 4, 5, 6), (2, 4, 11)])
def test_context_matches_naive(geometry, context_shape):
    attn = make(**geometry)
    img = rand(2, 4, 8, 8)
    context = rand(*context_shape, seed=3)
    out = attn(img, context=context)
    assert rel_err(out, naive_image_attention(attn, img, context, **geometry)) <= 1e-9
    assert rel_err(out, attn(img)) > 1e-6  # the context is attended to


def test_context_of_any_rank_is_flattened():
    attn = make()
    img, context = rand(1, 4, 6, 6), rand(1, 4, 2, 3, 4, seed=2)
    out = attn(img, context=context)
    assert rel_err(out, attn(img, context=context.reshape(1, 4, 24))) <= 1e-12
    # with a 1x1 kernel, a 4-d context gives the same as its flattened positions
    c4 = rand(1, 4, 3, 5, seed=3)
    assert rel_err(attn(img, context=c4), attn(img, context=c4.reshape(1, 4, 15))) <= 1e-12


def test_uniform_values_pass_through_when_rows_sum_to_one():
    # with zero value weights every value is the value bias, and rows summing to one
    # return exactly that bias at every position
    attn = make(norm_queries=True)
    with torch.no_grad():
        attn.to_v.weight.zero_()
        attn.to_out.weight.copy_(torch.eye(4, 10, dtype=torch.float64)[..., None, None])
        attn.to_out.bias.zero_()
    out = attn(rand(2, 4, 5, 5) * 10)
    expected = attn.to_v.bias[:4].detach().view(1, 4, 1, 1).expand_as(out)
    assert rel_err(out, expected) <= 1e-12


def test_inputs_are_not_modified():
    attn = make(kernel_size=3, padding=1)
    img, context = rand(1, 4, 6, 6), rand(1, 4, 7, seed=2)
    copies = img.clone(), context.clone()
    attn(img, context=context)
    assert torch.equal(img, copies[0]) and torch.equal(context, copies[1])


# ------------------------------------------------------------------ shapes


def test_readme_example_shape():
    torch.manual_seed(0)
    attn = ImageLinearAttention(chan=32, heads=8, key_dim=64)
    img = torch.randn(1, 32, 16, 16)
    out = attn(img)
    assert out.shape == (1, 32, 16, 16)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "kwargs, size, expected",
    [
        (dict(stride=2), (16, 16), (8, 8)),
        (dict(kernel_size=3, padding=1, stride=2), (16, 16), (8, 8)),
        (dict(kernel_size=3, padding=1, stride=2), (15, 9), (8, 5)),
        (dict(kernel_size=3, padding=0), (16, 12), (12, 8)),
        (dict(kernel_size=(3, 1), padding=(1, 0), stride=(2, 1)), (16, 12), (8, 12)),
    ],
)
def test_output_spatial_size(kwargs, size, expected):
    torch.manual_seed(0)
    attn = ImageLinearAttention(chan=8, chan_out=3, heads=2, key_dim=4, value_dim=4, **kwargs)
    out = attn(torch.randn(2, 8, *size))
    assert out.shape == (2, 3, *expected)


def test_gradients_reach_every_parameter():
    attn = make(kernel_size=3, padding=1)
    img = rand(1, 4, 6, 6).requires_grad_()
    attn(img, context=rand(1, 4, 5, seed=2)).square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert img.grad.abs().sum() > 0


# ------------------------------------------------------------------ half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_context", [False, True])
def test_autocast_finite_with_large_inputs(dtype, use_context):
    torch.manual_seed(0)
    attn = ImageLinearAttention(chan=16, heads=4, key_dim=32, value_dim=32, kernel_size=3, padding=1)
    img = torch.randn(2, 16, 16, 16) * 100
    context = torch.randn(2, 16, 40) * 100 if use_context else None
    with torch.autocast("cpu", dtype=dtype):
        out = attn(img, context=context)
    assert out.dtype == dtype
    assert out.shape == (2, 16, 16, 16)
    assert torch.isfinite(out).all()
    # accuracy at ordinary scale
    img, context = img / 100, None if context is None else context / 100
    with torch.autocast("cpu", dtype=dtype):
        out = attn(img, context=context)
    ref = attn(img, context=context)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.05


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(chan=0), ValueError, "chan"),
        (dict(chan_out=0), ValueError, "chan_out"),
        (dict(key_dim=0), ValueError, "key_dim"),
        (dict(value_dim=1.5), TypeError, "value_dim"),
        (dict(heads=0), ValueError, "heads"),
        (dict(kernel_size=0), ValueError, "kernel_size"),
        (dict(kernel_size=(1, 2, 3)), TypeError, "kernel_size"),
        (dict(padding=-1), ValueError, "padding"),
        (dict(stride=0), ValueError, "stride"),
        (dict(norm_queries=1), TypeError, "norm_queries"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        make(**kwargs)


def test_bad_forward_inputs():
    attn = make()
    img = rand(2, 4, 6, 6)
    cases = [
        (lambda: attn(rand(2, 3, 6, 6)), ValueError, "img"),
        (lambda: attn(rand(2, 4, 36)), ValueError, "img"),
        (lambda: attn(torch.ones(2, 4, 6, 6, dtype=torch.long)), TypeError, "img"),
        (lambda: attn(img, context=rand(2, 5, 10)), ValueError, "context"),
        (lambda: attn(img, context=rand(2, 4)), ValueError, "context"),
        (lambda: attn(img, context=rand(3, 4, 10)), ValueError, "context"),
        (lambda: make(kernel_size=3)(rand(1, 4, 2, 6)), ValueError, "img"),
        # a sequence context is one pixel high: a 3x3 kernel needs vertical padding
        (lambda: make(kernel_size=3)(img, context=rand(2, 4, 10)), ValueError, "context"),
        # to_out (stride 1, no padding) would leave nothing
        (lambda: make(kernel_size=3, stride=2)(rand(1, 4, 5, 5)), ValueError, "img"),
    ]
    for fn, exc, name in cases:
        with pytest.raises(exc, match=rf"^{name}\b"):
            fn()
    assert make(kernel_size=3)(img, context=rand(2, 4, 5, 5)).shape == (2, 4, 2, 2)
