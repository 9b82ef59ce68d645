"""FSDPCriticBackend: the learned value function for PPO with GAE, trained through verl's DataParallelPPOCritic.

With `algorithm.adv_estimator=gae` the trainer needs V(s_t) for every response token before it can compute
advantages, and it trains the critic on the returns in the same step as the policy. It calls four things:
`compute_values` ([B, R] values of the batch), `update_critic` (exactly one optimizer step on one batch),
and `state_dict`/`load_state_dict` for checkpoints. Like the policy backend it knows nothing of Ray or versions.

The math is verl 0.7.1's, unpatched (`DataParallelPPOCritic.update_critic` -> `core_algos.compute_value_loss`),
PPO's clipped value loss (Schulman et al. 2017, arXiv 1707.06347, Eq. 9, with the value clipping of
openai/baselines ppo2):

    V_clip_t = clip(V_theta(s_t), V_old(s_t) - eps_v, V_old(s_t) + eps_v)
    L_V      = 1/2 * agg_t max( (V_theta(s_t) - R_t)^2, (V_clip_t - R_t)^2 )

V_old is the batch's `values` (this critic's prediction before the step, from `compute_values`), R the batch's
`returns` (for GAE R_t = A_t + V_old(s_t), before whitening), eps_v `critic.cliprange_value`, and agg
`critic.loss_agg_mode` over response tokens (token-mean: the mean over every response token of the batch).
V(s_t) is read at the position before response token t (the state the token was generated from), as verl does.

One optimizer step per call, through the config alone (the actor patch does not touch the critic): verl's
`update_critic` splits the batch into mini-batches of `ppo_mini_batch_size` rows, loops `ppo_epochs` times over
them, and steps the optimizer once per mini-batch. Before each call the backend sets `ppo_mini_batch_size` to the
batch's row count (verl lists it in the config's `_mutable_fields`, as its own workers rescale it at run time),
and `ppo_epochs` must be 1 (`validate_critic_section`): one mini-batch x one epoch = one step. Within the step,
gradients accumulate over micro-batches weighted 1 / (mini-batch rows // micro-batch rows); the backend uses the
largest divisor of the row count not above `ppo_micro_batch_size_per_gpu`, so the weights sum to one and the step
is on the mean of equal-size micro-batch losses (the whole-batch loss when the micro-batch holds the batch).
With `use_dynamic_bsz` verl weights each micro-batch by its rows / mini-batch rows, which sums to one for any split.
A batch without response tokens takes no step (AdamW's weight decay would still move the weights) and leaves the
LR schedule where it was, as the policy backend does.

Model: the policy's HF folder loaded with `AutoModelForTokenClassification`, `num_labels=1` and dropout off, as
verl's fsdp_workers build it: the backbone is the policy's, the one-output `score` head is new, initialised by
transformers (normal(0, initializer_range), zero bias) under `seed`. Attention is sdpa (verl asks for
flash_attention_2, which CPUs lack).

Precision: verl's critic forward always enters `torch.autocast(bfloat16)`. On CPU that would run the matmuls in
bf16 (slow there, and values with three significant digits feeding GAE); the backend turns autocast off inside
the model's forward, so the CPU critic computes in fp32. On GPU verl's bf16 autocast over fp32 parameters stays.

World size 1 only (a plain `nn.Module`, CPU or one GPU). The unpatched critic's token-mean at world size N is a
mean of per-rank means and has no proof here like the actor patch's, so a sharded critic is refused rather than
run on unproven numbers.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import AutoConfig, AutoModelForTokenClassification
from verl import DataProto
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_device_name
from verl.utils.metric import reduce_metrics
from verl.workers.config import FSDPCriticConfig
from verl.workers.config.optimizer import build_optimizer
from verl.workers.critic.dp_critic import DataParallelPPOCritic

from rllm.experimental.fully_async.backends import build_lr_scheduler, to_cpu
from rllm.experimental.fully_async.backends.fsdp import ensure_process_group

logger = logging.getLogger(__name__)

__all__ = ["FSDPCriticBackend", "build_critic_config", "validate_critic_section"]

# Batch keys ([B, P+R] for the first three, [B, R] for the rest). compute_values masks its output with
# response_mask when the batch has one.
VALUE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = (*VALUE_KEYS, "response_mask", "values", "returns")

# `_target_`s verl's generated YAML carries and a hand-written section usually lacks; without them verl leaves a
# section a dict where CriticConfig.__post_init__ and build_optimizer need a dataclass.
_SECTION_TARGETS = {
    "optim": "verl.workers.config.FSDPOptimizerConfig",
    "model": "verl.workers.config.FSDPCriticModelCfg",
    "checkpoint": "verl.trainer.config.CheckpointConfig",
}
_CONFIG_TARGET = "verl.workers.config.FSDPCriticConfig"
_FSDP_CONFIG_TARGET = "verl.workers.config.FSDPEngineConfig"
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _section_dict(critic_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A plain, resolved copy of a `critic` section (DictConfig node, DictConfig or dict)."""

    # A node of the full run config resolves against its root (verl's `${oc.select:actor_rollout_ref...}` keys);
    # a detached section or dict resolves against itself, where those selects fall back to their defaults.
    node = critic_cfg if isinstance(critic_cfg, DictConfig) else OmegaConf.create(copy.deepcopy(dict(critic_cfg)))
    return OmegaConf.to_container(node, resolve=True)


def validate_critic_section(critic_cfg: Mapping[str, Any]) -> None:
    """Refuse, with one line naming the key, a `critic` section this backend cannot honour.

    Cheap (no model, no dataclass): meant for the config loader when `algorithm.adv_estimator=gae`, and called
    again by the backend. Keys that verl would accept but this backend would silently ignore are refused.
    """
    raw = _section_dict(critic_cfg)
    optim = raw.get("optim") or {}
    model = raw.get("model") or {}

    def positive(key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"'critic.{key}' must be a number > 0, got {value!r}")

    positive("optim.lr", optim.get("lr", 1e-3))
    positive("cliprange_value", raw.get("cliprange_value", 0.5))
    positive("grad_clip", raw.get("grad_clip", 1.0))
    if raw.get("ppo_epochs", 1) != 1:
        raise ValueError(
            f"'critic.ppo_epochs' must be 1, got {raw['ppo_epochs']!r}: the fully-async trainer takes exactly one "
            "critic step per batch (raise async_training.required_samples for larger steps)"
        )
    micro = raw.get("ppo_micro_batch_size_per_gpu")
    if not raw.get("use_dynamic_bsz", False) and (not isinstance(micro, int) or micro < 1):
        raise ValueError(
            f"'critic.ppo_micro_batch_size_per_gpu' must be an integer >= 1, got {micro!r} "
            "(or set critic.use_dynamic_bsz=true)"
        )
    mode = raw.get("loss_agg_mode", "token-mean")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"'critic.loss_agg_mode' must be one of {', '.join(LOSS_AGG_MODES)}; got {mode!r}")
    kind = optim.get("lr_scheduler_type", "constant")
    if kind not in ("constant", "cosine"):
        raise ValueError(f"'critic.optim.lr_scheduler_type' must be constant or cosine, got {kind!r}")
    if kind == "cosine" and not int(optim.get("total_training_steps", -1) or -1) > 0:
        raise ValueError("'critic.optim.total_training_steps' must be > 0 with critic.optim.lr_scheduler_type=cosine")
    # verl implements these in its Ray worker (monkey patches, PEFT, Ulysses), not in DataParallelPPOCritic.
    if model.get("use_remove_padding", False):
        raise ValueError("'critic.model.use_remove_padding' must be false: the padding-free path needs flash-attn")
    if raw.get("ulysses_sequence_parallel_size", 1) != 1:
        raise ValueError("'critic.ulysses_sequence_parallel_size' must be 1 (no sequence parallelism here)")
    if model.get("lora_rank", 0):
        raise ValueError("'critic.model.lora_rank' must be 0: the fully-async critic trains all weights")
    if (model.get("tiled_mlp") or {}).get("enabled", False):
        raise ValueError("'critic.model.tiled_mlp.enabled' must be false (it needs FSDP2 sharding)")


def build_critic_config(critic_cfg: Mapping[str, Any], model_path: str | os.PathLike[str]) -> FSDPCriticConfig:
    """verl's FSDPCriticConfig from a `critic` section shaped like `_generated_ppo_trainer.yaml`'s.

    `model.path` and `model.tokenizer_path` become `model_path` (the critic starts from the policy's folder).
    Missing `_target_`s default to verl's FSDP dataclasses, and the forward-pass sizes the YAML interpolates from
    the training ones (`forward_micro_batch_size_per_gpu`, `forward_max_token_len_per_gpu`) follow them when a
    plain section leaves them out.
    """
    raw = _section_dict(critic_cfg)
    raw.setdefault("_target_", _CONFIG_TARGET)
    for section, target in _SECTION_TARGETS.items():
        raw[section] = dict(raw.get(section) or {})
        raw[section].setdefault("_target_", target)
    raw["model"]["fsdp_config"] = dict(raw["model"].get("fsdp_config") or {})
    raw["model"]["fsdp_config"].setdefault("_target_", _FSDP_CONFIG_TARGET)
    raw["model"]["path"] = str(model_path)
    raw["model"]["tokenizer_path"] = str(model_path)
    if raw.get("forward_micro_batch_size_per_gpu") is None:
        raw["forward_micro_batch_size_per_gpu"] = raw.get("ppo_micro_batch_size_per_gpu")
    if raw.get("forward_max_token_len_per_gpu") is None and raw.get("ppo_max_token_len_per_gpu") is not None:
        raw["forward_max_token_len_per_gpu"] = raw["ppo_max_token_len_per_gpu"]

    with warnings.catch_warnings():
        # verl's own YAML still uses `critic.model`, which CriticConfig warns is deprecated (for model_config).
        warnings.filterwarnings("ignore", message="using model in Critic Config is deprecated")
        config = omega_conf_to_dataclass(OmegaConf.create(raw))
    if not isinstance(config, FSDPCriticConfig):
        raise TypeError(f"critic config builds {type(config).__name__}, expected FSDPCriticConfig (check _target_)")
    return config


def _load_value_model(model_path: Path, seed: int, attn_implementation: str) -> nn.Module:
    """The policy folder as a token classifier with one output, as verl's fsdp_workers build the critic."""

    hf_config = AutoConfig.from_pretrained(model_path, attn_implementation=attn_implementation)
    hf_config.num_labels = 1
    # verl's three names for dropout across architectures: a value regression wants none of them.
    hf_config.classifier_dropout = 0.0
    hf_config.hidden_dropout = "0"
    hf_config.summary_dropout_prob = 0.0
    # fork_rng: the head's initialisation is seeded here without moving the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForTokenClassification.from_pretrained(
                model_path, config=hf_config, dtype=torch.float32, attn_implementation=attn_implementation
            )
        except ValueError as exc:  # transformers' "Unrecognized configuration class ... for this kind of AutoModel"
            raise ValueError(
                f"{model_path}: {hf_config.model_type} has no token-classification model in transformers, which "
                "the critic needs (verl's trl value-head fallback is not supported here)"
            ) from exc
    return model


def _disable_autocast_in_forward(model: nn.Module, device_type: str) -> None:
    """Run `model`'s forward with autocast off for `device_type` (see the module docstring: CPU stays fp32).

    verl's `_forward_micro_batch` enters `torch.autocast(bfloat16)` around the model call; these hooks switch it
    off inside the call and back after. Hooks, not a wrapper module, so verl still sees the model itself.
    """
    saved: list[bool] = []

    def pre_hook(module: nn.Module, args: Any) -> None:
        saved.append(torch.is_autocast_enabled(device_type))
        torch.set_autocast_enabled(device_type, False)

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        # After an exception the post hook does not run; verl's autocast exit then restores the state itself.
        torch.set_autocast_enabled(device_type, saved.pop())

    model.register_forward_pre_hook(pre_hook)
    model.register_forward_hook(post_hook)


def _require_keys(data: DataProto, keys: tuple[str, ...], caller: str) -> None:
    present = set(data.batch.keys())
    missing = [k for k in keys if k not in present]
    if missing:
        raise KeyError(f"{caller} needs batch keys {missing} (has {sorted(present)})")


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0)


class FSDPCriticBackend:
    """The value model, its optimizer and LR schedule, and verl's DataParallelPPOCritic around them."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        critic_cfg: Mapping[str, Any],
        *,
        seed: int = 0,
        attn_implementation: str = "sdpa",
    ) -> None:
        validate_critic_section(critic_cfg)
        self.model_path = Path(model_path)
        self.config = build_critic_config(critic_cfg, self.model_path)
        # The configured micro-batch rows; update_critic writes a per-batch divisor of the row count into the config.
        self.micro_batch_size = self.config.ppo_micro_batch_size_per_gpu
        self.device = torch.device(get_device_name())
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        ensure_process_group(self.device.type)
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"the critic runs at world size 1, this process group has {dist.get_world_size()} ranks "
                "(see backends/critic.py: verl's unpatched critic loss is not proven for sharded batches)"
            )

        model = _load_value_model(self.model_path, seed, attn_implementation)
        if self.config.model.get("enable_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)
        if self.device.type == "cpu":
            _disable_autocast_in_forward(model, self.device.type)
        self.model = model

        self.optimizer = build_optimizer(self.model.parameters(), self.config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config.optim, "critic.optim")
        self.critic = DataParallelPPOCritic(self.config, self.model, self.optimizer)
        self.optimizer_steps = 0  # steps actually taken; a batch without response tokens takes none
        logger.info(
            "critic backend: %s on %s, %d parameters",
            self.model_path,
            self.device,
            sum(p.numel() for p in self.model.parameters()),
        )

    # ------------------------------------------------------------------------------------------------------------

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """V(s_t) for every response token, float32 [B, R] on CPU, without gradients; 0 where response_mask is 0.

        Needs batch keys input_ids, attention_mask, position_ids ([B, P+R]; prompts left-padded, responses
        right-padded) and responses ([B, R]); response_mask [B, R] when present masks the output. Micro-batches
        of `forward_micro_batch_size_per_gpu` rows (or a token budget with use_dynamic_bsz).
        """
        _require_keys(data, VALUE_KEYS, "compute_values")
        cfg = self.config
        keys = [*VALUE_KEYS, *(["response_mask"] if "response_mask" in data.batch else [])]
        meta = {
            "micro_batch_size": cfg.forward_micro_batch_size_per_gpu or cfg.ppo_micro_batch_size_per_gpu or len(data),
            "use_dynamic_bsz": cfg.use_dynamic_bsz,
            "max_token_len": cfg.forward_max_token_len_per_gpu,
        }
        view = DataProto(batch=data.batch.select(*keys), meta_info=meta)
        values = self.critic.compute_values(view)
        return values.float().cpu()

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """One optimizer step of the clipped value loss on the whole batch (none without response tokens).

        Needs batch keys input_ids, attention_mask, position_ids [B, P+R], responses, response_mask, values
        (the critic's predictions before this step) and returns [B, R]. Metrics (floats): verl's
        `critic/vf_loss` (the batch loss before the step), `critic/vf_clipfrac`, `critic/vpred_mean`,
        `critic/grad_norm`, plus `critic/vf_explained_var` (1 - Var(R - V_old) / Var(R) over response tokens),
        `critic/lr` (the rate this step used) and `critic/optimizer_step` (1.0 if a step was taken). The LR
        schedule advances only when a step was taken.
        """
        _require_keys(data, UPDATE_KEYS, "update_critic")
        response_mask = data.batch["response_mask"]
        lr = float(self.lr_scheduler.get_last_lr()[0])
        metrics = {
            "critic/vf_explained_var": _explained_variance(data.batch["values"], data.batch["returns"], response_mask)
        }
        if not bool(response_mask.bool().any()):
            return {**metrics, "critic/lr": lr, "critic/optimizer_step": 0.0}

        rows = len(data)
        # One mini-batch of all rows, once (see the module docstring); both fields are mutable in verl's config.
        self.config.ppo_mini_batch_size = rows
        if not self.config.use_dynamic_bsz:
            self.config.ppo_micro_batch_size_per_gpu = _largest_divisor_at_most(rows, int(self.micro_batch_size))
        view = DataProto(batch=data.batch.select(*UPDATE_KEYS), meta_info=dict(data.meta_info))
        raw = self.critic.update_critic(view)
        metrics.update({key: float(value) for key, value in reduce_metrics(raw).items()})
        # verl's _optimizer_step skips the step (zeroing gradients) when the gradient norm is not finite.
        stepped = math.isfinite(metrics["critic/grad_norm"])
        if stepped:
            self.lr_scheduler.step()
            self.optimizer_steps += 1
        metrics["critic/lr"] = lr
        metrics["critic/optimizer_step"] = float(stepped)
        return metrics

    # ------------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and LR-schedule state for a checkpoint (tensors on CPU, copies)."""
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(to_cpu(self.optimizer.state_dict())),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned, into a backend built from the same model folder and config."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens (verl's `critic/vf_explained_var`); 0 with < 2 tokens."""
    keep = mask.bool()
    if int(keep.sum()) < 2:
        return 0.0
    v, r = values[keep].double(), returns[keep].double()
    var_r = torch.var(r)
    if var_r <= 0:
        return 0.0
    return float(1.0 - torch.var(r - v) / var_r)
