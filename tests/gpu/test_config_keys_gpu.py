"""The verl keys only CUDA can show, each with its effect observed (tests/settings/test_config_keys.py refuses them
on CPU).

Skipped without CUDA. Each test loads a config with the key set, builds the policy as the trainer does
(`build_policy_backend`, through tests/helpers/config_effects.py) and looks at what was built or what one update did:
- `fsdp_config.dtype`: the dtype verl's actor autocasts to, and the dtype the logits really have in a forward;
- `fsdp_config.param_offload`: parameters on the CPU between calls, on the GPU inside them, the same step;
- `fsdp_config.optimizer_offload`: Adam's moments on the CPU after a step, the same step;
- `fsdp_config.offload_policy`: FSDP2 with CPUOffloadPolicy at one rank, parameters on the CPU, the same step;
- `use_torch_compile` (with the entropy computed): dynamo compiles verl's entropy function in the update;
- the shipped one-GPU FSDP config: gradient checkpointing on its one rank, recomputing in backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ACTOR = "actor_rollout_ref.actor"
FSDP = f"{ACTOR}.fsdp_config"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def user_model(tiny_model_dir) -> tuple[str, ...]:
    return (
        "task.name=null",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_files=unused.parquet",
        "trainer.device=cuda",
    )


def _build(*overrides: str):
    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend
    from rllm.experimental.fully_async.settings.loader import load_config

    backend, _ = build_policy_backend(build_run_spec(load_config(None, list(overrides))).trainer)
    return backend


def _step(backend) -> tuple[torch.Tensor, dict]:
    """One update on config_effects' fixed batch; returns the full parameters after it (on the CPU) and metrics."""
    from config_effects import fixed_batch, shifted
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from verl_helpers import make_batch

    data = fixed_batch(shifted(backend.compute_log_prob(make_batch(0))))
    metrics = backend.update_policy(data)
    state = get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return torch.cat([v.float().flatten() for v in state.values()]), metrics


def _same_step(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
    assert a[1]["actor/grad_norm"] == pytest.approx(b[1]["actor/grad_norm"], rel=1e-3)


def test_fsdp_dtype_is_the_autocast_dtype_of_the_forward(user_model):
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        backend = _build(*user_model, f"{FSDP}.dtype={name}")
        assert backend.describe()["autocast_dtype"] == name
        seen: list[torch.dtype] = []
        handle = backend.model.lm_head.register_forward_hook(lambda m, i, out, seen=seen: seen.append(out.dtype))
        try:
            _step(backend)
        finally:
            handle.remove()
        assert seen and set(seen) == {dtype}, seen


def test_param_offload_keeps_parameters_on_the_cpu_between_calls(user_model):
    plain, offloaded = _build(*user_model), _build(*user_model, f"{FSDP}.param_offload=true")
    assert plain.describe()["param_device"] == "cuda" and offloaded.describe()["param_device"] == "cpu"
    inside = []
    handle = offloaded.model.register_forward_pre_hook(lambda m, a: inside.append(next(m.parameters()).device.type))
    try:
        result = _step(offloaded)
    finally:
        handle.remove()
    assert inside and set(inside) == {"cuda"}  # loaded for the call
    assert offloaded.describe()["param_device"] == "cpu"  # and back after it
    _same_step(result, _step(plain))


def test_optimizer_offload_keeps_adams_moments_on_the_cpu(user_model):
    plain, offloaded = _build(*user_model), _build(*user_model, f"{FSDP}.optimizer_offload=true")
    result, reference = _step(offloaded), _step(plain)

    def moment_devices(backend) -> set[str]:
        return {s["exp_avg"].device.type for s in backend.optimizer.state.values()}

    assert moment_devices(offloaded) == {"cpu"} and moment_devices(plain) == {"cuda"}
    _same_step(result, reference)


def test_offload_policy_shards_with_fsdp2_cpu_offload_at_one_rank(user_model):
    plain, offloaded = _build(*user_model), _build(*user_model, f"{FSDP}.offload_policy=true")
    facts = offloaded.describe()
    assert facts["fsdp2"] and facts["offload_policy"] and facts["param_device"] == "cpu"
    _same_step(_step(offloaded), _step(plain))


def test_use_torch_compile_compiles_the_entropy_function(user_model):
    from torch._dynamo.utils import counters

    counters.clear()
    backend = _build(*user_model, f"{ACTOR}.entropy_coeff=0.01", f"{ACTOR}.use_torch_compile=true")
    assert backend.describe()["entropy_compiled"]
    _step(backend)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled something during the update


def test_the_one_gpu_fsdp_config_checkpoints_its_one_rank(tiny_model_dir):
    from config_effects import counting_layer_forwards

    from rllm.experimental.fully_async.run_spec import build_run_spec
    from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend
    from rllm.experimental.fully_async.settings.loader import load_config

    path = REPO / "config" / "fully_async_ppo_trainer.yaml"
    overrides = [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=unused.parquet"]
    forwards = {}
    for checkpointing in (True, False):
        cfg = load_config(path, [*overrides, f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}"])
        spec = build_run_spec(cfg).trainer
        assert spec.world_size == 1
        backend, _ = build_policy_backend(spec)
        assert backend.describe()["gradient_checkpointing"] is checkpointing
        with counting_layer_forwards(backend.model) as calls:
            _step(backend)
        forwards[checkpointing] = calls[0]
    assert forwards[True] == 2 * forwards[False]  # every micro-batch's forward recomputed in backward
