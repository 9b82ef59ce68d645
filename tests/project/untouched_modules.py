"""Which modules of the package a test run leaves untouched: never imported, or imported with no function run.

    pip install coverage   # a measuring tool, not a dependency of the project
    python tests/project/untouched_modules.py -m "not slow"      # any pytest arguments; default: the inner loop

It runs pytest under coverage with subprocesses measured too (the CLI, the engines, Ray's workers inherit it through
COVERAGE_PROCESS_CONFIG; a process killed with SIGKILL records nothing), then reads which lines ran. A module counts
as touched when a line inside one of its functions ran, or, for a module without functions (constants, dataclasses),
when it was imported (a Protocol, whose methods are stubs, counts as one). `patch = _exit` records the engines,
which end with os._exit. Exit status 1 when a module is untouched, so the inner loop's promise (it touches every module)
can be checked in one command.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rllm" / "experimental" / "fully_async"

COVERAGE_RC = """
[run]
source = {package}
parallel = true
patch = subprocess, _exit
sigterm = true
data_file = {data}
"""


def _is_stub(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A body of a docstring and/or `...` only: a Protocol's method, which no caller ever runs."""
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in node.body)


def function_body_lines(module: ast.Module) -> set[int]:
    """Line numbers of the statements inside the module's functions and methods (what runs only when called)."""
    lines: set[int] = set()
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_stub(node):
            for statement in node.body:
                lines.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
    return lines


def untouched(executed: dict[Path, set[int]]) -> tuple[list[str], list[str]]:
    """(modules never imported, modules imported with no function run), as paths relative to the repository."""
    never, imported_only = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ast.parse(path.read_text(), str(path))
        if all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in module.body):
            continue  # a docstring at most: nothing to run
        name, ran, bodies = str(path.relative_to(REPO)), executed.get(path, set()), function_body_lines(module)
        if not ran:
            never.append(name)
        elif bodies and not ran & bodies:
            imported_only.append(name)
    return never, imported_only


def main(pytest_args: list[str]) -> int:
    try:
        import coverage
    except ImportError:
        print("untouched_modules: needs coverage (pip install coverage); it is not a dependency of the project")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rc = Path(tmp) / "coveragerc"
        data = Path(tmp) / ".coverage"
        rc.write_text(COVERAGE_RC.format(package=PACKAGE, data=data))
        command = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", *pytest_args]
        tests = subprocess.run(command, cwd=REPO)
        subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=REPO, check=True)
        measured = coverage.CoverageData(basename=str(data))
        measured.read()
        executed = {Path(name): set(measured.lines(name) or ()) for name in measured.measured_files()}
    never, imported_only = untouched(executed)
    for name in never:
        print(f"never imported: {name}")
    for name in imported_only:
        print(f"imported, no function ran: {name}")
    total = len(list(PACKAGE.rglob("*.py")))
    print(f"{total - len(never) - len(imported_only)} of {total} modules touched (pytest exit {tests.returncode})")
    return 1 if never or imported_only else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["-m", "not slow", "tests"]))
