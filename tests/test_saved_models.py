"""Models saved by version 0.2.0 of the library (``__version__``, recorded beside them)
load into the current code and compute what they computed then.

tests/data holds them (written by tests/data/make_fixtures.py with that code, never at test
time): two ``LinearAttentionTransformerLM`` state_dicts with the keywords they were built with,
a ``save_pretrained`` folder of the Hugging Face model, and each one's float64 logits of a fixed
token sequence. A change that renames, fuses or reshapes parameters must still load these
(strict state_dict loading, ``from_pretrained``) and give the same logits; the cached one-token
step must give the full forward's logits at every position, through the stored sequence and on
through greedy decoding past it.
"""

import importlib
from pathlib import Path

import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).resolve().parent / "data"
EXPECTED = torch.load(DATA / "expected_logits.pt", weights_only=True)
STATE_DICTS = torch.load(DATA / "state_dict_tiny.pt", weights_only=True)
PROMPT = 8  # tokens read at once before stepping
GREEDY = 6  # tokens decoded past the stored sequence
TOLERANCE = dict(rtol=1e-10, atol=1e-10)  # float64: a reordering of the sums moves ~1e-14


def assert_decodes_as_the_full_forward(lm, tokens, expected):
    """``lm``'s cache after a prompt, then one token at a time: the stored sequence's tokens (logits
    as ``expected``), then its own greedy tokens, whose logits must be the full forward's."""
    with torch.no_grad():
        logits, cache = lm(tokens[:, :PROMPT], return_cache=True)
        steps = [logits]
        for i in range(PROMPT, tokens.shape[1]):
            logits, cache = lm(tokens[:, i:i + 1], cache=cache, return_cache=True)
            steps.append(logits)
        sequence = tokens
        for _ in range(GREEDY):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat((sequence, next_token), dim=1)
            logits, cache = lm(next_token, cache=cache, return_cache=True)
            steps.append(logits)
        stepped = torch.cat(steps, dim=1)  # (one column per token of sequence)
        full = lm(sequence)
    n = tokens.shape[1]
    torch.testing.assert_close(stepped[:, :n], expected, **TOLERANCE)
    torch.testing.assert_close(stepped[:, n:], full[:, n:], **TOLERANCE)
    torch.testing.assert_close(full[:, :n], expected, **TOLERANCE)


def test_the_fixtures_are_what_the_tests_expect():
    # (not the numbers, which only the code that wrote them may produce: their shapes and
    # kinds, so that a regenerated set that lost something fails here rather than passing)
    assert EXPECTED["version"] == "0.2.0" and EXPECTED["tokens"].shape == (1, 20)
    assert set(STATE_DICTS) == {"taylor_local_gate_conv", "reversible_kv_heads"}
    for name in (*STATE_DICTS, "hf_tiny"):
        logits = EXPECTED[name]
        assert logits.dtype == torch.float64 and logits.shape[:2] == (1, 20) and bool(logits.isfinite().all())
    assert STATE_DICTS["taylor_local_gate_conv"]["options"]["dim_qk"] == 8
    assert STATE_DICTS["reversible_kv_heads"]["options"]["kv_heads"] == 2


@pytest.mark.parametrize("name", sorted(STATE_DICTS))
def test_a_saved_state_dict_loads_strictly_and_computes_what_it_did(name, test_device):
    saved = STATE_DICTS[name]
    lm = LinearAttentionTransformerLM(**saved["options"])
    lm.load_state_dict(saved["state_dict"], strict=True)
    lm = lm.double().eval().to(test_device)
    tokens, expected = EXPECTED["tokens"].to(test_device), EXPECTED[name].to(test_device)
    with torch.no_grad():
        torch.testing.assert_close(lm(tokens), expected, **TOLERANCE)
    assert_decodes_as_the_full_forward(lm, tokens, expected)


@pytest.mark.requires("transformers", "safetensors")
def test_a_saved_hugging_face_folder_loads_and_computes_what_it_did(monkeypatch, test_device):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (read once, at import)
    hf = importlib.import_module("linear_attention_transformer.hf")
    from transformers import AutoModelForCausalLM

    folder = DATA / "hf_tiny"
    tokens, expected = EXPECTED["tokens"].to(test_device), EXPECTED["hf_tiny"].to(test_device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(test_device)
    assert type(model) is hf.LinearAttentionTransformerForCausalLM
    assert model.model.token_emb.weight.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits.double(), expected, rtol=1e-4, atol=1e-4)
        # cast as the fixture's logits were (the rotary table too): the tight comparison
        model.double()
        torch.testing.assert_close(model(tokens).logits, expected, **TOLERANCE)
    assert_decodes_as_the_full_forward(model.model, tokens, expected)
