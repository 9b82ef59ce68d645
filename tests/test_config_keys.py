"""Honest configuration: every key either changes what runs (the frozen run spec) or is refused when loading.

Walks every leaf of this project's sections and every verl key the allow-list says is read; checks that every
other verl leaf is refused; loads the GPU YAMLs and a YAML shaped like rLLM's fully-async config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rllm.experimental.fully_async.settings.loader import ConfigError, base_config, load_config
from rllm.experimental.fully_async.settings.schema import PROJECT_SECTIONS
from rllm.experimental.fully_async.settings.spec import build_run_spec
from rllm.experimental.fully_async.settings.verl_keys import VERL_ACTOR_KEYS_NOT_READ, VERL_KEYS_READ, is_read

REPO = Path(__file__).resolve().parents[1]

# A value different from the default config's (config/tiny_cpu.yaml) for each leaf the generic rule cannot pick.
PERTURB: dict[str, str] = {
    "async_training.staleness_threshold": "0.5",
    "async_training.use_rollout_log_probs": "false",
    "engines.backend": "sglang",
    "engines.dtype": "bfloat16",
    "engines.on_engine_failure": "stop",
    "engines.extra_args": "{mem_fraction_static: 0.5}",
    "param_sync.transport": "distributed",
    "param_sync.weights_dir": "/tmp/elsewhere",
    "param_sync.dtype": "bfloat16",
    "param_sync.master_address": "10.0.0.5",
    "task.name": "smollm2",
    "task.cache_dir": "/tmp/cache",
    "workflow.name": "my_agent",
    "workflow.path": "/tmp/agent.py",
    "workflow.layout": "concat",
    "env.name": "number_line",
    "env.path": "/tmp/env.py",
    "env.kwargs": "{size: 8}",
    "tools.format": "compact",
    "tools.functions": "{calculator: calculator}",
    "trainer.rollout_data_dir": "/tmp/dumps",
    "trainer.validation_data_dir": "/tmp/val_dumps",
    "run.dir": "/tmp/run",
    "run.log_level": "INFO",
    "data.truncation": "left",
    "data.seed": "7",
    "actor_rollout_ref.rollout.name": "sglang",
    "actor_rollout_ref.rollout.top_p": "0.9",
    "actor_rollout_ref.rollout.top_k": "20",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "0.8",
    "actor_rollout_ref.rollout.mode": "sync",
    "actor_rollout_ref.rollout.temperature": "0.7",
    "algorithm.adv_estimator": "rloo",
    "algorithm.gamma": "0.9",
    "algorithm.lam": "0.9",
    "algorithm.singleton_group_advantage": "verl",
    "algorithm.gigpo": "{omega: 0.5}",
    "algorithm.off_policy_correction": "{mode: tis}",
    "algorithm.rollout_correction.rollout_is": "token",
    "algorithm.rollout_correction.rollout_rs": "token",
    "algorithm.rollout_correction.rollout_rs_threshold": "2.0",
    "algorithm.rollout_correction.loss_type": "reinforce",
    "algorithm.group_filter": "{drop_zero_variance: true}",
    "trainer.resume_mode": "disable",
    "trainer.resume_from_path": "/tmp/ckpt/step_1",
    "trainer.project_name": "other",
    "trainer.experiment_name": "other",
    "trainer.logger": "[console,tensorboard]",
    "trainer.device": "cuda",
    "trainer.total_training_steps": "9",
    "reward.custom_reward_function.path": "/tmp/reward.py",
    "reward.custom_reward_function.name": "score",
    "custom_reward_function.path": "/tmp/reward.py",
    "custom_reward_function.name": "score",
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
    "actor_rollout_ref.actor.strategy": "fsdp",
}

# Keys refused at their perturbed value in the default config, with the words the refusal must contain.
REFUSED: dict[str, str] = {
    "async_training.staleness_threshold": "only derives max_staleness when that is null",
    "engines.extra_args": "with engines.backend=embedded remove it",
    "workflow.name": "not a built-in workflow",
    "workflow.rllm_batched": "read only with an rLLM rollout function",
    "workflow.layout": "read only with workflow.name=multi_turn",
    **{
        f"{section}.{key}": "read only with workflow.name=multi_turn"
        for section, keys in {
            "env": ("name", "path", "kwargs", "max_turns", "max_total_tokens", "step_timeout_s"),
            "tools": ("format", "timeout_s", "functions"),
        }.items()
        for key in keys
    },
    "actor_rollout_ref.rollout.val_kwargs.n": "single-turn validation decodes each prompt once",
    "algorithm.rollout_correction.rollout_rs": "not supported here",
    "algorithm.rollout_correction.rollout_rs_threshold": "has no counterpart here",
    "algorithm.rollout_correction.loss_type": "has no counterpart here",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "has no counterpart here",
    "algorithm.rollout_correction.rollout_is_threshold": "used only with rollout_is",
    "actor_rollout_ref.rollout.mode": "cannot be honoured",
    "actor_rollout_ref.rollout.calculate_log_probs": "cannot be honoured",
    "actor_rollout_ref.hybrid_engine": "cannot be honoured",
    "actor_rollout_ref.actor.strategy": "FSDP2 only",
    "actor_rollout_ref.actor.use_kl_loss": "needs a reference model",
    "actor_rollout_ref.actor.ppo_epochs": "exactly one optimizer step",
    "data.train_batch_size": "is read only when async_training.required_samples is null",
    **{
        f"async_training.adaptive_staleness.{key}": "is read only with async_training.adaptive_staleness.enable=true"
        for key in ("min", "max", "step", "raise_after", "raise_margin", "min_ess", "max_kl", "max_cut")
    },
    "algorithm.gigpo": "read only with algorithm.adv_estimator=gigpo",
    # a built-in task (the default) makes its own data and model: refused, never replaced (test_task.py)
    "data.train_files": "task.name=addition makes its own data and model",
    "data.val_files": "task.name=addition makes its own data and model",
    "actor_rollout_ref.model.path": "task.name=addition makes its own data and model",
}
try:
    import torch

    if torch.cuda.is_available():
        PERTURB["trainer.device"] = "cpu"  # on a GPU host the other way round; both are in the spec
    else:
        REFUSED["trainer.device"] = "CUDA is not available"
except ImportError:  # pragma: no cover - torch is a dependency
    pass


def _perturbed(key: str, value: object) -> str:
    if key in PERTURB:
        return PERTURB[key]
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):
        return str(value + 1)
    if isinstance(value, float):
        return repr(value / 2 if value > 0 else 0.5)
    raise AssertionError(f"no perturbed value for {key}={value!r}: add one to PERTURB")


def _outcome(key: str, value: str, baseline: object) -> str:
    try:
        spec = build_run_spec(load_config(None, [f"{key}={value}"]))
    except ConfigError as exc:
        assert "\n" not in str(exc), str(exc)
        return f"refused: {exc}"
    return "changed" if spec != baseline else "ignored"


def _check(key: str, baseline: object, default_value: object) -> None:
    outcome = _outcome(key, _perturbed(key, default_value), baseline)
    if key in REFUSED:
        assert outcome.startswith("refused") and REFUSED[key] in outcome, f"{key}: {outcome}"
    else:
        assert outcome == "changed", f"{key}={_perturbed(key, default_value)}: {outcome}"


@pytest.fixture(scope="module")
def default():
    cfg = load_config()
    return cfg, build_run_spec(cfg)


def _leaves(node: object, prefix: str) -> list[tuple[str, object]]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() if k != "_target_" for leaf in _leaves(v, f"{prefix}.{k}")]
    return [(prefix, node)]


def _project_leaves() -> list[str]:
    cfg = base_config()
    return [k for s in PROJECT_SECTIONS for k, _ in _leaves(OmegaConf.to_container(cfg[s]), s)]


@pytest.mark.parametrize("key", _project_leaves())
def test_every_project_key_changes_the_run_spec_or_is_refused(key, default):
    cfg, baseline = default
    _check(key, baseline, OmegaConf.select(cfg, key))


def _verl_read_leaves() -> list[str]:
    """Every explicit allow-listed key, and for the prefixes (whole sections handed to verl) a sample of leaves."""
    keys = [k for k in VERL_KEYS_READ if not k.endswith(".")]
    keys += [
        "actor_rollout_ref.actor.clip_ratio",
        "actor_rollout_ref.actor.entropy_coeff",
        "actor_rollout_ref.actor.loss_agg_mode",
        "actor_rollout_ref.actor.optim.lr",
        "actor_rollout_ref.actor.optim.weight_decay",
        "actor_rollout_ref.actor.grad_clip",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.use_kl_loss",
        "actor_rollout_ref.actor.ppo_epochs",
        "actor_rollout_ref.actor.strategy",
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_rs",
        "algorithm.rollout_correction.loss_type",
        "algorithm.rollout_correction.rollout_rs_threshold",
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        "algorithm.rollout_correction.rollout_is_threshold",
        "algorithm.rollout_correction.bypass_mode",
        "actor_rollout_ref.rollout.val_kwargs.n",
    ]
    prefixes = {k for k in VERL_KEYS_READ if k.endswith(".")} - {"critic."}
    covered = {p for p in prefixes for k in keys if k.startswith(p)}
    assert covered == prefixes, f"allow-listed prefixes without a sampled leaf: {prefixes - covered}"
    return keys


@pytest.mark.parametrize("key", _verl_read_leaves())
def test_every_verl_key_read_changes_the_run_spec_or_is_refused(key, default):
    cfg, baseline = default
    _check(key, baseline, OmegaConf.select(cfg, key))


def test_every_other_verl_key_is_refused_by_name():
    cfg = OmegaConf.to_container(base_config(), resolve=False)
    leaves = [k[1:] for k, _ in _leaves(cfg, "") if k[1:].split(".")[0] not in PROJECT_SECTIONS]
    unread = [k for k in leaves if not is_read(k)]
    assert len(unread) > 300  # verl's tree is ~600 leaves; most of the rest are the actor's, read by verl
    for key in ("actor_rollout_ref.ref.fsdp_config.param_offload", "algorithm.kl_ctrl.kl_coef", "trainer.val_only"):
        assert key in unread
    for key in [*VERL_ACTOR_KEYS_NOT_READ, "actor_rollout_ref.actor.checkpoint.save_contents"]:
        assert not is_read(key + "leaf" if key.endswith(".") else key)
    # end to end for a spread of them (each load is ~0.4 s, so not all 500)
    for key in unread[:: max(1, len(unread) // 12)]:
        value = OmegaConf.select(base_config(), key, throw_on_missing=False)
        perturbed = "7" if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)) else None
        perturbed = perturbed or ("true" if value is False else "false" if value is True else "something_else")
        with pytest.raises(ConfigError, match=r"not used by the fully-async trainer|critic|must be") as info:
            load_config(None, [f"{key}={perturbed}"])
        assert "\n" not in str(info.value)


# A multi_turn agent config: each env/tools/layout/val_kwargs key changes the spec there (refused elsewhere, above).
AGENT = ["workflow.name=multi_turn", "env.name=number_line", "env.max_total_tokens=64"]
AGENT_PERTURB = {
    "env.name": None,  # only built-in is number_line; env.path below names a class instead
    "env.path": ["env.path=/tmp/env.py", "env.name=MyEnv"],
    "env.kwargs": ["env.kwargs={size: 8}"],
    "env.max_turns": ["env.max_turns=3"],
    "env.max_total_tokens": ["env.max_total_tokens=65"],
    "env.step_timeout_s": ["env.step_timeout_s=1.5"],
    "tools.format": ["tools.format=compact"],
    "tools.timeout_s": ["tools.timeout_s=1.5"],
    "tools.functions": ["tools.functions={calculator: calculator}"],
    "workflow.layout": ["workflow.layout=concat"],
    "actor_rollout_ref.rollout.val_kwargs.n": ["actor_rollout_ref.rollout.val_kwargs.n=4"],
    "actor_rollout_ref.rollout.val_kwargs.do_sample": [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    ],
    "actor_rollout_ref.rollout.val_kwargs.top_p": ["actor_rollout_ref.rollout.val_kwargs.top_p=0.5"],
    "actor_rollout_ref.rollout.val_kwargs.top_k": ["actor_rollout_ref.rollout.val_kwargs.top_k=5"],
}


@pytest.mark.parametrize("key", [k for k, v in AGENT_PERTURB.items() if v])
def test_every_agent_key_changes_the_run_spec_of_a_multi_turn_run(key):
    baseline = build_run_spec(load_config(None, AGENT))
    assert baseline.executor.agent is not None and baseline.executor.agent.env_name == "number_line"
    assert build_run_spec(load_config(None, [*AGENT, *AGENT_PERTURB[key]])) != baseline, key


def test_agent_settings_that_cannot_run_are_refused_in_one_line():
    cases = {
        "env.name=null": "'env.name' must be set",
        "env.name=maze": "unknown environment 'maze'",
        "tools.functions={c: calculator}\ntools.format=xml": "'tools.format' must be one of",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0": "used only with val_kwargs.do_sample=true",
        "env.max_turns=0": "'env.max_turns' must be >= 1",
    }
    for overrides, words in cases.items():
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as info:
            load_config(None, [*AGENT, *overrides.split("\n")])
        assert "\n" not in str(info.value)


def test_the_critic_section_is_read_only_with_gae():
    with pytest.raises(ConfigError, match=r"read only with algorithm\.adv_estimator=gae"):
        load_config(None, ["critic.optim.lr=1e-3"])
    spec = build_run_spec(load_config(None, ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3"]))
    assert spec.trainer.critic is not None and spec.trainer.critic["optim"]["lr"] == 1e-3


# --- the shipped GPU YAMLs -------------------------------------------------------------------------------------


def test_gpu_fsdp_yaml_loads_with_every_key_honoured_or_refused():
    import torch

    path = REPO / "config" / "fully_async_ppo_trainer.yaml"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"'trainer.device=cuda' but CUDA is not available"):
            load_config(path)
    cfg = load_config(path, ["trainer.device=cpu"] if not torch.cuda.is_available() else [])
    spec = build_run_spec(cfg)
    assert spec.engines.backend == "sglang" and spec.engines.num_engines == 4 and spec.engines.dtype == "bfloat16"
    assert spec.trainer.enable_gradient_checkpointing is True
    assert spec.trainer.actor["use_dynamic_bsz"] is True and spec.trainer.actor["fsdp_config"]["dtype"] == "bfloat16"
    assert spec.schedule.max_staleness == 2 and spec.run.test_freq == 25
    # every leaf the file sets is this project's or a verl key that is read
    written = OmegaConf.to_container(OmegaConf.load(path))
    written.pop("defaults")
    for key, _ in _leaves(written, ""):
        key = key[1:]
        assert key.split(".")[0] in PROJECT_SECTIONS or is_read(key), key


def test_gpu_megatron_yaml_is_refused_without_cuda_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/test_megatron.py covers the Megatron YAML")
    with pytest.raises(ConfigError, match="needs CUDA") as info:
        load_config(REPO / "config" / "fully_async_ppo_megatron_trainer.yaml")
    assert "\n" not in str(info.value)


# --- a YAML written for rLLM's fully-async module ---------------------------------------------------------------

# The key set and defaults of rLLM's rllm/experimental/fully_async/config/fully_async_ppo_trainer.yaml.
RLLM_YAML = """
hydra:
  searchpath: [pkg://verl.trainer.config]
defaults: [ppo_trainer, _self_]
async_training:
  staleness_threshold: 0.1
  trigger_parameter_sync_step: 4
  require_batches: 1
  required_samples: 128
  partial_rollout: true
  use_rollout_log_probs: true
  compute_prox_log_prob: false
  use_trainer_do_validate: false
  checkpoint_engine: {enable: ENABLE, device_buffer_size_M: 4096, overlap_broadcast_and_consume: false}
rollout: {nnodes: 1, n_gpus_per_node: 8, n: 4, total_rollout_steps: 1000, total_epochs: 10, test_freq: 1,
          rejection_sample: false}
data: {train_batch_size: 0, gen_batch_size: 1, train_dataset_name: null, train_split: train,
       val_dataset_name: null, val_split: test}
critic: {strategy: fsdp2}
actor_rollout_ref:
  hybrid_engine: false
  checkpoint_engine: ${oc.select:async_training.checkpoint_engine, null}
  actor: {strategy: fsdp2, use_rollout_log_probs: "${oc.select:async_training.use_rollout_log_probs, True}"}
  rollout: {name: sglang, mode: async, calculate_log_probs: true}
"""


def test_rllm_fully_async_yaml_loads_with_each_key_mapped(tmp_path):
    path = tmp_path / "rllm.yaml"
    path.write_text(RLLM_YAML.replace("ENABLE", "false"))
    cfg = load_config(path)
    spec = build_run_spec(cfg)
    assert spec.executor.samples_per_prompt == 4  # rollout.n
    assert spec.engines.backend == "sglang" and spec.engines.num_engines == 4  # 8 GPUs / verl's default tp=2
    assert spec.run.total_training_steps == 8  # ceil(1000 rollout samples / 128 per step)
    assert spec.executor.data.total_epochs == 10
    assert spec.run.test_freq == 4  # every weight sync = every 4 optimizer steps
    assert spec.schedule.trigger_parameter_sync_step == 4 and spec.schedule.required_samples == 128
    assert spec.schedule.max_staleness == 0  # rLLM's 0.1 threshold: floor(int(128 * 1.1 * 4) / (128 * 4)) - 1 = 0
    assert spec.executor.group_filter is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("ENABLE", "true"), "'async_training.checkpoint_engine.enable=true'"),
        (("use_trainer_do_validate: false", "use_trainer_do_validate: true"), "validation runs on the rollout engines"),
        (("require_batches: 1", "require_batches: 2"), "required_samples=128 is set and wins"),
        (("gen_batch_size: 1", "gen_batch_size: 4"), "'data.gen_batch_size=4'"),
        (("train_dataset_name: null", "train_dataset_name: gsm8k"), "DatasetRegistry is not read here"),
        (("nnodes: 1", "nnodes: 2"), "'rollout.nnodes=2'"),
        (("hybrid_engine: false", "hybrid_engine: true"), "'actor_rollout_ref.hybrid_engine=True'"),
        (("mode: async", "mode: sync"), "'actor_rollout_ref.rollout.mode=sync'"),
        (("n: 4,", "n: 4, bogus: 1,"), "'rollout.bogus' is not a key of rLLM's"),
    ],
)
def test_rllm_keys_that_cannot_be_honoured_are_refused_naming_the_equivalent(tmp_path, change, named):
    path = tmp_path / "rllm.yaml"
    path.write_text(RLLM_YAML.replace(*change).replace("ENABLE", "false"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert named in str(info.value) and "\n" not in str(info.value)
    assert "did you mean" not in str(info.value)


def test_rllm_require_batches_sizes_the_step_when_required_samples_is_null():
    cfg = load_config(None, ["async_training.required_samples=null", "async_training.require_batches=2"])
    assert cfg.async_training.required_samples == 2 * cfg.actor_rollout_ref.actor.ppo_mini_batch_size


def test_rllm_rejection_sample_turns_on_the_zero_variance_filter():
    spec = build_run_spec(load_config(None, ["rollout.rejection_sample=true"]))
    assert spec.executor.group_filter is not None and spec.executor.group_filter.drop_zero_variance
