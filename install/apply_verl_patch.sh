#!/usr/bin/env bash
# Applies patches/verl_dp_actor.patch to verl 0.7.1 (see patches/README.md for what it changes and why).
#
# Which verl:
#   VERL_SRC=DIR   a verl source checkout (DIR holds verl/__init__.py) or a verl package folder (DIR/__init__.py)
#   otherwise      the verl that $VERL_PYTHON (default python3) imports, usually in site-packages
# Idempotent: when the patch is already applied it says so and changes nothing. Exit 1 on any other state.
set -euo pipefail

expected_version="0.7.1"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
patch_file="$repo_root/patches/verl_dp_actor.patch"

say() { echo "[apply_verl_patch] $*"; }
die() {
  echo "[apply_verl_patch] error: $*" >&2
  exit 1
}

command -v git >/dev/null || die "git is required (it applies the patch, also outside a git repository)"
[[ -f "$patch_file" ]] || die "patch file $patch_file is missing"

if [[ -n "${VERL_SRC:-}" ]]; then
  src="$(cd "$VERL_SRC" 2>/dev/null && pwd)" || die "VERL_SRC=$VERL_SRC is not a directory"
  if [[ -f "$src/verl/__init__.py" ]]; then
    verl_root="$src"
  elif [[ -f "$src/__init__.py" && "$(basename "$src")" == "verl" ]]; then
    verl_root="$(dirname "$src")"
  else
    die "VERL_SRC=$VERL_SRC holds neither verl/__init__.py (a checkout) nor __init__.py in a folder named verl"
  fi
else
  python_bin="${VERL_PYTHON:-python3}"
  # find_spec locates the package without importing it (importing verl pulls in torch: seconds, and can fail)
  pkg_dir="$("$python_bin" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("verl")
sys.exit(1) if spec is None or spec.origin is None else print(os.path.dirname(os.path.realpath(spec.origin)))')" ||
    die "$python_bin cannot find verl: install verl==$expected_version first, or set VERL_PYTHON / VERL_SRC"
  verl_root="$(dirname "$pkg_dir")"
fi

version_file="$verl_root/verl/version/version"
found_version="$(tr -d '[:space:]' <"$version_file" 2>/dev/null || true)"
if [[ "$found_version" != "$expected_version" ]]; then
  die "expected verl $expected_version, found ${found_version:-no version file} at $verl_root/verl (the patch targets $expected_version only)"
fi

# site-packages usually sits inside some repository's ignored .venv, and there git apply skips every path and
# still exits 0. The ceiling stops git from looking above verl_root; a source checkout's own .git is still used.
export GIT_CEILING_DIRECTORIES
GIT_CEILING_DIRECTORIES="$(dirname "$verl_root")"
cd "$verl_root"

if git apply --reverse --check "$patch_file" 2>/dev/null; then
  say "verl $expected_version at $verl_root/verl: already applied, nothing changed"
  exit 0
fi
if ! check_log="$(git apply --check "$patch_file" 2>&1)"; then
  echo "$check_log" >&2
  die "the patch does not apply to $verl_root/verl: its files differ from pristine verl $expected_version (reinstall verl==$expected_version, then run this again)"
fi
git apply "$patch_file"
# Trust but verify: the result must now read as applied, or something (a skipped path) went wrong.
git apply --reverse --check "$patch_file" 2>/dev/null || die "git apply reported success but the patch is not in place"
say "verl $expected_version at $verl_root/verl: applied $(basename "$patch_file")"
