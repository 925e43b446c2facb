#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with every wheel benchmarks/gpu_check.py needs that a GPU image with
# only torch lacks (Python 3.12, manylinux x86_64, no dependency resolved: the list below is the
# closure, read from each wheel's Requires-Dist). The library itself travels as the working tree.
# On the GPU machine (no network):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  fla-core==0.6.0                  # the fla kernel's Triton kernels (the cuda extra's newest line)
  einops==0.8.2                    # the library, fla-core and the three below
  local-attention==1.11.2          # the library
  axial-positional-embedding==0.3.12
  product-key-memory==0.3.0
  colt5-attention==0.11.2          # product-key-memory's
  hyper-connections==0.4.11        # local-attention's
  torch-einops-utils==0.2.0        # hyper-connections'
  packaging==26.2                  # colt5-attention's
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $total bytes"
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then echo "over 64 MiB" >&2; exit 1; fi
