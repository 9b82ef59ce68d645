#!/usr/bin/env bash
# Sets up a GPU host for FSDP training with SGLang engines: a venv with CUDA torch 2.9.1, sglang 0.5.6 (the version
# verl 0.7.1's `sglang` extra pins), flash-attn, this package, and verl 0.7.1 patched for fully-async training.
# Every version comes from install/constraints-gpu.txt (linux x86_64, Python 3.11, CUDA 12.8 wheels).
#
# Usage: bash install/install_fsdp_sglang.sh [--dry-run]
#   --dry-run   print every step and its command without running anything (works on any machine)
# Environment: PYTHON (default python3, 3.11 recommended: the lock was resolved for it), VENV (default .venv),
#   MAX_JOBS (parallel compile jobs if flash-attn has to be built from source; default 8).
# Needs: an NVIDIA driver for CUDA 12.8 (nvidia-smi), git, and nvcc only if no prebuilt flash-attn wheel matches.
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
# torch first and alone: the PyPI linux wheel of torch 2.9.1 is the CUDA 12.8 build; pulled in by another package
# it could be resolved differently.
step "install CUDA torch" -- "${pip[@]}" "$torch_pin" "$(pin torchvision)" "$(pin torchaudio)"
# sglang 0.5.6 dropped its srt/openai extras (pip warns); the spelling matches verl 0.7.1's `sglang` extra.
step "install SGLang" -- "${pip[@]}" "sglang[srt,openai]==$sglang_version"
step "install rllm-fully-async with verl 0.7.1 and the test tools" -- "${pip[@]}" -e "${repo_root}[gpu,test]"
# flash-attn compiles against the installed torch, hence no build isolation; MAX_JOBS bounds the compiler's memory.
step "install flash-attn" -- env "MAX_JOBS=${MAX_JOBS:-8}" "${pip[@]}" --no-build-isolation "$(pin flash-attn)"
step "check that the GPU stack imports" -- "$vpy" -c \
  'import torch, sglang, flash_attn, verl; assert torch.cuda.is_available(), "torch sees no GPU"'
step "patch verl for fully-async training" -- env "VERL_PYTHON=$vpy" bash "$repo_root/install/apply_verl_patch.sh"
step "check the installation" -- "$vpy" -m rllm.experimental.fully_async doctor
if [[ "$dry_run" == 1 ]]; then
  echo "[$tag] dry run: $step_no steps printed, nothing run"
else
  echo "[$tag] done: $venv"
fi
