"""The ONNX graph of the one-token decoding step (linear_attention_transformer/export.py): ONNX
Runtime, fed one token at a time from zero states, gives the library's logits and greedy
tokens; the Hugging Face model exports as the library model it holds; what the graph cannot
hold is refused by name; examples/onnx_generate.py decodes without torch."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from linear_attention_transformer import LinearAttentionTransformerLM, LinformerSettings
from linear_attention_transformer.export import DecodingStep, export_onnx

ROOT = Path(__file__).resolve().parents[1]
ONNX = pytest.mark.requires("onnx", "onnxscript", "onnxruntime")
pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 256
TINY = dict(num_tokens=NUM_TOKENS, dim=32, heads=4, causal=True)


def make_model(seed=0, **options):
    torch.manual_seed(seed)
    model = LinearAttentionTransformerLM(**{**TINY, **options}).eval()
    # the library's initialisation leaves the output near uniform: spread the logits so
    # that greedy choices are far from ties
    if model.to_logits is not None:  # (None with return_embeddings)
        with torch.no_grad():
            model.to_logits.weight.normal_(std=1.0)
    return model


def graph_of(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def zeros_for(graph):
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
    return [np.zeros(spec.shape, dtype=types[spec.type]) for spec in graph.get_inputs()[1:]]


def runtime_decode(graph, prompt, new_tokens):
    """prompt (b, n) int array fed one column at a time from zero states, then ``new_tokens``
    greedy steps -> (every column's tokens (b, n + new_tokens), the logits after each of the
    first n + new_tokens - 1 columns)."""
    names = [spec.name for spec in graph.get_inputs()]
    state = zeros_for(graph)
    tokens = [prompt[:, i] for i in range(prompt.shape[1])]
    logits = []
    for i in range(prompt.shape[1] + new_tokens - 1):
        out, *state = graph.run(None, dict(zip(names, [tokens[i][:, None].astype(np.int64), *state])))
        logits.append(out)
        if i + 1 == len(tokens):
            tokens.append(out.argmax(-1))
    return np.stack(tokens, 1), np.stack(logits, 1)


def library_greedy(model, prompt, new_tokens):
    """The library's cached decoding of the same: prompt (b, n) tensor -> tokens (b, n + new_tokens)."""
    tokens = prompt
    with torch.no_grad():
        cache = model.empty_cache(prompt.shape[0])
        for i in range(prompt.shape[1] + new_tokens - 1):
            logits, cache = model(tokens[:, i:i + 1], cache=cache, return_cache=True)
            if i + 1 == tokens.shape[1]:
                tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return tokens


def check_decodes(model, path, prompt_length, new_tokens, batch_size=1):
    """Export ``model``, decode a random prompt in ONNX Runtime: its greedy tokens are the
    library's, and its logits at every position those of one forward over the whole sequence."""
    export_onnx(model, path, batch_size=batch_size)
    graph = graph_of(path)
    prompt = torch.randint(0, NUM_TOKENS, (batch_size, prompt_length), generator=torch.Generator().manual_seed(1))
    tokens, logits = runtime_decode(graph, prompt.numpy(), new_tokens)
    expected = library_greedy(model, prompt, new_tokens)
    np.testing.assert_array_equal(tokens, expected.numpy())
    with torch.no_grad():
        whole = model(expected[:, :-1])
    np.testing.assert_allclose(logits, whole.numpy(), atol=1e-4, rtol=0)
    return graph


@ONNX
def test_default_heads_with_axial_positions(tmp_path):
    model = make_model(depth=2, max_seq_len=24, n_local_attn_heads=2, local_attn_window_size=4)
    graph = check_decodes(model, tmp_path / "step.onnx", prompt_length=5, new_tokens=19)  # to max_seq_len
    inputs, outputs = graph.get_inputs(), graph.get_outputs()
    assert [inputs[0].name, inputs[0].type, inputs[0].shape] == ["input_ids", "tensor(int64)", [1, 1]]
    assert [outputs[0].name, outputs[0].shape] == ["logits", [1, NUM_TOKENS]]
    assert [i.name for i in inputs[1:]] == [f"state_{i}" for i in range(len(inputs) - 1)]
    assert [o.name for o in outputs[1:]] == [f"next_state_{i}" for i in range(len(inputs) - 1)]
    # each next state has its state's shape and type: output i + 1 feeds input i + 1
    assert [(o.type, o.shape) for o in outputs[1:]] == [(i.type, i.shape) for i in inputs[1:]]
    # one of them is the position: an int64 scalar (or one element)
    assert any(i.type == "tensor(int64)" and i.shape in ([], [1]) for i in inputs[1:])


@ONNX
def test_recommended_heads_with_rotary_decode_past_max_seq_len(tmp_path):
    model = make_model(depth=1, max_seq_len=16, n_local_attn_heads=2, local_attn_window_size=4, use_gate=True,
                       use_local_conv=True, feature_map="taylor", dim_qk=8, use_rotary_emb=True)
    check_decodes(model, tmp_path / "step.onnx", prompt_length=6, new_tokens=22)  # 28 positions, 16 trained


@ONNX
def test_delta_rule_heads_with_gate_conv_and_rotary_decode_past_max_seq_len(tmp_path):
    model = make_model(depth=1, max_seq_len=16, n_local_attn_heads=2, local_attn_window_size=4, update_rule="delta",
                       use_gate=True, use_local_conv=True, use_rotary_emb=True)
    check_decodes(model, tmp_path / "step.onnx", prompt_length=5, new_tokens=19)  # 24 positions, 16 trained


@ONNX
def test_window_linear_heads_with_sinks_decode_past_max_seq_len(tmp_path):
    model = make_model(depth=1, max_seq_len=16, n_local_attn_heads=4, local_attn_window_size=4,
                       local_attn_exact_windowsize=True, local_attn_older_keys="linear", local_attn_sinks=2,
                       local_attn_feature_dim=4, use_rotary_emb=True, kv_heads=2)
    check_decodes(model, tmp_path / "step.onnx", prompt_length=3, new_tokens=21)  # 24 positions, 16 trained


@ONNX
def test_shifted_reversible_glu_gated_two_rows(tmp_path):
    model = make_model(depth=2, max_seq_len=16, n_local_attn_heads=2, local_attn_window_size=4, shift_tokens=True,
                       reversible=True, ff_glu=True, use_gate=True)
    graph = check_decodes(model, tmp_path / "step.onnx", prompt_length=4, new_tokens=12, batch_size=2)
    assert graph.get_inputs()[0].shape == [2, 1] and graph.get_outputs()[0].shape == [2, NUM_TOKENS]


@ONNX
def test_no_position_embedding_with_shared_kv_heads_and_blindspot_past_max_seq_len(tmp_path):
    model = make_model(depth=1, max_seq_len=8, n_local_attn_heads=2, local_attn_window_size=4, use_pos_emb=False,
                       kv_heads=1, blindspot_size=2, use_local_conv=True)
    check_decodes(model, tmp_path / "step.onnx", prompt_length=3, new_tokens=17)  # 20 positions, 8 trained


@ONNX
def test_position_zero_starts_a_sequence_whatever_the_other_states_hold(tmp_path):
    model = make_model(depth=1, max_seq_len=16, n_local_attn_heads=2, local_attn_window_size=4, use_local_conv=True)
    path = tmp_path / "step.onnx"
    model.train()  # (exported in eval mode, then left as it was)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_onnx(model, path)
    assert model.training
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    graph = graph_of(path)
    names = [spec.name for spec in graph.get_inputs()]
    zeros = zeros_for(graph)
    # the position is the int64 state of no more than one element
    position = next(i for i, (spec, z) in enumerate(zip(graph.get_inputs()[1:], zeros))
                    if spec.type == "tensor(int64)" and z.size == 1)
    rng = np.random.default_rng(0)
    noise = [z if i == position else (rng.standard_normal(z.shape) * 5).astype(z.dtype) for i, z in enumerate(zeros)]
    ids = np.array([[7]], dtype=np.int64)
    from_zeros = graph.run(None, dict(zip(names, [ids, *zeros])))
    from_noise = graph.run(None, dict(zip(names, [ids, *noise])))
    for a, b in zip(from_zeros, from_noise):
        np.testing.assert_array_equal(a, b)
    assert from_zeros[1 + position].reshape(()) == 1  # the position advances by one


@ONNX
@pytest.mark.requires("transformers", "safetensors")
def test_the_hugging_face_model_exports_as_its_library_model(tmp_path):
    hf = importlib.import_module("linear_attention_transformer.hf")
    options = dict(TINY, depth=1, max_seq_len=16, n_local_attn_heads=2, local_attn_window_size=4, use_rotary_emb=True)
    torch.manual_seed(0)
    hf_lm = hf.LinearAttentionTransformerForCausalLM(hf.LinearAttentionTransformerConfig(**options)).eval()
    with torch.no_grad():
        hf_lm.model.to_logits.weight.normal_(std=1.0)  # (as make_model does: greedy choices far from ties)
    export_onnx(hf_lm, tmp_path / "hf.onnx")
    export_onnx(hf_lm.model, tmp_path / "library.onnx")
    prompt = np.array([[3, 1, 4, 1]])
    tokens, logits = runtime_decode(graph_of(tmp_path / "hf.onnx"), prompt, 8)
    expected_tokens, expected_logits = runtime_decode(graph_of(tmp_path / "library.onnx"), prompt, 8)
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(logits, expected_logits)
    np.testing.assert_array_equal(tokens, library_greedy(hf_lm.model, torch.from_numpy(prompt), 8).numpy())


def test_the_step_leaves_its_inputs_as_they_were():
    model = make_model(depth=1, max_seq_len=16, n_local_attn_heads=2, local_attn_window_size=4, use_local_conv=True,
                       shift_tokens=True)
    step = DecodingStep(model, 2).eval()
    state = step.zero_state()
    kept = [t.clone() for t in state]
    with torch.no_grad():
        _, *after_one = step(torch.tensor([[3], [4]]), *state)
        kept_one = [t.clone() for t in after_one]
        _, *after_two = step(torch.tensor([[5], [6]]), *after_one)
    assert all(torch.equal(a, b) for a, b in zip(state, kept))
    assert all(torch.equal(a, b) for a, b in zip(after_one, kept_one))
    assert any(not torch.equal(a, b) for a, b in zip(after_one, after_two))
    assert after_one[step.position_index].dtype == torch.int64 and after_one[step.position_index].reshape(()) == 1


REFUSED = {
    "Linformer": (dict(causal=False, linformer_settings=LinformerSettings(k=4)), "Linformer"),
    "not causal": (dict(causal=False), "causal=False"),
    "attend_axially": (dict(attend_axially=True), "attend_axially"),
    "receives_context": (dict(receives_context=True), "receives_context"),
    "return_embeddings": (dict(return_embeddings=True), "return_embeddings"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_models_the_graph_cannot_hold_are_refused_by_name(name, tmp_path):
    options, named = REFUSED[name]
    model = make_model(depth=1, max_seq_len=16, **options)
    with pytest.raises(ValueError, match=named):
        export_onnx(model, tmp_path / "step.onnx")
    assert not (tmp_path / "step.onnx").exists()


def test_bad_arguments_are_refused(tmp_path):
    model = make_model(depth=1, max_seq_len=16)
    with pytest.raises(TypeError, match="LinearAttentionTransformerLM"):
        export_onnx(model.transformer, tmp_path / "step.onnx")
    with pytest.raises(TypeError, match="path"):
        export_onnx(model, None)
    for bad in (0, -1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="batch_size"):
            export_onnx(model, tmp_path / "step.onnx", batch_size=bad)


def test_package_does_not_import_the_exporter():
    code = "import sys, linear_attention_transformer; print('linear_attention_transformer.export' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@ONNX
def test_example_generates_the_library_greedy_tokens_without_torch(tmp_path):
    model = make_model(depth=1, max_seq_len=32, n_local_attn_heads=2, local_attn_window_size=4)
    path = tmp_path / "byte.onnx"
    export_onnx(model, path)
    # a torch that fails to import, first on the path: the script must not need it
    blocked = tmp_path / "blocked" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('torch is blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "blocked"), OMP_NUM_THREADS="1")
    script = str(ROOT / "examples" / "onnx_generate.py")
    prompt, length = "ab", 12

    def run(*extra):
        done = subprocess.run([sys.executable, script, str(path), "--prompt", prompt, "--length", str(length),
                               "--threads", "1", "--print-ids", *extra], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        ids_line = done.stdout.splitlines()[-1]
        assert ids_line.startswith("ids: ")
        return done.stdout, [int(t) for t in ids_line[len("ids: "):].split()]

    stdout, greedy = run()
    expected = library_greedy(model, torch.tensor([list(prompt.encode())]), length)[0, 2:].tolist()
    assert greedy == expected
    assert stdout.startswith(prompt)
    _, sampled = run("--temperature", "1.0", "--seed", "3")
    assert len(sampled) == length and all(0 <= t < NUM_TOKENS for t in sampled)
    assert sampled != greedy  # (spread logits at temperature 1: twelve draws all equal to the argmax would be luck)
