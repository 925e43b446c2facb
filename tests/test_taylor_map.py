"""feature_map='taylor' in whole models: its features are wider than the head (1 + d + d (d + 1) / 2),
so the causal state, the cache and the one-token step must all carry that width. Only public
model APIs: forward with and without a cache, one token per row under no_grad (the step)."""

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {
    "taylor": dict(),
    "taylor, conv, gate, local head": dict(use_local_conv=True, use_gate=True, n_local_attn_heads=1,
                                           local_attn_window_size=8),
    "taylor, blindspot 3, rotary": dict(blindspot_size=3, use_rotary_emb=True),
}


def make_model(options, seed=0):
    torch.manual_seed(seed)
    model = LinearAttentionTransformerLM(num_tokens=40, dim=24, depth=2, max_seq_len=64, heads=2, causal=True,
                                         chunk_size=16, feature_map="taylor", **options)
    return model.double().eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_taylor_cache_in_pieces_equals_full_forward(name):
    model = make_model(CONFIGS[name])
    x = torch.randint(0, 40, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        outs, cache = [], None
        for start, end in ((0, 1), (1, 18), (18, 19), (19, 41)):  # 1 token, past a chunk, 1, the rest
            out, cache = model(x[:, start:end], cache=cache, return_cache=True)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_taylor_decoder_steps_equal_full_forward(name):
    model = make_model(CONFIGS[name], seed=2)
    x = torch.randint(0, 40, (3, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x)
        logits, cache = model(x[:, :7], return_cache=True)
        steps = [logits[:, -1]]
        taken = []
        original = model.transformer.attend
        model.transformer.attend = lambda x, place, *args: taken.append(place.step) or original(x, place, *args)
        for t in range(7, 29):
            out, cache = model(x[:, t:t + 1], cache=cache, return_cache=True)
            steps.append(out[:, 0])
        del model.transformer.attend
    assert taken == [True] * 22  # the one-token step, not the general cached path
    assert cache.position == 29
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:29], rtol=1e-10, atol=1e-10)


def test_taylor_model_weights_differ_from_elu_model():
    """The option acts: same weights, another feature map, other logits."""
    model = make_model({})
    x = torch.randint(0, 40, (1, 20), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    elu = LinearAttentionTransformerLM(num_tokens=40, dim=24, depth=2, max_seq_len=64, heads=2, causal=True,
                                       chunk_size=16, feature_map="elu").double().eval()
    elu.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (model(x) - elu(x)).abs().max() > 1e-3
