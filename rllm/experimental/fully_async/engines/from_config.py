"""Build the engine launcher a run's spec (`run_spec.py`, EnginesSpec) asks for.

Keys honoured here, for `engines.backend=sglang`:
- `actor_rollout_ref.rollout.tensor_model_parallel_size` -> `--tp-size` (GPUs per engine);
- `actor_rollout_ref.rollout.gpu_memory_utilization` -> `--mem-fraction-static`;
- `engines.dtype`, `engines.max_running_requests`, `run.seed` (engine i samples with seed + i);
- `engines.deterministic_inference` -> `--enable-deterministic-inference` (both backends);
- with LoRA (actor_rollout_ref.model.lora_rank > 0), `engines.lora.*` -> `--enable-lora`, `--max-lora-rank`,
  `--lora-target-modules`, `--max-loras-per-batch`, `--max-loaded-loras` (both backends), `--lora-eviction-policy`,
  `--lora-backend` (sglang only; refused with the embedded engine by settings/validate.py);
- `engines.forward_sleep_s` -> the embedded engine's `--forward-sleep-time` (SGLang's /slow_down from the start);
- `engines.extra_args` -> extra `sglang.launch_server` flags: `{enable_foo: true}` becomes the bare `--enable-foo`
  (SGLang's argparse rejects `--enable-foo=True`), false or null omits the flag, a list becomes
  `--flag v1 v2`, anything else `--flag=value`. A flag this module already sets is refused.
Engines that listen beyond loopback get a per-run secret (`--api-key`, sent as `Authorization: Bearer` by the
client and ParamSync); on loopback no key is needed and none is set.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rllm.experimental.fully_async.core.addresses import is_loopback
from rllm.experimental.fully_async.engines.launcher import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.sglang import SGLangEngineCommand
from rllm.experimental.fully_async.run_spec import EnginesSpec, thaw

# Flags the SGLang command sets from the config itself; extra_args may not set them a second time.
MANAGED_SGLANG_FLAGS = frozenset(
    {
        "model-path",
        "host",
        "port",
        "tp-size",
        "tensor-parallel-size",
        "dtype",
        "random-seed",
        "weight-version",
        "log-level",
        "mem-fraction-static",
        "max-running-requests",
        "api-key",
        "enable-deterministic-inference",
        "enable-lora",
        "max-lora-rank",
        "lora-target-modules",
        "max-loras-per-batch",
        "max-loaded-loras",
        "lora-eviction-policy",
        "lora-backend",
    }
)


def api_key_for(host: str) -> str | None:
    """A fresh per-run secret when engines listen on `host` beyond loopback, else None."""
    return None if is_loopback(host) else secrets.token_urlsafe(32)


def sglang_extra_args(extra: dict[str, Any]) -> tuple[str, ...]:
    """`engines.extra_args` as `sglang.launch_server` flags (see the module docstring)."""
    args: list[str] = []
    for key, value in extra.items():
        flag = str(key).replace("_", "-").lstrip("-")
        if flag in MANAGED_SGLANG_FLAGS:
            raise ValueError(
                f"engines.extra_args.{key}: --{flag} is set from the config already; use the config key instead"
            )
        if value is None or value is False:
            continue
        if value is True:
            args.append(f"--{flag}")
        elif isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
            args += [f"--{flag}", *(str(v) for v in value)]
        else:
            args.append(f"--{flag}={value}")
    return tuple(args)


def engine_command(engines: EnginesSpec, api_key: str | None = None) -> Any:
    """The `EngineCommand` (embedded or SGLang) that starts each engine of the configured backend."""
    if engines.backend == "embedded":
        return EmbeddedEngineCommand(
            model_path=engines.model_path,
            max_running_requests=engines.max_running_requests,
            dtype=engines.dtype,
            seed=engines.seed,
            num_threads=engines.torch_threads,
            log_level=engines.log_level,
            deterministic_inference=engines.deterministic_inference,
            lora=engines.lora,
            forward_sleep_s=engines.forward_sleep_s,
            extra_args=("--api-key", api_key) if api_key else (),
        )

    return SGLangEngineCommand(
        model_path=engines.model_path,
        tp_size=engines.tensor_model_parallel_size,
        dtype=engines.dtype,
        mem_fraction_static=engines.gpu_memory_utilization,
        max_running_requests=engines.max_running_requests,
        seed=engines.seed,
        api_key=api_key,
        deterministic_inference=engines.deterministic_inference,
        lora=engines.lora,
        extra_args=sglang_extra_args(thaw(engines.extra_args)),
    )


def engine_launcher(engines: EnginesSpec, log_dir: Path, *, host: str = "127.0.0.1") -> Any:
    """An EngineLauncher for the configured backend (a context manager whose `.urls` are the engines, and whose
    `.api_key` is the secret clients must send, or None)."""
    api_key = api_key_for(host)
    launcher = EngineLauncher(
        engine_command(engines, api_key),
        engines.num_engines,
        host=host,
        startup_timeout_s=engines.startup_timeout_s,
        log_dir=log_dir,
    )
    launcher.api_key = api_key
    return launcher
