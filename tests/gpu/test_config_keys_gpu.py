"""The verl keys only CUDA can show, each with its effect observed (tests/settings/test_config_keys.py refuses them
on CPU), and the one-GPU FSDP config's gradient checkpointing.

Each test runs on the `device` parameter (tests/gpu/conftest.py). It loads a config with the key set, builds the
policy as the trainer does (`build_policy_backend`, through tests/helpers/config_effects.py) and looks at what was
built or what one update did:
- `fsdp_config.dtype`: the dtype verl's actor autocasts to, and the dtype the logits really have in a forward;
- `fsdp_config.param_offload`: parameters on the CPU between calls, on the GPU inside them, the same step;
- `fsdp_config.optimizer_offload`: Adam's moments on the CPU after a step, the same step;
- `fsdp_config.offload_policy`: FSDP2 with CPUOffloadPolicy at one rank, parameters on the CPU, the same step;
- `use_torch_compile` (with the entropy computed): dynamo compiles verl's entropy function in the update;
- the shipped one-GPU FSDP config: gradient checkpointing on its one rank, recomputing in backward.
On CPU a CUDA-only key is refused when the config loads (asserted: that is the key's CPU behaviour), and the rest of
the test runs with the key left out, where the same observation has its CPU value: the forward in fp32, parameters
and moments in CPU memory, two builds taking the same step. So what the test builds, hooks, steps and compares is
proven here; on CUDA only the key's own effect is new.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from config_effects import counting_layer_forwards, fixed_batch, shifted
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from verl_helpers import make_batch

from rllm.experimental.fully_async.run_spec import build_run_spec
from rllm.experimental.fully_async.runtime.trainer.build import build_policy_backend
from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

ACTOR = "actor_rollout_ref.actor"
FSDP = f"{ACTOR}.fsdp_config"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def user_model(tiny_model_dir, device) -> tuple[str, ...]:
    return (
        "task.name=null",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_files=unused.parquet",
        f"trainer.device={device}",
    )


def _build(*overrides: str):
    backend, _ = build_policy_backend(build_run_spec(load_config(None, list(overrides))).trainer)
    return backend


def _cuda_only(device: str, user_model: tuple[str, ...], key: str) -> tuple[str, ...]:
    """`key` as an override on CUDA. On CPU the config refuses it (checked), unless it is verl's default value, which
    loads and changes nothing there; either way the CPU build goes on without it."""
    if device == "cuda":
        return (key,)
    try:
        load_config(None, [*user_model, key])
    except ConfigError as exc:
        assert "read only with trainer.device=cuda" in str(exc), exc
    else:
        assert key == f"{FSDP}.dtype=bfloat16", f"{key} loads on CPU"  # verl's default autocast dtype
    return ()


def _step(backend) -> tuple[torch.Tensor, dict]:
    """One update on config_effects' fixed batch; returns the full parameters after it (on the CPU) and metrics."""
    data = fixed_batch(shifted(backend.compute_log_prob(make_batch(0))))
    metrics = backend.update_policy(data)
    state = get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return torch.cat([v.float().flatten() for v in state.values()]), metrics


def _same_step(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
    assert a[1]["actor/grad_norm"] == pytest.approx(b[1]["actor/grad_norm"], rel=1e-3)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_fsdp_dtype_is_the_autocast_dtype_of_the_forward(device, user_model, name):
    backend = _build(*user_model, *_cuda_only(device, user_model, f"{FSDP}.dtype={name}"))
    dtype = getattr(torch, name) if device == "cuda" else torch.float32  # the CPU trainer computes in fp32
    assert backend.describe()["autocast_dtype"] == str(dtype).removeprefix("torch.")
    seen: list[torch.dtype] = []
    handle = backend.model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    try:
        _step(backend)
    finally:
        handle.remove()
    assert seen and set(seen) == {dtype}, seen


def test_param_offload_keeps_parameters_on_the_cpu_between_calls(device, user_model):
    plain = _build(*user_model)
    offloaded = _build(*user_model, *_cuda_only(device, user_model, f"{FSDP}.param_offload=true"))
    assert plain.describe()["param_device"] == device and offloaded.describe()["param_device"] == "cpu"
    inside = []
    handle = offloaded.model.register_forward_pre_hook(lambda m, a: inside.append(next(m.parameters()).device.type))
    try:
        result = _step(offloaded)
    finally:
        handle.remove()
    assert inside and set(inside) == {device}  # loaded onto the device for the call
    assert offloaded.describe()["param_device"] == "cpu"  # and back after it
    _same_step(result, _step(plain))


def test_optimizer_offload_keeps_adams_moments_on_the_cpu(device, user_model):
    plain = _build(*user_model)
    offloaded = _build(*user_model, *_cuda_only(device, user_model, f"{FSDP}.optimizer_offload=true"))
    result, reference = _step(offloaded), _step(plain)

    def moment_devices(backend) -> set[str]:
        return {s["exp_avg"].device.type for s in backend.optimizer.state.values()}

    assert moment_devices(offloaded) == {"cpu"} and moment_devices(plain) == {device}
    _same_step(result, reference)


def test_offload_policy_shards_with_fsdp2_cpu_offload_at_one_rank(device, user_model):
    plain = _build(*user_model)
    offloaded = _build(*user_model, *_cuda_only(device, user_model, f"{FSDP}.offload_policy=true"))
    facts = offloaded.describe()
    assert facts["param_device"] == "cpu"
    if device == "cuda":
        assert facts["fsdp2"] and facts["offload_policy"]
    else:  # one rank on CPU: the plain module, unsharded
        assert not facts["fsdp2"] and "offload_policy" not in facts
    _same_step(_step(offloaded), _step(plain))


@pytest.mark.xfail(
    strict=True,
    reason="verl 0.7.1's actor calls its compiled entropy function only on the padding-free path "
    "(use_remove_padding), which this trainer refuses (it runs sdpa): with use_torch_compile=true the update still "
    "computes the entropy eagerly, so the key changes nothing it does (dp_actor.py _forward_micro_batch)",
)
def test_use_torch_compile_compiles_the_entropy_function(device, user_model):
    from torch._dynamo.utils import counters

    counters.clear()
    backend = _build(*user_model, f"{ACTOR}.entropy_coeff=0.01", f"{ACTOR}.use_torch_compile=true")
    assert backend.describe()["entropy_compiled"]
    _step(backend)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled something during the update


def test_the_one_gpu_fsdp_config_checkpoints_its_one_rank(device, tiny_model_dir):
    """With gradient checkpointing every forward of the update runs again in backward. Only `update_policy` is
    counted: the log-prob forward before it (no gradients) is not recomputed, and counted with the update it made
    n + 2m against 2(n + m)."""
    path = REPO / "config" / "gpu_fsdp_sglang.yaml"
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_files=unused.parquet",
        f"trainer.device={device}",
    ]
    forwards, steps = {}, {}
    for checkpointing in (True, False):
        cfg = load_config(path, [*overrides, f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}"])
        spec = build_run_spec(cfg).trainer
        assert spec.world_size == 1
        backend, _ = build_policy_backend(spec)
        assert backend.describe()["gradient_checkpointing"] is checkpointing
        data = fixed_batch(shifted(backend.compute_log_prob(make_batch(0))))
        with counting_layer_forwards(backend.model) as calls:
            steps[checkpointing] = backend.update_policy(data)
        forwards[checkpointing] = calls[0]
    assert forwards[False] >= 1 and forwards[True] == 2 * forwards[False]  # every micro-batch's forward recomputed
    assert steps[True]["actor/grad_norm"] == pytest.approx(steps[False]["actor/grad_norm"], rel=1e-3)  # same step
