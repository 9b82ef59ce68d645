#!/usr/bin/env bash
# Sets up a GPU host for Megatron training with SGLang engines: everything install_fsdp_sglang.sh installs (CUDA
# torch 2.9.1, sglang 0.5.6, flash-attn, this package, patched verl 0.7.1), then TransformerEngine 2.10,
# megatron-core 0.16.1 and mbridge (verl 0.7.1's `mcore` extra). Versions come from install/constraints-gpu.txt.
#
# Usage: bash install/install_megatron_sglang.sh [--dry-run]
#   --dry-run   print every step and its command without running anything (works on any machine)
# Environment: as install_fsdp_sglang.sh (PYTHON, VENV, MAX_JOBS). TransformerEngine compiles its torch extension
# against the installed torch: it needs nvcc and cuDNN headers (the CUDA 12.8 toolkit) and takes a long time.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
constraints="$repo_root/install/constraints-gpu.txt"
venv="${VENV:-$repo_root/.venv}"
tag="install_megatron_sglang"

# shellcheck source=install/_lib.sh
source "$repo_root/install/_lib.sh"
parse_installer_args "$@"
pass_args=()
if [[ "$dry_run" == 1 ]]; then
  pass_args+=(--dry-run)
fi
vpy="$venv/bin/python"
pip=("$vpy" -m pip install --disable-pip-version-check -c "$constraints")
te_version="$(pin transformer-engine)"
te_version="${te_version#*==}"

# The FSDP + SGLang stack first (it ends with the verl patch and a doctor run); VENV and PYTHON pass through.
echo "[$tag] the FSDP + SGLang stack first: install/install_fsdp_sglang.sh"
bash "$repo_root/install/install_fsdp_sglang.sh" "${pass_args[@]}"

# TransformerEngine's torch extension is built against the installed torch 2.9.1, so no build isolation.
step "install TransformerEngine" -- env NVTE_FRAMEWORK=pytorch "MAX_JOBS=${MAX_JOBS:-8}" "${pip[@]}" \
  --no-build-isolation "transformer-engine[pytorch]==$te_version"
step "install megatron-core and mbridge" -- "${pip[@]}" "$(pin megatron-core)" "$(pin mbridge)"
step "check that the Megatron stack imports" -- "$vpy" -c \
  'import transformer_engine.pytorch, megatron.core, mbridge; from verl.workers.actor.megatron_actor import MegatronPPOActor'
# Re-run the patch step: a no-op ("already applied") unless something above reinstalled verl.
step "patch verl for fully-async training" -- env "VERL_PYTHON=$vpy" bash "$repo_root/install/apply_verl_patch.sh"
step "check the installation" -- "$vpy" -m rllm.experimental.fully_async doctor
if [[ "$dry_run" == 1 ]]; then
  echo "[$tag] dry run: $step_no more steps printed, nothing run"
else
  echo "[$tag] done: $venv"
fi
