"""What a config key means: `config --explain KEY`, and the one-line comments `config` prints beside each key.

A key is explained from what already documents it, never from a second copy:
- this project's sections: the comments beside each field of `settings/schema.py`'s dataclasses (read from the
  source, so a field's comment is written once);
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
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from rllm.experimental.fully_async.errors import ConfigError
from rllm.experimental.fully_async.settings.loader import base_config, verl_base_config
from rllm.experimental.fully_async.settings.schema import FULLY_ASYNC_VERL_DEFAULTS, PROJECT_SECTIONS
from rllm.experimental.fully_async.settings.validate import _CHOICES, _LOWER_BOUNDS
from rllm.experimental.fully_async.settings.verl_keys import READ_ONLY_WHEN, VERL_KEYS_READ, is_read, refusal_reason

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


@functools.cache
def schema_comments() -> dict[str, tuple[str, str]]:
    """`section.field` -> (comment, annotated type) from settings/schema.py's dataclasses: the comment lines above
    the field and the one beside it."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in PROJECT_SECTIONS.items():
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        pending: list[str] = []
        for line in inspect.getsource(cls).splitlines()[1:]:
            stripped = line.strip()
            if stripped.startswith("#"):
                pending.append(stripped.lstrip("#").strip())
                continue
            match = _FIELD_LINE.match(line.split("  #")[0])
            if match and match.group(1) in types:
                beside = line.split("  # ", 1)[1].strip() if "  # " in line else ""
                out[f"{section}.{match.group(1)}"] = (" ".join([*pending, beside]).strip(), types[match.group(1)])
            pending = []
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
        kind = schema_comments()[key][1]
        kind = kind.replace("int", "an integer").replace("float", "a number").replace("str", "a string")
        return kind.replace("bool", "true | false").replace(" | None", " or null") + bound
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
    base = base_config(megatron)
    node = OmegaConf.select(base, key, default=_MISSING, throw_on_missing=False)
    if node is _MISSING:
        leaves = list(_leaves(base))
        close = difflib.get_close_matches(key, leaves, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else " (config --all lists every key)"
        raise ConfigError(f"unknown key '{key}'{hint}")
    if isinstance(node, DictConfig):
        lines = [f"{key}: a section; its keys:"]
        for child in node:
            full = f"{key}.{child}"
            lines.append(f"  {full}: {meaning(full, megatron) or '(see ' + full + ')'}")
        return lines
    raw = node
    lines = [f"{key}", f"  meaning:  {meaning(key, megatron) or 'no comment in verl or settings/schema.py'}"]
    verl_default = OmegaConf.select(verl_base_config(megatron), key, default=_MISSING, throw_on_missing=False)
    ours = _fully_async_default(key)
    if ours is not _MISSING and verl_default is not _MISSING and ours != verl_default:
        lines.append(f"  default:  {_yaml(ours)} (this project's; verl's is {_yaml(verl_default)})")
    else:
        lines.append(f"  default:  {_yaml(raw)}")
    lines.append(f"  allowed:  {allowed(key, raw)}")
    if cfg is not None:
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        lines.append(f"  now:      {_yaml(value)}" + (f" (set in {origin})" if origin else ""))
    where = readers(key)
    lines += [f"  read by:  {where[0]}", *(f"            {w}" for w in where[1:])] if where else []
    where_doc = "settings/schema.py" if key.split(".")[0] in PROJECT_SECTIONS else "verl/trainer/config/*.yaml"
    lines.append(f"  documented in {where_doc}")
    return lines


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


def diff_lines(cfg: DictConfig, layers: list[tuple[str, DictConfig]]) -> list[str]:
    """The config's keys that differ from the defaults (verl 0.7.1's plus this project's) as YAML, each with its
    meaning and where it was set in a comment: what `config` prints."""
    megatron = cfg.actor_rollout_ref.actor.strategy == "megatron"
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
        comment = f"[{origin_of(key, layers)}] {note}".rstrip()
        lines.append(f"{'  ' * (len(parts) - 1)}{parts[-1]}: {text}  # {comment}")
    return lines


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
