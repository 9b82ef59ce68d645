"""LoRA adapters over the embedded engine's base model: what an adapter is, how one is read, the checks SGLang
0.5.6 makes before it serves one, and the forward hooks that add each row's adapter in a mixed-adapter batch.

An adapter comes from a peft folder (`adapter_config.json` + `adapter_model.safetensors`, what peft's
`save_pretrained` writes) or, as an extension of SGLang's API, from tensors received over the weight-update group
under the same names (`lora_routes.py`). `build_adapter` maps peft's tensor names
(`base_model.model.<module>.lora_A.weight`) onto the served model's `nn.Linear` modules and checks their shapes.

Checks, in SGLang's order and wording where it has one (`sglang/srt/lora/lora_config.py` LoRAConfig,
`lora_manager.validate_new_adapter`, `lora/mem_pool.can_support`, `lora/lora.py` LoRAAdapter):
- `embed_tokens` or `lm_head` among the target modules: "Not supported yet";
- a rank above `--max-lora-rank`, or target modules outside `--lora-target-modules` (compared after SGLang's
  normalisation: q/k/v_proj count as qkv_proj, gate/up_proj as gate_up_proj, so `--lora-target-modules q_proj`
  admits an adapter on k_proj): "... is incompatible with the current LoRA memory pool configuration ...";
- `peft_type` other than LORA (SGLang asserts; the message is empty there, named here).
SGLang serves `scaling = lora_alpha / r` and reads nothing else from the config, so an adapter trained with
`use_rslora`, `use_dora`, `rank_pattern`/`alpha_pattern`, a LoRA bias or `modules_to_save` would be served as
another model than peft trains. The embedded engine refuses those instead of serving them wrongly (a run that works
here must compute the same on SGLang); the SGLang stand-in, which mirrors SGLang, is told `strict=False`.

The mixed batch (`LoRALayers`): the base model is left untouched (peft's injection would rename its parameters to
`...q_proj.base_layer.weight`, and full weight updates address them by their HF names); a forward hook on every
linear layer SGLang can target adds `scaling * B(A(x))` (B stored pre-scaled) for the rows of each adapter in the
batch, one pair of matmuls per adapter present (peft's `_mixed_batch_forward` does the same per adapter group),
nothing for base rows. Rows of one adapter only (the common case) take no gather at all. Measured against peft's own
mixed batch (`adapter_names=`) and against one pass per adapter's sub-batch: tests/bench/bench_lora.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from torch import nn

# sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES and LORA_TARGET_ALL_MODULES (the --lora-target-modules
# choices).
SUPPORTED_LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
LORA_TARGET_ALL = "all"
# sglang/srt/lora/utils.py get_normalized_target_modules: stacked projections share one LoRA buffer.
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
_STACKED["up_proj"] = "gate_up_proj"
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message says why (SGLang's wording where SGLang has one)."""


def normalized_target_modules(names: Iterable[str]) -> frozenset[str]:
    """SGLang's normalisation of target module names: the last dotted part, q/k/v -> qkv_proj, gate/up ->
    gate_up_proj (`get_normalized_target_modules`)."""
    out = set()
    for name in names:
        base = str(name).split(".")[-1]
        out.add(_STACKED.get(base, base))
    return frozenset(out)


def server_target_modules(flag_values: Sequence[str] | None) -> frozenset[str] | None:
    """`--lora-target-modules` as SGLang keeps it: None when not given, `all` expanded (and alone), normalised."""
    if not flag_values:
        return None
    values = set(flag_values)
    if LORA_TARGET_ALL in values:
        if len(values) != 1:
            raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
        values = set(SUPPORTED_LORA_TARGET_MODULES)
    return normalized_target_modules(values)


@dataclass(frozen=True)
class LoRALimits:
    """What an engine started with `--enable-lora` admits (the server flags, resolved as SGLang resolves them)."""

    max_lora_rank: int
    target_modules: frozenset[str]  # normalised (qkv_proj, gate_up_proj, o_proj, down_proj)
    max_loras_per_batch: int = 8  # distinct adapters in one running batch, the base model counting as one
    max_loaded_loras: int | None = None  # adapters registered at once (None: no limit); LRU-evicted beyond it


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One loaded adapter: its weights per base-model linear module, and SGLang's scaling (alpha / r)."""

    lora_id: str  # unique per load (SGLang's LoRARef.lora_id): a name loaded twice gets two ids
    name: str
    path: str | None  # the folder it was read from; None for one received as tensors
    rank: int
    scaling: float
    target_modules: frozenset[str]  # normalised
    pinned: bool
    # module -> (A [r, in], scaling * B [out, r]): the delta of a row x is B_scaled @ (A @ x)
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_folder(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A peft folder's `adapter_config.json` and tensors. SGLang would try the Hugging Face hub for a path that is
    not a folder; engines here run offline, so that is an error naming the path."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"{path} is not a folder holding {ADAPTER_CONFIG} (adapters load from local folders)")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{path}: cannot read {ADAPTER_CONFIG}: {exc}") from exc
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoRAAdapterError(f"{path} holds no .safetensors file (peft's adapter_model.safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            # Bytes, not safe_open: safetensors' mmap backend keeps objects per tensor opened (weights.py).
            tensors.update(load_safetensors_bytes(file.read_bytes()))
    except (OSError, SafetensorError) as exc:
        raise LoRAAdapterError(f"{path}: cannot read the adapter's tensors: {exc}") from exc
    return config, tensors


def config_rank_and_targets(config: Mapping[str, Any]) -> tuple[int, frozenset[str]]:
    """The rank and normalised target modules of an adapter config, with SGLang's LoRAConfig refusal."""
    targets = config.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list | tuple) or not targets:
        raise LoRAAdapterError(
            f"target_modules {targets!r}: SGLang needs the list of module names in {ADAPTER_CONFIG} "
            "(peft writes it so for target_modules='all-linear')"
        )
    if any(module in targets for module in ("embed_tokens", "lm_head")):
        raise LoRAAdapterError("Not supported yet")  # SGLang's message (lora_config.py)
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as exc:
        raise LoRAAdapterError(f"{ADAPTER_CONFIG} needs integer r and numeric lora_alpha: {exc!r}") from exc
    if rank < 1 or alpha <= 0:
        raise LoRAAdapterError(f"{ADAPTER_CONFIG}: r must be >= 1 and lora_alpha > 0, got r={rank}, alpha={alpha}")
    return rank, normalized_target_modules(targets)


def check_fits(name: str, rank: int, targets: frozenset[str], limits: LoRALimits) -> None:
    """SGLang's memory-pool check (`can_support`), with its message."""
    if rank > limits.max_lora_rank or not targets <= limits.target_modules:
        raise LoRAAdapterError(
            f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool configuration. "
            "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the "
            "target modules are included in `--lora-target-modules`."
        )


# What peft can train that SGLang 0.5.6 does not serve as peft computes it (it reads only r and lora_alpha).
_UNSERVED_FEATURES = {
    "use_rslora": "rank-stabilised scaling (SGLang scales by alpha / r)",
    "use_dora": "DoRA's magnitude vectors",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "lora_bias": "a LoRA bias",
    "modules_to_save": "fully trained extra modules",
    "fan_in_fan_out": "transposed (Conv1D) weights",
}


def check_served_as_trained(name: str, config: Mapping[str, Any]) -> None:
    """Refuse peft features SGLang would ignore, so that an adapter is never served as another model."""
    if str(config.get("peft_type", "LORA")).lower() != "lora":
        raise LoRAAdapterError(f"LoRA adapter {name}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSERVED_FEATURES.items():
        if config.get(key):
            raise LoRAAdapterError(
                f"LoRA adapter {name}: {key}={config[key]!r} ({what}) is not served: SGLang 0.5.6 reads only r and "
                "lora_alpha, so it would compute another model than the one trained; train without it"
            )
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name}: bias={config['bias']!r} is not served; train with bias='none'")


def build_adapter(
    *,
    lora_id: str,
    name: str,
    path: str | None,
    pinned: bool,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    model: nn.Module,
    strict: bool = True,
) -> LoRAAdapter:
    """The adapter `config` + `tensors` describe, mapped onto `model`'s linear layers and cast to its dtype.

    `strict` (the embedded engine) refuses peft features SGLang would not serve as trained; the stand-in, which
    reproduces SGLang, passes False and serves alpha / r whatever the config says. Raises LoRAAdapterError.
    """
    rank, targets = config_rank_and_targets(config)
    if strict:
        check_served_as_trained(name, config)
    elif str(config.get("peft_type", "")).lower() != "lora":
        raise LoRAAdapterError("")  # SGLang: `assert peft_type.lower() == "lora"`, an AssertionError without text
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _module_and_kind(key)
        pairs.setdefault(module, {})[kind] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module_name, pair in sorted(pairs.items()):
        linear = modules.get(module_name)
        if not isinstance(linear, nn.Linear):
            raise LoRAAdapterError(f"LoRA adapter {name}: {module_name} is not a linear layer of the served model")
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"LoRA adapter {name}: {module_name} has {sorted(pair)}, needs lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        expected_a, expected_b = (rank, linear.in_features), (linear.out_features, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise LoRAAdapterError(
                f"LoRA adapter {name}: {module_name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, the "
                f"served model needs {expected_a} and {expected_b} (r={rank})"
            )
        dtype = linear.weight.dtype
        # Copies (tensors received over the weight-update group view a buffer that the next call reuses); B takes
        # the scaling, so a pass spends no multiply on it.
        b_scaled = b.to(torch.float32) * (float(config["lora_alpha"]) / rank)
        weights[module_name] = (a.to(dtype, copy=True).contiguous(), b_scaled.to(dtype).contiguous())
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name} holds no lora_A/lora_B tensor")
    return LoRAAdapter(
        lora_id=lora_id,
        name=name,
        path=path,
        rank=rank,
        scaling=float(config["lora_alpha"]) / rank,
        target_modules=targets,
        pinned=pinned,
        weights=weights,
    )


def _module_and_kind(key: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> (`model.layers.0.self_attn.q_proj`,
    `lora_A`); peft's saved names (no adapter name)."""
    parts = key.removeprefix(PEFT_PREFIX).split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise LoRAAdapterError(f"tensor {key!r} is not a peft LoRA weight (<module>.lora_A.weight | lora_B.weight)")
    return ".".join(parts[:-2]), parts[-2]


_HOOKABLE = frozenset(name for name in SUPPORTED_LORA_TARGET_MODULES if name not in ("qkv_proj", "gate_up_proj"))


class LoRALayers:
    """Forward hooks that add the adapters of the rows being run to a model's linear layers.

    `attach(model)` hooks every `nn.Linear` SGLang can target (q/k/v/o, gate/up/down projections), once per model
    object (a weight swap serves another object: the runner attaches it too). `rows(adapters)` says, for the
    forward pass run inside it, which adapter each batch row uses (None: the base model). Forward passes run one at
    a time (the scheduler's worker thread), so the rows are plain state, not per-thread.
    """

    def __init__(self) -> None:
        self._groups: tuple[tuple[LoRAAdapter, torch.Tensor | None], ...] = ()
        self._attached: set[int] = set()

    def attach(self, model: nn.Module) -> None:
        if id(model) in self._attached:
            return
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in _HOOKABLE:
                module.register_forward_hook(self._hook(name))
        self._attached.add(id(model))

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[LoRAAdapter | None]) -> Iterator[None]:
        """Within: batch row i runs with `adapters[i]`."""
        by_adapter: dict[LoRAAdapter, list[int]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                by_adapter.setdefault(adapter, []).append(row)
        n = len(adapters)
        self._groups = tuple(
            (adapter, None if len(rows) == n else torch.tensor(rows, dtype=torch.long))
            for adapter, rows in by_adapter.items()
        )
        try:
            yield
        finally:
            self._groups = ()

    def _hook(self, module_name: str) -> Any:
        def add_adapters(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            # In place: `output` is the fresh result of this layer's matmul, and its backward (were there one) does
            # not read it. A pass of one adapter (the common case) gathers nothing.
            for adapter, rows in self._groups:
                pair = adapter.weights.get(module_name)
                if pair is None:
                    continue
                a, b_scaled = pair
                if rows is None:
                    output.add_(nn.functional.linear(nn.functional.linear(args[0], a), b_scaled))
                else:
                    x = args[0].index_select(0, rows)
                    output.index_add_(0, rows, nn.functional.linear(nn.functional.linear(x, a), b_scaled))
            return output

        return add_adapters
