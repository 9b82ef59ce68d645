"""The tree shows the layers: folders import only folders below them, runtime's wings only wings below them, pure code
stays pure, no folder holds more than 12 modules, and package modules import no circle.

Built from the source's ASTs, so the rules hold without importing anything, and every import counts: at the top of a
module, inside a function (lazy) or under `if TYPE_CHECKING`. Imports that do not meet a rule yet are listed, with
why, in the allow-lists below (printed by `test_known_exceptions_are_listed_with_their_reason`); the lead empties
them when the work that fixes them merges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rllm" / "experimental" / "fully_async"
PREFIX = "rllm.experimental.fully_async"
PURE_LAYERS = ("api", "core", "algorithms")
FORBIDDEN_IMPORTS = {"ray", "asyncio", "aiohttp", "httpx", "socket"}
# Calls that read or write files: open(...), Path.open / read_* / write_*, os.open, torch.save / torch.load, ...
FILE_CALL_ATTRS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "touch", "unlink", "mkdir"}
FILE_CALL_QUALIFIED = {("torch", "save"), ("torch", "load"), ("np", "save"), ("np", "load"), ("json", "dump")}

MAX_MODULES_PER_FOLDER = 12

# The folder order, bottom to top: a unit (a folder of the package, or a module at its top) may import itself and the
# units listed BEFORE it, never one after it.
LAYERS = (
    "errors",  # the one exception type every refusal derives from
    "config",  # rLLM's config package (pkg://rllm.experimental.fully_async.config): YAML, no code
    "api",  # the contracts between parts: trajectory and step messages, workflow, policy backend, weight transport
    "protocol",  # rLLM's protocol types at rLLM's path: a contract too (pure types), which the rLLM adapter reads
    "message_utils",  # rLLM's generated-text -> assistant message (tool calls parsed): pure formatting
    "core",  # pure policy: staleness, ledger, batch assembly, versions, placement
    "algorithms",  # pure tensor math: advantages, corrections, filters
    "run_spec",  # the frozen run spec every piece reads, built from a checked config (settings/ loads and checks)
    # the pieces, each a responsibility; where one uses another, the used one comes first
    "backends",  # verl's actors behind api.PolicyBackend
    "engines",  # the engine client, launcher, supervisor and the embedded CPU engine
    "client",  # rLLM's RolloutClient over the engine client, which the rLLM adapter (workflows) hands to user code
    "data",  # prompts and the token cache
    "workers",  # the pool that runs user code in killable processes
    "tools",  # built-in tools
    "envs",  # environments (run in the worker pool)
    "workflows",  # single-turn and multi-turn rollouts, the rLLM adapter
    "tasks",  # built-in tasks
    "observe",  # what a run records: metrics sink, progress, dumps, wall time, end-of-run summary; the dump viewer
    "settings",  # the config: loading and checking (it knows every section); explain, defaults, rLLM's keys
    "runtime",  # the Ray/asyncio shells that run the pieces: run, rollout, trainer, sync, checkpoints, cluster
    # the user-facing tools, on top
    "simulate",
    "report",  # the run report: reads run directories, fits the simulator to them
    "cli",
    "runner",  # rLLM's public names (a thin layer over the rest)
    "__main__",
    "__init__",  # the package's own __init__ (its version)
)

# The order of runtime/'s wings, bottom to top, enforced as the top level's is (no exception list): the checkpoint
# store and the weight transports know no other wing; Ray's session and placement come next; the rollout service and
# the trainer each wire their own process (each may write its part of a checkpoint, the trainer syncs weights); the
# driver (run/) starts them all.
RUNTIME_WINGS = (
    "checkpoints",  # the crash-safe store, a checkpoint's files, the trainer's shards
    "sync",  # ParamSync and its transports, both ends of the weight-update group
    "cluster",  # Ray's session, placement on one host or a cluster, engine hosts
    "rollout",  # the rollout service's process: service, executor, queue, ledger journal, validation
    "trainer",  # the trainer's process and its ranks; record and replay
    "run",  # the driver: start, step, checkpoint, stop
)

# Imports against the order, allowed for now with the reason (importer module -> imported module, package-relative).
# Empty: the run spec every piece reads sits below the pieces (run_spec.py), the address rule in core/.
ORDER_ALLOWED: dict[tuple[str, str], str] = {}

# Allowed for now, because another helper is rewriting the module (remove when merged):
PURITY_ALLOWED: dict[str, str] = {}
CYCLES_ALLOWED: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages as their __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PREFIX, *parts))] = path
    return out


MODULES = _modules()


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every module name an import statement anywhere in the file (lazy imports included) refers to."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import submodule`
    return names


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _pure_files() -> list[Path]:
    return [p for p in MODULES.values() if _rel(p).split("/")[0] in PURE_LAYERS]


@pytest.mark.parametrize("path", _pure_files(), ids=_rel)
def test_pure_layers_import_no_io_or_concurrency_library(path):
    module = next(m for m, p in MODULES.items() if p == path)
    bad = sorted(
        {
            n
            for n in _imported_names(_tree(path), module, path.name == "__init__.py")
            if n.split(".")[0] in FORBIDDEN_IMPORTS
        }
    )
    assert not bad, f"{_rel(path)} imports {bad}: pure code (core/, algorithms/) takes these through a Protocol"


def _file_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.append(f"open() line {node.lineno}")
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if (
                func.attr in FILE_CALL_ATTRS
                or func.attr.startswith("write_")
                or (owner, func.attr) in FILE_CALL_QUALIFIED
            ):
                found.append(f".{func.attr}() line {node.lineno}")
    return found


@pytest.mark.parametrize("path", _pure_files(), ids=_rel)
def test_pure_layers_open_no_files(path):
    if _rel(path) in PURITY_ALLOWED:
        pytest.skip(PURITY_ALLOWED[_rel(path)])
    calls = _file_calls(_tree(path))
    assert not calls, f"{_rel(path)} touches files ({', '.join(calls)}): do I/O in a shell and pass data in"


def test_the_file_scan_sees_the_calls_it_forbids():
    tree = ast.parse("open('x')\nPath('y').read_text()\np.write_bytes(b'')\ntorch.save(m, f)\n'a'.replace('a','b')")
    assert len(_file_calls(tree)) == 4
    assert _imported_names(ast.parse("import asyncio\nfrom ray.util import x"), "a.b", False) == [
        "asyncio",
        "ray.util",
        "ray.util.x",
    ]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = _imported_names(_tree(path), module, path.name == "__init__.py")
        graph[module] = {t for t in targets if t in MODULES and t != module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the components with more than one module are the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_cycles_between_package_modules():
    cycles = [c for c in strongly_connected(import_graph()) if frozenset(c) not in CYCLES_ALLOWED]
    short = [sorted(m.removeprefix(PREFIX + ".") for m in c) for c in cycles]
    assert not cycles, f"import cycles (lazy imports count): {short}"


def _unit(module: str) -> str:
    """The layer unit of a package module: its top folder, or the top-level module's own name."""
    rel = module.removeprefix(PREFIX).lstrip(".")
    return rel.split(".")[0] if rel else "__init__"


def _short(module: str) -> str:
    return module.removeprefix(PREFIX).lstrip(".") or "__init__"


def order_violations(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[tuple[str, str]]:
    """(importer, imported) pairs, package-relative, where the imported module's unit comes after the importer's."""
    rank = {unit: i for i, unit in enumerate(layers)}
    return sorted(
        (_short(a), _short(b))
        for a, targets in graph.items()
        for b in targets
        if _unit(a) != _unit(b) and rank[_unit(b)] > rank[_unit(a)]
    )


def test_every_unit_of_the_package_has_a_place_in_the_order():
    units = {_unit(m) for m in MODULES}
    assert not units - set(LAYERS), f"add {sorted(units - set(LAYERS))} to LAYERS in tests/project/test_layers.py"
    assert len(set(LAYERS)) == len(LAYERS)


def test_the_order_check_sees_an_import_that_points_up():
    graph = {f"{PREFIX}.core.a": {f"{PREFIX}.runtime.b", f"{PREFIX}.api.c"}, f"{PREFIX}.runtime.b": set()}
    assert order_violations(graph, LAYERS) == [("core.a", "runtime.b")]


def test_folders_import_only_folders_below_them():
    found = order_violations(import_graph(), LAYERS)
    against = [f"{a} -> {b}" for a, b in found if (a, b) not in ORDER_ALLOWED]
    assert not against, (
        f"imports against the folder order ({' < '.join(LAYERS)}): {against}. Move what the lower folder needs down "
        "(or the importer up); an exception goes in ORDER_ALLOWED with its reason"
    )


def test_known_exceptions_are_listed_with_their_reason():
    """Prints the allow-list (pytest -rP or -s shows it); an entry whose import is gone must be removed."""
    found = set(order_violations(import_graph(), LAYERS))
    for (a, b), reason in sorted(ORDER_ALLOWED.items()):
        print(f"allowed against the folder order: {a} -> {b}: {reason}")
    stale = sorted(pair for pair in ORDER_ALLOWED if pair not in found)
    assert not stale, f"no longer imported, remove from ORDER_ALLOWED: {stale}"
    assert all(reason.strip() for reason in ORDER_ALLOWED.values())


def _wing(module: str) -> str | None:
    """The runtime wing of a package module (runtime.<wing>...), or None outside runtime's wings."""
    parts = _short(module).split(".")
    return parts[1] if parts[0] == "runtime" and len(parts) > 2 else None


def wing_violations(graph: dict[str, set[str]], wings: tuple[str, ...]) -> list[tuple[str, str]]:
    """(importer, imported) pairs inside runtime/ where the imported module's wing comes after the importer's."""
    rank = {wing: i for i, wing in enumerate(wings)}
    return sorted(
        (_short(a), _short(b))
        for a, targets in graph.items()
        for b in targets
        if _wing(a) is not None and _wing(b) is not None and rank[_wing(b)] > rank[_wing(a)]
    )


def test_every_runtime_wing_has_a_place_in_the_order():
    wings = {_wing(m) for m in MODULES} - {None}
    assert wings == set(RUNTIME_WINGS), f"RUNTIME_WINGS must list exactly runtime's folders: {sorted(wings)}"


def test_the_wing_check_sees_an_import_that_points_up():
    graph = {f"{PREFIX}.runtime.sync.a": {f"{PREFIX}.runtime.run.b", f"{PREFIX}.runtime.checkpoints.c"}}
    assert wing_violations(graph, RUNTIME_WINGS) == [("runtime.sync.a", "runtime.run.b")]


def test_runtime_wings_import_only_wings_below_them():
    against = [f"{a} -> {b}" for a, b in wing_violations(import_graph(), RUNTIME_WINGS)]
    assert not against, (
        f"imports against runtime's wing order ({' < '.join(RUNTIME_WINGS)}): {against}. Move what the lower wing "
        "needs down, or the importer up"
    )


def _folders() -> list[Path]:
    return sorted({path.parent for path in MODULES.values()})


@pytest.mark.parametrize("folder", _folders(), ids=lambda f: f.relative_to(PACKAGE).as_posix() or ".")
def test_no_folder_holds_more_than_12_modules(folder):
    modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_MODULES_PER_FOLDER, (
        f"{folder.relative_to(PACKAGE).as_posix() or 'the package root'} holds {len(modules)} modules: group them into "
        "rooms (sub-packages), one responsibility each"
    )
