"""Generate text from a byte-level model exported with ``linear_attention_transformer.export``,
with onnxruntime and numpy alone (no torch).

    python -c "from linear_attention_transformer.export import export_onnx; ..."  # writes model.onnx
    python examples/onnx_generate.py model.onnx --prompt "The cat " --length 64
    python examples/onnx_generate.py model.onnx --prompt "The cat " --temperature 0.8 --seed 1

Every state input starts at zeros of the shape and dtype the graph declares; the prompt's bytes
go in one at a time, each step's next state feeding the next step; then each new token is the
most likely one (greedy, the default) or drawn at ``--temperature``. The bytes print as UTF-8
(an incomplete or invalid sequence shows as U+FFFD).
"""

import argparse
import sys

import numpy as np
import onnxruntime as ort

# numpy's dtype for each ONNX Runtime type string a state input may have
DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
          "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def load_graph(path, threads=None):
    """The graph at ``path`` in onnxruntime on the CPU (``threads``: its intra-op threads, None: its own)."""
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def zero_state(graph):
    """The first state: zeros of each state input's declared shape and dtype."""
    state = []
    for spec in graph.get_inputs()[1:]:
        if spec.type not in DTYPES or not all(isinstance(d, int) for d in spec.shape):
            raise ValueError(f"state input {spec.name} is {spec.type} of shape {spec.shape}: expected a fixed "
                             "shape of a numeric type")
        state.append(np.zeros(spec.shape, dtype=DTYPES[spec.type]))
    return state


class Decoder:
    """One exported step and its state: ``feed(tokens)`` -> logits (batch, num_tokens)."""

    def __init__(self, graph):
        self.graph = graph
        ids = graph.get_inputs()[0]
        self.batch = ids.shape[0]
        self.names = [spec.name for spec in graph.get_inputs()]
        self.state = zero_state(graph)

    def feed(self, tokens):
        """One token per row (a sequence of ``batch`` ints); the state advances by one."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(self.batch, 1)
        logits, *self.state = self.graph.run(None, dict(zip(self.names, [ids, *self.state])))
        return logits


def pick(logits, temperature, rng):
    """The next token of each row: the most likely (temperature 0) or one drawn from
    softmax(logits / temperature)."""
    if temperature == 0:
        return logits.argmax(axis=-1)
    scaled = logits.astype(np.float64) / temperature
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(len(row), p=row) for row in probs])


def generate(graph, prompt, length, temperature=0.0, seed=0):
    """``length`` new tokens after the token ids ``prompt`` (a non-empty list), for the one row
    of a graph exported with batch_size=1."""
    decoder = Decoder(graph)
    if decoder.batch != 1:
        raise ValueError(f"this script decodes one row; the graph was exported for {decoder.batch}")
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    rng = np.random.default_rng(seed)
    for token in prompt:
        logits = decoder.feed([token])
    out = []
    for _ in range(length):
        token = int(pick(logits, temperature, rng)[0])
        out.append(token)
        logits = decoder.feed([token])
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the .onnx file export_onnx wrote")
    parser.add_argument("--prompt", default="The ", help="text whose UTF-8 bytes start the sequence")
    parser.add_argument("--length", type=int, default=64, help="new tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime's intra-op threads")
    parser.add_argument("--print-ids", action="store_true", help="also print the new token ids, one line")
    args = parser.parse_args(argv)
    if args.length < 0:
        parser.error(f"--length must be 0 or more, got {args.length}")
    if args.temperature < 0:
        parser.error(f"--temperature must be 0 or more, got {args.temperature}")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    return args


def main(argv=None):
    args = parse_args(argv)
    graph = load_graph(args.model, args.threads)
    vocabulary = graph.get_outputs()[0].shape[-1]
    if vocabulary < 256:
        raise SystemExit(f"a byte-level model has at least 256 tokens; this graph's logits have {vocabulary}")
    prompt = list(args.prompt.encode("utf-8"))
    tokens = generate(graph, prompt, args.length, args.temperature, args.seed)
    # an id past 255 (a vocabulary larger than the bytes) becomes 0xFF, never valid UTF-8: shown as U+FFFD
    text = bytes(prompt + [t if t < 256 else 0xFF for t in tokens]).decode("utf-8", errors="replace")
    print(text)
    if args.print_ids:
        print("ids:", " ".join(map(str, tokens)))
    return tokens


if __name__ == "__main__":
    main(sys.argv[1:])
