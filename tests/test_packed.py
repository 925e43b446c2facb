"""Packed sequences (``segment_ids``): a packed row gives, for every segment, exactly what
that segment gives when it runs alone (float64, 1e-9), in every component; what cannot be
honoured is refused."""

import pytest
import torch

from linear_attention_transformer import (
    AutoregressiveWrapper,
    LinearAttentionTransformer,
    LinearAttentionTransformerLM,
    LinformerSettings,
)
from linear_attention_transformer.attention import Attention

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64
WINDOW = dict(local_attn_window_size=5)  # divides none of the segment lengths below

CAUSAL = {
    "plain": dict(),
    "gate(feature)+conv": dict(use_gate=True, use_local_conv=True),
    "gate(feature), elu": dict(use_gate=True, gate_granularity="feature", feature_map="elu"),
    "local heads, shift": dict(n_local_attn_heads=2, shift_tokens=True, **WINDOW),
    "local exact, look back 2": dict(n_local_attn_heads=1, local_attn_exact_windowsize=True,
                                     local_attn_look_backward=2, **WINDOW),
    "blindspot, local, gate, conv": dict(n_local_attn_heads=2, blindspot_size=4, use_gate=True, use_local_conv=True,
                                         **WINDOW),
    "reversible, rotary, shift, gate": dict(reversible=True, use_rotary_emb=True, shift_tokens=True, use_gate=True),
    "checkpoint, absolute positions, relu": dict(checkpoint=True, use_axial_pos_emb=False, feature_map="relu",
                                                 n_local_attn_heads=1, **WINDOW),
    "dim_qk 2, taylor, blindspot, local, gate, conv, rotary": dict(
        dim_qk=2, feature_map="taylor", n_local_attn_heads=1, blindspot_size=4, use_gate=True, use_local_conv=True,
        use_rotary_emb=True, **WINDOW),
    "delta, gate, conv, local, rotary": dict(update_rule="delta", use_gate=True, use_local_conv=True,
                                             n_local_attn_heads=2, use_rotary_emb=True, **WINDOW),
}
NONCAUSAL = {
    "plain": dict(),
    "gate, conv, elu": dict(use_gate=True, use_local_conv=True, feature_map="elu"),
    "local heads look 1+1, shift": dict(n_local_attn_heads=2, shift_tokens=True, **WINDOW),
    "local look 2+2, reversible, rotary": dict(n_local_attn_heads=1, local_attn_look_backward=2,
                                               local_attn_look_forward=2, reversible=True, use_rotary_emb=True,
                                               **WINDOW),
    "dim_qk 6, local, gate, conv, rotary": dict(dim_qk=6, n_local_attn_heads=2, use_gate=True, use_local_conv=True,
                                                use_rotary_emb=True, **WINDOW),
}
# segment lengths per row: a length-1 segment, boundaries on and off the chunk (4) and
# window (5) grid, a long segment over several chunks
LENGTHS = [[3, 1, 4, 9, 2, 8], [4, 4, 13, 1, 5]]


def lm(causal, **options):
    chunking = dict(chunk_size=4) if causal and "blindspot_size" not in options else {}
    model = LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=2, heads=4, max_seq_len=32, causal=causal,
                                         **chunking, **options)
    return model.to(D).eval()


def packed_batch(lengths, seed, ids=None):
    """Tokens (b, n) and segment ids laid out by ``lengths``; ids alternate 0/1 per segment
    (a run, not a value, is a segment)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths[0])
    x = torch.randint(0, 20, (len(lengths), n), generator=g)
    segment_ids = torch.stack([torch.cat([torch.full((l,), i % 2) for i, l in enumerate(row)]) for row in lengths])
    return x, segment_ids


def bounds(row):
    start = 0
    for length in row:
        yield start, start + length
        start += length


def each_segment_alone(model, x, lengths, mask=None):
    """The model run on every segment by itself, outputs laid out as in the packed row."""
    out = torch.zeros(*x.shape, model.num_tokens, dtype=D)
    for r, row in enumerate(lengths):
        for a, b in bounds(row):
            m = None if mask is None else mask[r : r + 1, a:b]
            out[r, a:b] = model(x[r : r + 1, a:b], input_mask=m)[0]
    return out


def assert_close(actual, expected, rtol=1e-9):
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("causal, name", [(True, k) for k in CAUSAL] + [(False, k) for k in NONCAUSAL])
def test_packed_equals_each_segment_alone(causal, name):
    torch.manual_seed(0)
    model = lm(causal, **(CAUSAL if causal else NONCAUSAL)[name])
    x, segment_ids = packed_batch(LENGTHS, seed=1)
    assert_close(model(x, segment_ids=segment_ids), each_segment_alone(model, x, LENGTHS))


@pytest.mark.parametrize("causal", [True, False])
def test_packed_with_padding_equals_each_segment_alone(causal):
    """input_mask keeps marking padding beside segment_ids (here a padded segment end and
    a whole padded segment); real tokens get what they get alone with the same mask."""
    torch.manual_seed(2)
    options = dict(n_local_attn_heads=2, use_gate=True, use_local_conv=True, shift_tokens=True, **WINDOW)
    model = lm(causal, **options)
    x, segment_ids = packed_batch(LENGTHS, seed=3)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, 14:17] = False  # the end of row 0's fourth segment
    mask[1, 25:26] = False  # row 1's length-1 segment, all padding
    mask[1, 5:7] = False  # inside a segment (a segment's positions count from its first token, padding or not)
    packed = model(x, input_mask=mask, segment_ids=segment_ids)
    alone = each_segment_alone(model, x, LENGTHS, mask)
    assert_close(packed[mask], alone[mask])


def test_packed_gradients_equal_each_segment_alone():
    """One full configuration: gradients of the parameters from the packed batch equal the
    sum over the segments run alone."""
    torch.manual_seed(4)
    model = lm(True, n_local_attn_heads=1, blindspot_size=4, use_gate=True, use_local_conv=True, shift_tokens=True,
               reversible=True, **WINDOW)
    x, segment_ids = packed_batch(LENGTHS, seed=5)
    weights = torch.randn(*x.shape, 20, dtype=D, generator=torch.Generator().manual_seed(6))
    model.train()  # no dropout configured: train mode only switches the reversible backward on
    (model(x, segment_ids=segment_ids) * weights).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    (each_segment_alone(model, x, LENGTHS) * weights).sum().backward()
    for name, p in model.named_parameters():
        if p.grad is None:
            assert packed[name] is None or packed[name].abs().max() == 0, name
            continue
        assert_close(packed[name], p.grad)


def test_one_segment_equals_no_segment_ids():
    torch.manual_seed(7)
    model = lm(True, n_local_attn_heads=2, blindspot_size=4, **WINDOW)
    x, _ = packed_batch(LENGTHS, seed=8)
    same = torch.full_like(x, 3)
    assert_close(model(x, segment_ids=same), model(x), rtol=1e-12)


def test_ids_are_runs_not_values():
    """[a, a, b, b, a]: the last run is a segment of its own, not a continuation of the first."""
    torch.manual_seed(9)
    model = lm(True, n_local_attn_heads=1, **WINDOW)
    x, _ = packed_batch([[5, 6, 7]], seed=10)
    ids = torch.tensor([[7] * 5 + [2] * 6 + [7] * 7])
    out = model(x, segment_ids=ids)
    assert_close(out[:, 11:], model(x[:, 11:]))
    runs = torch.tensor([[0] * 5 + [1] * 6 + [2] * 7])
    assert_close(out, model(x, segment_ids=runs), rtol=0)


def test_wrapper_loss_leaves_out_targets_that_start_a_segment():
    """The loss over a packed batch is the mean over each segment's own next-token targets:
    the same sum of losses as the segments alone, over as many targets."""
    torch.manual_seed(11)
    model = lm(True, n_local_attn_heads=1, shift_tokens=True, **WINDOW)
    wrapper = AutoregressiveWrapper(model)
    x, segment_ids = packed_batch(LENGTHS, seed=12)
    packed = wrapper(x, segment_ids=segment_ids)
    total, count = 0.0, 0
    for r, row in enumerate(LENGTHS):
        for a, b in bounds(row):
            if b - a >= 2:
                total = total + wrapper(x[r : r + 1, a:b]) * (b - a - 1)
                count += b - a - 1
    assert_close(packed, total / count)


# ------------------------------------------------------------------------- refused


def test_bad_segment_ids():
    model = lm(True)
    x = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(TypeError, match="segment_ids"):
        model(x, segment_ids=torch.zeros(2, 6))
    with pytest.raises(TypeError, match="segment_ids"):
        model(x, segment_ids=[[0] * 6] * 2)
    with pytest.raises(ValueError, match="segment_ids"):
        model(x, segment_ids=torch.zeros(2, 5, dtype=torch.long))
    layer = Attention(16, heads=4, causal=True)
    with pytest.raises(ValueError, match="segment_ids"):
        layer(torch.zeros(2, 6, 16), segment_ids=torch.zeros(6, dtype=torch.long))


def test_refused_with_a_cache():
    model = lm(True)
    x = torch.zeros(1, 6, dtype=torch.long)
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="segment_ids cannot be combined with a cache"):
        model(x, segment_ids=ids, return_cache=True)
    _, cache = model(x, return_cache=True)
    with pytest.raises(ValueError, match="segment_ids cannot be combined with a cache"):
        model(x[:, :1], segment_ids=ids[:, :1], cache=cache)


@pytest.mark.parametrize("options, what", [
    (dict(linformer_settings=LinformerSettings(k=4)), "Linformer"),
    (dict(attend_axially=True, local_attn_window_size=4), "attend_axially"),
    (dict(receives_context=True), "receives_context"),
])
def test_refused_model_kinds(options, what):
    model = LinearAttentionTransformer(dim=16, depth=1, heads=4, max_seq_len=8, **options)
    x = torch.zeros(1, 8, 16)
    context = torch.zeros(1, 3, 16) if options.get("receives_context") else None  # refused without it
    with pytest.raises(ValueError, match=what):
        model(x, context=context, segment_ids=torch.zeros(1, 8, dtype=torch.long))


def test_generate_with_segment_ids_refused():
    """Sampling continues one sequence through a cache: packed ids are refused, not ignored."""
    wrapper = AutoregressiveWrapper(lm(True).float())
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="segment_ids"):
        wrapper.generate(prompt, 2, segment_ids=torch.zeros(1, 4, dtype=torch.long))


def test_transformer_on_vectors_packed_equals_each_segment_alone():
    """The transformer itself (continuous inputs, rotary positions restarting per segment)."""
    torch.manual_seed(13)
    model = LinearAttentionTransformer(dim=16, depth=2, heads=4, max_seq_len=32, causal=True, chunk_size=4,
                                       n_local_attn_heads=2, use_rotary_emb=True, use_gate=True, **WINDOW).to(D).eval()
    x = torch.randn(2, 27, 16, dtype=D)
    _, segment_ids = packed_batch(LENGTHS, seed=14)
    packed = model(x, segment_ids=segment_ids)
    for r, row in enumerate(LENGTHS):
        for a, b in bounds(row):
            assert_close(packed[r : r + 1, a:b], model(x[r : r + 1, a:b]))
