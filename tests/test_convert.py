"""The exact import of a Llama checkpoint (``linear_attention_transformer/convert.py``), against
transformers' own ``LlamaForCausalLM`` on small random configurations, in float64."""

import pytest
import torch

pytestmark = [pytest.mark.requires("transformers"), pytest.mark.usefixtures("one_thread")]

D = torch.float64
SMALL = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def llama(seed=0, **options):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**SMALL, **options})
    model = LlamaForCausalLM(config).to(D).eval()
    with torch.no_grad():  # norms away from their initial ones, so that a swapped weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def tokens(shape, seed=1, high=97):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def float64_llama(monkeypatch):
    """transformers' Llama computed in float64 throughout: its RMSNorm and its rotary angles
    otherwise pass through float32 even in a float64 model (a difference of about 1e-7)."""
    from transformers.models.llama import modeling_llama

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        angles = position_ids[..., None].to(D) * self.inv_freq.to(D)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary)


@pytest.mark.parametrize("options", [
    {},
    dict(tie_word_embeddings=True),
    dict(num_key_value_heads=6, rope_theta=500.0),
    dict(num_key_value_heads=1, head_dim=16),
], ids=["grouped", "tied", "no-groups-theta", "one-kv-head-dim16"])
def test_logits_equal_transformers_llama(options, float64_llama):
    from linear_attention_transformer.convert import from_llama

    hf = llama(**options)
    lm = from_llama(hf)
    x = tokens((2, 40))
    with torch.no_grad():
        expected, got = hf(x).logits, lm(x)
    assert got.dtype == D
    torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-11)
    if options.get("tie_word_embeddings"):
        assert lm.to_logits.weight is lm.token_emb.weight


def test_logits_equal_transformers_own_float64_within_its_float32_casts():
    """Unpatched, transformers' RMSNorm and rotary angles round through float32: equal to that."""
    from linear_attention_transformer.convert import from_llama

    hf = llama()
    lm = from_llama(hf)
    x = tokens((2, 40))
    with torch.no_grad():
        torch.testing.assert_close(lm(x), hf(x).logits, rtol=1e-5, atol=1e-5)


def test_greedy_tokens_equal_transformers_generate(float64_llama):
    from linear_attention_transformer.convert import from_llama

    hf = llama(seed=3)
    lm = from_llama(hf)
    prompt = tokens((1, 7), seed=4)
    expected = hf.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)[0, 7:]
    # the library's cache: the prompt once, then one token per step through each head's ring
    with torch.no_grad():
        logits, cache = lm(prompt, return_cache=True)
        got = []
        for _ in range(30):
            token = logits[:, -1].argmax(-1, keepdim=True)
            got.append(token)
            logits, cache = lm(token, cache=cache, return_cache=True)
    assert torch.equal(torch.cat(got, dim=1)[0], expected)


def test_imported_weights_are_copies():
    from linear_attention_transformer.convert import from_llama

    hf = llama()
    lm = from_llama(hf)
    x = tokens((1, 9))
    with torch.no_grad():
        before = lm(x)
        for p in hf.parameters():
            p.zero_()
        torch.testing.assert_close(lm(x), before, rtol=0, atol=0)


@pytest.mark.parametrize("options, named", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope scaling"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_what_cannot_be_imported_exactly_is_refused_by_name(options, named):
    from linear_attention_transformer.convert import from_llama

    with pytest.raises(ValueError, match=named):
        from_llama(llama(**options))


def test_other_architectures_and_bare_bodies_refused():
    from transformers import LlamaModel, MistralConfig, MistralForCausalLM

    from linear_attention_transformer.convert import from_llama

    mistral = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16))
    with pytest.raises(ValueError, match="model_type='mistral'"):
        from_llama(mistral)
    with pytest.raises(ValueError, match="lm_head"):
        from_llama(LlamaModel(llama().config))
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        from_llama(torch.nn.Linear(2, 2))
