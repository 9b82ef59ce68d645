"""LoRA on the engines, from the rollout side: the versioned adapter names a run serves, and the engine flags its
settings give (`run_spec.EngineLoRASpec`).

Names (docs/design.md#rule-one-version-per-lora-sample). Policy version v is served as the adapter `policy-v<v>`:
each weight sync loads a new name, so a request that names a version keeps it from its first token to its last,
whatever is loaded meanwhile (SGLang holds a request's adapter until it ends; an unload waits for it; its radix
cache keys prefixes by adapter id, so no KV computed under one version serves another). SGLang's `/generate` answer
does not say which adapter produced it (meta_info: id, finish_reason, prompt_tokens, weight_version, ...;
`tokenizer_manager._handle_batch_output`), so the adapter a result records is the one its request named, and its
tokens' version is read from that name (`adapter_version`); the engine's `weight_version` is the base model's.

Flags. `lora_flags` gives SGLang's (`--enable-lora --max-lora-rank R --lora-target-modules M.. --max-loras-per-batch
N [--max-loaded-loras L] --lora-eviction-policy P --lora-backend B`) and the embedded engine's, which are the same
minus the two GPU-only ones (`engines/embedded/lora_api.py`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run_spec imports verl (~4 s) through algorithms/; an engine process needs only the type
    from rllm.experimental.fully_async.run_spec import EngineLoRASpec


ADAPTER_PREFIX = "policy-v"
_VERSIONED = re.compile(rf"^{re.escape(ADAPTER_PREFIX)}(\d+)$")


def adapter_name(version: int) -> str:
    """The adapter name policy version `version` is loaded under (`policy-v7`)."""
    if version < 0:
        raise ValueError(f"a policy version is >= 0, got {version}")
    return f"{ADAPTER_PREFIX}{version}"


def adapter_version(name: str | None) -> int | None:
    """The policy version a versioned adapter name stands for; None for None or a name of another form."""
    if name is None:
        return None
    match = _VERSIONED.match(name)
    return int(match.group(1)) if match else None


def lora_flags(spec: EngineLoRASpec | None, *, sglang: bool) -> list[str]:
    """The LoRA flags of one engine's command line (none when `spec` is None: LoRA off)."""
    if spec is None:
        return []
    flags = [
        "--enable-lora",
        "--max-lora-rank",
        str(spec.max_lora_rank),
        "--lora-target-modules",
        *spec.target_modules,
        "--max-loras-per-batch",
        str(spec.max_loras_per_batch),
    ]
    if spec.max_loaded_loras is not None:
        flags += ["--max-loaded-loras", str(spec.max_loaded_loras)]
    if sglang:
        flags += ["--lora-eviction-policy", spec.eviction_policy, "--lora-backend", spec.backend]
    return flags
