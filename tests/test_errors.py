"""Every keyword acts or is refused, and errors name the user's argument.

Forward arguments that a model or layer would not read (a context without receives_context,
input_mask or rotary on cross-attention, any keyword to a feed-forward), token ids outside the
vocabulary, empty sequences and misspelt options raise errors that name what the caller wrote.
"""

import inspect

import pytest
import torch

from linear_attention_transformer import (
    Attention,
    AutoregressiveWrapper,
    LinearAttentionTransformer,
    LinearAttentionTransformerLM,
    LinformerSelfAttention,
    compat,
)
from linear_attention_transformer.attention import LOCAL_WINDOW_SIZE
from linear_attention_transformer.autoregressive import top_p
from linear_attention_transformer.feedforward import FeedForward
from linear_attention_transformer.gating import ForgetGate, LocalConv
from linear_attention_transformer.ops import causal_linear_attention
from linear_attention_transformer.ops.causal.forms import CHUNK_SIZE
from linear_attention_transformer.place import PLAIN
from linear_attention_transformer.transformer import FoldAxially, ProductKeyMemory

DIM, TOKENS, MAX_LEN = 16, 20, 32


def lm(**options):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(TOKENS, DIM, 1, MAX_LEN, heads=2, **options).eval()


def tokens(n=5, b=2, seed=0):
    return torch.randint(0, TOKENS, (b, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ context without receives_context


def test_context_refused_by_a_model_without_receives_context():
    model = LinearAttentionTransformer(DIM, 1, MAX_LEN, heads=2, causal=True)
    x, context = torch.randn(2, 5, DIM), torch.randn(2, 3, DIM)
    for given in (dict(context=context), dict(context_mask=torch.ones(2, 3, dtype=torch.bool))):
        with pytest.raises(ValueError, match=r"context.*receives_context=True"):
            model(x, **given)
    decoder = LinearAttentionTransformer(DIM, 1, MAX_LEN, heads=2, causal=True, receives_context=True)
    assert not torch.allclose(decoder(x, context=context), decoder(x, context=torch.randn(2, 3, DIM)))


def test_context_refused_by_every_entry_of_an_lm_without_receives_context():
    model, x, context = lm(causal=True), tokens(), torch.randn(2, 3, DIM)
    with pytest.raises(ValueError, match=r"context.*receives_context=True"):
        model(x, context=context)
    with pytest.raises(ValueError, match=r"context.*receives_context=True"):
        model.output_features(x, context=context)
    with pytest.raises(ValueError, match=r"context.*receives_context=True"):
        model(x, context=context, return_cache=True)
    with pytest.raises(ValueError, match=r"context.*receives_context=True"):
        AutoregressiveWrapper(model).generate(x, 2, context=context)


def test_context_refused_by_a_self_attention_layer():
    layer = Attention(DIM, heads=2)
    with pytest.raises(ValueError, match=r"context.*receives_context=True"):
        layer(torch.randn(1, 4, DIM), context=torch.randn(1, 3, DIM))


# ------------------------------------------------------------------ cross-attention's own arguments


@pytest.mark.parametrize("name", ["input_mask", "rotary"])
def test_cross_attention_refuses_input_mask_and_rotary(name):
    layer = Attention(DIM, heads=2, receives_context=True)
    x, context = torch.randn(2, 4, DIM), torch.randn(2, 3, DIM)
    value = torch.ones(2, 4, dtype=torch.bool) if name == "input_mask" else (torch.ones(4, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=rf"{name}.*cross-attention.*context_mask"):
        layer(x, context=context, **{name: value})
    layer(x, context=context, context_mask=torch.ones(2, 3, dtype=torch.bool))  # its own mask acts
    # a decoder model routes input_mask to its self-attention only, where it acts
    model, x, context = lm(causal=True, receives_context=True), tokens(), torch.randn(2, 3, DIM)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[:, 0] = False
    assert not torch.allclose(model(x, context=context)[:, -1], model(x, context=context, input_mask=mask)[:, -1])


def test_linformer_cross_attention_refuses_input_mask():
    layer = LinformerSelfAttention(DIM, 8, k=4, heads=2)
    with pytest.raises(ValueError, match="input_mask.*context_mask"):
        layer(torch.randn(1, 4, DIM), torch.randn(1, 6, DIM), input_mask=torch.ones(1, 4, dtype=torch.bool))


# ------------------------------------------------------------------ no keyword swallowed


def test_feedforward_pkm_and_fold_refuse_keywords_they_do_not_read():
    x, mask = torch.randn(1, 4, DIM), torch.ones(1, 4, dtype=torch.bool)
    for module in (FeedForward(DIM), ProductKeyMemory(DIM, 4)):
        with pytest.raises(TypeError, match="input_mask"):
            module(x, input_mask=mask)
    fold = FoldAxially(2, Attention(DIM, heads=2))
    with pytest.raises(TypeError, match="context"):
        fold(x, input_mask=mask, context=x)


def test_positions_refused_without_rotary_embeddings():
    model = LinearAttentionTransformer(DIM, 1, MAX_LEN, heads=2)
    with pytest.raises(ValueError, match="positions.*use_rotary_emb"):
        model(torch.randn(1, 4, DIM), positions=torch.arange(4))
    rotary = LinearAttentionTransformer(DIM, 1, MAX_LEN, heads=2, use_rotary_emb=True)
    x = torch.randn(1, 4, DIM)
    assert not torch.allclose(rotary(x), rotary(x, positions=torch.arange(4) + 7))


# ------------------------------------------------------------------ defaults written once


def test_defaults_come_from_one_place():
    model = LinearAttentionTransformerLM(TOKENS, DIM, 1, 4 * LOCAL_WINDOW_SIZE, heads=2, causal=True,
                                         n_local_attn_heads=1, attend_axially=True, use_gate=True, use_local_conv=True)
    attention = model.transformer.layers.blocks[0][0].fn
    fold = model.transformer.layers.blocks[1][0].fn
    assert attention.local_heads.window.size == fold.width == model.pos_emb.width == LOCAL_WINDOW_SIZE
    kernel_default = inspect.signature(causal_linear_attention).parameters["chunk_size"].default
    assert attention.global_heads.chunk_size == kernel_default == CHUNK_SIZE
    gate = inspect.signature(ForgetGate).parameters
    assert attention.global_heads.forget_gate.temperature == gate["temperature"].default
    assert attention.global_heads.forget_gate.granularity == gate["granularity"].default
    assert attention.global_heads.forget_gate.gate_down.out_features == gate["rank"].default
    assert attention.global_heads.local_conv[0].kernel_size == inspect.signature(LocalConv).parameters["kernel_size"].default


def test_gate_settings_checked_in_a_layer_of_local_heads_only():
    with pytest.raises(ValueError, match="gate_rank"):
        Attention(DIM, heads=2, n_local_attn_heads=2, use_gate=True, gate_rank=0)


def test_fold_axially_checks_its_stride():
    with pytest.raises(ValueError, match="local_attn_window_size"):
        LinearAttentionTransformer(DIM, 1, MAX_LEN, heads=2, attend_axially=True, local_attn_window_size=0)


# ------------------------------------------------------------------ token ids, empty sequences


@pytest.mark.parametrize("bad", [TOKENS, -1])
def test_token_ids_outside_the_vocabulary_name_the_argument_and_range(bad):
    model, x = lm(causal=True), tokens()
    x[1, 2] = bad
    with pytest.raises(ValueError, match=rf"x holds token ids .*valid ids are 0 to {TOKENS - 1}"):
        model(x)
    with pytest.raises(ValueError, match=rf"start_tokens holds token ids .*valid ids are 0 to {TOKENS - 1}"):
        AutoregressiveWrapper(model).generate(x, 2)
    _, cache = model(tokens(), return_cache=True)
    with pytest.raises(ValueError, match="x holds token ids"):  # a continuing step, on the CPU
        model(x[:, 2:3], cache=cache)


def test_token_ids_are_checked_before_the_embedding_off_the_cpu(monkeypatch):
    """Off the CPU the ids are checked before the embedding reads them (on CUDA an id outside
    the vocabulary is a device-side assert that loses the CUDA context): here on the meta
    device, where the embedding would not fail at all."""
    import linear_attention_transformer.lm as lm_module

    seen = []

    def check(ids, num_tokens, name):
        seen.append((ids.device.type, num_tokens, name))
        raise ValueError("checked")

    monkeypatch.setattr(lm_module, "check_token_ids", check)
    with pytest.raises(ValueError, match="checked"):
        lm(causal=True).to("meta")(tokens().to("meta"))
    assert seen == [("meta", TOKENS, "x")]
    lm(causal=True)(tokens())  # (valid ids on the CPU: not checked, no host sync)
    assert len(seen) == 1


def test_empty_sequences_are_refused_at_every_entry():
    with pytest.raises(ValueError, match=r"at least one token.*\(1, 0\)"):
        lm(causal=True)(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"seq_len >= 1.*\(1, 0, 16\)"):
        LinearAttentionTransformer(DIM, 1, MAX_LEN, heads=2, causal=True)(torch.zeros(1, 0, DIM))
    with pytest.raises(ValueError, match=r"seq_len >= 1.*\(1, 0, 16\)"):
        Attention(DIM, heads=2)(torch.zeros(1, 0, DIM))


# ------------------------------------------------------------------ misspelt options


def test_a_misspelt_lm_option_names_the_lm_and_suggests_the_spelling():
    with pytest.raises(TypeError) as error:
        LinearAttentionTransformerLM(TOKENS, DIM, 1, MAX_LEN, n_local_attn_head=1)
    message = str(error.value)
    assert message.startswith("LinearAttentionTransformerLM got an unexpected keyword argument")
    assert "'n_local_attn_head' (did you mean 'n_local_attn_heads'?)" in message


def test_misspelt_options_of_the_other_models():
    with pytest.raises(TypeError, match=r"^LinearAttentionTransformer got .*'reversibel' \(did you mean 'reversible'\?\)"):
        LinearAttentionTransformer(DIM, 1, MAX_LEN, reversibel=True)
    with pytest.raises(TypeError, match=r"'ff_mul' \(did you mean 'ff_mult'\?\)"):
        LinearAttentionTransformer(DIM, 1, MAX_LEN, ff_mul=2)
    with pytest.raises(TypeError, match=r"^Linformer got .*'casual'"):
        compat.Linformer(DIM, MAX_LEN, 1, k=4, casual=True)
    with pytest.raises(TypeError, match=r"^LinformerLM got .*'emb_dims' \(did you mean 'emb_dim'\?\)"):
        compat.LinformerLM(TOKENS, DIM, MAX_LEN, 1, k=4, emb_dims=8)
    with pytest.raises(TypeError, match=r"'zzz'$"):  # nothing close: no suggestion
        LinearAttentionTransformer(DIM, 1, MAX_LEN, zzz=1)


def count_keyword_checks(monkeypatch, *modules):
    """The owners named by every call of ``refuse_unknown_keywords``, in every module that calls it."""
    from linear_attention_transformer import lm as lm_module, transformer as transformer_module

    real, owners = transformer_module.refuse_unknown_keywords, []

    def counted(owner, given, known):
        owners.append(owner)
        return real(owner, given, known)

    for module in (transformer_module, lm_module, compat, *modules):
        monkeypatch.setattr(module, "refuse_unknown_keywords", counted)
    return owners


@pytest.mark.parametrize("build, owner", [
    (lambda: LinearAttentionTransformerLM(TOKENS, DIM, 1, MAX_LEN, heads=2, ff_mult=2, use_gate=True),
     "LinearAttentionTransformerLM"),
    (lambda: LinearAttentionTransformer(DIM, 1, MAX_LEN, heads=2, ff_mult=2, use_gate=True), "LinearAttentionTransformer"),
    (lambda: compat.Linformer(DIM, MAX_LEN, 1, k=4, ff_mult=2), "Linformer"),
    (lambda: compat.LinformerLM(TOKENS, DIM, MAX_LEN, 1, k=4, ff_mult=2), "LinformerLM"),
])
def test_keywords_are_checked_once_by_the_constructor_called(monkeypatch, build, owner):
    """A model built inside another (the LM's stack, compat's models) takes the keywords its
    builder checked: one check per model, naming what the user called."""
    checks = count_keyword_checks(monkeypatch)
    build()
    assert checks == [owner]


def test_the_hugging_face_config_checks_keywords_once_and_its_model_not_again(monkeypatch):
    hf = pytest.importorskip("linear_attention_transformer.hf")
    checks = count_keyword_checks(monkeypatch, hf)
    config = hf.LinearAttentionTransformerConfig(num_tokens=TOKENS, dim=DIM, depth=1, max_seq_len=MAX_LEN, heads=2,
                                                 use_gate=True)
    assert checks == ["LinearAttentionTransformerConfig"]
    model = hf.LinearAttentionTransformerForCausalLM(config)
    assert checks == ["LinearAttentionTransformerConfig"] and model.model.transformer.attention_layers[0].global_heads.forget_gate


# ------------------------------------------------------------------ generate's keywords


def test_generate_takes_top_k_as_a_count():
    model, prompt = lm(causal=True), tokens(3)
    wrapper = AutoregressiveWrapper(model)
    greedy = wrapper.generate(prompt, 6, temperature=0.0)
    torch.manual_seed(3)
    assert torch.equal(wrapper.generate(prompt, 6, temperature=2.0, top_k=1), greedy)

    def keep_three(logits, thres):  # a reference: every logit below the third largest removed
        return logits.masked_fill(logits < logits.topk(3, dim=-1).values[..., -1:], float("-inf"))

    torch.manual_seed(4)
    expected = wrapper.generate(prompt, 6, temperature=2.0, filter_logits_fn=keep_three)
    torch.manual_seed(4)
    assert torch.equal(wrapper.generate(prompt, 6, temperature=2.0, top_k=3), expected)


def test_generate_takes_top_p_as_a_mass():
    wrapper, prompt = AutoregressiveWrapper(lm(causal=True)), tokens(3)
    torch.manual_seed(5)
    expected = wrapper.generate(prompt, 6, temperature=2.0, filter_logits_fn=top_p, filter_thres=0.6)
    torch.manual_seed(5)
    assert torch.equal(wrapper.generate(prompt, 6, temperature=2.0, top_p=0.6), expected)
    torch.manual_seed(6)
    unfiltered = wrapper.generate(prompt, 6, temperature=2.0, filter_logits_fn=None)
    torch.manual_seed(6)
    assert torch.equal(wrapper.generate(prompt, 6, temperature=2.0, top_p=1.0), unfiltered)
    torch.manual_seed(7)
    assert torch.equal(wrapper.generate(prompt, 6, top_k=1, top_p=0.9), wrapper.generate(prompt, 6, temperature=0.0))


@pytest.mark.parametrize("given, error, match", [
    (dict(top_k=3, filter_thres=0.5), ValueError, "filter_logits_fn / filter_thres"),
    (dict(top_p=0.5, filter_logits_fn=None), ValueError, "filter_logits_fn / filter_thres"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k must be an int"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(return_lengths=1), TypeError, "return_lengths must be True or False"),
])
def test_generate_refuses_conflicting_or_bad_filters(given, error, match):
    with pytest.raises(error, match=match):
        AutoregressiveWrapper(lm(causal=True)).generate(tokens(3), 2, **given)


class Increment(torch.nn.Module):
    """Logits whose favourite is (last token + 1) % num_tokens: greedy outputs known in advance."""

    num_tokens, max_seq_len = 10, 16

    def forward(self, x, **kwargs):
        return torch.nn.functional.one_hot((x + 1) % self.num_tokens, self.num_tokens).float() * 10.0


@pytest.mark.parametrize("pad_value", [0, 4])
def test_generate_returns_each_rows_length(pad_value):
    wrapper = AutoregressiveWrapper(Increment(), pad_value=pad_value)
    out, lengths = wrapper.generate(torch.tensor([[1], [6], [3]]), 6, eos_token=4, temperature=0.0,
                                    return_lengths=True)
    p = pad_value
    # row 1 never meets eos and holds a real 0, which pad_value=0 alone could not tell apart
    assert out.tolist() == [[2, 3, 4, p, p, p], [7, 8, 9, 0, 1, 2], [4, p, p, p, p, p]]
    assert lengths.tolist() == [3, 6, 1] and lengths.dtype == torch.long
    out, length = wrapper.generate(torch.tensor([1]), 5, eos_token=4, temperature=0.0, return_lengths=True)
    assert out.tolist() == [2, 3, 4] and length.ndim == 0 and int(length) == 3
    out, lengths = wrapper.generate(torch.tensor([[1], [2]]), 3, temperature=0.0, return_lengths=True)
    assert lengths.tolist() == [3, 3]  # no eos_token: every generated token counts


@pytest.mark.parametrize("options, named", [
    (dict(update_rule="delta", causal=False), "causal"),
    (dict(update_rule="delta", causal=True, n_local_attn_heads=4, local_attn_window_size=4), "every head"),
    (dict(update_rule="delta", causal=True, feature_map="taylor"), "feature_map"),
    (dict(update_rule="delta", causal=True, feature_map="softmax"), "feature_map"),
    (dict(update_rule="delta", causal=True, blindspot_size=2), "blindspot_size"),
    (dict(update_rule="delta", causal=True, use_gate=True, gate_granularity="feature"), "gate_granularity"),
    (dict(update_rule="delta", causal=True, receives_context=True), "receives_context"),
    (dict(update_rule="Delta", causal=True), "update_rule"),
])
def test_what_the_delta_rule_cannot_honour_is_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        Attention(16, heads=4, **options)


def test_context_parallel_refuses_the_delta_rule_by_name():
    layer = Attention(16, heads=4, causal=True, update_rule="delta")
    with pytest.raises(ValueError, match="update_rule='delta'"):
        layer.check_place(PLAIN, 8, parallel=True)
