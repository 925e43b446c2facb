"""Keys of a Hugging Face config that are not this library's options: config.json records which
of its keys are (``library_options``, with ``library_version``); a listed option this version
does not know is refused, a misspelt option is refused, and any other unknown key is kept on
the config with one warning, as transformers keeps the keys it does not know."""

import importlib
import json
import warnings
from pathlib import Path

import pytest
import torch

import linear_attention_transformer
from linear_attention_transformer import LinearAttentionTransformerLM

pytestmark = [pytest.mark.requires("transformers", "safetensors"), pytest.mark.usefixtures("one_thread")]

DATA = Path(__file__).resolve().parent / "data"
TINY = dict(num_tokens=64, dim=16, depth=1, max_seq_len=32, heads=2, causal=True, use_gate=True)
TOKENS = torch.tensor([[5, 17, 3, 60, 41, 8, 22, 9]])
KEPT = "LinearAttentionTransformerConfig kept"  # how the warning begins


@pytest.fixture
def hf(monkeypatch):
    """The module, with the Hub offline (nothing here may reach the network)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (read once, at import)
    return importlib.import_module("linear_attention_transformer.hf")


@pytest.fixture
def saved(hf, tmp_path):
    """A tiny float32 model saved to tmp_path / "model", and its logits of a few tokens."""
    torch.manual_seed(0)
    model = hf.LinearAttentionTransformerForCausalLM(hf.LinearAttentionTransformerConfig(**TINY)).eval()
    model.save_pretrained(tmp_path / "model")
    with torch.no_grad():
        logits = model(TOKENS).logits
    return tmp_path / "model", logits


def edit_config(folder, drop=(), **changes):
    """config.json in ``folder`` with ``changes`` and without the keys ``drop``; returns it."""
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(changes)
    for key in drop:
        del config[key]
    path.write_text(json.dumps(config), encoding="utf-8")
    return config


def load_recording(load):
    """What ``load()`` returns, and the messages of the config's warnings about kept keys."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = load()
    return loaded, [str(w.message) for w in record if str(w.message).startswith(KEPT)]


def test_config_json_records_the_librarys_options_and_version(hf, saved):
    from transformers import AutoConfig

    folder, _ = saved
    written = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert written["library_options"] == sorted(LinearAttentionTransformerLM.option_names())
    assert written["library_version"] == linear_attention_transformer.__version__
    config, kept = load_recording(lambda: AutoConfig.from_pretrained(folder))
    assert kept == [] and config.use_gate is True
    assert not hasattr(config, "library_options") and not hasattr(config, "library_version")


def test_a_config_json_without_the_record_loads_without_a_warning(hf):
    from transformers import AutoConfig

    # tests/data/hf_tiny/config.json predates library_options: every key is known
    assert "library_options" not in json.loads((DATA / "hf_tiny" / "config.json").read_text(encoding="utf-8"))
    config, kept = load_recording(lambda: AutoConfig.from_pretrained(DATA / "hf_tiny"))
    assert kept == [] and config.shift_tokens is True and config.num_tokens == 256


@pytest.mark.parametrize("key, value", [("layer_types", None), ("some_future_hf_key", 1)])
def test_an_unknown_key_is_kept_with_one_warning_and_saved_again(hf, saved, tmp_path, key, value):
    from transformers import AutoModelForCausalLM

    folder, logits = saved
    edit_config(folder, **{key: value})
    model, kept = load_recording(lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    assert len(kept) == 1 and repr(key) in kept[0] and "not read by the model" in kept[0]
    assert getattr(model.config, key) == value and model.config.to_dict()[key] == value
    with torch.no_grad():
        assert torch.equal(model.eval()(TOKENS).logits, logits)
    model.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text(encoding="utf-8"))[key] == value
    again, kept = load_recording(lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32))
    assert len(kept) == 1 and getattr(again.config, key) == value
    assert again.config.model_options() == model.config.model_options() == TINY


def test_an_option_this_version_does_not_know_is_refused(hf, saved):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, _ = saved
    config = edit_config(folder, future_option=True, library_version="9.1.0")
    edit_config(folder, library_options=sorted([*config["library_options"], "future_option"]))
    for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=r"'future_option'.* by linear_attention_transformer 9\.1\.0"):
            load(folder)
    # the record decides: the same key, unlisted, is another program's and kept
    edit_config(folder, library_options=config["library_options"])
    loaded, kept = load_recording(lambda: AutoConfig.from_pretrained(folder))
    assert loaded.future_option is True and len(kept) == 1 and "'future_option'" in kept[0]


def test_a_misspelt_option_is_refused_and_another_key_kept(hf, saved):
    from transformers import AutoConfig

    Config = hf.LinearAttentionTransformerConfig
    with pytest.raises(TypeError, match=r"'use_gat' \(did you mean 'use_gate'\?\)"):
        Config(**TINY, use_gat=True)
    with pytest.raises(TypeError, match=r"'hidden_szie' \(did you mean 'hidden_size'\?\)"):
        Config(hidden_szie=32)  # (transformers' names of options count as the library's)
    config, kept = load_recording(lambda: Config(**TINY, run_note="baseline"))
    assert config.run_note == "baseline" and len(kept) == 1 and "'run_note'" in kept[0]
    # in a config.json that records the library's options, an unlisted near-miss is not an option
    # of the writer's: kept, the warning suggesting the option
    folder, _ = saved
    edit_config(folder, use_gat=True)
    config, kept = load_recording(lambda: AutoConfig.from_pretrained(folder))
    assert config.use_gat is True and len(kept) == 1 and "'use_gat' (did you mean 'use_gate'?)" in kept[0]
    # without the record, it is a misspelling as in Python
    edit_config(folder, drop=["library_options"])
    with pytest.raises(TypeError, match="did you mean 'use_gate'"):
        AutoConfig.from_pretrained(folder)


def test_a_key_that_hides_the_configs_attributes_or_a_bad_record_is_refused(hf):
    Config = hf.LinearAttentionTransformerConfig
    with pytest.raises(ValueError, match="'model_options'"):
        Config(**TINY, model_options={})
    with pytest.raises(TypeError, match="library_options"):
        Config(**TINY, library_options="use_gate")
