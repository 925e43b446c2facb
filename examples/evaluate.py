"""Score a Hugging Face checkpoint of a model of this library with lm-evaluation-harness, on local tasks.

    python examples/train_enwik8.py --steps 2000 --hf-save runs/hf   # write a checkpoint
    python examples/evaluate.py runs/hf                               # the tasks of examples/lm_eval_tasks/
    python examples/evaluate.py runs/hf --tasks my_task.yaml --batch-size 8 --limit 100 --output scores.json

The checkpoint is a folder that ``save_pretrained`` wrote (the model and its tokenizer), as
``train_enwik8.py --hf-save`` does; it loads with ``AutoModelForCausalLM.from_pretrained`` once
``linear_attention_transformer.hf`` is imported. Each task is an lm-eval task YAML of plain YAML
(no ``!function``, no ``include``) whose ``dataset_kwargs: data_files:`` name local files, read
relative to the YAML's folder. The defaults, ``lm_eval_tasks/tiny_choice.yaml`` (multiple choice:
accuracy) and ``lm_eval_tasks/tiny_text.yaml`` (bits per byte, which for a byte-level model is
its BPC), need nothing but this folder. Nothing is downloaded: the script sets HF_HUB_OFFLINE=1
and HF_DATASETS_OFFLINE=1 unless the environment sets them. It prints lm-eval's table of the
metrics. Needs the eval extra: ``pip install -e ".[eval]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TASKS = (HERE / "lm_eval_tasks" / "tiny_choice.yaml", HERE / "lm_eval_tasks" / "tiny_text.yaml")


def task_config(path, cache_dir=None):
    """The task YAML at ``path`` as the dict lm-eval takes for a task, its local ``data_files``
    made absolute (relative ones are read from the YAML's folder, not the working directory).
    ``cache_dir``: where ``datasets`` keeps the prepared data (default: its own cache)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"--tasks {path}: no such task file")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise SystemExit(f"--tasks {path}: not plain YAML ({e})") from None
    if not isinstance(config, dict) or "task" not in config:
        raise SystemExit(f"--tasks {path}: not an lm-eval task (no 'task' name)")
    dataset_kwargs = dict(config.get("dataset_kwargs") or {})
    files = dataset_kwargs.get("data_files")
    if isinstance(files, dict):  # {split: file(s)}, or file(s) that datasets calls the train split
        dataset_kwargs["data_files"] = {split: _beside(path, names) for split, names in files.items()}
    elif files is not None:
        dataset_kwargs["data_files"] = _beside(path, files)
    if cache_dir is not None:
        dataset_kwargs["cache_dir"] = str(cache_dir)
    config["dataset_kwargs"] = dataset_kwargs
    return config


def _beside(task_file, names):
    """``names`` (a file name or a list of them) as absolute paths, relative ones taken from
    ``task_file``'s folder; addresses (``hf://...``, ``https://...``) as they are."""
    if isinstance(names, list):
        return [_beside(task_file, name) for name in names]
    if "://" in names or Path(names).is_absolute():
        return names
    return str((task_file.parent / names).resolve())


def load_checkpoint(folder, device="cpu"):
    """(model, tokenizer) from the ``save_pretrained`` folder ``folder``, the model in float32
    and eval mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import linear_attention_transformer.hf  # noqa: F401  (registers the model with the Auto classes)

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"checkpoint {folder}: no config.json there; pass the folder that save_pretrained "
                         f"(train_enwik8.py --hf-save) wrote")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def evaluate(model, tokenizer, tasks, batch_size=1, limit=None, cache_dir=None, log_samples=False):
    """lm-eval's ``simple_evaluate`` of ``model`` (a transformers causal LM) with ``tokenizer``
    on ``tasks`` (task YAML paths): its result dict ("results" holds each task's metrics)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    configs = [task_config(path, cache_dir) for path in tasks]
    return simple_evaluate(model=lm, tasks=configs, task_manager=TaskManager(include_defaults=False), limit=limit,
                           bootstrap_iters=0, log_samples=log_samples)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a folder save_pretrained wrote (train_enwik8.py --hf-save)")
    p.add_argument("--tasks", nargs="+", default=[str(t) for t in DEFAULT_TASKS],
                   help="lm-eval task YAML files (default: the two of examples/lm_eval_tasks/)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per forward (default: 1)")
    p.add_argument("--limit", type=int, default=None, help="at most this many documents per task (default: all)")
    p.add_argument("--device", default="cpu", help="where the model runs: 'cpu', 'cuda', ... (default: cpu)")
    p.add_argument("--output", default=None, help="also write the metrics here, as JSON {task: {metric: value}}")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise SystemExit("--batch-size and --limit must be >= 1")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # local tasks and a local checkpoint: nothing to fetch
        os.environ.setdefault(name, "1")
    try:
        import lm_eval  # noqa: F401

        import linear_attention_transformer.hf  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"evaluate.py needs lm-eval, transformers and linear_attention_transformer.hf ({e}): "
                         f"pip install -e \".[eval]\"") from None
    model, tokenizer = load_checkpoint(args.checkpoint, args.device)
    results = evaluate(model, tokenizer, args.tasks, args.batch_size, args.limit)
    from lm_eval.utils import make_table

    print(make_table(results))
    metrics = results["results"]
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(metrics, indent=2))
    return metrics


if __name__ == "__main__":
    # (this file shares its name with the `evaluate` package, which lm-eval may import: run as a
    # script, its folder leaves the import path so that the package, not this file, is found)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    main()
