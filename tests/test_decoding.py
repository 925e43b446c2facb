"""The one-token decoder (decoding.py) equals the full forward, and its recurrence step
equals the reference step of ops/linear_attention.py."""

import pytest
import torch
from test_cache import CONFIGS, inputs, make

from linear_attention_transformer import AutoregressiveWrapper
from linear_attention_transformer.decoding import CacheDecoder, Decoder, global_step
from linear_attention_transformer.ops import CausalState
from linear_attention_transformer.ops.linear_attention import causal_linear_attention_step

D = torch.float64

DECODER_CONFIGS = {
    **{name: cfg for name, cfg in CONFIGS.items() if not cfg.get("attend_axially")},
    "gate+conv+rotary+exact window": dict(
        use_gate=True, use_local_conv=True, use_rotary_emb=True, n_local_attn_heads=2, local_attn_window_size=3,
        local_attn_look_backward=2, local_attn_exact_windowsize=True,
    ),
    "head gate+kv_heads+relu+factorised tied": dict(
        use_gate=True, gate_granularity="head", kv_heads=2, feature_map="relu", emb_dim=8, tie_embedding=True,
        n_local_attn_heads=2, local_attn_window_size=4, blindspot_size=2,
    ),
    "global only, blindspot 5": dict(blindspot_size=5, shift_tokens=True),
    "elu, blindspot 3, no gate": dict(feature_map="elu", blindspot_size=3, n_local_attn_heads=1, local_attn_window_size=6),
}


def decoded(model, x, mask, kw, prompt):
    """Logits for positions prompt - 1 .. n - 1: the prompt's last, then one per step."""
    logits, decoder = model.start_decoding(x[:, :prompt], input_mask=mask[:, :prompt], **kw)
    steps = [logits] + [decoder.step(x[:, t]) for t in range(prompt, x.shape[1])]
    return torch.stack(steps, dim=1), decoder


@pytest.mark.parametrize("name", list(DECODER_CONFIGS))
@pytest.mark.parametrize("prompt", [3, 4, 9])  # the padding (first 3 tokens of row 1) is in the prompt
def test_decoder_equals_full_forward_float64(name, prompt):
    cfg = DECODER_CONFIGS[name]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = model(x, input_mask=mask, **kw)
    out, decoder = decoded(model, x, mask, kw, prompt)
    assert isinstance(decoder, Decoder)  # the lean form, not the fallback
    assert decoder.position == x.shape[1]
    scale = full[mask].abs().max()
    assert (out - full[:, prompt - 1:])[mask[:, prompt - 1:]].abs().max() <= 1e-12 * scale
    after = model.state_dict()  # the decoder copies weights; it never adds to or writes into the model
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("name", ["local+blindspot+shift+reversible", "gate+conv+rotary+exact window"])
def test_decoder_exact_at_large_logits(name):
    """Queries and keys scaled to logits in the hundreds: the exponential features' references
    keep every step finite and equal to the full forward."""
    cfg = DECODER_CONFIGS[name]
    model = make(cfg)
    with torch.no_grad():
        for layer in model.modules():
            if hasattr(layer, "to_kv"):
                layer.to_q.weight.mul_(300.0)
                layer.to_kv.weight.mul_(300.0)
    x, mask, kw = inputs(cfg)
    full = model(x, input_mask=mask, **kw)
    out, _ = decoded(model, x, mask, kw, 5)
    assert torch.isfinite(out).all()
    assert (out - full[:, 4:])[mask[:, 4:]].abs().max() <= 1e-9 * full[mask].abs().max()


def test_decoder_float32_close_to_full_forward():
    cfg = DECODER_CONFIGS["local+blindspot+shift+reversible"]
    model = make(cfg, torch.float32)
    x, mask, kw = inputs(cfg, dtype=torch.float32)
    full = model(x, input_mask=mask, **kw)
    out, _ = decoded(model, x, mask, kw, 5)
    torch.testing.assert_close(out[mask[:, 4:]], full[:, 4:][mask[:, 4:]], rtol=1e-4, atol=1e-4)


def test_axial_model_gets_the_general_form_behind_the_same_interface():
    cfg = CONFIGS["gate+conv+axial+rotary"]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    out, decoder = decoded(model, x, mask, kw, 6)
    assert isinstance(decoder, CacheDecoder)
    full = model(x, input_mask=mask, **kw)
    assert (out - full[:, 5:])[mask[:, 5:]].abs().max() <= 1e-12 * full[mask].abs().max()


def test_decoder_refuses_steps_beyond_max_seq_len():
    model = make(CONFIGS["exact global"])
    _, decoder = model.start_decoding(torch.randint(0, 20, (1, 39)))
    decoder.step(torch.tensor([3]))  # position 39: the last one of max_seq_len = 40
    with pytest.raises(ValueError, match="max_seq_len"):
        decoder.step(torch.tensor([3]))


def test_generate_uses_the_decoder_and_matches_recompute():
    model = make(DECODER_CONFIGS["gate+conv+rotary+exact window"], torch.float32)
    wrapper = AutoregressiveWrapper(model)
    prompt = torch.randint(0, 20, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, :2] = False
    calls = []
    original = model.start_decoding
    model.start_decoding = lambda *a, **k: calls.append(1) or original(*a, **k)
    cached = wrapper.generate(prompt, 30, temperature=0, input_mask=mask, use_cache=True)
    del model.start_decoding
    recomputed = wrapper.generate(prompt, 30, temperature=0, input_mask=mask, use_cache=False)
    assert calls == [1]  # primed once, then stepped
    assert torch.equal(cached, recomputed)


# ------------------------------------------------------------ the recurrence step alone


# large logits matter for exponential features (given features are already non-negative)
@pytest.mark.parametrize("exp_features, logit_scale", [(True, 1.0), (True, 300.0), (False, 1.0)])
@pytest.mark.parametrize("blindspot", [1, 3])
@pytest.mark.parametrize("gate", [None, "head", "feature"])
def test_global_step_equals_reference_step_float64(exp_features, logit_scale, blindspot, gate):
    g = torch.Generator().manual_seed(blindspot)
    b, h, d, e, n = 2, 3, 4, 5, 11
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=D) * logit_scale for _ in range(2))
    v = torch.randn(b, h, n, e, generator=g, dtype=D)
    if not exp_features:
        q, k = q.exp(), k.exp()
    log_decay = None
    if gate is not None:
        shape = (b, h, n) if gate == "head" else (b, h, n, d)
        log_decay = -torch.rand(*shape, generator=g, dtype=D) * 3
    reference = CausalState.zeros(b, h, d, e, blindspot, exp_features, dtype=D)
    lean = (reference.kv, reference.ref, reference.pending, reference.pending_ref)
    for t in range(n):
        ld = None if log_decay is None else log_decay[:, :, t]
        want, reference = causal_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], reference, ld, blindspot,
                                                       exp_features)
        got, lean = global_step(q[:, :, t], k[:, :, t], v[:, :, t], lean, ld, blindspot, exp_features, t)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, r in zip(lean, (reference.kv, reference.ref, reference.pending, reference.pending_ref)):
        assert (a is None) == (r is None)
        if a is not None:
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
