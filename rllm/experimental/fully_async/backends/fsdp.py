"""FSDPPolicyBackend: the trainer's policy, optimizer and PPO step, through verl's patched DataParallelPPOActor.

The trainer (a Ray actor; world size 1 by default) calls four things: `compute_log_prob` for old or proximal
log-probs, `update_policy` for exactly one optimizer step on one batch, `save_hf` to hand weights to ParamSync's
disk transport, and `save_checkpoint`/`load_checkpoint` for the run's checkpoints: one shard per rank through
torch.distributed.checkpoint, nothing gathered, resumable at another world size (runtime/checkpoints/trainer_state.py).
`state_dict`/`load_state_dict` (full, unsharded state) remain for tests and for reading this round's first
checkpoint format. With several ranks,
runtime/trainer/ranks.py runs one backend per rank behind the same interface. The backend knows nothing of Ray,
queues or policy versions.

The PPO math is verl's: `DataParallelPPOActor.update_policy` with the actor config's `fully_async` flag on
(`FULLY_ASYNC_FLAG`; added by patches/verl_dp_actor.patch, see patches/README.md). Under that flag one call is one
mini-batch and one optimizer step, `old_log_probs` always come from the batch, "token-mean" is the whole-batch
token mean however the batch is split into micro-batches, and a batch without response tokens makes no step.

Layout: world size 1 runs the HF model as a plain `nn.Module` (CPU or one GPU). With a process group of world size
N > 1 (e.g. started by torchrun) the model is sharded with FSDP2 `fully_shard` on a 1-D mesh of all ranks, each rank
passing its own shard of the batch; FSDP2 averages gradients and the patch's `world_size` factor undoes that, so
the step equals the one on the whole batch.

Precision: the parameters are loaded in `fsdp_config.model_dtype` (verl's default fp32). On CPU the forward runs in
that dtype: verl's `fsdp_config.dtype` admits only bf16/fp16 (GPU autocast dtypes); bf16 matmuls on CPU are slow,
and their rounding would show up as trainer-vs-engine log-prob gaps (settings/verl_keys.py refuses the key there).
On GPU the actor autocasts to `fsdp_config.dtype`, as verl does.

Memory (CUDA only; refused on CPU, where everything is in CPU memory already), as verl's FSDP workers do it:
`fsdp_config.param_offload` keeps the parameters on the CPU between calls and `optimizer_offload` the optimizer
state between steps (verl's offload/load helpers around each call); `offload_policy` shards with FSDP2 and its
`CPUOffloadPolicy` (also at world size 1), so parameters, gradients and the optimizer step live on the CPU.
`model.enable_gradient_checkpointing` is applied to the module at every world size.

Previous weights (`keep_previous_weights`, for the correction's prox_log_probs=previous and its synchronous control;
`previous_weights.py`): at every weight sync (`weights_synced`, called by the trainer when its weights become a new
version) the backend copies each rank's own parameters to the CPU; the copy of the sync before is the previous
version's, and `compute_log_prob(data, weights="previous")` runs with it in place. Checkpoints hold it
(`previous_model` beside `model`, and `published_model` when steps were taken since the last sync), so a resumed
run's next step uses the same proximal policy as the run that was not stopped.

LoRA (`lora`: peft's LoraConfig arguments, from actor_rollout_ref.model.lora_*, run_spec.TrainerLoRASpec): the HF
model is wrapped with peft's `get_peft_model(LoraConfig(task_type=CAUSAL_LM, ...))` before FSDP2, after
`enable_input_require_grads`, as verl 0.7.1's FSDP workers do (`target_modules: all-linear` is peft's own
spelling). Only the adapter's parameters require gradients, and the optimizer is built over those alone: base
weights never move, and AdamW's state is the adapter's. `save_adapter` writes what peft's `save_pretrained` writes
(adapter_model.safetensors with peft's names, adapter_config.json), the folder the engines' `/load_lora_adapter`
reads; checkpoints (DCP) hold the whole module, adapter included, and the adapter's optimizer state.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from peft.utils.save_and_load import get_peft_model_state_dict
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from transformers import AutoModelForCausalLM
from verl import DataProto
from verl.utils.device import get_device_id, get_device_name
from verl.utils.fsdp_utils import (
    apply_fsdp2,
    load_fsdp_model_to_gpu,
    load_fsdp_optimizer,
    offload_fsdp_model_to_cpu,
    offload_fsdp_optimizer,
)
from verl.utils.metric import reduce_metrics
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.config import FSDPActorConfig
from verl.workers.config.optimizer import build_optimizer

from rllm.experimental.fully_async.backends import (
    FULLY_ASYNC_FLAG,
    build_lr_scheduler,
    build_verl_actor_config,
    copy_model_folder_files,
    require_batch_keys,
    to_cpu,
)
from rllm.experimental.fully_async.backends.previous_weights import PreviousWeights, local_tensor
from rllm.experimental.fully_async.backends.verl_patch import require_patched_verl

logger = logging.getLogger(__name__)

__all__ = ["FULLY_ASYNC_FLAG", "FSDPPolicyBackend", "build_actor_config", "model_dtype"]

# Batch keys update_policy needs ([B, P+R] for the first three, [B, R] for the rest); the optional ones are used
# when present: rollout_is_weights multiplies the per-token loss, rollout_log_probs only feeds metrics.
LOG_PROB_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = (*LOG_PROB_KEYS, "response_mask", "old_log_probs", "advantages")
OPTIONAL_UPDATE_KEYS = ("rollout_log_probs", "rollout_is_weights")

# `_target_` for the sections verl turns into dataclasses; filled in when the caller's config leaves them out
# (verl's generated YAML has them; a hand-written dict usually does not, and build_optimizer needs the dataclass).
_SECTION_TARGETS = {
    "optim": "verl.workers.config.FSDPOptimizerConfig",
    "fsdp_config": "verl.workers.config.FSDPEngineConfig",
    "policy_loss": "verl.workers.config.PolicyLossConfig",
}

# Written next to torch.distributed.checkpoint's shards: what is not a tensor (LR schedule, steps taken).
CHECKPOINT_EXTRA = "extra.pt"

# fsdp_config keys that move tensors to the CPU: CUDA only (settings/verl_keys.py refuses them elsewhere).
OFFLOAD_KEYS = ("param_offload", "optimizer_offload", "offload_policy")

_CPU_AUTOCAST_WARNING = "In CPU autocast, but the target dtype is not supported"


def build_actor_config(actor_cfg: Mapping[str, Any]) -> FSDPActorConfig:
    """verl's FSDPActorConfig from an `actor_rollout_ref.actor` section (DictConfig or dict), `fully_async` on.

    The section is shaped like verl/trainer/config/_generated_ppo_trainer.yaml's; missing `_target_`s default to
    verl's FSDP dataclasses (see `build_verl_actor_config`).
    """
    config = build_verl_actor_config(actor_cfg, "verl.workers.config.FSDPActorConfig", _SECTION_TARGETS)
    if not isinstance(config, FSDPActorConfig):
        raise TypeError(f"actor config builds {type(config).__name__}, expected FSDPActorConfig (check its _target_)")
    return config


def ensure_process_group(device_type: str) -> None:
    """torch.distributed must be up before verl's actor is built; start a private world of one if nobody has.

    A world of one uses an in-process HashStore: no port, no network. Larger worlds are started by the launcher
    (torchrun's env:// variables) before the backend is built.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def gradient_checkpointing_on(model: nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on for `model` (its 5.x name first, then 4.x's)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def model_dtype(config: FSDPActorConfig) -> torch.dtype:
    """The dtype the policy's parameters are loaded in: `fsdp_config.model_dtype` (verl's default fp32)."""

    return PrecisionType.to_dtype(config.fsdp_config.get("model_dtype") or "fp32")


def _shard_fsdp2(model: nn.Module, config: FSDPActorConfig, device_type: str) -> nn.Module:
    """FSDP2 over every rank: decoder layers and the root are `fully_shard`-ed by verl's apply_fsdp2, with
    `fsdp_config.reshard_after_forward` and, with `fsdp_config.offload_policy`, FSDP2's CPUOffloadPolicy."""

    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    # Gradients are reduced in fp32 so the data-parallel average is exact; parameters compute in the dtype they are
    # stored in (verl's actor autocasts on GPU, and CPU runs in fp32).
    mp_policy = MixedPrecisionPolicy(param_dtype=model_dtype(config), reduce_dtype=torch.float32)
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "reshard_after_forward": bool(config.fsdp_config.get("reshard_after_forward", True)),
    }
    if config.fsdp_config.get("offload_policy", False):
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)  # as verl's FSDP workers
    # transformers 5 keeps _no_split_modules as a set, which verl's default lookup cannot index: name the layer
    # classes here unless the config does.
    wrap_policy = dict(config.fsdp_config.get("wrap_policy") or {})
    if not wrap_policy.get("transformer_layer_cls_to_wrap"):
        wrap_policy["transformer_layer_cls_to_wrap"] = sorted(getattr(model, "_no_split_modules", None) or [])
    apply_fsdp2(model, fsdp_kwargs, {"wrap_policy": wrap_policy})
    return model


def _with_lora(model: nn.Module, lora: Mapping[str, Any]) -> nn.Module:
    """The HF model wrapped with peft's LoRA adapter, as verl 0.7.1's FSDP workers wrap it (fsdp_workers.py,
    `_build_model_optimizer`): input embeddings' outputs require grad (so gradient checkpointing reaches the
    adapter through a frozen embedding), then get_peft_model with task CAUSAL_LM and no bias; or, with
    `adapter_path` (actor_rollout_ref.model.lora_adapter_path), the saved adapter loaded trainable with
    `PeftModel.from_pretrained(..., is_trainable=True)`, its own adapter_config.json deciding rank, alpha and
    modules (settings/model_source.py has checked them against the lora_* keys), its task type made the enum."""

    model.enable_input_require_grads()
    options = dict(lora)
    adapter_path = options.pop("adapter_path", None)
    if adapter_path is None:
        return get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, **options))
    model = PeftModel.from_pretrained(model, str(adapter_path), is_trainable=True)
    config = model.peft_config["default"]
    if isinstance(config.task_type, str):
        config.task_type = TaskType.CAUSAL_LM
    return model


def _on_every_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank of the process group (an all-reduce; collective above world size 1)."""
    if dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _with_resident(optimizer: bool) -> Any:
    """Decorate a backend method to run with its tensors on the device (`FSDPPolicyBackend._resident`)."""

    def decorate(method: Any) -> Any:
        @functools.wraps(method)
        def wrapped(self: FSDPPolicyBackend, *args: Any, **kwargs: Any) -> Any:
            with self._resident(optimizer=optimizer):
                return method(self, *args, **kwargs)

        return wrapped

    return decorate


def cast_floating(state: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """`state` with its floating-point tensors cast to `dtype` (a torch dtype's name, e.g. param_sync.dtype
    "bfloat16"); integer tensors and `dtype=None` leave it as it is."""
    if dtype is None:
        return state
    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}


class FSDPPolicyBackend:
    """The policy model, its AdamW optimizer and LR schedule, and verl's patched PPO actor around them."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        actor_cfg: Mapping[str, Any],
        *,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        enable_gradient_checkpointing: bool = False,
        keep_previous_weights: bool = False,
        lora: Mapping[str, Any] | None = None,
    ) -> None:

        require_patched_verl()  # unpatched verl would train, silently, on the wrong numbers
        self.model_path = Path(model_path)
        self.config = build_actor_config(actor_cfg)
        self.device = torch.device(get_device_name())
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        ensure_process_group(self.device.type)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()

        fsdp = self.config.fsdp_config
        offload = [key for key in OFFLOAD_KEYS if fsdp.get(key, False)]
        if offload and self.device.type != "cuda":
            raise ValueError(
                f"actor_rollout_ref.actor.fsdp_config.{offload[0]} moves tensors off the GPU, and this trainer runs "
                f"on {self.device.type}: remove it"
            )
        offload_policy = bool(fsdp.get("offload_policy", False))
        # With CPUOffloadPolicy FSDP2 owns where the tensors are; verl's workers then switch the other two off.
        self.offload_params = bool(fsdp.get("param_offload", False)) and not offload_policy
        self.offload_optimizer = bool(fsdp.get("optimizer_offload", False)) and not offload_policy

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=model_dtype(self.config), attn_implementation=attn_implementation
        )
        if enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = dict(lora) if lora is not None else None
        if self.lora is not None:
            model = _with_lora(model, self.lora)
        model.to(self.device)
        if self.world_size > 1 or offload_policy:
            model = _shard_fsdp2(model, self.config, self.device.type)
        self.model = model

        # all parameters train, or with LoRA only the adapter's (the frozen base has no gradient and no state)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(trained, self.config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config.optim, "actor_rollout_ref.actor.optim")
        # verl's actor prints its settings ("Actor use_remove_padding=False", ...) on construction; a Ray actor would
        # forward them between the progress lines. They go to the debug log instead.
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            self.actor = DataParallelPPOActor(self.config, self.model, self.optimizer)
        if printed.getvalue().strip():
            logger.debug("verl actor: %s", " ".join(printed.getvalue().split()))
        if self.device.type == "cpu":
            # see the module docstring: CPU computes in the parameters' own dtype (autocast to fp32 is a no-op)
            self.actor.param_dtype = torch.float32
        self.optimizer_steps = 0  # steps actually taken; an all-masked batch takes none
        self.keep_previous_weights = keep_previous_weights
        # the weights of the last two versions, on the CPU (the initial ones are version 0's)
        self.previous_weights = PreviousWeights(self.model) if keep_previous_weights else None
        if self.offload_params:
            offload_fsdp_model_to_cpu(self.model)  # loaded back for each call (`_resident`)
        logger.info(
            "policy backend: %s on %s, world size %d, %d parameters",
            self.model_path,
            self.device,
            self.world_size,
            sum(p.numel() for p in self.model.parameters()),
        )

    def describe(self) -> dict[str, Any]:
        """What was built, read off the objects themselves (for the log line and for tests that check a key's
        effect): parameter dtype and device, gradient checkpointing, FSDP2 sharding and its options, the optimizer,
        verl's autocast dtype and entropy function."""

        param = next(self.model.parameters())
        local = local_tensor(param)
        facts: dict[str, Any] = {
            "param_dtype": str(param.dtype).removeprefix("torch."),
            "param_device": local.device.type,
            "gradient_checkpointing": gradient_checkpointing_on(self.model),
            "fsdp2": isinstance(self.model, FSDPModule),
            "optimizer": f"{type(self.optimizer).__module__}.{type(self.optimizer).__name__}",
            "autocast_dtype": str(self.actor.param_dtype).removeprefix("torch."),
            "entropy_fn": getattr(self.actor.compute_entropy_from_logits, "__name__", "?"),
            "entropy_compiled": hasattr(self.actor.compute_entropy_from_logits, "_torchdynamo_orig_callable"),
            "lora": self._lora_facts(),
        }
        layers = [m for m in self.model.modules() if isinstance(m, FSDPModule) and m is not self.model]
        if layers:  # FSDP2's per-module state: private in torch, read here only to report what was applied
            group = layers[0]._get_fsdp_state()._fsdp_param_group
            facts["reshard_after_forward"] = group.post_forward_mesh_info is not None
            facts["offload_policy"] = isinstance(group.offload_policy, CPUOffloadPolicy)
        return facts

    def _lora_facts(self) -> dict[str, Any] | None:
        """The adapter peft built (None without LoRA): rank, alpha, the modules it wraps, trained parameter count."""
        if self.lora is None:
            return None
        config = self.model.peft_config["default"]
        return {
            "r": int(config.r),
            "lora_alpha": float(config.lora_alpha),
            "wrapped": sorted({n.rsplit(".", 1)[-1] for n, m in self.model.named_modules() if hasattr(m, "lora_A")}),
            "trained_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
        }

    # ------------------------------------------------------------------------------------------------------------
    # PPO
    # ------------------------------------------------------------------------------------------------------------

    def compute_log_prob(self, data: DataProto, weights: str = "current") -> torch.Tensor:
        """log pi(response token | prefix) at meta_info['temperature'], float32 [B, R] on CPU, without gradients.

        Needs batch keys input_ids, attention_mask, position_ids ([B, P+R]; prompts left-padded, responses
        right-padded) and responses ([B, R]). Micro-batching follows the actor config (ppo_infer_* keys, falling
        back to the training ones). `weights`: "current", or "previous" (the weights of the previous version, before
        the last `weights_synced`; the current ones before the first; needs `keep_previous_weights`).
        """
        if weights not in ("current", "previous"):
            raise ValueError(f"weights must be 'current' or 'previous', got {weights!r}")
        if weights == "previous" and self.previous_weights is None:
            raise ValueError("log-probs under the previous weights need a backend built with keep_previous_weights")
        require_batch_keys(data, LOG_PROB_KEYS, "compute_log_prob")
        cfg = self.config
        micro = cfg.ppo_infer_micro_batch_size_per_gpu or cfg.ppo_micro_batch_size_per_gpu or len(data)
        meta = {
            "micro_batch_size": micro,
            "use_dynamic_bsz": cfg.use_dynamic_bsz,
            "max_token_len": cfg.ppo_infer_max_token_len_per_gpu,
            **data.meta_info,
        }
        view = DataProto(batch=data.batch.select(*LOG_PROB_KEYS), meta_info=meta)
        swapped = (
            self.previous_weights.in_place()
            if weights == "previous" and self.previous_weights is not None
            else contextlib.nullcontext()
        )
        with self._resident(optimizer=False), self._quiet_cpu_autocast(), swapped:
            out = self.actor.compute_log_prob(view, calculate_entropy=False)
        return out["log_probs"].float().cpu()

    def update_policy(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on the whole batch (none if it has no response token). Returns float metrics.

        Needs batch keys input_ids, attention_mask, position_ids [B, P+R], responses, response_mask,
        old_log_probs, advantages [B, R] (rollout_log_probs and rollout_is_weights [B, R] when present) and
        meta_info['temperature']. Metrics are verl's (`actor/pg_loss`, `actor/ppo_kl`, `actor/pg_clipfrac`,
        `actor/grad_norm`, ...; per-micro-batch values averaged) plus `actor/lr` (the rate this step used) and
        `actor/optimizer_step` (1.0 if a step was taken). The LR schedule advances only when a step was taken.
        """
        require_batch_keys(data, UPDATE_KEYS, "update_policy")
        present = set(data.batch.keys())
        keys = [*UPDATE_KEYS, *(k for k in OPTIONAL_UPDATE_KEYS if k in present)]
        view = DataProto(batch=data.batch.select(*keys), meta_info=dict(data.meta_info))
        lr = float(self.lr_scheduler.get_last_lr()[0])
        with self._resident(optimizer=True), self._quiet_cpu_autocast():
            raw = self.actor.update_policy(view)
        metrics = {key: float(value) for key, value in reduce_metrics(raw).items()}
        # The patched actor leaves out grad_norm when it took no step; verl's _optimizer_step also skips the step
        # (zeroing gradients) when the norm is not finite.
        stepped = math.isfinite(metrics.get("actor/grad_norm", math.nan))
        if stepped:
            self.lr_scheduler.step()
            self.optimizer_steps += 1
        metrics["actor/lr"] = lr
        metrics["actor/optimizer_step"] = float(stepped)
        return metrics

    @_with_resident(optimizer=False)
    def weights_synced(self) -> None:
        """The current weights became the engines' new version: with `keep_previous_weights` they are copied to the
        CPU, and the copy made at the sync before becomes the previous version's (`compute_log_prob(weights=
        "previous")`). Nothing otherwise."""
        if self.previous_weights is not None:
            self.previous_weights.publish()

    # ------------------------------------------------------------------------------------------------------------
    # Weights out: HF folder for the engines, state dicts for checkpoints
    # ------------------------------------------------------------------------------------------------------------

    @_with_resident(optimizer=False)
    def save_hf(self, path: str | os.PathLike[str], dtype: str | None = None) -> None:
        """Write the current weights as an HF safetensors folder (config, weights, tokenizer files if any), with
        floating-point tensors cast to `dtype` (e.g. "bfloat16", param_sync.dtype) when given.

        Collective at world size > 1 (every rank must call it); rank 0 writes.
        """

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if self.rank == 0:
            state = cast_floating(state, dtype)
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out, state_dict=state, safe_serialization=True)
            copy_model_folder_files(self.model_path, out)
        if self.world_size > 1:
            dist.barrier()

    @_with_resident(optimizer=False)
    def save_adapter(self, path: str | os.PathLike[str], dtype: str | None = None) -> None:
        """Write the LoRA adapter alone as peft's `save_pretrained` does (adapter_model.safetensors with peft's
        tensor names `base_model.model.<module>.lora_A.weight`, and adapter_config.json), floating-point tensors cast
        to `dtype` when given: the folder SGLang's and the embedded engine's /load_lora_adapter read.

        Collective at world size > 1 (the adapter's shards are gathered); rank 0 writes.
        """

        if self.lora is None:
            raise ValueError("save_adapter needs a LoRA policy (actor_rollout_ref.model.lora_rank > 0)")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if self.rank == 0:
            adapter = get_peft_model_state_dict(self.model, state_dict=state)
            adapter = cast_floating(adapter, dtype)
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            # peft filters `state_dict` to the adapter again (idempotent) and writes its config beside it
            self.model.save_pretrained(out, state_dict=adapter, safe_serialization=True)
        if self.world_size > 1:
            dist.barrier()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors under peft's names, full and on the CPU (world size 1; for tests and bytes)."""

        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    @_with_resident(optimizer=True)
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and LR-schedule state for a checkpoint (tensors on CPU).

        World size 1: plain torch state dicts, loadable into a backend built from the same model and config, and the
        previous weights (a list in `parameters()` order, or None). World size > 1: full (unsharded) state dicts on
        rank 0, empty elsewhere, without the previous weights (the run's checkpoints, `save_checkpoint`, hold them);
        collective.
        """

        if self.world_size == 1:
            model_state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            optim_state = copy.deepcopy(to_cpu(self.optimizer.state_dict()))
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        kept = self.previous_weights if self.world_size == 1 else None
        previous = kept.tensors if kept is not None else None
        return {
            "model": model_state,
            "optimizer": optim_state,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "previous_weights": None if previous is None else [t.clone() for t in previous],
            "published_weights": None if kept is None else [t.clone() for t in kept.published],
        }

    @_with_resident(optimizer=True)
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (at world size > 1, rank 0's copy is broadcast; collective)."""

        if self.world_size == 1:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
        if self.previous_weights is not None:
            previous, published = state.get("previous_weights"), state.get("published_weights")
            self.previous_weights.tensors = None if previous is None else [t.clone() for t in previous]
            # a state dict from before K > 1 was supported holds none: it was taken right after a sync (K = 1)
            kept = self.previous_weights
            kept.published = kept.snapshot() if published is None else [t.clone() for t in published]

    @_with_resident(optimizer=True)
    def save_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Write model and optimizer with torch.distributed.checkpoint, each rank its own shard; collective.

        Nothing is gathered: each rank writes the parameters and Adam moments it holds (`__<rank>_0.distcp`), rank
        0 adds DCP's `.metadata` and `extra.pt` (the LR schedule and step count, the same on every rank). Resumable
        at any world size (DCP reshards on load). When it returns, on any rank, every rank's files are on disk: the
        checkpoint's manifest (runtime/checkpoints/) hashes them then, each rank its share with several ranks.
        """

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        kept = self.previous_weights
        has_previous = kept is not None and kept.tensors is not None
        # the published version differs from the current weights only between syncs (K > 1); every rank agrees
        has_published = kept is not None and not _on_every_rank(kept.published_is_current(), self.device)
        if has_previous:
            state["previous_model"] = kept.model_state("previous")
        if has_published:
            state["published_model"] = kept.model_state("published")
        dcp.save(state, checkpoint_id=str(directory))
        if self.rank == 0:
            extra = {
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps,
                "previous_weights": has_previous,
                "published_weights": has_published,
            }
            with open(Path(directory) / CHECKPOINT_EXTRA, "wb") as file:
                torch.save(extra, file)
                file.flush()
                os.fsync(file.fileno())  # DCP fsyncs its own files; the commit's rename must not overtake this one
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)  # the folder's names are on disk before the checkpoint that holds it is renamed in
            finally:
                os.close(fd)
        if self.world_size > 1:
            dist.barrier()  # every file is on disk before any rank returns (and hashes its share of them)

    @_with_resident(optimizer=True)
    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Restore what `save_checkpoint` wrote (possibly by another world size); collective."""

        # get_state_dict initialises AdamW's lazy state (a zero-lr step), so the moments have tensors to load into
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        # weights_only: the schedule's state is plain numbers and lists, and loading it must not run code
        extra = torch.load(Path(directory) / CHECKPOINT_EXTRA, map_location="cpu", weights_only=True)
        kept = self.previous_weights
        for which in ("previous", "published"):
            if extra.get(f"{which}_weights", False) and kept is not None:
                state[f"{which}_model"] = kept.model_state(which)  # a template of the shards to load into
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if kept is not None:
            kept.tensors = None
            if "previous_model" in state:
                kept.keep_model_state(state["previous_model"], "previous")
            # without `published_model` the checkpoint was taken right after a sync: the weights are the published
            kept.published = kept.snapshot()
            if "published_model" in state:
                kept.keep_model_state(state["published_model"], "published")
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.optimizer_steps = int(extra["optimizer_steps"])

    # ------------------------------------------------------------------------------------------------------------

    def resident(self) -> contextlib.AbstractContextManager[None]:
        """The parameters on the device for the block (with param_offload they live on the CPU between calls): for
        code that reads `self.model` itself, e.g. the distributed weight transport gathering full tensors."""
        return self._resident(optimizer=False)

    @contextlib.contextmanager
    def _resident(self, optimizer: bool) -> Iterator[None]:
        """With param_offload (optimizer_offload), the parameters (optimizer state) on the GPU for the block and back
        on the CPU after, as verl's FSDP workers do around each call."""

        if self.offload_params:
            load_fsdp_model_to_gpu(self.model)
        if optimizer and self.offload_optimizer:
            load_fsdp_optimizer(self.optimizer, get_device_id())
        try:
            yield
        finally:
            if self.offload_params:
                offload_fsdp_model_to_cpu(self.model)
            if optimizer and self.offload_optimizer:
                offload_fsdp_optimizer(self.optimizer)

    @contextlib.contextmanager
    def _quiet_cpu_autocast(self) -> Iterator[None]:
        # verl's actor always enters torch.autocast(param_dtype); fp32 on CPU disables it with a UserWarning.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_CPU_AUTOCAST_WARNING)
            yield
