"""Every option of every model mode either acts or is refused with an error that names it.

"Acts" is observed, not assumed: a model built with the option (and the same values for every
parameter the two models share) must compute something different from the model without
it, in train mode under one seed (so dropout counts). The few options whose effect is exact
by design (chunk sizes, checkpointing) are checked on the module that must carry them.
"""

import pytest
import torch

from linear_attention_transformer import (
    LinearAttentionTransformer,
    LinearAttentionTransformerLM,
    LinformerContextSettings,
    LinformerSettings,
)
from linear_attention_transformer.attention import Attention
from linear_attention_transformer.feedforward import FeedForward

D = torch.float64
DIM, N, M = 16, 12, 8

MODES = {
    "linear causal": dict(causal=True),
    "linear non-causal": dict(),
    "Linformer": dict(linformer_settings=LinformerSettings(k=4)),
    "decoder with context": dict(causal=True, receives_context=True),
    "Linformer context": dict(
        causal=True, receives_context=True, context_linformer_settings=LinformerContextSettings(seq_len=M, k=4)
    ),
}

WINDOW = dict(n_local_attn_heads=2, local_attn_window_size=4)
# (option, value, the options it needs beside it in both models[, options that go with it into the
# model under test only: a window of 4 shapes local heads, but alone it is refused])
OPTIONS = [
    ("n_local_attn_heads", 2, {}, dict(local_attn_window_size=4)),
    ("n_local_attn_heads", (2,), {}, dict(local_attn_window_size=4)),
    ("local_attn_window_size", 3, dict(n_local_attn_heads=2)),
    ("local_attn_window_size", 3, {}),  # no local heads, no axial attention: nothing to shape
    ("local_attn_look_backward", 2, WINDOW),
    ("local_attn_look_forward", 2, WINDOW),
    ("local_attn_exact_windowsize", True, WINDOW),
    ("blindspot_size", 4, {}),
    ("kv_heads", 2, {}),
    ("one_kv_head", True, {}),
    ("feature_map", "elu", {}),
    ("attn_dropout", 0.5, {}),
    ("attn_layer_dropout", 0.5, {}),
    ("chunk_size", 4, {}),
    ("use_gate", True, {}),
    ("gate_rank", 3, dict(use_gate=True)),
    ("gate_temperature", 2.0, dict(use_gate=True)),
    ("gate_granularity", "feature", dict(use_gate=True)),  # the kernel's gate setting, when present
    ("use_local_conv", True, {}),
    ("local_conv_kernel", 5, dict(use_local_conv=True)),
    ("ff_mult", 2, {}),
    ("ff_activation", "relu", {}),
    ("ff_glu", True, {}),
    ("ff_dropout", 0.5, {}),
    ("ff_chunks", 3, {}),
    ("shift_tokens", True, {}),
    ("reversible", True, {}),
    ("checkpoint", True, {}),
    ("attend_axially", True, {}, dict(local_attn_window_size=4)),
    ("pkm_layers", (1,), dict(pkm_num_keys=4)),
    ("use_rotary_emb", True, {}),
    ("update_rule", "delta", {}),
    ("dim_qk", 2, {}),
    ("dim_qk", 6, dict(use_rotary_emb=True)),
    ("rotary_base", 100.0, dict(use_rotary_emb=True)),
    ("rotary_base", 100.0, {}),  # no rotary embedding: nothing to shape
    ("norm", "rmsnorm", {}),
    ("norm_eps", 0.5, {}),
    ("norm_eps", 0.5, dict(norm="rmsnorm")),
    ("bias", False, {}),
    ("ff_hidden_dim", 24, {}),
    ("ff_activation", "silu", {}),
    ("local_attn_older_keys", "linear", {**WINDOW, "local_attn_exact_windowsize": True}),
    ("local_attn_feature_dim", 3, {**WINDOW, "local_attn_exact_windowsize": True, "local_attn_older_keys": "linear"}),
    ("local_attn_feature_dim", 3, {}),  # no keys beyond a window to read
    ("local_attn_sinks", 2, {**WINDOW, "local_attn_exact_windowsize": True, "local_attn_older_keys": "linear"}),
    ("local_attn_sinks", 2, {}),
    ("bogus_option", 1, {}),
    ("ff_bogus", 1, {}),
]

# options whose effect is exact by design: the module that must carry the value
CARRIED = {
    "chunk_size": lambda model: any(isinstance(m, Attention) and m.global_heads.chunk_size == 4 for m in model.modules()),
    "ff_chunks": lambda model: any(isinstance(m, FeedForward) and m.chunks == 3 for m in model.modules()),
    "checkpoint": lambda model: model.layers.checkpoint,
}


def build(**kw):
    torch.manual_seed(0)
    return LinearAttentionTransformer(dim=DIM, depth=1, heads=4, max_seq_len=16, **kw).to(D)


def run(model):
    torch.manual_seed(1)
    x = torch.randn(2, N, DIM, dtype=D)
    context = torch.randn(2, M, DIM, dtype=D)
    model.train()
    torch.manual_seed(2)
    return model(x, context=context if model.receives_context else None)


def copy_shared_parameters(source, target):
    """Give ``target`` the values of every parameter it shares (name and shape) with ``source``,
    and move its own ones away from their initial values: some start as the identity (a local
    convolution), and an option must show its effect once trained."""
    theirs = source.state_dict()
    with torch.no_grad():
        for name, t in target.state_dict().items():
            if name in theirs and theirs[name].shape == t.shape:
                t.copy_(theirs[name])
            elif t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.5)


OPTIONS = [entry if len(entry) == 4 else (*entry, {}) for entry in OPTIONS]


@pytest.mark.parametrize("option, value, needs, alongside", OPTIONS, ids=[f"{o}={v}" for o, v, *_ in OPTIONS])
def test_every_entry_is_checked_in_the_causal_mode(option, value, needs, alongside):
    # the walk below skips a mode whose base model is refused; in the most permissive mode no
    # base may be, or the entry would check nothing anywhere
    build(**MODES["linear causal"], **needs)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("option, value, needs, alongside", OPTIONS, ids=[f"{o}={v}" for o, v, *_ in OPTIONS])
def test_every_option_acts_or_is_refused(mode, option, value, needs, alongside):
    base_kw = {**MODES[mode], **needs}
    try:
        base = build(**base_kw)
    except (TypeError, ValueError):
        return  # the companion itself is refused in this mode; its own entry checks the message
    try:
        model = build(**base_kw, **alongside, **{option: value})
    except (TypeError, ValueError) as error:
        assert option in str(error), f"the error does not name {option!r}: {error}"
        return
    if option in CARRIED:
        assert CARRIED[option](model), f"{option} accepted but no layer carries it"
        return
    copy_shared_parameters(base, model)
    assert not torch.equal(run(base), run(model)), f"{option}={value!r} accepted in mode {mode!r} but changes nothing"


@pytest.mark.parametrize("mode", list(MODES))
def test_unknown_keywords_are_type_errors_naming_them(mode):
    with pytest.raises(TypeError, match="bogus_option"):
        build(**MODES[mode], bogus_option=1)
    with pytest.raises(TypeError, match="ff_bogus"):
        build(**MODES[mode], ff_bogus=1)


@pytest.mark.parametrize(
    "option, value",
    [("n_local_attn_heads", 2), ("blindspot_size", 4), ("kv_heads", 2), ("one_kv_head", True), ("feature_map", "elu"),
     ("chunk_size", 4), ("use_gate", True), ("use_local_conv", True)],
)
def test_linformer_refuses_linear_attention_options(option, value):
    with pytest.raises(ValueError, match=option):
        build(linformer_settings=LinformerSettings(k=4), **{option: value})


def test_attn_layer_dropout_acts_on_linformer_layers():
    model = build(linformer_settings=LinformerSettings(k=4), attn_layer_dropout=0.5)
    trained = run(model)
    model.eval()
    torch.manual_seed(1)
    x = torch.randn(2, N, DIM, dtype=D)
    assert not torch.equal(trained, model(x))  # dropout in train mode only
    torch.testing.assert_close(model(x), model(x))


@pytest.mark.parametrize("option, value", [("blindspot_size", 4), ("chunk_size", 4)])
def test_causal_kernel_options_refused_without_causal(option, value):
    with pytest.raises(ValueError, match=option):
        build(**{option: value})


def test_axial_and_rotary_position_embeddings_together_refused():
    kw = dict(num_tokens=10, dim=DIM, depth=1, heads=4, max_seq_len=16)
    with pytest.raises(ValueError, match="use_axial_pos_emb"):
        LinearAttentionTransformerLM(use_axial_pos_emb=True, use_rotary_emb=True, **kw)
    assert LinearAttentionTransformerLM(use_rotary_emb=True, **kw).pos_emb is None
    assert LinearAttentionTransformerLM(**kw).pos_emb is not None  # axial by default


def test_lm_window_size_shapes_the_axial_embedding_or_is_refused():
    """In the LM the window also shapes the axial position table: without local heads it acts
    there, and with rotary positions (no table) it has no use and is refused."""
    lm = dict(num_tokens=8, dim=DIM, depth=1, heads=4, max_seq_len=16)
    axial = LinearAttentionTransformerLM(**lm, local_attn_window_size=4)
    assert axial.pos_emb.width == 4
    with pytest.raises(ValueError, match="local_attn_window_size"):
        LinearAttentionTransformerLM(**lm, local_attn_window_size=4, use_rotary_emb=True)
    with pytest.raises(ValueError, match="local_attn_window_size"):
        Attention(DIM, heads=4, local_attn_window_size=4)
