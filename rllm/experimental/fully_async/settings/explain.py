"""What a config key means: `config --explain KEY`, and the one-line comments `config` prints beside each key.

A key is explained from what already documents it, never from a second copy:
- this project's sections: the comments beside (or above) each field of `settings/schema.py`'s dataclasses,
  nested sections included (`async_training.adaptive_staleness`, `engines.lora`), read from the source so a field's
  comment is written once; the algorithm sections under `algorithm` (`ALGORITHM_SECTIONS`, null by default) from
  their dataclasses' docstring entries (`name: meaning`) in algorithms/;
- verl's keys: the comment above the key in verl 0.7.1's own config files (`verl/trainer/config/**.yaml`, where
  verl's CI requires one per field), found by following `ppo_trainer.yaml`'s (or `ppo_megatron_trainer.yaml`'s)
  `defaults:` list to the file and place each section comes from;
- its default: verl's default and, where this project changes it, the fully-async default (`base_config`);
- allowed values: `settings/validate.py`'s choices and bounds, else the type of the field or of verl's default;
- who reads it: `settings/verl_keys.py`'s entry for a verl key (or that it is refused), and the modules of this
  package whose source names the key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from rllm.experimental.fully_async.algorithms.correction_config import CorrectionConfig
from rllm.experimental.fully_async.algorithms.filters import FilterConfig
from rllm.experimental.fully_async.algorithms.gigpo import GiGPOConfig
from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.settings.loader import base_config, verl_base_config
from rllm.experimental.fully_async.settings.schema import FULLY_ASYNC_VERL_DEFAULTS, PROJECT_SECTIONS
from rllm.experimental.fully_async.settings.validate import _CHOICES, _LOWER_BOUNDS
from rllm.experimental.fully_async.settings.verl_keys import READ_ONLY_WHEN, VERL_KEYS_READ, is_read, refusal_reason
from rllm.experimental.fully_async.tasks import TASK_ASSET_KEYS, task_asset_paths

PACKAGE = Path(__file__).resolve().parents[1]
_KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w\-]*)\s*:")
_FIELD_LINE = re.compile(r"^\s+([a-z_][a-z0-9_]*)\s*:\s*[^=]+(=.*)?$")


# ---- comments ------------------------------------------------------------------------------------------------


def _yaml_comments(path: Path, package: str, out: dict[str, str]) -> None:
    """Each key's comment block (the `#` lines right above it) in one verl YAML file, under `package`."""
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = _KEY_LINE.match(line)
        if not match:
            pending = []
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path_keys = [k for _, k in stack] + [key]
        if pending and path_keys[0] != "defaults":
            out[".".join(p for p in (package, *path_keys) if p)] = " ".join(pending)
        pending = []
        stack.append((indent, key))


def _compose(root: Path, path: Path, package: str, choices: dict[str, str], out: dict[str, str]) -> None:
    """Follow a verl config file's `defaults:` list (Hydra's `group@package: name`, relative to the file), then
    read the file's own comments, which win as its values do (`_self_` last)."""
    if not path.is_file():
        return
    defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults") or []
    for entry in defaults:
        if entry == "_self_":
            continue
        if isinstance(entry, str):
            _compose(root, path.parent / f"{entry}.yaml", package, choices, out)
            continue
        ((target, name),) = entry.items()
        group, _, at = str(target).partition("@")
        if not at:  # a plain group choice (model_engine: dp) sets no keys this trainer reads
            continue
        for var, value in choices.items():
            name = str(name).replace(f"${{{var}}}", value)
        child = ".".join(p for p in (package, at) if p)
        _compose(root, (path.parent / group / f"{name}.yaml").resolve(), child, choices, out)
    _yaml_comments(path, package, out)


@functools.cache
def verl_comments(megatron: bool = False) -> dict[str, str]:
    """Dotted verl key -> the comment verl's config files write above it."""
    # lazy: importing verl costs ~3 s; the comments need only its config folder, for config --explain
    import verl

    root = Path(verl.__file__).parent / "trainer" / "config"
    out: dict[str, str] = {}
    top = "ppo_megatron_trainer.yaml" if megatron else "ppo_trainer.yaml"
    _compose(root, root / top, "", {"model_engine": "megatron" if megatron else "dp"}, out)
    return out


# This project's sections under verl's `algorithm` (algorithms/): null (off) by default; set, each is its
# dataclass's fields (documented in the dataclass's docstring as `name: meaning` entries) and checked by building it
# (settings/validate.py).
ALGORITHM_SECTIONS: dict[str, type] = {
    "algorithm.off_policy_correction": CorrectionConfig,
    "algorithm.group_filter": FilterConfig,
    "algorithm.gigpo": GiGPOConfig,
}


def dataclass_sections() -> dict[str, type]:
    """Every config section that is one of this project's dataclasses, nested ones included (`engines.lora`,
    `async_training.adaptive_staleness`): dotted section -> its class."""
    out: dict[str, type] = {}

    def add(section: str, cls: type) -> None:
        out[section] = cls
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                add(f"{section}.{f.name}", hints[f.name])

    for section, cls in {**PROJECT_SECTIONS, **ALGORITHM_SECTIONS}.items():
        add(section, cls)
    return out


def _field_comments(cls: type) -> dict[str, str]:
    """Field -> its comment: the `#` lines above the field and the one beside it in the class's source, else the
    class docstring's `name: meaning` entry (an entry's continuation lines are indented)."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD_LINE.match(line.split("  #")[0])
        if match and match.group(1) in names:
            beside = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            out[match.group(1)] = " ".join([*pending, beside]).strip()
        pending = []
    docs = _docstring_entries(cls, names)
    return {name: out.get(name) or docs.get(name, "") for name in names}


def _docstring_entries(cls: type, names: set[str]) -> dict[str, str]:
    """The class docstring's `name: meaning` entries for `names`, each with its indented continuation lines."""
    out: dict[str, str] = {}
    entry: str | None = None
    for line in (inspect.getdoc(cls) or "").splitlines():
        match = _DOC_ENTRY.match(line)
        if match and match.group(1) in names:
            entry = match.group(1)
            out[entry] = match.group(2).strip()
        elif entry is not None and line.startswith(" "):
            out[entry] += " " + line.strip()
        else:
            entry = None
    return out


_DOC_ENTRY = re.compile(r"^([a-z_][a-z0-9_]*): (.*)$")


def describe_type(hint: Any) -> str:
    """A field's type as `allowed:` prints it: `an integer or null`, `token | sequence`, `true | false`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(str(a) for a in args)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " | ".join(describe_type(a) for a in rest) + " or null"
    origin = typing.get_origin(hint) or hint
    names = {bool: "true | false", int: "an integer", float: "a number", str: "a string", list: "a list"}
    if dataclasses.is_dataclass(origin):
        return "a section"
    return names.get(origin, "a mapping" if origin is dict else str(hint))


@functools.cache
def schema_comments() -> dict[str, tuple[str, str]]:
    """`section.field` -> (comment, allowed values from the annotated type) for every field of every dataclass
    section (`dataclass_sections`), read from the classes' source (`_field_comments`)."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in dataclass_sections().items():
        hints = typing.get_type_hints(cls)
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            out[f"{section}.{f.name}"] = (comments.get(f.name, ""), describe_type(hints[f.name]))
    return out


def meaning(key: str, megatron: bool = False) -> str:
    """The one-line meaning of a key ('' when nothing documents it)."""
    if key in schema_comments():
        return schema_comments()[key][0]
    return verl_comments(megatron).get(key, "")


# ---- readers, defaults, allowed values ------------------------------------------------------------------------


@functools.cache
def _sources() -> dict[str, str]:
    skip = {"settings/explain.py", "settings/schema.py"}
    return {
        p.relative_to(PACKAGE).as_posix(): p.read_text()
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).as_posix() not in skip
    }


def readers(key: str) -> list[str]:
    """What reads `key`: verl_keys.py's entry for a verl key, then the modules whose source names it."""
    out: list[str] = []
    section = key.split(".")[0]
    if section not in PROJECT_SECTIONS:
        entries = [(e, why) for e, why in VERL_KEYS_READ.items() if key == e or key.startswith(e.rstrip(".") + ".")]
        if not is_read(key):
            why = refusal_reason(key)
            out.append(f"not read by the fully-async trainer ({why}): a value other than the default is refused")
        elif entries:
            out.append(max(entries, key=lambda e: len(e[0]))[1] + " (settings/verl_keys.py)")
            rule = READ_ONLY_WHEN.get(key)
            if rule is not None:
                out.append(f"read only {rule.condition}: set otherwise, it is refused")
    fields = spec_fields().get(key)
    if fields:
        out.append(f"run_spec.py into the run spec: {', '.join(fields)}")
    needle = re.compile(r"(?<![\w.])" + re.escape(key) + r"(?![\w])")
    found = [path for path, text in _sources().items() if needle.search(text) and not path.startswith(_NOT_READERS)]
    if found:
        out.append("named in " + ", ".join(found))
    return out


# Modules that show a saved config or check it rather than run with it.
_NOT_READERS = ("observe/", "simulate/", "run_spec.py", "settings/verl_keys.py")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


@functools.cache
def spec_fields() -> dict[str, list[str]]:
    """Config key -> the run-spec fields built from it (`SpecClass.field`), read from run_spec.py's source:
    each keyword argument of a spec constructor and the `cfg.` keys its value names, through local aliases such
    as `at = cfg.async_training`."""
    tree = ast.parse((PACKAGE / "run_spec.py").read_text())
    out: dict[str, list[str]] = {}
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        aliases: dict[str, str] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for target, value in zip(targets, values, strict=False):
                    dotted = _dotted(value)
                    if isinstance(target, ast.Name) and dotted and dotted.startswith("cfg."):
                        aliases[target.id] = dotted.removeprefix("cfg.")
        for call in (n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            for keyword in call.keywords:
                for node in ast.walk(keyword.value):
                    dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
                    if dotted is None or not isinstance(node.ctx, ast.Load):
                        continue
                    head, _, rest = dotted.partition(".")
                    key = rest if head == "cfg" else f"{aliases[head]}.{rest}" if head in aliases and rest else None
                    field = f"{call.func.id}.{keyword.arg}"
                    if key and field not in out.setdefault(key, []):
                        out[key].append(field)
    return out


def allowed(key: str, default: Any) -> str:
    if key in _CHOICES:
        return " | ".join(_CHOICES[key])
    bound = ""
    if key in _LOWER_BOUNDS:
        minimum, strict = _LOWER_BOUNDS[key]
        bound = f" {'>' if strict else '>='} {minimum:g}"
    if key in schema_comments():
        return schema_comments()[key][1] + bound
    names = {bool: "true | false", int: "an integer", float: "a number", str: "a string"}
    if isinstance(default, (list, ListConfig)):
        return "a list"
    return next((name + bound for t, name in names.items() if type(default) is t), "any (null by default)" + bound)


def _fully_async_default(key: str) -> Any:
    node: Any = FULLY_ASYNC_VERL_DEFAULTS
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _yaml(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def explain(key: str, cfg: DictConfig | None = None, origin: str | None = None) -> list[str]:
    """The lines `config --explain KEY` prints. `cfg`: the loaded config (its value is shown); unknown keys raise
    ConfigError naming the nearest keys."""
    megatron = cfg is not None and cfg.actor_rollout_ref.actor.strategy == "megatron"
    base, verl_base = _bases(megatron)
    section, _, name = key.rpartition(".")
    if key in ALGORITHM_SECTIONS:  # null in the base config: its keys are the dataclass's
        lines = [f"{key}: a section, null by default (off); setting any of its keys turns it on. Its keys:"]
        names = [f.name for f in dataclasses.fields(ALGORITHM_SECTIONS[key])]
        lines += [f"  {key}.{name}: {meaning(f'{key}.{name}')}" for name in names]
        return lines
    if section in ALGORITHM_SECTIONS and key in schema_comments():
        node: Any = {f.name: f.default for f in dataclasses.fields(ALGORITHM_SECTIONS[section])}[name]
    else:
        node = OmegaConf.select(base, key, default=_MISSING, throw_on_missing=False)
    if node is _MISSING:
        leaves = [*_leaves(base), *(k for k in schema_comments() if k.rpartition(".")[0] in ALGORITHM_SECTIONS)]
        close = difflib.get_close_matches(key, leaves, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else " (config --all lists every key)"
        raise ConfigError(f"unknown key '{key}'{hint}")
    free_form = schema_comments().get(key, ("", ""))[1] == "a mapping"  # engines.extra_args: a value, not a section
    if isinstance(node, DictConfig) and not free_form:
        lines = [f"{key}: a section; its keys:"]
        for child in node:
            full = f"{key}.{child}"
            lines.append(f"  {full}: {meaning(full, megatron) or '(see ' + full + ')'}")
        return lines
    raw = node
    lines = [f"{key}", f"  meaning:  {meaning(key, megatron) or 'no comment in verl or settings/schema.py'}"]
    verl_default = OmegaConf.select(verl_base, key, default=_MISSING, throw_on_missing=False)
    ours = _fully_async_default(key)
    if section in ALGORITHM_SECTIONS:
        lines.append(f"  default:  {_yaml(raw)} (once {section} is set; it is null by default: off)")
    elif ours is not _MISSING and verl_default is not _MISSING and ours != verl_default:
        lines.append(f"  default:  {_yaml(ours)} (this project's; verl's is {_yaml(verl_default)})")
    else:
        lines.append(f"  default:  {_yaml(raw)}")
    lines.append(f"  allowed:  {allowed(key, raw)}")
    if cfg is not None:
        cfg, task_origins = with_task_assets(cfg)
        lines.append(f"  now:      {_now(key, cfg, raw, task_origins.get(key, origin))}")
    where = readers(key)
    lines += [f"  read by:  {where[0]}", *(f"            {w}" for w in where[1:])] if where else []
    lines.append(f"  documented in {_documented_in(section)}")
    return lines


@functools.cache
def _bases(megatron: bool) -> tuple[DictConfig, DictConfig]:
    """(this project's base config, verl's), built once per process (~0.2 s each), read and never changed here."""
    return base_config(megatron), verl_base_config(megatron)


def _now(key: str, cfg: DictConfig, default: Any, origin: str | None) -> str:
    """The value `cfg` gives `key` and where it came from: a layer, derived, the default, or an algorithm section
    left off (null)."""
    section = key.rpartition(".")[0]
    if section in ALGORITHM_SECTIONS and OmegaConf.select(cfg, section) is None:
        return f"null ({section} is null: off)"
    value = OmegaConf.select(cfg, key, default=default, throw_on_missing=False)
    if origin == "derived" and _yaml(value) == _yaml(default):
        origin = "the default"  # no layer sets it and nothing derived changed it
    return _yaml(value) + (f" (set in {origin})" if origin and origin != "the default" else " (the default)")


def _documented_in(section: str) -> str:
    """Where a key's comment is written: the dataclass of its section, else verl's config files."""
    cls = dataclass_sections().get(section)
    if cls is None:
        return "verl/trainer/config/*.yaml"
    return f"{Path(inspect.getsourcefile(cls) or '').resolve().relative_to(PACKAGE).as_posix()} ({cls.__name__})"


def _leaves(node: DictConfig, prefix: str = ""):
    for key in node:
        full = f"{prefix}{key}"
        child = node._get_node(key)
        if isinstance(child, DictConfig) and len(child):
            yield from _leaves(child, f"{full}.")
        else:
            yield full


# ---- `config`: what this config changes ------------------------------------------------------------------------


def origin_of(key: str, layers: list[tuple[str, DictConfig]]) -> str:
    """The last layer (file or the command line) that sets `key`, else `derived` (settings/derive.py, or mapped
    from an rLLM key by settings/compat.py)."""
    for name, layer in reversed(layers):
        value = OmegaConf.select(layer, key, default=_MISSING, throw_on_missing=False)
        if value is not _MISSING:
            return "derived" if value is None else name  # null asks for the derived value
    return "derived"


def changed_leaves(cfg: DictConfig, base: DictConfig, prefix: str = "") -> list[str]:
    """Dotted leaves whose value differs from the defaults; a default that is an interpolation (verl's
    `${oc.select:...}`) follows its target, so it is not listed for itself."""
    out: list[str] = []
    for key in cfg:
        full = f"{prefix}{key}"
        node, default = cfg._get_node(key), base._get_node(key) if key in base.keys() else None  # noqa: SIM118
        if isinstance(node, DictConfig) and isinstance(default, DictConfig) and len(default):
            out += changed_leaves(node, default, f"{full}.")
            continue
        if default is not None and not isinstance(default, DictConfig) and default._is_interpolation():
            continue
        ours = OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
        theirs = default
        if isinstance(theirs, (DictConfig, ListConfig)):
            theirs = OmegaConf.to_container(theirs, resolve=False)
        elif theirs is not None:
            theirs = theirs._value()
        if not isinstance(ours, (dict, list)) and hasattr(ours, "_value"):
            ours = OmegaConf.select(cfg, key)
        if ours != theirs:
            out.append(full)
    return out


def with_task_assets(cfg: DictConfig) -> tuple[DictConfig, dict[str, str]]:
    """The config as the run will use it: with a built-in task, its data and model in place of verl's placeholder
    defaults (which the task replaces when the run starts: tasks.apply_task), found without building anything
    (tasks.task_asset_paths). Returns the copy and, per replaced key, where its value comes from (`task addition`,
    `task addition, built at its first run` while its cache entry does not exist yet)."""
    name = cfg.task.name
    if name is None:
        return cfg, {}
    paths = task_asset_paths(cfg)
    shown = cfg.copy()
    origins: dict[str, str] = {}
    for key in TASK_ASSET_KEYS:
        value = paths[key] if paths is not None else f"made by task {name} when the run starts"
        OmegaConf.update(shown, key, value, merge=False)
        built = paths is not None and Path(value).exists()
        origins[key] = f"task {name}" + ("" if built else ", built at its first run")
    return shown, origins


def diff_lines(cfg: DictConfig, layers: list[tuple[str, DictConfig]]) -> list[str]:
    """The config's keys that differ from the defaults (verl 0.7.1's plus this project's) as YAML, each with its
    meaning and where it was set in a comment: what `config` prints. A built-in task's data and model are shown as
    the run will use them (`with_task_assets`)."""
    megatron = cfg.actor_rollout_ref.actor.strategy == "megatron"
    cfg, task_origins = with_task_assets(cfg)
    keys = changed_leaves(cfg, base_config(megatron))
    lines: list[str] = []
    opened: list[str] = []
    for key in keys:
        parts = key.split(".")
        common = 0
        while common < min(len(opened), len(parts) - 1) and opened[common] == parts[common]:
            common += 1
        opened = opened[:common]
        for depth in range(common, len(parts) - 1):
            lines.append(f"{'  ' * depth}{parts[depth]}:")
            opened.append(parts[depth])
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        text = _flow(value)
        note = meaning(key, megatron)
        note = note if len(note) <= 90 else note[:87] + "..."
        comment = f"[{task_origins.get(key) or origin_of(key, layers)}] {note}".rstrip()
        lines.append(f"{'  ' * (len(parts) - 1)}{parts[-1]}: {text}  # {comment}")
    return lines


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
