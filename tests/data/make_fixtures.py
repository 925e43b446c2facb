"""Writes the saved-model fixtures beside this file, which tests/test_saved_models.py loads with
the current code. Not part of the suite: run it with the code whose models are to be kept
(``python tests/data/make_fixtures.py`` in a checkout of it: that checkout's package is
imported, whatever is installed). The files it writes are that code's models and numbers,
kept so that a later version that renames or fuses parameters is held to loading them.

Written:
    state_dict_tiny.pt   {name: {"options": LinearAttentionTransformerLM keywords,
                          "state_dict": its state_dict (float32)}}
    hf_tiny/             a LinearAttentionTransformerForCausalLM by save_pretrained (safetensors,
                          float32); no tokenizer, which transformers 5 saves in a form 4.57
                          does not read
    expected_logits.pt   {"tokens": (1, 20) long, "version": the writer's __version__,
                          name (the state_dicts' and "hf_tiny"): float64 logits (1, 20, num_tokens)}

The logits are those of the saved float32 parameters cast to float64 (``model.double()``),
so that the comparison can be tight. Every parameter gets seeded noise beyond its
initialisation first: a LayerNorm left at ones or a gate at zeros would not notice being
loaded into the wrong place.
"""

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # (the checkout this file is in, not an installed copy)

STATE_DICTS = {
    # axial positions (the default), local beside global heads, Taylor features of a q/k width
    # other than the heads' (dim_qk), the forget gate and the short convolution
    "taylor_local_gate_conv": dict(num_tokens=64, dim=32, depth=2, max_seq_len=64, heads=4, causal=True,
                                   n_local_attn_heads=2, local_attn_window_size=8, feature_map="taylor", dim_qk=8,
                                   use_gate=True, use_local_conv=True),
    # reversible layers and key/value heads shared by two query heads each
    "reversible_kv_heads": dict(num_tokens=64, dim=32, depth=2, max_seq_len=64, heads=4, causal=True,
                                n_local_attn_heads=2, local_attn_window_size=8, kv_heads=2, reversible=True),
}
# (num_tokens=256: the byte-level models of examples/ and their --hf-save)
HF_OPTIONS = dict(num_tokens=256, dim=32, depth=2, heads=4, n_local_attn_heads=2, local_attn_window_size=8,
                  max_seq_len=64, use_gate=True, use_local_conv=True, shift_tokens=True, use_rotary_emb=True,
                  ff_glu=True)
TOKENS = torch.tensor([[(7 * i + 3) % 64 for i in range(20)]])  # (below every model's num_tokens)


def perturbed(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def logits_of(model):
    with torch.no_grad():
        out = model.double().eval()(TOKENS)
    return getattr(out, "logits", out)


def main():
    import linear_attention_transformer
    from linear_attention_transformer import LinearAttentionTransformerLM
    from linear_attention_transformer.hf import (LinearAttentionTransformerConfig,
                                                 LinearAttentionTransformerForCausalLM)

    expected = {"tokens": TOKENS, "version": linear_attention_transformer.__version__}
    saved = {}
    for seed, (name, options) in enumerate(STATE_DICTS.items()):
        torch.manual_seed(seed)
        model = perturbed(LinearAttentionTransformerLM(**options), seed + 100)
        saved[name] = {"options": options, "state_dict": {k: v.clone() for k, v in model.state_dict().items()}}
        expected[name] = logits_of(model)
    torch.save(saved, HERE / "state_dict_tiny.pt")

    torch.manual_seed(10)
    hf_model = perturbed(LinearAttentionTransformerForCausalLM(LinearAttentionTransformerConfig(**HF_OPTIONS)), 110)
    hf_model.save_pretrained(HERE / "hf_tiny")
    expected["hf_tiny"] = logits_of(hf_model)
    torch.save(expected, HERE / "expected_logits.pt")
    print(f"written by {linear_attention_transformer.__file__} ({expected['version']})")


if __name__ == "__main__":
    main()
