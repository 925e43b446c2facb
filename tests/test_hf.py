"""The Hugging Face model (``linear_attention_transformer/hf.py``): config, forward and loss,
save and reload, generate, the byte tokenizer. Float64 where numbers are compared; tiny models.
The module is imported per test (fixture ``hf``), after the ``requires`` marker has skipped
where transformers is absent."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM, LinformerSettings

pytestmark = [pytest.mark.requires("transformers", "safetensors"), pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(num_tokens=64, dim=32, depth=2, max_seq_len=64, heads=4, causal=True)


@pytest.fixture
def hf(monkeypatch):
    """The module, with the Hub offline (nothing here may reach the network)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (read once, at import)
    return importlib.import_module("linear_attention_transformer.hf")


def causal_lm(hf, dtype=torch.float64, seed=0, **options):
    torch.manual_seed(seed)
    config = hf.LinearAttentionTransformerConfig(**{**SMALL, **options})
    return hf.LinearAttentionTransformerForCausalLM(config).to(dtype).eval()


def tokens(shape, seed=1, high=64):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def test_the_package_does_not_import_transformers():
    probe = "import sys, linear_attention_transformer; print(sorted({'transformers', 'safetensors'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_hf_extra_admits_the_releases_tested_and_the_installed_one():
    import re

    import transformers
    from packaging.specifiers import SpecifierSet

    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    admitted = SpecifierSet(re.search(r'HF_EXTRA = \["transformers([^"]+)"', setup).group(1))
    assert all(v in admitted for v in ("4.57.6", "5.24.0", transformers.__version__)) and "4.56.2" not in admitted


# -- config -------------------------------------------------------------------------------------

def test_every_library_keyword_is_a_config_field_and_the_aliases_resolve(hf):
    config = hf.LinearAttentionTransformerConfig(vocab_size=100, hidden_size=48, num_hidden_layers=3,
                                                 num_attention_heads=6, max_position_embeddings=96)
    assert LinearAttentionTransformerLM.option_names() <= set(config.to_dict())
    assert (config.num_tokens, config.dim, config.depth, config.heads, config.max_seq_len) == (100, 48, 3, 6, 96)
    config.hidden_size = 24
    assert config.dim == 24 and config.model_options()["dim"] == 24
    assert config.use_gate is False and config.ff_mult == 4 and config.causal is True  # the library's defaults
    assert config.model_options() == dict(num_tokens=100, dim=24, depth=3, heads=6, max_seq_len=96, causal=True)
    same = hf.LinearAttentionTransformerConfig(**config.model_options())
    assert same == config and hf.LinearAttentionTransformerConfig(**{**config.model_options(), "dim": 32}) != config


def test_per_layer_tuples_survive_the_json_round_trip(hf, tmp_path):
    from transformers import AutoConfig

    config = hf.LinearAttentionTransformerConfig(**SMALL, n_local_attn_heads=(1, 2), local_attn_window_size=8,
                                                 pkm_layers=(1,))
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is hf.LinearAttentionTransformerConfig
    assert loaded.n_local_attn_heads == (1, 2) and isinstance(loaded.n_local_attn_heads, tuple)
    assert loaded.pkm_layers == (1,) and isinstance(loaded.pkm_layers, tuple)
    assert loaded.model_options() == config.model_options()


def test_options_json_cannot_hold_and_misspelt_keywords_are_refused(hf):
    Config = hf.LinearAttentionTransformerConfig
    with pytest.raises(ValueError, match="feature_map"):
        Config(**SMALL, feature_map=lambda x: x.relu())
    with pytest.raises(ValueError, match="linformer_settings"):
        Config(**SMALL, linformer_settings=LinformerSettings(k=8))
    with pytest.raises(TypeError, match="'hedas' \\(did you mean 'heads'\\?\\)"):
        Config(hedas=4)
    with pytest.raises(TypeError, match="'hidden_size' and 'dim'"):
        Config(hidden_size=32, dim=32)
    for refused in (dict(causal=False), dict(return_embeddings=True)):
        with pytest.raises(ValueError, match=next(iter(refused))):
            hf.LinearAttentionTransformerForCausalLM(Config(**{**SMALL, **refused}))


# -- forward and loss ---------------------------------------------------------------------------

def test_labels_give_the_loss_of_the_autoregressive_wrapper(hf):
    model = causal_lm(hf, n_local_attn_heads=2, local_attn_window_size=8, use_gate=True)
    x = tokens((3, 20))
    wrapper = AutoregressiveWrapper(model.model)
    out = model(x, labels=x)
    torch.testing.assert_close(out.loss, wrapper(x), rtol=1e-12, atol=1e-12)
    embedding = model.model.token_emb.weight
    grads = [torch.autograd.grad(loss, embedding)[0] for loss in (out.loss, wrapper(x))]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.logits, model.model(x), rtol=0, atol=0)
    # right padding: padded targets are not scored, as with the wrapper's input_mask
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, 14:] = False
    torch.testing.assert_close(model(x, attention_mask=mask.long(), labels=x).loss, wrapper(x, input_mask=mask),
                               rtol=1e-12, atol=1e-12)
    # -100 is not scored
    labels = x.clone()
    labels[:, 5:9] = -100
    logits, targets = out.logits[:, :-1], x[:, 1:].clone()
    targets[:, 4:8] = -100
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(model(x, labels=labels).loss, expected, rtol=1e-12, atol=1e-12)
    assert not torch.isclose(expected, out.loss)


def test_forward_with_a_cache_continues_the_sequence(hf):
    model = causal_lm(hf, n_local_attn_heads=2, local_attn_window_size=4, use_local_conv=True, shift_tokens=True)
    x, mask = tokens((2, 15)), torch.ones(2, 15, dtype=torch.long)
    first = model(x[:, :9], attention_mask=mask[:, :9], use_cache=True)
    cache = getattr(first, hf.CACHE_NAME)
    assert isinstance(cache, hf.LinearAttentionTransformerCache) and cache.get_seq_length() == 9
    second = model(x[:, 9:], attention_mask=mask, past_key_values=cache)  # (the mask may span the whole sequence)
    assert getattr(second, hf.CACHE_NAME) is cache and cache.get_seq_length() == 15
    full = model(x).logits
    torch.testing.assert_close(torch.cat([first.logits, second.logits], dim=1), full, rtol=1e-10, atol=1e-10)
    assert model(x, use_cache=False, return_dict=False)[0].shape == (2, 15, 64)
    with pytest.raises(TypeError, match="two names"):
        model(x[:, :1], cache=cache, past_key_values=cache)
    with pytest.raises(TypeError, match="LinearAttentionTransformerCache"):
        model(x[:, :1], cache=((torch.zeros(1),),))
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(x, inputs_embeds=torch.zeros(2, 15, 32))


# -- save and reload ----------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_save_and_reload_keep_the_tie_and_the_logits(hf, tmp_path, tie):
    from safetensors import safe_open
    from transformers import AutoModel, AutoModelForCausalLM

    # float32 throughout: the reloaded model is built in the checkpoint's dtype, so the logits match
    # bit for bit; rotary positions: their table is a buffer that is not saved
    model = causal_lm(hf, torch.float32, tie_embedding=tie, use_rotary_emb=True)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        stored = set(saved.keys())
    assert ("model.to_logits.weight" in stored) != tie and "model.token_emb.weight" in stored
    x = tokens((2, 12))
    for Auto in (AutoModelForCausalLM, AutoModel):
        loaded = Auto.from_pretrained(tmp_path, dtype=torch.float32).eval()
        assert type(loaded) is hf.LinearAttentionTransformerForCausalLM
        assert (loaded.model.to_logits.weight is loaded.model.token_emb.weight) == tie
        assert torch.equal(loaded.model.transformer.rotary.inv_freq, model.model.transformer.rotary.inv_freq)
        assert torch.equal(loaded(x).logits, model(x).logits)


WRAPPED = dict(SMALL, n_local_attn_heads=2, local_attn_window_size=8, use_rotary_emb=True, use_gate=True,
               tie_embedding=True)


def test_a_wrapped_library_model_saves_and_reloads_with_its_logits(hf, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(**WRAPPED).to(torch.float64).eval()
    wrapped = hf.LinearAttentionTransformerForCausalLM.wrap(model)
    assert wrapped.model is model and not wrapped.training
    assert wrapped.config == hf.LinearAttentionTransformerConfig(**WRAPPED)
    x = tokens((2, 20))
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(wrapped(x).logits, expected)
        wrapped.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
        assert type(loaded) is hf.LinearAttentionTransformerForCausalLM
        assert loaded.model.to_logits.weight is loaded.model.token_emb.weight
        # (close, not equal: the reloaded rotary table is computed in float32, the converted one in float64)
        torch.testing.assert_close(loaded(x).logits, expected)


def test_wrap_refuses_what_the_config_refuses(hf):
    wrap = hf.LinearAttentionTransformerForCausalLM.wrap
    with pytest.raises(ValueError, match="causal=False"):  # (left out: the library's default)
        wrap(LinearAttentionTransformerLM(**{name: value for name, value in WRAPPED.items() if name != "causal"}))
    with pytest.raises(TypeError, match="LinearAttentionTransformerLM"):
        wrap(LinearAttentionTransformerLM(**WRAPPED).transformer)


# -- generate -----------------------------------------------------------------------------------

def test_greedy_generate_equals_the_librarys_with_and_without_the_cache(hf):
    model = causal_lm(hf, n_local_attn_heads=2, local_attn_window_size=4, use_gate=True)
    prompt = tokens((2, 6))
    expected = AutoregressiveWrapper(model.model).generate(prompt, 12, temperature=0)
    for use_cache in (True, False):
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=use_cache)
        assert torch.equal(out[:, :6], prompt) and torch.equal(out[:, 6:], expected)


def test_sampling_beam_search_and_continuing_from_the_returned_cache(hf):
    model = causal_lm(hf, n_local_attn_heads=2, local_attn_window_size=4)
    prompt = tokens((2, 5))
    # the cache changes the cost, not the tokens: sampling (several per prompt) and beam search
    # (its reordering of the cache's rows) as when every step recomputes the whole sequence
    for options, rows in ((dict(do_sample=True, num_return_sequences=3, top_k=10), 6),
                          (dict(do_sample=False, num_beams=3, num_return_sequences=2), 4)):
        runs = []
        for use_cache in (True, False):
            torch.manual_seed(7)
            runs.append(model.generate(prompt, max_new_tokens=8, use_cache=use_cache, **options))
        assert runs[0].shape == (rows, 13) and torch.equal(runs[0], runs[1])
    greedy = model.generate(prompt, max_new_tokens=10, do_sample=False)
    first = model.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = getattr(first, hf.CACHE_NAME)
    assert isinstance(cache, hf.LinearAttentionTransformerCache) and cache.get_seq_length() == 8
    rest = model.generate(first.sequences, max_new_tokens=6, do_sample=False, **{hf.CACHE_NAME: cache})
    assert torch.equal(rest, greedy)
    # an empty cache passed in is filled
    empty = hf.LinearAttentionTransformerCache()
    assert torch.equal(model.generate(prompt, max_new_tokens=10, do_sample=False, **{hf.CACHE_NAME: empty}), greedy)
    assert empty.get_seq_length() == 14


# Each row of a left-padded batch gives what that row gives alone: positions count per row from
# its first real token (the library's own tests: tests/test_ragged.py)
RAGGED_CASES = {
    "axial": dict(),
    "absolute": dict(use_axial_pos_emb=False),
    "rotary": dict(use_rotary_emb=True),
    "local_heads": dict(n_local_attn_heads=2, local_attn_window_size=4),
    "local_conv": dict(use_local_conv=True),
    "shift_tokens": dict(shift_tokens=True),
    "use_gate": dict(use_gate=True),
    "recommended": dict(use_gate=True, use_local_conv=True, feature_map="taylor", dim_qk=8, n_local_attn_heads=2,
                        local_attn_window_size=4, use_rotary_emb=True),
}


@pytest.mark.parametrize("options", RAGGED_CASES.values(), ids=RAGGED_CASES.keys())
def test_each_row_of_a_left_padded_batch_is_that_row_alone(hf, options):
    model = causal_lm(hf, **options)
    rows = [tokens((1, 9), seed=2)[0], tokens((1, 5), seed=3)[0]]
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, width - len(row):], mask[i, width - len(row):] = row, 1
    last = model(batch, attention_mask=mask).logits[:, -1]
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for i, row in enumerate(rows):
        alone = row[None]
        torch.testing.assert_close(last[i], model(alone).logits[0, -1], rtol=1e-10, atol=1e-10)
        assert torch.equal(generated[i, width:], model.generate(alone, max_new_tokens=8, do_sample=False)[0, len(row):])


# -- the tokenizer ------------------------------------------------------------------------------

def test_the_byte_tokenizer_round_trips_any_text_and_reloads(hf, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = hf.byte_tokenizer()
    texts = ["plain ASCII, two  spaces\n\ttab", "héllo wörld, 日本語, 🎉", "Ā and \x00 are bytes too", ""]
    for tok in (tokenizer, None):
        if tok is None:
            tokenizer.save_pretrained(tmp_path)
            tok = AutoTokenizer.from_pretrained(tmp_path)
        assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == 256
        assert (tok.eos_token_id, tok.pad_token_id) == (0, 0)
        for text in texts:
            ids = tok(text)["input_ids"]
            assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
        batch = tok(["ab", "abcd"], padding=True, padding_side="left", return_tensors="pt")
        assert set(batch) == {"input_ids", "attention_mask"}
        assert batch["input_ids"].tolist() == [[0, 0, 97, 98], [97, 98, 99, 100]]
        assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.requires("accelerate")  # (transformers' Trainer needs it)
def test_trainer_trains_it(hf, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = causal_lm(hf, torch.float32)
    before = model.model.token_emb.weight.detach().clone()
    rows = [{"input_ids": row, "labels": row} for row in tokens((8, 16))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to="none", save_strategy="no", use_cpu=True, logging_steps=1)
    result = Trainer(model=model, args=args, train_dataset=rows).train()
    assert torch.isfinite(torch.tensor(result.training_loss)) and result.global_step == 2
    assert not torch.equal(model.model.token_emb.weight, before)


def test_a_reordered_cache_steps_on_its_own_and_leaves_the_old_one_as_it_was(hf):
    model = causal_lm(hf)
    x = tokens((2, 6))
    with torch.no_grad():
        out = model(x, use_cache=True)
        cache = getattr(out, hf.CACHE_NAME)
        old = cache.state
        cache.reorder_cache(torch.tensor([1, 0]))
        stepped = model(x[[1, 0], -1:] * 0 + 5, cache=cache, use_cache=True).logits[:, -1]
        # the old state's position (its device count too) did not move
        assert old.position == 6 and cache.get_seq_length() == 7
        alone = model(torch.cat((x[[1, 0]], torch.full((2, 1), 5)), dim=1)).logits[:, -1]
    torch.testing.assert_close(stepped, alone, rtol=1e-10, atol=1e-10)
