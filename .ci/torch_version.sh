#!/usr/bin/env bash
# Runs the test suite on one torch release, in a scratch venv, on the committed HEAD:
#   bash .ci/torch_version.sh 2.11.0 [pytest arguments]
# Not part of CI's run. torch comes from the package index (a CUDA build where the index serves
# one: it runs on the CPU all the same). Where a pip configuration caps torch, run it with
# PIP_CONFIG_FILE=/dev/null. The last line says the version, pytest's summary and the seconds.
set -euo pipefail
version=${1:?usage: bash .ci/torch_version.sh TORCH_VERSION [pytest arguments]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
scratch=${LAT_SCRATCH:-/tmp}/lat-torch-$version
rm -rf "$scratch"
python3 -m venv "$scratch/venv"
git clone -q "$root" "$scratch/src"
pip=("$scratch/venv/bin/python" -m pip install -q)
"${pip[@]}" "torch==$version"
"${pip[@]}" "$scratch/src[test]"
cd "$scratch/src"
start=$(date +%s)
set +e
"$scratch/venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@" 2>&1 | tee "$scratch/pytest.log" | tail -5
status=${PIPESTATUS[0]}
set -e
summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$scratch/pytest.log" | tail -1)
echo "torch $version ($("$scratch/venv/bin/python" -c 'import torch; print(torch.__version__)')): ${summary:-no summary}, exit $status, $(( $(date +%s) - start )) s"
exit "$status"
