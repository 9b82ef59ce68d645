"""engines.lora.*: the engines' LoRA flags, derived from the trainer's LoRA rank and modules and from the largest η the
run may reach, checked to hold every adapter version the staleness bound admits, and passed to both engine kinds.

`actor_rollout_ref.model.lora_rank` is verl's key (the trainer's side: tests/backends/test_fsdp_lora.py). Here a
loaded config gets it set and is derived and validated again exactly as `load_config` does it (resolve_derived,
then validate).
"""

from __future__ import annotations

import pytest

from rllm.experimental.fully_async.cli.plan import run_plan
from rllm.experimental.fully_async.engines.from_config import engine_command
from rllm.experimental.fully_async.run_spec import build_run_spec, engines_spec
from rllm.experimental.fully_async.settings.derive import resolve_derived
from rllm.experimental.fully_async.settings.loader import ConfigError, load_config
from rllm.experimental.fully_async.settings.validate import validate

SGLANG = ("engines.backend=sglang", "actor_rollout_ref.rollout.name=sglang")


def lora_config(*overrides: str, rank: int = 8, lora: dict | None = None, target_modules: object = None):
    """A loaded config (with `overrides`) trained as LoRA of `rank`, derived and validated as load_config does."""
    cfg = load_config(None, list(overrides), check_host=False)
    cfg.actor_rollout_ref.model.lora_rank = rank
    if target_modules is not None:
        cfg.actor_rollout_ref.model.target_modules = target_modules
    for key, value in (lora or {}).items():
        cfg.engines.lora[key] = value
    resolve_derived(cfg)
    validate(cfg, check_host=False)
    return cfg


def argv(cfg) -> list[str]:
    return engine_command(engines_spec(cfg)).build("127.0.0.1", 30000, 0)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_flags_hold_eta_max_plus_one_versions_and_one_retiring_by_default():
    fixed = lora_config("async_training.max_staleness=3")
    cmd = argv(fixed)
    assert (
        "--enable-lora" in cmd and flag(cmd, "--max-lora-rank") == "8" and flag(cmd, "--lora-target-modules") == "all"
    )
    assert flag(cmd, "--max-loaded-loras") == flag(cmd, "--max-loras-per-batch") == "5"  # η=3: 4 admitted + 1
    assert "--lora-eviction-policy" not in cmd and "--lora-backend" not in cmd, "GPU-only: not the embedded engine's"
    adaptive = lora_config(
        "async_training.max_staleness=2",
        "async_training.adaptive_staleness.enable=true",
        "async_training.adaptive_staleness.max=6",
    )
    assert flag(argv(adaptive), "--max-loaded-loras") == "8", "sized for the largest η adaptive staleness may reach"
    listed = lora_config(target_modules=["q_proj", "model.layers.0.self_attn.v_proj", "q_proj"])
    cmd = argv(listed)
    assert cmd[cmd.index("--lora-target-modules") + 1 : cmd.index("--max-loras-per-batch")] == ["q_proj", "v_proj"]


def test_sglang_gets_the_same_flags_and_its_gpu_only_ones():
    cmd = argv(lora_config(*SGLANG, lora={"eviction_policy": "fifo", "backend": "triton", "max_loaded_loras": 9}))
    assert flag(cmd, "--lora-eviction-policy") == "fifo" and flag(cmd, "--lora-backend") == "triton"
    assert flag(cmd, "--max-loaded-loras") == "9" and "--enable-lora" in cmd
    plain = argv(load_config(None, list(SGLANG), check_host=False))
    assert not any("lora" in a for a in plain), "no LoRA flag without LoRA"


@pytest.mark.parametrize(
    ("overrides", "lora", "named"),
    [
        (
            (),
            {"max_loaded_loras": 1},
            r"'engines\.lora\.max_loaded_loras=1' cannot hold the η\+1=2 .*--max-loaded-loras",
        ),
        ((), {"max_loras_per_batch": 1}, r"max_loras_per_batch=1' cannot hold .*--max-loras-per-batch\) to at least 2"),
        (
            (),
            {"max_loaded_loras": 3, "max_loras_per_batch": 4},
            r"max_loaded_loras' \(3\) must be >= .*max_loras_per_batch",
        ),
        ((), {"max_lora_rank": 4}, r"max_lora_rank' \(4\) is below actor_rollout_ref\.model\.lora_rank \(8\)"),
        (
            (),
            {"target_modules": ["embed_tokens"]},
            r"target_modules' \['embed_tokens'\]: SGLang 0\.5\.6 serves LoRA on",
        ),
        ((), {"target_modules": ["all", "q_proj"]}, r"or \[all\] alone"),
        ((), {"backend": "triton"}, r"'engines\.lora\.backend' is read by SGLang only"),
        (("param_sync.transport=distributed", *SGLANG), {}, r"cannot carry LoRA adapters to SGLang 0\.5\.6"),
    ],
)
def test_settings_the_engines_cannot_honour_are_refused_in_one_line(overrides, lora, named):
    with pytest.raises(ConfigError, match=named) as refused:
        lora_config("async_training.max_staleness=1", *overrides, lora=lora)
    assert "\n" not in str(refused.value)


def test_the_distributed_transport_with_lora_is_refused_for_the_embedded_engine_too():
    """The embedded engine's extension route could take adapters over the weight-update group
    (engines/embedded/lora_api.py), but the trainer sends adapters by disk only: refused, naming the key."""
    with pytest.raises(ConfigError, match=r"'param_sync\.transport=distributed' with .*lora_rank > 0.*disk") as info:
        lora_config("param_sync.transport=distributed")
    assert "\n" not in str(info.value)


def test_the_lora_keys_without_lora_are_refused_when_loading():
    with pytest.raises(ConfigError, match=r"'engines\.lora\.max_loaded_loras' is read only when the policy trains"):
        load_config(None, ["engines.lora.max_loaded_loras=4"])


def test_plan_shows_the_lora_flags(capsys):
    assert run_plan(lora_config("async_training.max_staleness=2")) == 0
    out = capsys.readouterr().out
    assert "eta_max + 1 = 3 versions" in out and "--max-loaded-loras 4" in out
    assert (
        "--enable-lora --max-lora-rank 8 --lora-target-modules all --max-loras-per-batch 4 --max-loaded-loras 4" in out
    )


def test_a_run_spec_holds_the_lora_flags_frozen():
    spec = build_run_spec(lora_config()).engines.lora
    assert spec is not None and spec.max_lora_rank == 8 and spec.target_modules == ("all",)
    with pytest.raises(AttributeError):
        spec.max_lora_rank = 16  # type: ignore[misc]
