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
    with pytest.raises(ValueError, match="lm_head"):  # (tied: the body alone lacks its output layer all the same)
        from_llama(LlamaModel(llama(tie_word_embeddings=True).config))
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        from_llama(torch.nn.Linear(2, 2))


# -- linearize and attention transfer -------------------------------------------------------------

def linearized(window=8, seed=0, sinks=1, **options):
    from linear_attention_transformer.convert import from_llama, linearize

    teacher = from_llama(llama(seed=seed, **options))
    with torch.no_grad():  # (sharper attention than a random checkpoint's: something for the features to learn)
        for layer in teacher.transformer.attention_layers:
            layer.to_q.weight.mul_(4.0)
    return teacher, linearize(teacher, window=window, sinks=sinks, feature_dim=6)


def test_linearize_keeps_every_weight_and_is_the_teacher_within_its_window():
    teacher, student = linearized(window=16)
    x = tokens((2, 16))
    with torch.no_grad():  # (no key is older than the window: the softmax heads exactly)
        torch.testing.assert_close(student(x), teacher(x), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(student(tokens((2, 40))), teacher(tokens((2, 40))), rtol=1e-3, atol=1e-3)
    from linear_attention_transformer.heads import WindowLinearHeads

    assert all(isinstance(layer.local_heads, WindowLinearHeads) and layer.local_heads.keys == 16
               for layer in student.transformer.attention_layers)
    assert student.options["local_attn_window_size"] == 16 and student.options["local_attn_feature_dim"] == 6


def test_linearize_refuses_a_model_without_softmax_heads():
    from linear_attention_transformer import LinearAttentionTransformerLM
    from linear_attention_transformer.convert import linearize

    with pytest.raises(ValueError, match="n_local_attn_heads == heads"):
        linearize(LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, max_seq_len=32, heads=2, causal=True))
    with pytest.raises(TypeError, match="window"):
        linearize(linearized()[0], window=4.5)


def layer_error(teacher, student, x):
    from linear_attention_transformer.convert import attention_pairs

    with torch.no_grad():
        return sum(float((layer.attend(normed, place) - target).pow(2).mean())
                   for normed, target, layer, place in attention_pairs(teacher, student, x))


def batches(seed=5, n=40):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, 97, (2, n), generator=g)


def test_attention_transfer_lowers_the_layer_error_and_trains_only_the_features():
    from linear_attention_transformer.convert import transfer_attention

    teacher, student = linearized()
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    held_out = tokens((2, 40), seed=9)
    error = layer_error(teacher, student, held_out)
    losses = transfer_attention(student, teacher, batches(), steps=40, lr=0.1)
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])
    assert layer_error(teacher, student, held_out) < 0.2 * error
    changed = {name for name, p in student.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(".local_heads." in name for name in changed)
    assert all(p.requires_grad for p in student.parameters())  # (left as they were)


def test_attention_transfer_resumes_where_it_stopped(tmp_path):
    from linear_attention_transformer.convert import added_parameters, transfer_attention

    teacher, whole = linearized()
    _, resumed = linearized()
    expected = transfer_attention(whole, teacher, batches(), steps=6)
    checkpoint = tmp_path / "transfer.pt"
    transfer_attention(resumed, teacher, batches(), steps=3, checkpoint=checkpoint)
    assert transfer_attention(resumed, teacher, batches(), steps=6, checkpoint=checkpoint) == expected
    for (name, a), b in zip(added_parameters(whole).items(), added_parameters(resumed).values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_a_linearized_model_saves_and_reloads_with_its_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from linear_attention_transformer.hf import LinearAttentionTransformerForCausalLM

    _, student = linearized()
    x = tokens((2, 30))
    LinearAttentionTransformerForCausalLM.wrap(student).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=D).eval()
    assert loaded.model.options == student.options
    with torch.no_grad():  # (transformers loads the rotary frequencies in float32: angles to about 1e-7)
        torch.testing.assert_close(loaded(x).logits, student(x), rtol=1e-6, atol=1e-6)


def test_finetune_lowers_the_next_token_loss_and_trains_the_attention_alone(tmp_path):
    from linear_attention_transformer.convert import finetune

    _, student = linearized()
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    text = tokens((2, 40), seed=3)  # (one batch, seen again and again: its loss must fall)
    losses = finetune(student, (text for _ in range(30)), steps=30, lr=1e-2, checkpoint=tmp_path / "f.pt")
    assert len(losses) == 30 and losses[-1] < 0.8 * losses[0]
    changed = {name for name, p in student.named_parameters() if not torch.equal(p, before[name])}
    assert any(".to_q." in name for name in changed) and any(".local_heads." in name for name in changed)
    assert all(".local_heads." in name or ".fn.to_" in name for name in changed)
    assert finetune(student, (text for _ in range(30)), steps=30, checkpoint=tmp_path / "f.pt") == losses  # done


# -- the library's own mixed layer ----------------------------------------------------------------

def heads_outputs(model, x):
    """Every attention layer's heads' outputs side by side, (b, n, heads * dim_head): the input of
    its output projection."""
    seen = []
    hooks = [layer.to_out.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
             for layer in model.transformer.attention_layers]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


def test_mix_keeps_every_weight_and_its_local_heads_are_the_teachers_within_their_window():
    from linear_attention_transformer.convert import added_parameters, from_llama, mix

    teacher = from_llama(llama())
    student = mix(teacher, 2, window=16, feature_map="elu", use_local_conv=True)
    x = tokens((2, 16))
    dim_head = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    # (the first layer's: the global heads change what every later layer reads)
    mine, theirs = heads_outputs(student, x)[0], heads_outputs(teacher, x)[0]
    torch.testing.assert_close(mine[..., : 2 * dim_head], theirs[..., : 2 * dim_head], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(mine[..., 2 * dim_head :], theirs[..., 2 * dim_head :], rtol=1e-3, atol=1e-3)
    taught = teacher.state_dict()
    for name, value in student.state_dict().items():
        if name in taught:
            assert torch.equal(value, taught[name]), name
    added = added_parameters(student)
    assert added and all(".global_heads." in name for name in added)
    assert set(added) == set(student.state_dict()) - set(taught)
    layer = student.transformer.attention_layers[0]
    assert (layer.n_local, layer.update_rule) == (2, "additive") and student.options["feature_map"] == "elu"
    every_head_global = mix(teacher, 0).transformer.attention_layers[0]
    assert every_head_global.local_heads is None and every_head_global.global_heads.heads == 6


def test_mix_refuses_what_it_cannot_build_by_name():
    from linear_attention_transformer.convert import from_llama, mix

    teacher = from_llama(llama())
    with pytest.raises(TypeError, match=r"not \['dim_qk'\]"):
        mix(teacher, 2, dim_qk=4)
    for n_local in (6, -1, 2.0):
        with pytest.raises(ValueError, match="n_local_attn_heads"):
            mix(teacher, n_local)
    with pytest.raises(ValueError, match="update_rule"):
        mix(teacher, 2, update_rule="hebbian")
    with pytest.raises(ValueError, match="n_local_attn_heads == heads"):
        mix(mix(teacher, 2), 2)


def test_attention_transfer_trains_a_mixed_models_gates_alone_and_refuses_one_with_nothing_added():
    from linear_attention_transformer.convert import from_llama, mix, transfer_attention

    teacher = from_llama(llama())
    student = mix(teacher, 2, window=8, update_rule="delta", use_gate=True)
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    held_out = tokens((2, 40), seed=9)
    error = layer_error(teacher, student, held_out)
    losses = transfer_attention(student, teacher, batches(), steps=30, lr=0.05)
    assert sum(losses[-5:]) < sum(losses[:5]) and layer_error(teacher, student, held_out) < error
    changed = {name for name, p in student.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(".global_heads." in name or ".output_gate." in name for name in changed)
    with pytest.raises(ValueError, match="nothing to train"):
        transfer_attention(mix(teacher, 2), teacher, batches(), steps=1)


def test_finetune_trains_a_mixed_models_attention_and_lowers_its_loss():
    from linear_attention_transformer.convert import finetune, from_llama, mix

    student = mix(from_llama(llama()), 3, window=8)  # (nothing added: the projections alone train)
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    text = tokens((2, 40), seed=3)
    losses = finetune(student, (text for _ in range(30)), steps=30, lr=1e-2)
    assert losses[-1] < 0.9 * losses[0]
    changed = {name for name, p in student.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(".fn.to_" in name for name in changed)


def test_training_under_autocast_keeps_the_parameters_and_follows_the_float32_run():
    from linear_attention_transformer.convert import finetune, transfer_attention

    runs = {}
    for autocast in (None, torch.bfloat16):
        teacher, student = linearized()
        teacher, student = teacher.float(), student.float()
        text = tokens((2, 40), seed=3)
        runs[autocast] = (transfer_attention(student, teacher, batches(), steps=5, lr=0.05, autocast=autocast),
                          finetune(student, (text for _ in range(20)), steps=20, lr=1e-2, autocast=autocast))
        assert all(p.dtype == torch.float32 for p in student.parameters())
    (transfer, tuned), (transfer16, tuned16) = runs[None], runs[torch.bfloat16]
    assert transfer16 != transfer and tuned16 != tuned  # (bfloat16 did compute)
    torch.testing.assert_close(torch.tensor(transfer16), torch.tensor(transfer), rtol=0.05, atol=0)
    assert tuned16[-1] < 0.9 * tuned16[0] and abs(tuned16[-1] - tuned[-1]) < 0.05 * tuned[-1]
    with pytest.raises(TypeError, match="autocast"):
        finetune(student, (text for _ in range(2)), steps=1, autocast="bfloat16")
