"""The Megatron backend without CUDA: config composition, the Megatron -> HF weight mapping, the patched iterator.

megatron-core 0.16.1 and mbridge import on CPU, but a Megatron forward pass needs CUDA, so what is tested here is
everything around it (tests/gpu/test_megatron_gpu.py has the rest):
- `config/gpu_megatron_sglang.yaml` composes on verl's `ppo_megatron_trainer` defaults, its parallel
  keys load and reach verl's McoreActorConfig with `fully_async` on; on a machine without CUDA the strategy is
  refused in one line;
- the Megatron -> HF weight-name mapping of verl's two converters (mbridge, verl's McoreToHFWeightConverterDense)
  against a hand-written table for a tiny Qwen2, and the tensors through the same code back to the HF model;
- the patched `MegatronPPOActor.make_minibatch_iterator` and the empty-batch skip of `update_policy`, measured
  against a pristine copy of verl (no forward pass: the probe stops where the forward would start).

Run as a script (`python tests/backends/test_megatron.py patched|pristine`) the module prints the probe's observations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")

REPO = Path(__file__).resolve().parents[2]
MEGATRON_YAML = REPO / "config" / "gpu_megatron_sglang.yaml"
GPU_OVERRIDES = ["trainer.device=cuda"]

# ----------------------------------------------------------------------------------------------------------------
# Config: composed on verl's ppo_megatron_trainer
# ----------------------------------------------------------------------------------------------------------------


def _load(path: Path = MEGATRON_YAML, overrides: tuple[str, ...] = ()) -> Any:
    from rllm.experimental.fully_async.settings.loader import load_config

    return load_config(path, list(overrides), check_host=False)  # planned for a GPU host


def test_megatron_yaml_composes_on_verl_megatron_defaults_and_parallel_keys_load():
    """verl's Megatron keys load (sizes above 1 are refused while the trainer runs on one GPU: test_config_keys)."""
    from rllm.experimental.fully_async.backends.megatron import build_actor_config, build_worker_config

    parallel = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1}
    cfg = _load(overrides=tuple(f"actor_rollout_ref.actor.megatron.{k}={v}" for k, v in parallel.items()))
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and actor._target_ == "verl.workers.config.McoreActorConfig"
    assert actor.optim._target_ == "verl.workers.config.McoreOptimizerConfig" and "fsdp_config" not in actor
    assert {k: actor.megatron[k] for k in parallel} == parallel
    assert actor.megatron.use_mbridge is True  # verl's default export path
    worker_cfg = build_worker_config(cfg.actor_rollout_ref)
    assert worker_cfg.actor.fully_async is True and worker_cfg.model.path == cfg.actor_rollout_ref.model.path
    config = build_actor_config(worker_cfg.actor)
    assert type(config).__name__ == "McoreActorConfig" and config.fully_async is True
    assert config.megatron.tensor_model_parallel_size == 1 and config.megatron.context_parallel_size == 1


def test_strategy_megatron_alone_selects_the_megatron_base(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    strategy: megatron\ntrainer:\n  device: cuda\n")
    cfg = _load(path, ("actor_rollout_ref.actor.megatron.use_mbridge=false",))
    assert cfg.actor_rollout_ref.actor.megatron.use_mbridge is False
    # and the override alone does it too
    plain = tmp_path / "p.yaml"
    plain.write_text("trainer:\n  device: cuda\n")
    cfg = _load(plain, ("actor_rollout_ref.actor.strategy=megatron",))
    assert "megatron" in cfg.actor_rollout_ref.actor


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (("actor_rollout_ref.actor.megatron.tensor_parallel_size=2",), "tensor_model_parallel_size"),
        (("actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",), "actor_rollout_ref.actor.fsdp_config"),
        (("actor_rollout_ref.actor.strategy=fsdp2",), "strategy=megatron"),
        (("trainer.device=cpu",), "trainer.device=cuda"),
        (("trainer.n_gpus_per_node=2",), "one process"),
        (("algorithm.adv_estimator=gae",), "FSDP critic"),
        (
            ("algorithm.off_policy_correction={mode: decoupled, prox_log_probs: previous}",),
            "prox_log_probs=previous",
        ),
        (
            (
                "async_training.max_staleness=0",
                "algorithm.off_policy_correction={mode: m2po, control_prox: previous_step}",
            ),
            "control_prox",
        ),
    ],
)
def test_megatron_config_refusals_are_one_line(overrides, named):
    from rllm.experimental.fully_async.errors import ConfigError

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as info:
        _load(overrides=overrides)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the strategy is not refused")
@pytest.mark.parametrize("config", ["gpu_megatron_sglang.yaml", "tiny_cpu.yaml"])
def test_without_cuda_megatron_is_refused_in_one_line_before_anything_else(config):
    from rllm.experimental.fully_async.backends.megatron import CUDA_REFUSAL, build_megatron_backend
    from rllm.experimental.fully_async.errors import ConfigError
    from rllm.experimental.fully_async.settings.loader import load_config

    with pytest.raises(ConfigError) as info:
        load_config(REPO / "config" / config, ["actor_rollout_ref.actor.strategy=megatron"])
    assert str(info.value) == CUDA_REFUSAL
    with pytest.raises(RuntimeError, match="needs CUDA"):  # and the backend itself, if reached some other way
        build_megatron_backend(_load().actor_rollout_ref)


def test_on_a_cuda_host_without_transformer_engine_megatron_is_refused_in_one_line(monkeypatch):
    """PyPI has no binary wheel of TransformerEngine's torch extension: a GPU host set up from binary wheels lacks
    it, and the config loader and the backend say so before verl's worker fails inside megatron-core."""
    from rllm.experimental.fully_async.backends import megatron
    from rllm.experimental.fully_async.errors import ConfigError
    from rllm.experimental.fully_async.settings.loader import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron, "_installed", lambda module: module in ("megatron.core", "mbridge"))
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "config" / "gpu_megatron_sglang.yaml", ["actor_rollout_ref.actor.strategy=megatron"])
    assert str(info.value).startswith(
        "'actor_rollout_ref.actor.strategy=megatron': Megatron path unusable: TransformerEngine's PyTorch extension"
    )
    assert "\n" not in str(info.value) and "no binary wheel" in str(info.value)
    with pytest.raises(RuntimeError, match=r"^Megatron path unusable: TransformerEngine's"):
        megatron.require_megatron_stack()
    monkeypatch.setattr(megatron, "_installed", lambda module: True)
    assert megatron.megatron_unusable_reason() is None
    megatron.require_megatron_stack()  # the whole stack: nothing to refuse


# ----------------------------------------------------------------------------------------------------------------
# Megatron -> HF weights for a tiny Qwen2 (2 layers, 4 heads, 2 KV groups)
# ----------------------------------------------------------------------------------------------------------------

QKV_W = [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]
QKV_B = [f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"]
# Megatron's (TransformerEngine layer spec, as verl builds it) parameter names -> HF names, written by hand.
LAYER_TABLE = {
    "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight": ["model.layers.{i}.input_layernorm.weight"],
    "decoder.layers.{i}.self_attention.linear_qkv.weight": QKV_W,
    "decoder.layers.{i}.self_attention.linear_qkv.bias": QKV_B,
    "decoder.layers.{i}.self_attention.linear_proj.weight": ["model.layers.{i}.self_attn.o_proj.weight"],
    "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight": ["model.layers.{i}.post_attention_layernorm.weight"],
    "decoder.layers.{i}.mlp.linear_fc1.weight": [
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
    ],
    "decoder.layers.{i}.mlp.linear_fc2.weight": ["model.layers.{i}.mlp.down_proj.weight"],
}
NAME_TABLE = {
    "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
    **{k.format(i=i): [n.format(i=i) for n in v] for i in (0, 1) for k, v in LAYER_TABLE.items()},
    "decoder.final_layernorm.weight": ["model.norm.weight"],
}
UNTIED = {"output_layer.weight": ["lm_head.weight"]}


@pytest.fixture(scope="module")
def model_parallel():
    """megatron-core's parallel state for a gloo world of one (mbridge reads it)."""
    from megatron.core import parallel_state as mpu

    from rllm.experimental.fully_async.backends.fsdp import ensure_process_group

    ensure_process_group("cpu")
    mpu.initialize_model_parallel(1, 1)
    yield
    mpu.destroy_model_parallel()


def _qwen2(tmp_path: Path, tied: bool) -> Path:
    from model_helpers import build_tiny_qwen2
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tied:
        return build_tiny_qwen2(tmp_path / "tied")
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "untied")
    return tmp_path / "untied"


@pytest.mark.parametrize("use_mbridge", [True, False], ids=["mbridge", "verl-converter"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_megatron_to_hf_names_match_the_hand_written_table(model_parallel, tmp_path, use_mbridge, tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rllm.experimental.fully_async.backends.megatron_weights import build_name_converter, megatron_to_hf_names

    folder = _qwen2(tmp_path, tied)
    hf_config = AutoConfig.from_pretrained(folder)
    converter = build_name_converter(hf_config, use_mbridge=use_mbridge, dtype=torch.float32)
    table = NAME_TABLE if tied else {**NAME_TABLE, **UNTIED}
    got = {name: megatron_to_hf_names(converter, name) for name in table}
    assert got == table
    # the table covers the HF model exactly (a tied lm_head is the embedding)
    hf_names = {n for n, _ in AutoModelForCausalLM.from_pretrained(folder).named_parameters()}
    assert {n for names in table.values() for n in names} == hf_names


@pytest.mark.parametrize("use_mbridge", [True, False], ids=["mbridge", "verl-converter"])
def test_megatron_tensors_export_to_the_same_hf_model(model_parallel, tmp_path, use_mbridge):
    """HF -> Megatron's fused layout (mbridge's loader, as verl loads weights) -> HF through the export path:
    the folder written for the engines holds the original tensors and computes the original logits."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from rllm.experimental.fully_async.backends.megatron_weights import (
        build_name_converter,
        hf_weights,
        write_hf_folder,
    )

    folder = _qwen2(tmp_path, tied=False)
    hf_config = AutoConfig.from_pretrained(folder)
    original = AutoModelForCausalLM.from_pretrained(folder).eval()
    hf_state = original.state_dict()
    loader = build_name_converter(hf_config, use_mbridge=True, dtype=torch.float32)
    table = {**NAME_TABLE, **UNTIED}
    megatron_state = {m: loader._weight_to_mcore_format(m, [hf_state[n] for n in names]) for m, names in table.items()}
    assert megatron_state["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (128, 64)  # fused q+k+v

    converter = build_name_converter(hf_config, use_mbridge=use_mbridge, dtype=torch.float32)
    stream = [pair for m, t in megatron_state.items() for pair in hf_weights(converter, m, t)]
    for name, tensor in stream:
        torch.testing.assert_close(tensor, hf_state[name], rtol=0, atol=0, msg=name)

    written = write_hf_folder(stream, tmp_path / "export", hf_config=hf_config, source_dir=folder, dtype="bfloat16")
    assert set(written) == set(hf_state)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 - safe_open has no __iter__
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, original(ids).logits, rtol=0.05, atol=0.05)

    with pytest.raises(ValueError, match="lack 3 HF tensors"):  # a half-exported model never reaches an engine
        write_hf_folder(stream[3:], tmp_path / "partial", hf_config=hf_config)


# ----------------------------------------------------------------------------------------------------------------
# The probe: runs in a subprocess against a patched or pristine copy of verl
# ----------------------------------------------------------------------------------------------------------------

ROWS, MINI, EPOCHS = 6, 2, 3


def probe() -> dict[str, Any]:
    """make_minibatch_iterator's output and update_policy's behaviour on an all-masked batch, without a forward."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import verl
    from megatron.core import parallel_state as mpu
    from verl.workers.actor import megatron_actor
    from verl.workers.actor.megatron_actor import MegatronPPOActor
    from verl_helpers import make_batch

    from rllm.experimental.fully_async.backends.megatron import build_actor_config

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1)
    settings = {"ppo_mini_batch_size": MINI, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": EPOCHS}
    settings["shuffle"] = False
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    target = {"_target_": "verl.workers.config.McoreActorConfig", "rollout_n": 1}
    ordinary = omega_conf_to_dataclass(OmegaConf.create({**settings, **target}))
    try:
        fully_async = build_actor_config(settings)  # the backend's config: the flag on
    except Exception:  # pristine verl: McoreActorConfig has no fully_async field, so nothing to switch on
        fully_async = ordinary
    data = make_batch(seed=5)
    data.batch["old_log_probs"] = torch.zeros_like(data.batch["advantages"])
    out: dict[str, Any] = {"verl_file": verl.__file__}
    for name, config in (("fully_async", fully_async), ("ordinary", ordinary)):
        actor = SimpleNamespace(config=config, enable_routing_replay=False)
        batches = list(MegatronPPOActor.make_minibatch_iterator(actor, data))
        out[name] = {
            "batches": len(batches),
            "rows": [len(b) for b in batches],
            "whole_batch_unchanged": len(batches) == 1
            and all(torch.equal(batches[0].batch[k], data.batch[k]) for k in batches[0].batch.keys()),  # noqa: SIM118 - a TensorDict iterates rows,
        }

    # update_policy on a batch without a response token: where does it go?
    calls: list[str] = []

    class Optimizer:
        def zero_grad(self) -> None:
            calls.append("zero_grad")

        def step(self) -> tuple[bool, float, int]:
            calls.append("step")
            return True, 1.0, 0

    def forward_backward_batch(*args: Any, **kwargs: Any) -> Any:
        calls.append("forward")
        raise RuntimeError("forward reached")

    # update_policy ends with get_torch_device().empty_cache(); torch.cpu has none: the one GPU call stubbed
    megatron_actor.get_torch_device = lambda: SimpleNamespace(empty_cache=lambda: None)
    empty = make_batch(seed=6, empty_rows=tuple(range(ROWS)))
    empty.batch["old_log_probs"] = torch.zeros_like(empty.batch["advantages"])
    actor = SimpleNamespace(
        config=fully_async,
        enable_routing_replay=False,
        actor_optimizer=Optimizer(),
        actor_module=[],
        forward_backward_batch=forward_backward_batch,
    )
    try:
        metrics = MegatronPPOActor.update_policy(actor, MegatronPPOActor.make_minibatch_iterator(actor, empty))
        out["empty_batch"] = {"metrics": metrics, "calls": calls}
    except RuntimeError as exc:
        out["empty_batch"] = {"error": str(exc), "calls": calls}
    return out


@pytest.fixture(scope="module")
def iterator_observations(tmp_path_factory) -> dict[str, dict[str, Any]]:
    from verl_helpers import make_verl_copy

    results = {}
    procs = {}
    for state in ("patched", "pristine"):
        root = make_verl_copy(tmp_path_factory.mktemp(f"verl_mcore_{state}"), patched=state == "patched")
        path = os.pathsep.join(
            [str(root), str(REPO / "tests" / "backends"), str(REPO / "tests" / "helpers"), str(REPO)]
        )
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, state]
        procs[state] = (root, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for state, (root, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{state} probe failed:\n{stderr[-4000:]}"
        results[state] = json.loads(stdout.strip().splitlines()[-1])
        assert results[state]["verl_file"].startswith(str(root)), "the probe imported the wrong verl"
    return results


@pytest.mark.slow  # verl Megatron workers in four processes (~20 s on a busy 2-core machine)
def test_patched_iterator_yields_the_whole_batch_once(iterator_observations):
    patched = iterator_observations["patched"]
    assert patched["fully_async"] == {"batches": 1, "rows": [ROWS], "whole_batch_unchanged": True}
    # the same actor without the flag still does what verl does: mini-batches of MINI, EPOCHS times over
    assert patched["ordinary"]["batches"] == EPOCHS * ROWS // MINI and set(patched["ordinary"]["rows"]) == {MINI}
    # pristine verl has no flag: its iterator always splits, so one call would take 9 optimizer steps
    pristine = iterator_observations["pristine"]
    assert pristine["fully_async"] == pristine["ordinary"] == patched["ordinary"]


@pytest.mark.slow  # verl Megatron workers in four processes (~20 s on a busy 2-core machine)
def test_patched_update_policy_skips_a_batch_without_response_tokens(iterator_observations):
    patched = iterator_observations["patched"]["empty_batch"]
    assert patched.get("metrics") == {} and "forward" not in patched["calls"] and "step" not in patched["calls"]
    pristine = iterator_observations["pristine"]["empty_batch"]
    assert pristine["error"] == "forward reached" and "forward" in pristine["calls"]


if __name__ == "__main__":
    print(json.dumps(probe()))
