"""Local heads that also read the keys older than their window by linear attention
(``local_attn_older_keys='linear'``, ``heads.WindowLinearHeads``): the layer against the plain
form of its own projections, and a model's cached, chunked, left-padded and streaming forms
against its full forward, in float64; what it refuses, by name."""

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformer, LinearAttentionTransformerLM
from linear_attention_transformer.attention import Attention
from linear_attention_transformer.heads import HedgehogFeatures, WindowLinearHeads
from linear_attention_transformer.ops.window_linear import naive_window_linear_attention

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64
OLDER = dict(local_attn_exact_windowsize=True, local_attn_older_keys="linear")


def model(seed=0, **options):
    torch.manual_seed(seed)
    options = {**dict(num_tokens=50, dim=32, depth=2, max_seq_len=64, heads=4, causal=True, n_local_attn_heads=4,
                      local_attn_window_size=5, local_attn_feature_dim=6, local_attn_sinks=2, use_rotary_emb=True),
               **OLDER, **options}
    lm = LinearAttentionTransformerLM(**options).to(D).eval()
    with torch.no_grad():  # (features away from the identity they start at)
        for name, p in lm.named_parameters():
            if ".local_heads." in name:
                p.add_(torch.randn_like(p) * 0.5)
    return lm


def tokens(shape, seed=1):
    return torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed))


def test_hedgehog_features_follow_their_definition():
    torch.manual_seed(0)
    features = HedgehogFeatures(2, 3, 4).to(D)
    with torch.no_grad():
        features.weight.normal_()
        features.bias.normal_()
    x = torch.randn(1, 2, 5, 3, dtype=D)
    projected = torch.stack([x[0, h] @ features.weight[h] + features.bias[h] for h in range(2)])[None]
    expected = torch.cat((projected.softmax(-1), (-projected).softmax(-1)), dim=-1)
    torch.testing.assert_close(features(x), expected, rtol=1e-14, atol=1e-14)
    fresh = HedgehogFeatures(2, 3, 4)
    assert torch.equal(fresh.weight[0], torch.eye(3, 4)) and not fresh.bias.any()  # the identity, at first


@pytest.mark.parametrize("sinks", [0, 2])
def test_layer_equals_the_plain_form_of_its_projections(sinks):
    torch.manual_seed(0)
    layer = Attention(16, heads=2, causal=True, n_local_attn_heads=2, local_attn_window_size=3,
                      local_attn_look_backward=2, local_attn_feature_dim=5, local_attn_sinks=sinks, **OLDER).to(D)
    x = torch.randn(2, 19, 16, dtype=D)
    mask = torch.rand(2, 19) > 0.3
    mask[:, 0] = True
    (q, k, v), _ = layer.project(x, x)
    heads = layer.local_heads
    assert isinstance(heads, WindowLinearHeads) and heads.keys == 6  # look_backward * size keys in the window
    fq = heads.query_features(q) * heads.older_log_weight.exp()[:, None, None]
    expected = naive_window_linear_attention(q, k, v, fq, heads.key_features(k), 6, mask, sinks)
    expected = layer.to_out(expected.transpose(1, 2).flatten(2))
    torch.testing.assert_close(layer(x, input_mask=mask), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [{}, dict(kv_heads=2), dict(heads=4, n_local_attn_heads=2),
                                     dict(local_attn_sinks=0), dict(local_attn_sinks=9)],
                         ids=["all-local", "grouped", "beside-global-heads", "no-sinks", "sinks-beyond-the-window"])
def test_cached_steps_and_chunks_equal_the_full_forward(options):
    lm = model(**options)
    x = tokens((2, 23))
    with torch.no_grad():
        full = lm(x)
        logits, cache = lm(x[:, :3], return_cache=True)
        steps = [logits]
        for t in range(3, 23):
            logits, cache = lm(x[:, t : t + 1], cache=cache, return_cache=True)
            steps.append(logits)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-11, atol=1e-11)
        logits, cache = lm(x[:, :7], return_cache=True)
        chunks = [logits]
        for a, b in [(7, 8), (8, 15), (15, 23)]:
            logits, cache = lm(x[:, a:b], cache=cache, return_cache=True)
            chunks.append(logits)
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-11, atol=1e-11)


def test_left_padded_rows_equal_each_row_alone():
    lm = model()
    x = tokens((2, 20), seed=2)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :6] = False
    with torch.no_grad():
        alone = lm(x[1:, 6:])[0]
        torch.testing.assert_close(lm(x, input_mask=mask)[1, 6:], alone, rtol=1e-11, atol=1e-11)
        logits, cache = lm(x[:, :9], input_mask=mask[:, :9], return_cache=True)
        out = [logits]
        for t in range(9, 20):
            logits, cache = lm(x[:, t : t + 1], cache=cache, return_cache=True)
            out.append(logits)
        torch.testing.assert_close(torch.cat(out, dim=1)[1, 6:], alone, rtol=1e-11, atol=1e-11)


def test_streaming_past_max_seq_len_keeps_a_state_of_fixed_size():
    lm = model(max_seq_len=16)
    x = tokens((1, 60), seed=3)
    with torch.no_grad():
        full = lm(x)
        logits, cache = lm(x[:, :1], return_cache=True)
        sizes = {t.numel() for t in cache.static_tensors()}
        out = [logits]
        for t in range(1, 60):
            logits, cache = lm(x[:, t : t + 1], cache=cache, return_cache=True)
            out.append(logits)
        assert {t.numel() for t in cache.static_tensors()} == sizes
    torch.testing.assert_close(torch.cat(out, dim=1), full, rtol=1e-10, atol=1e-10)


def test_a_later_token_leaves_earlier_outputs_alone():
    lm = model()
    x = tokens((1, 30), seed=4)
    changed = x.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 50
    with torch.no_grad():
        torch.testing.assert_close(lm(changed)[:, :20], lm(x)[:, :20], rtol=0, atol=0)


@pytest.mark.parametrize("options, match", [
    (dict(local_attn_older_keys="softmax"), "local_attn_older_keys must be"),
    (dict(local_attn_exact_windowsize=False), "local_attn_exact_windowsize=True"),
    (dict(causal=False, local_attn_exact_windowsize=False), "causal=True"),
    (dict(local_attn_older_keys=None), "local_attn_feature_dim"),
    (dict(local_attn_older_keys=None, local_attn_feature_dim=None), "local_attn_sinks"),
    (dict(local_attn_sinks=-1), "local_attn_sinks"),
    (dict(local_attn_feature_dim=0), "local_attn_feature_dim"),
])
def test_settings_it_cannot_honour_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        model(**options)


def test_packed_sequences_refused_by_name():
    lm = model()
    with pytest.raises(ValueError, match="segment_ids .* local_attn_older_keys"):
        lm(tokens((1, 10)), segment_ids=torch.tensor([[0] * 5 + [1] * 5]))


def test_without_local_heads_refused():
    with pytest.raises(ValueError, match="local_attn_older_keys"):
        LinearAttentionTransformer(dim=16, depth=1, max_seq_len=16, heads=2, causal=True, **OLDER)
