"""Is the installed verl patched for fully-async training? (`patches/verl_dp_actor.patch`,
docs/design.md#rule-small-proven-patch)

The trainer needs verl 0.7.1 with `patches/verl_dp_actor.patch` applied: without it `update_policy` silently drops
the staleness correction (the on-policy shortcut replaces `old_log_probs`), weights micro-batches by how the batch
happens to be split, and steps the optimizer on a NaN loss when a batch has no response tokens. The patch
changes source files inside the verl package, so the state is read from those files, not from verl's behaviour.

The answer comes from the same test the installer uses (`install/apply_verl_patch.sh`): `git apply --check` of the
patch in reverse (applied) and forward (not applied), run outside any git repository that happens to contain
site-packages. Neither passing means verl's files were changed some other way.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError

logger = logging.getLogger(__name__)

EXPECTED_VERL_VERSION = "0.7.1"
REPO_ROOT = Path(__file__).resolve().parents[4]
PATCH_FILE = REPO_ROOT / "patches" / "verl_dp_actor.patch"
APPLY_SCRIPT = REPO_ROOT / "install" / "apply_verl_patch.sh"
GIT_TIMEOUT_S = 30.0  # git apply --check on four files takes milliseconds; this only guards against a hung git


class PatchState(str, enum.Enum):
    """Where verl stands with respect to the fully-async patch."""

    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    CONFLICT = "modified otherwise"  # neither pristine 0.7.1 nor patched: the patch applies in neither direction
    WRONG_VERSION = "wrong verl version"
    NOT_INSTALLED = "verl not installed"
    UNKNOWN = "unknown"  # git or the patch file is missing, so the state cannot be read


@dataclass(frozen=True)
class PatchStatus:
    """The patch state of one verl installation, with what a person needs to fix it."""

    state: PatchState
    verl_root: Path | None  # the folder holding the `verl` package (site-packages, or a source checkout)
    verl_version: str | None
    detail: str  # one line: why, in the words of the check that decided

    @property
    def ok(self) -> bool:
        return self.state is PatchState.APPLIED

    def fix_command(self) -> str:
        """The one command (or pair) that brings this installation to the patched state."""
        apply = f"VERL_PYTHON={shlex.quote(sys.executable)} bash {shlex.quote(str(APPLY_SCRIPT))}"
        pip = f"{shlex.quote(sys.executable)} -m pip install --no-deps --force-reinstall verl=={EXPECTED_VERL_VERSION}"
        if self.state in (PatchState.WRONG_VERSION, PatchState.NOT_INSTALLED, PatchState.CONFLICT):
            return f"{pip} && {apply}"
        if self.state is PatchState.UNKNOWN:
            return f"install git, then {apply}"
        return apply


class UnpatchedVerlError(FullyAsyncError, RuntimeError):
    """verl is not 0.7.1 with patches/verl_dp_actor.patch applied; the message is one line ending in the fix."""

    exit_code = EXIT_BAD_INPUT  # the installation: fixed before starting (the message names the command)


def verl_package_dir() -> Path | None:
    """The installed `verl` package folder, found without importing verl (which pulls in torch)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent


def read_verl_version(package_dir: Path) -> str | None:
    """verl keeps its version in `verl/version/version`, in the wheel and in a source checkout alike."""
    try:
        return (package_dir / "version" / "version").read_text().strip()
    except OSError:
        return None


def _git_apply_check(git: str, verl_root: Path, patch_file: Path, *, reverse: bool) -> subprocess.CompletedProcess[str]:
    cmd = [git, "apply", "--check", *(["--reverse"] if reverse else []), str(patch_file)]
    # Inside a repository that ignores .venv, git apply skips the paths silently and reports success: stop git
    # from looking above verl_root for a repository (a verl source checkout's own .git is still found).
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(verl_root.parent)}
    return subprocess.run(cmd, cwd=verl_root, env=env, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)


def patch_status(package_dir: Path | None = None, patch_file: Path = PATCH_FILE) -> PatchStatus:
    """Read the patch state of the verl package at `package_dir` (default: the one Python would import)."""
    package_dir = verl_package_dir() if package_dir is None else package_dir
    if package_dir is None:
        return PatchStatus(PatchState.NOT_INSTALLED, None, None, "no module named 'verl'")
    verl_root = package_dir.parent
    version = read_verl_version(package_dir)
    if version != EXPECTED_VERL_VERSION:
        detail = f"found verl {version} at {package_dir}, the patch targets {EXPECTED_VERL_VERSION}"
        return PatchStatus(PatchState.WRONG_VERSION, verl_root, version, detail)
    git = shutil.which("git")
    if git is None:
        return PatchStatus(PatchState.UNKNOWN, verl_root, version, "git is not on PATH")
    if not patch_file.is_file():
        return PatchStatus(PatchState.UNKNOWN, verl_root, version, f"patch file {patch_file} is missing")
    if _git_apply_check(git, verl_root, patch_file, reverse=True).returncode == 0:
        return PatchStatus(PatchState.APPLIED, verl_root, version, f"{patch_file.name} is applied")
    forward = _git_apply_check(git, verl_root, patch_file, reverse=False)
    if forward.returncode == 0:
        return PatchStatus(PatchState.NOT_APPLIED, verl_root, version, f"{patch_file.name} is not applied")
    first_error = next((line for line in forward.stderr.splitlines() if line.startswith("error:")), forward.stderr)
    detail = f"{patch_file.name} applies neither forward nor in reverse ({first_error.strip()})"
    return PatchStatus(PatchState.CONFLICT, verl_root, version, detail)


def require_patched_verl() -> PatchStatus:
    """Raise UnpatchedVerlError unless the importable verl is 0.7.1 with the fully-async patch applied.

    The trainer calls this before building anything: unpatched verl trains, but on the wrong numbers.
    """
    status = patch_status()
    if not status.ok:
        where = f" at {status.verl_root}" if status.verl_root is not None else ""
        raise UnpatchedVerlError(
            f"verl{where} is not patched for fully-async training ({status.state.value}: {status.detail}); "
            f"fix: {status.fix_command()}"
        )
    logger.debug("verl %s at %s: %s", status.verl_version, status.verl_root, status.detail)
    return status
