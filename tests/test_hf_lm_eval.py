"""lm-evaluation-harness scores a model of this library through its ``HFLM``, offline.

A small random byte-level model behind ``LinearAttentionTransformerForCausalLM`` and
``byte_tokenizer()``. Every figure lm-eval reports is computed again here by hand from the
library's own ``LinearAttentionTransformerLM`` (in float64) or ``AutoregressiveWrapper``, on the
text's UTF-8 bytes: a continuation's log-likelihood, a long text's rolling log-likelihood over
windows of the model's context, greedy generation (alone and in a left-padded batch), and the
metrics of the local tasks of examples/lm_eval_tasks/ run by ``simple_evaluate`` and by
examples/evaluate.py.
"""

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from linear_attention_transformer import AutoregressiveWrapper

pytestmark = [pytest.mark.requires("lm_eval", "transformers"), pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "lm_eval_tasks"
CONTEXT = 64  # the model's max_seq_len: lm-eval's max_length
CONFIGS = {"default": {}, "rotary-taylor": {"use_rotary_emb": True, "feature_map": "taylor"}}


def evaluate_example():
    """examples/evaluate.py as a module (loaded by path: its name is also the ``evaluate`` package's)."""
    spec = importlib.util.spec_from_file_location("evaluate_example", ROOT / "examples" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing is fetched: the variables, and the copies huggingface_hub and datasets took of them
    when imported (earlier in the same process, perhaps)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def make_model(**options):
    """A random causal byte-level model (float32, eval mode) whose logits spread over several
    nats, so that the greedy choices and the choices of the tasks are not near ties."""
    from linear_attention_transformer.hf import LinearAttentionTransformerConfig, LinearAttentionTransformerForCausalLM

    torch.manual_seed(0)
    config = LinearAttentionTransformerConfig(num_tokens=256, dim=32, depth=2, heads=2, max_seq_len=CONTEXT,
                                              causal=True, **options)
    model = LinearAttentionTransformerForCausalLM(config).eval()
    with torch.no_grad():
        model.model.token_emb.weight.normal_(0, 1.0)
        model.model.to_logits.weight.normal_(0, 0.5)
    return model


def harness(model, batch_size=1):
    from lm_eval.models.huggingface import HFLM

    from linear_attention_transformer.hf import byte_tokenizer

    return HFLM(pretrained=model, tokenizer=byte_tokenizer(), backend="causal", batch_size=batch_size)


def requests(kind, arguments):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def utf8(text):
    return list(text.encode("utf-8"))


def prefix_token(tokenizer):
    """What lm-eval conditions a text without context on: the BOS token, else the EOS token."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def next_token_log_probs(net, tokens):
    """(len(tokens), vocab) float64: log-probabilities of the token after each of ``tokens``."""
    with torch.no_grad():
        return net(torch.tensor([tokens]))[0].double().log_softmax(-1)


def continuation_log_prob(net, context, continuation):
    """(sum of log P(continuation's tokens | what precedes each), whether each is the argmax)."""
    log_probs = next_token_log_probs(net, (context + continuation)[:-1])[len(context) - 1:]
    targets = torch.tensor(continuation)
    picked = log_probs.gather(1, targets[:, None]).sum().item()
    return picked, bool((log_probs.argmax(-1) == targets).all())


def rolling_log_prob(net, tokens, prefix, window=CONTEXT):
    """log P(tokens) predicted in disjoint runs of ``window`` tokens, each run read after the
    ``window`` tokens that end just before its last token (``prefix`` first, before the text)."""
    padded = [prefix, *tokens]  # padded[i] is the token before tokens[i]
    total = 0.0
    for start in range(0, len(tokens), window):
        end = min(start + window, len(tokens))
        log_probs = next_token_log_probs(net, padded[max(0, end - window):end])[-(end - start):]
        total += log_probs.gather(1, torch.tensor(tokens[start:end])[:, None]).sum().item()
    return total


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def reference(model):
    """The library's own model of ``model``, in float64."""
    return copy.deepcopy(model.model).double()


def test_loglikelihood_is_the_continuations_log_probability_from_the_logits(model, reference):
    pairs = [("The cat sat on the", " mat"), ("héllo", " wörld, again"), ("A", "B"),
             ("a somewhat longer context than the others", " and its end")]
    lm = harness(model, batch_size=3)  # one batch of three right-padded rows, then one
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (log_prob, greedy) in zip(pairs, got):
        want, want_greedy = continuation_log_prob(reference, utf8(context), utf8(continuation))
        assert log_prob == pytest.approx(want, rel=1e-5, abs=1e-4), (context, continuation)
        assert greedy == want_greedy
    assert len({round(lp, 3) for lp, _ in got}) == len(pairs)  # four different figures
    # an empty context: the continuation is read after lm-eval's prefix token
    (log_prob, _), = lm.loglikelihood(requests("loglikelihood", [("", "xyz")]))
    want, _ = continuation_log_prob(reference, [prefix_token(lm.tokenizer)], utf8("xyz"))
    assert log_prob == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_loglikelihood_rolling_sums_windows_of_the_models_context(model, reference):
    lm = harness(model, batch_size=2)
    assert lm.max_length == CONTEXT  # read from the config
    texts = ["short text", "a text of more than two windows: " + "the quick brown fox jumps. " * 5]
    assert len(utf8(texts[1])) > 2 * CONTEXT
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    prefix = prefix_token(lm.tokenizer)
    for text, log_prob in zip(texts, got):
        assert log_prob == pytest.approx(rolling_log_prob(reference, utf8(text), prefix), rel=1e-5), text
    # the windows matter: windows of half the context score the text otherwise
    halves = rolling_log_prob(reference, utf8(texts[1]), prefix, window=CONTEXT // 2)
    assert abs(got[1] - halves) > 1e-3


PROMPTS = ["The cat", "héllo wörld, a much longer prompt", "Once upon a time"]
UNTIL = ["\n\n"]
GREEDY = {"until": UNTIL, "max_gen_toks": 12, "do_sample": False, "temperature": 0.0}


def generate_until(model, prompts, batch_size):
    lm = harness(model, batch_size=batch_size)
    return lm.generate_until(requests("generate_until", [(prompt, GREEDY) for prompt in prompts]))


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_generate_until_is_greedy_decoding_cut_at_the_first_stop(options):
    """Each prompt alone: AutoregressiveWrapper's greedy continuation, up to the end-of-text
    token, decoded, and cut at the first stop string."""
    from linear_attention_transformer.hf import byte_tokenizer

    model = make_model(**options)
    tokenizer = byte_tokenizer()
    wrapper = AutoregressiveWrapper(model.model)
    texts = [generate_until(model, [prompt], batch_size=1)[0] for prompt in PROMPTS]
    for prompt, text in zip(PROMPTS, texts):
        tokens = wrapper.generate(torch.tensor([utf8(prompt)]), GREEDY["max_gen_toks"], temperature=0)[0].tolist()
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
        want = tokenizer.decode(tokens)
        for stop in UNTIL:
            want = want.split(stop)[0]
        assert text == want, prompt
    assert len(set(texts)) == len(PROMPTS)


# lm-eval left-pads the prompts of a batch; a row's positions count from its first real token
@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_generate_until_gives_a_left_padded_row_what_it_gives_that_row_alone(options):
    model = make_model(**options)
    alone = [generate_until(model, [prompt], batch_size=1)[0] for prompt in PROMPTS]
    assert generate_until(model, PROMPTS, batch_size=3) == alone


def choice_task_by_hand(net, docs):
    """(each document's choices' log-likelihoods, the accuracy of the most likely choice)."""
    scores = [[continuation_log_prob(net, utf8(doc["question"]), utf8(" " + choice))[0] for choice in doc["choices"]]
              for doc in docs]
    hits = [max(range(len(s)), key=s.__getitem__) == doc["answer"] for s, doc in zip(scores, docs)]
    return scores, sum(hits) / len(hits)


def bits_per_byte_by_hand(net, texts, prefix):
    total = sum(rolling_log_prob(net, utf8(text), prefix) for text in texts)
    return -total / sum(len(utf8(text)) for text in texts) / math.log(2)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_simple_evaluate_runs_the_local_tasks_offline(model, reference, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task_config = evaluate_example().task_config
    tasks = [task_config(TASKS / name, cache_dir=tmp_path / "datasets") for name in ("tiny_choice.yaml", "tiny_text.yaml")]
    assert Path(tasks[0]["dataset_kwargs"]["data_files"]["test"]).is_file()  # read beside the YAML
    lm = harness(model, batch_size=4)
    out = simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_defaults=False),
                          bootstrap_iters=0, log_samples=True)
    docs = read_jsonl(TASKS / "tiny_choice.jsonl")
    scores, accuracy = choice_task_by_hand(reference, docs)
    samples = sorted(out["samples"]["tiny_choice"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs) == 6
    for sample, doc_scores in zip(samples, scores):
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(doc_scores, rel=1e-5, abs=1e-4)
    assert out["results"]["tiny_choice"]["acc,none"] == pytest.approx(accuracy)
    assert 0 < accuracy < 1  # neither all nor none: each choice counts
    texts = [doc["text"] for doc in read_jsonl(TASKS / "tiny_text.jsonl")]
    want = bits_per_byte_by_hand(reference, texts, prefix_token(lm.tokenizer))
    assert out["results"]["tiny_text"]["bits_per_byte,none"] == pytest.approx(want, rel=1e-5)


def test_evaluate_script_scores_a_saved_checkpoint(model, reference, tmp_path, monkeypatch, capsys):
    """examples/evaluate.py on a save_pretrained folder: its printed table and --output hold the
    metrics of the default tasks, those of the model saved."""
    from linear_attention_transformer.hf import byte_tokenizer

    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")  # not the user's cache
    script = evaluate_example()
    output = tmp_path / "scores.json"
    metrics = script.main([str(folder), "--batch-size", "2", "--limit", "2", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(metrics))
    printed = capsys.readouterr().out
    assert "tiny_choice" in printed and "bits_per_byte" in printed
    texts = [doc["text"] for doc in read_jsonl(TASKS / "tiny_text.jsonl")][:2]  # --limit 2
    want = bits_per_byte_by_hand(reference, texts, prefix_token(byte_tokenizer()))
    assert metrics["tiny_text"]["bits_per_byte,none"] == pytest.approx(want, rel=1e-5)
    _, accuracy = choice_task_by_hand(reference, read_jsonl(TASKS / "tiny_choice.jsonl")[:2])
    assert metrics["tiny_choice"]["acc,none"] == pytest.approx(accuracy)
    with pytest.raises(SystemExit, match="no config.json"):
        script.main([str(tmp_path), "--limit", "1"])
    with pytest.raises(SystemExit, match="--tasks .*missing.yaml: no such task file"):
        script.main([str(folder), "--tasks", str(tmp_path / "missing.yaml")])
    with pytest.raises(SystemExit, match="--batch-size"):
        script.main([str(folder), "--batch-size", "0"])
