"""SGLang 0.5.6's LoRA serving protocol, for the embedded engine and the SGLang stand-in: adapter names and ids,
per-adapter counts of the requests using them, and loads and unloads that never pause generation.

Written from SGLang 0.5.6's source: `sglang/srt/lora/lora_registry.py` (LoRARegistry),
`managers/tokenizer_communicator_mixin.py` (load_lora_adapter, unload_lora_adapter, _unload_lora_adapter_locked),
`managers/tokenizer_manager.py` (generate_request: how a request's `lora_path` is resolved; release on finish),
`lora/lora_manager.py` (load validation, validate_lora_batch). What it does, as SGLang does:
- A load reads and checks the adapter, THEN registers it under its name with a fresh id (so a failed load leaves
  nothing registered). Generation goes on meanwhile: nothing is paused or aborted (the scheduler only admits by
  `can_run`). A name that is loaded already fails: "Failed to load LoRA adapter X because it is already loaded".
- `--max-loaded-loras`: after a load, while more adapters are registered than that, the least recently used
  unpinned one is unloaded (a request naming an adapter counts as a use), and the load answers only when that
  unload is done.
- An unload unregisters the name at once (new requests no longer find it), then WAITS until every request using
  the adapter has finished, then drops it; the HTTP call returns only then. It holds the LoRA update lock all that
  time, so a load (or another unload) sent meanwhile waits too. Unknown name: "LoRA with name X does not exist.".
- A request's `lora_path` is an adapter NAME. Resolved after the pause gate: a name never loaded fails the request
  ("Got LoRA adapter that has never been loaded: X"); a name loaded once and unloaded since is RELOADED from the
  path it was loaded from ("Reloading evicted adapter"), possibly evicting another; a batch naming more distinct
  adapters than `--max-loaded-loras` (None counting as one) fails. Then the request holds the adapter's id until
  it finishes, aborted or not: an unload waits for it, and its tokens all come from that adapter.
- `can_run`: the scheduler admits a waiting request only if the distinct adapters of the running batch, of those
  admitted with it and its own (the base model counting as one) fit in `--max-loras-per-batch`, pinned adapters
  keeping their slots (validate_lora_batch); the first request that does not fit stops admission (FIFO).
Not SGLang's: SGLang reads and copies the adapter inside its scheduler loop (no forward pass runs meanwhile); here
the files are read in a worker thread and only registration happens on the event loop, between passes. And
`load_lora_adapter_from_tensors` (the embedded engine's extension for the distributed transport, `lora_routes.py`)
registers an adapter received as tensors; having no path, it cannot be implicitly reloaded once unloaded.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rllm.experimental.fully_async.engines.embedded.lora import (
    LoRAAdapter,
    LoRAAdapterError,
    LoRALayers,
    LoRALimits,
    build_adapter,
    check_fits,
    config_rank_and_targets,
    read_adapter_folder,
)

logger = logging.getLogger(__name__)

LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@dataclass(frozen=True)
class LoRARef:
    """One registration of an adapter (SGLang's LoRARef): a fresh `lora_id` per load, even of the same name."""

    lora_name: str
    lora_path: str | None
    pinned: bool = False
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class LoRAUpdateOutput:
    """The answer of /load_lora_adapter and /unload_lora_adapter (SGLang's LoRAUpdateOutput): `loaded_adapters`
    maps each adapter the model side holds to its path (None when the request failed before reaching it)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str | None] | None = None

    def to_json(self) -> dict[str, Any]:
        # SGLang serialises the dataclass with orjson: BaseReq's rid and http_worker_ipc come along, null.
        return {
            "success": self.success,
            "error_message": self.error_message,
            "loaded_adapters": self.loaded_adapters,
            "rid": None,
            "http_worker_ipc": None,
        }


class _InFlight:
    """Requests using one adapter id (SGLang's ConcurrentCounter); an unload waits for zero."""

    def __init__(self) -> None:
        self.count = 0
        self._zero = asyncio.Event()
        self._zero.set()

    def increment(self) -> None:
        self.count += 1
        self._zero.clear()

    def decrement(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._zero.set()

    async def wait_for_zero(self) -> None:
        await self._zero.wait()


class LoRAServing:
    """The adapters one engine serves over its base model; see the module docstring for the protocol.

    `model()` returns the served model (adapters are mapped onto its linear layers); `layers` are the hooks the
    model runner runs batches through. `strict=False` (the SGLang stand-in) serves what SGLang would, quirks
    included (`lora.build_adapter`). Everything runs on the engine's event loop except file reads (worker thread).
    """

    def __init__(
        self, limits: LoRALimits, model: Callable[[], nn.Module], *, strict: bool = True, enabled: bool = True
    ) -> None:
        self.limits = limits
        self.enabled = enabled
        self.layers = LoRALayers()
        self._model = model
        self._strict = strict
        self._registry: OrderedDict[str, LoRARef] = OrderedDict()  # name -> ref, least recently used first
        self._in_flight: dict[str, _InFlight] = {}  # lora_id -> requests using it
        self._loaded: dict[str, LoRAAdapter] = {}  # lora_id -> adapter (the model side: SGLang's lora_manager)
        self._ever_loaded: dict[str, LoRARef] = {}  # name -> latest ref (SGLang's lora_ref_cache: implicit reloads)
        self._update_lock = asyncio.Lock()  # one load/unload at a time; never blocks generation
        self.stats = {"lora_loads": 0, "lora_unloads": 0, "lora_implicit_reloads": 0, "lora_evictions": 0}

    # ---------------------------------------------------------------- what is served
    @property
    def max_loras_per_batch(self) -> int:
        return self.limits.max_loras_per_batch

    def registered(self) -> list[LoRARef]:
        """Adapters requests can name now, least recently used first (/v1/models lists these)."""
        return list(self._registry.values())

    def loaded_adapters(self) -> dict[str, str | None]:
        """Adapters the model side holds, name -> path (an adapter being unloaded stays until its requests end)."""
        return {a.name: a.path for a in self._loaded.values()}

    def in_flight(self) -> dict[str, int]:
        """Requests using each registered adapter, by name."""
        return {ref.lora_name: self._in_flight[ref.lora_id].count for ref in self._registry.values()}

    # ---------------------------------------------------------------- load / unload
    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> LoRAUpdateOutput:
        """Load the peft folder `path` under `name` (SGLang's /load_lora_adapter)."""

        async def read() -> tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]:
            return await asyncio.to_thread(read_adapter_folder, path)

        return await self._load(LoRARef(name, path, pinned), read)

    async def load_lora_adapter_from_tensors(
        self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], pinned: bool = False
    ) -> LoRAUpdateOutput:
        """Register an adapter given as its config and peft-named tensors (the embedded engine's extension)."""

        async def given() -> tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]:
            return config, tensors

        return await self._load(LoRARef(name, None, pinned), given)

    async def unload_lora_adapter(self, name: str) -> LoRAUpdateOutput:
        """Unregister `name` now, drop it once no request uses it; answers then (SGLang's /unload_lora_adapter)."""
        if not self.enabled:
            return LoRAUpdateOutput(False, LORA_NOT_ENABLED)
        try:
            async with self._update_lock:
                return await self._unload_locked(name)
        except ValueError as exc:
            return LoRAUpdateOutput(False, str(exc))

    async def _load(self, ref: LoRARef, source: Callable[[], Any]) -> LoRAUpdateOutput:
        if not self.enabled:
            return LoRAUpdateOutput(False, LORA_NOT_ENABLED)
        logger.info("Start load Lora adapter. Lora name=%s, path=%s", ref.lora_name, ref.lora_path)
        try:
            async with self._update_lock:
                result = await self._load_on_model_side(ref, source)
                if result.success:
                    self._register(ref)
                    self._ever_loaded[ref.lora_name] = ref
                    self.stats["lora_loads"] += 1
                await self._evict_beyond_limit(result)
                return result
        except ValueError as exc:
            return LoRAUpdateOutput(False, str(exc))

    async def _load_on_model_side(self, ref: LoRARef, source: Callable[[], Any]) -> LoRAUpdateOutput:
        """SGLang's lora_manager.load_lora_adapter: every failure becomes success=False with its message."""
        try:
            config, tensors = await source()
            rank, targets = config_rank_and_targets(config)
            if any(a.name == ref.lora_name for a in self._loaded.values()):
                raise LoRAAdapterError(f"Failed to load LoRA adapter {ref.lora_name} because it is already loaded")
            check_fits(ref.lora_name, rank, targets, self.limits)
            pinned = sum(a.pinned for a in self._loaded.values())
            if ref.pinned and pinned >= self.limits.max_loras_per_batch - 1:
                raise LoRAAdapterError(
                    f"Failed to load LoRA adapter {ref.lora_name} as a pinned adapter. It is not allowed to pin all "
                    "slots in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                    "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
                )
            adapter = build_adapter(
                lora_id=ref.lora_id,
                name=ref.lora_name,
                path=ref.lora_path,
                pinned=ref.pinned,
                config=config,
                tensors=tensors,
                model=self._model(),
                strict=self._strict,
            )
        except (LoRAAdapterError, OSError, ValueError) as exc:
            logger.warning("loading LoRA adapter %s failed: %s", ref.lora_name, exc)
            return LoRAUpdateOutput(False, str(exc), self.loaded_adapters())
        self._loaded[ref.lora_id] = adapter
        return LoRAUpdateOutput(True, "", self.loaded_adapters())

    def _register(self, ref: LoRARef) -> None:
        if ref.lora_name in self._registry:
            raise ValueError(f"LoRA with name {ref.lora_name} already exists. Loaded LoRAs: {self._names()}")
        self._registry[ref.lora_name] = ref
        self._in_flight[ref.lora_id] = _InFlight()

    async def _evict_beyond_limit(self, result: LoRAUpdateOutput) -> None:
        limit = self.limits.max_loaded_loras
        while limit is not None and len(self._registry) > limit:
            victim = next((n for n, r in self._registry.items() if not r.pinned), None)
            if victim is None:
                raise ValueError(
                    "Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                    f"LoRA registry is: {dict(self._registry)}"
                )
            logger.info(
                "Unloading least recently used LoRA adapter '%s' (current number of adapters: %d, max allowed: %d)",
                victim,
                len(self._registry),
                limit,
            )
            unloaded = await self._unload_locked(victim)
            if not unloaded.success:
                raise ValueError(f"Error while unloading LRU LoRA adapter '{victim}': {unloaded.error_message}")
            self.stats["lora_evictions"] += 1
            if result.loaded_adapters is not None:
                result.loaded_adapters.pop(victim, None)

    async def _unload_locked(self, name: str) -> LoRAUpdateOutput:
        ref = self._registry.pop(name, None)
        if ref is None:
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self._names()}")
        logger.info("Start unload Lora adapter. Lora name=%s", name)
        await self._in_flight[ref.lora_id].wait_for_zero()
        del self._in_flight[ref.lora_id]
        self._loaded.pop(ref.lora_id, None)
        self.stats["lora_unloads"] += 1
        return LoRAUpdateOutput(True, "", self.loaded_adapters())

    def _never_loaded(self, name: str) -> str:
        return (
            f"Got LoRA adapter that has never been loaded: {name}\n"
            f"All loaded adapters: dict_keys({list(self._ever_loaded)})."
        )

    def _names(self) -> str:
        return f"odict_keys({list(self._registry)})"  # SGLang prints the OrderedDict's keys view

    # ---------------------------------------------------------------- requests
    def check_request(self, names: list[str | None]) -> None:
        """Before a (batched) request starts: its distinct adapters (None counting as one) must fit
        `--max-loaded-loras`, and each must have been loaded once (SGLang checks both for the whole request before
        any of it runs; `acquire` then resolves each prompt's adapter). Raises ValueError."""
        if not any(names):
            return
        unique = set(names)
        limit = self.limits.max_loaded_loras
        if limit is not None and len(unique) > limit:
            raise ValueError(
                f"Received request with {len(unique)} unique loras requested but max loaded loras is {limit}"
            )
        for name in unique:
            if name is not None and name not in self._registry and name not in self._ever_loaded:
                raise ValueError(self._never_loaded(name))

    async def acquire(self, name: str) -> LoRAAdapter:
        """The adapter `name` for one request, held until `release`; reloads a name unloaded since (module
        docstring). Raises ValueError (the request fails with HTTP 400) as SGLang does."""
        if name not in self._registry:
            ref = self._ever_loaded.get(name)
            if ref is None:
                raise ValueError(self._never_loaded(name))
            if ref.lora_path is None:
                raise ValueError(f"LoRA adapter {name} was loaded from tensors and unloaded since: load it again")
            logger.info("Reloading evicted adapter: %s", name)
            self.stats["lora_implicit_reloads"] += 1
            result = await self.load_lora_adapter(ref.lora_name, ref.lora_path, ref.pinned)
            if not result.success and "already loaded" not in (result.error_message or ""):
                raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {result.error_message}")
        ref = self._registry.get(name)
        if ref is None:
            raise ValueError(
                f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {self._names()}."
            )
        self._registry.move_to_end(name)  # a lookup counts as a use (LRU order)
        self._in_flight[ref.lora_id].increment()
        return self._loaded[ref.lora_id]

    def release(self, adapter: LoRAAdapter) -> None:
        """The request holding `adapter` has finished (or was aborted or abandoned)."""
        self._in_flight[adapter.lora_id].decrement()

    def can_run(self, lora_ids: set[str | None]) -> bool:
        """Whether a batch using these adapter ids (None: the base model) fits (SGLang's validate_lora_batch)."""
        limit = self.limits.max_loras_per_batch
        if len(lora_ids) > limit:
            return False
        pinned_total = sum(a.pinned for a in self._loaded.values())
        if pinned_total == 0:
            return True
        pinned_here = sum(1 for i in lora_ids if i is not None and (a := self._loaded.get(i)) is not None and a.pinned)
        return len(lora_ids) - pinned_here <= limit - pinned_total
