#!/usr/bin/env bash
# `make peer-wheels`: the wheels a GPU machine without a network needs for the GPU checks and
# for tools/benchmark_torchtitan.py, saved in .whl/ (git-ignored) for CPython 3.12 on x86-64
# Linux: torchtitan 0.2.2 (the release built against torch 2.11, the GPU image's) and what it
# imports that the image lacks, liger-kernel (the fine-tuning table's second peer), plus the wheels of ../shared/wheels/ (torchdata, torchao, tomli).
# On that machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
DEST=${1:-.whl}
PY=${PY:-python3}
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$DEST" \
    torchtitan==0.2.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 shtab==1.13.0 \
    datasets==4.5.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5
if compgen -G "../shared/wheels/*.whl" >/dev/null; then
    cp ../shared/wheels/*.whl "$DEST"/
fi
du -sh "$DEST"
ls "$DEST"
