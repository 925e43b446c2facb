"""Local window options (seed 004): look_backward, look_forward, exact window size, against an
explicit masked softmax written here from the definition, in the full forward and in cached
decoding."""

import pytest
import torch
from einops import rearrange

from linear_attention_transformer import LinearAttentionTransformer
from linear_attention_transformer.attention import Attention
from linear_attention_transformer.ops.windowed_attention import Window, windowed_attention

D = torch.float64

# (causal, look_backward, look_forward, exact)
WINDOWS = [
    (True, 1, None, False),
    (True, 2, None, False),
    (True, 0, None, False),
    (True, 1, None, True),
    (True, 3, None, True),
    (False, 1, None, False),
    (False, 0, 2, False),
    (False, 2, 0, False),
]


def sees(i, j, w, causal, back, forward, exact):
    """Key j visible to query i, from the definitions in seed 004's words."""
    if exact:  # the last back * w keys, the query itself included
        return i - back * w < j <= i
    in_windows = i // w - back <= j // w <= i // w + forward
    return in_windows and (j <= i or not causal)


def explicit(q, k, v, w, causal, back, forward, exact, mask):
    b, h, n, d = q.shape
    out = torch.zeros_like(q)
    for i in range(n):
        keys = [j for j in range(n) if sees(i, j, w, causal, back, forward, exact)]
        for bi in range(b):
            real = [j for j in keys if mask is None or mask[bi, j]]
            logits = torch.einsum("hd,hjd->hj", q[bi, :, i], k[bi, :, real]) / d**0.5
            out[bi, :, i] = torch.einsum("hj,hjd->hd", logits.softmax(-1), v[bi, :, real])
    return out


def random_mask(n, w):
    mask = torch.rand(2, n) > 0.3
    mask[:, :: max(1, w // 2)] = True  # every query keeps a visible key
    return mask


@pytest.mark.parametrize("causal, back, forward, exact", WINDOWS)
@pytest.mark.parametrize("n", [3, 12, 14])  # (3: shorter than one window)
@pytest.mark.parametrize("masked", [False, True])
def test_blocked_form_equals_explicit_softmax(causal, back, forward, exact, n, masked):
    torch.manual_seed(n)
    w = 4
    forward = (0 if causal else 1) if forward is None else forward
    q, k, v = (torch.randn(2, 3, n, 5, dtype=D) for _ in range(3))
    mask = random_mask(n, w) if masked else None
    out = windowed_attention(q, k, v, Window(w, back, forward, causal, exact), mask)
    ref = explicit(q, k, v, w, causal, back, forward, exact, mask)
    rows = slice(None) if mask is None else mask[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(out[rows], ref[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal, back, forward, exact", WINDOWS)
def test_layer_local_heads_use_the_window_options(causal, back, forward, exact):
    torch.manual_seed(3)
    options = dict(local_attn_look_backward=back, local_attn_exact_windowsize=exact)
    if forward is not None:
        options["local_attn_look_forward"] = forward
    layer = Attention(16, heads=2, dim_head=5, causal=causal, n_local_attn_heads=2, local_attn_window_size=3,
                      **options).to(D)
    x = torch.randn(2, 10, 16, dtype=D)
    mask = random_mask(10, 3)
    q, k, v = layer.project(x, x)[0]  # (every head is local)
    forward = (0 if causal else 1) if forward is None else forward
    heads = explicit(q, k, v, 3, causal, back, forward, exact, mask)
    ref = layer.to_out(rearrange(heads, "b h n d -> b n (h d)"))
    torch.testing.assert_close(layer(x, input_mask=mask)[mask], ref[mask], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("back, exact", [(2, False), (1, True), (3, True)])
@pytest.mark.parametrize("steps", [(1,) * 11, (3, 1, 4, 1, 2)])
def test_cached_decoding_equals_full_forward(back, exact, steps):
    torch.manual_seed(5)
    model = LinearAttentionTransformer(
        dim=16, depth=2, heads=4, max_seq_len=32, causal=True, n_local_attn_heads=2, local_attn_window_size=3,
        local_attn_look_backward=back, local_attn_exact_windowsize=exact, chunk_size=4,
    ).to(D).eval()
    n = sum(steps)
    x = torch.randn(2, n, 16, dtype=D)
    mask = random_mask(n, 3)
    full = model(x, input_mask=mask)
    cache, outs, start = None, [], 0
    for step in steps:
        out, cache = model(x[:, start : start + step], input_mask=mask[:, start : start + step], cache=cache,
                           return_cache=True)
        outs.append(out)
        start += step
    local = cache.layers[0][0].fn.local
    assert local.keys.shape[2] <= back * 3 + 3  # the cache keeps a bounded window, not the sequence
    torch.testing.assert_close(torch.cat(outs, 1)[mask], full[mask], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "options, name",
    [
        (dict(causal=True, local_attn_look_forward=1), "local_attn_look_forward"),
        (dict(local_attn_exact_windowsize=True), "local_attn_exact_windowsize"),
        (dict(causal=True, local_attn_exact_windowsize=True, local_attn_look_backward=0), "local_attn_exact_windowsize"),
        (dict(local_attn_look_backward=-1), "local_attn_look_backward"),
        (dict(local_attn_look_forward=1.5), "local_attn_look_forward"),
    ],
)
def test_bad_window_options(options, name):
    with pytest.raises(ValueError, match=name):
        LinearAttentionTransformer(dim=16, depth=1, heads=4, max_seq_len=8, n_local_attn_heads=2, **options)


def test_window_options_without_local_heads_refused():
    with pytest.raises(ValueError, match="local_attn_look_backward"):
        LinearAttentionTransformer(dim=16, depth=1, heads=4, max_seq_len=8, local_attn_look_backward=2)


@pytest.mark.parametrize("exact", [False, True])
def test_query_that_sees_no_key_gets_zero_and_reads_nothing_later(exact):
    """A padded first token of a causal window sees no key (its own is masked): it must get 0,
    not a uniform average over the window's later keys."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=D, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 0] = False
    out = windowed_attention(q, k, v, Window(4, causal=True, exact=exact), mask)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    grads = torch.autograd.grad(out[:, :, 0].sum(), (k, v), allow_unused=True)
    assert all(gr is None or torch.equal(gr, torch.zeros_like(gr)) for gr in grads)
