"""What a run directory already holds decides how a run starts: continue it, refuse, say it is done, or start over.

`settle_run_dir(cfg)` runs once the config is final (task prepared, data checked) and before any process starts:

- **Finished.** With trainer.resume_mode=auto, a run dir whose newest checkpoint is at (or past)
  trainer.total_training_steps, or whose run ended with its data exhausted (`finished.json`, written by
  `mark_finished`, at that checkpoint's step and with no more trainer.total_epochs now) raises `RunFinished`: one
  line naming the run dir and how to start fresh; the CLI prints it and exits 0. Raising total_training_steps
  (or total_epochs after the data ran out) continues the run instead.
- **Start fresh.** trainer.resume_mode=disable, or auto with no checkpoint yet, in a run dir that holds an
  earlier run's outputs (RUN_OUTPUTS) moves them into `RUN_DIR/previous-<UTC time>/` and says so in one line:
  nothing of the old run mixes with the new one (metrics.jsonl is appended to, the ledger journal is replayed),
  and nothing is deleted. Only those names move, so a run.dir that holds other files keeps them.
- **Resume.** The saved `config.yaml` (the resumed run dir's, or the one beside trainer.resume_from_path's run)
  is compared leaf by leaf (as written, interpolations unresolved) with the new config. Any difference outside
  the safe list below raises `ResumeConfigError`, naming every such key with its old and new value in one line.

Safe to change on resume (they decide how long, how often, how loudly, or how rollouts are served, never what a
trained step or a queued sample means):

- trainer: total_training_steps, total_epochs, test_freq, save_freq, val_before_train, logger, project_name,
  experiment_name, resume_mode, resume_from_path, log_val_generations, rollout_data_dir, validation_data_dir,
  default_local_dir; the optimizers' total_training_steps (the LR horizon follows total_training_steps);
- trainer.n_gpus_per_node and trainer.nnodes (the trainer's world size): the policy's torch.distributed.checkpoint
  shards reshard onto the new ranks, and a step does not depend on how many ranks share it
  (runtime/checkpoints/trainer_state.py; a checkpoint of the first format that cannot reshard is refused there);
- run.log_level, run.dir; param_sync.weights_dir (a scratch folder); run.record_batches (the record then starts or
  stops at the resume: a replay needs the checkpoint a record starts from);
- engines.* (backend, count, threads, restarts: the weights and their version come from the checkpoint);
- data.val_files and task.val_size (what validation measures, not what trains);
- every timeout: a key whose last part ends in `timeout_s` or `_timeout`.

Everything else is refused: the model and tokenizer, the data and its order (data.*, task.* other than
val_size), samples per prompt (rollout.n), batch and staleness settings (async_training.*), the algorithm,
the optimizer, the loss and the seeds. Refusing by default errs on the safe side: a key found safe later is one
line added here.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from rllm.experimental.fully_async.core.elastic import EVENTS_FILE
from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointManager
from rllm.experimental.fully_async.settings.loader import ConfigError, base_config
from rllm.experimental.fully_async.settings.paths import home_expanded

if TYPE_CHECKING:
    from rllm.experimental.fully_async.run_spec import RunSpec

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
FINISHED_FILE = "finished.json"
# What a run writes into its run dir; `previous-*` folders and anything else stay where they are.
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "ledger.jsonl",
    CONFIG_FILE,
    FINISHED_FILE,
    "engines",
    "weights",
    "record",  # run.record_batches (runtime/trainer/record.py)
    EVENTS_FILE,  # engines joining and leaving (runtime/run/elastic.py); appended to on a resume
)

SAFE_KEYS = frozenset(
    {
        "trainer.total_training_steps",
        "trainer.total_epochs",
        "trainer.test_freq",
        "trainer.save_freq",
        "trainer.val_before_train",
        "trainer.logger",
        "trainer.project_name",
        "trainer.experiment_name",
        "trainer.resume_mode",
        "trainer.resume_from_path",
        "trainer.log_val_generations",
        "trainer.rollout_data_dir",
        "trainer.validation_data_dir",
        "trainer.default_local_dir",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "actor_rollout_ref.actor.optim.total_training_steps",
        "critic.optim.total_training_steps",
        "run.log_level",
        "run.dir",
        "run.record_batches",
        "param_sync.weights_dir",
        "data.val_files",
        "task.val_size",
    }
)
SAFE_PREFIXES = ("engines.",)
SAFE_SUFFIXES = ("timeout_s", "_timeout")


class RunFinished(Exception):  # an outcome, not an error: the CLI exits 0
    """The run dir holds a finished run and nothing was started; the message is the one line to print."""


class ResumeConfigError(ConfigError):
    """Resuming would change keys that corrupt the run; the message names them (exit 2)."""


def settle_run_dir(cfg: DictConfig) -> None:
    """Decide, before anything starts, whether the run continues, is done, or starts over; then save config.yaml."""

    run_dir = Path(cfg.run.dir)
    mode = str(cfg.trainer.resume_mode)
    latest = CheckpointManager(run_dir / "checkpoints").latest() if mode == "auto" else None
    if mode == "auto" and latest is not None:
        check_not_finished(cfg, run_dir, latest)
        check_resume_config(_load_saved(run_dir / CONFIG_FILE), cfg, run_dir)
    elif mode == "resume_path" and cfg.trainer.resume_from_path:
        source = Path(str(cfg.trainer.resume_from_path)).absolute().parent.parent  # RUN/checkpoints/step_N
        saved = source / CONFIG_FILE if (source / CONFIG_FILE).is_file() else run_dir / CONFIG_FILE
        check_resume_config(_load_saved(saved), cfg, source)
    else:  # a fresh start: resume_mode=disable, or auto with no checkpoint to resume
        moved = set_aside_previous_run(run_dir)
        if moved is not None:
            print(f"starting fresh: the previous run in {run_dir} was moved to {moved}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / CONFIG_FILE)


def check_not_finished(cfg: DictConfig, run_dir: Path, latest: Path) -> None:
    """Raise RunFinished when the newest checkpoint `latest` already ends the run this config asks for."""
    step = int(json.loads((latest / "meta.json").read_text())["step"])
    total = cfg.trainer.total_training_steps
    how = (
        f"to train again from scratch add trainer.resume_mode=disable (moves it to {run_dir}/previous-*) or "
        "choose another run.dir"
    )
    if total is not None and step >= int(total):
        raise RunFinished(
            f"run dir {run_dir} already finished: its checkpoint is at step {step} of "
            f"trainer.total_training_steps={total}; nothing to do ({how}, or raise total_training_steps to go on)"
        )
    marker = _read_marker(run_dir)
    if (
        marker.get("reason") == "data_exhausted"
        and marker.get("step") == step
        and int(cfg.trainer.total_epochs) <= int(marker.get("total_epochs", 0))
    ):
        raise RunFinished(
            f"run dir {run_dir} already finished: its prompt data (trainer.total_epochs={marker['total_epochs']}) "
            f"was exhausted at step {step}; nothing to do ({how}, or raise total_epochs to go on)"
        )


def mark_finished(run_dir: str | Path, step: int, spec: RunSpec) -> None:
    """Record that the run ended normally at `step` (its final checkpoint), and why: the step count or the data."""
    total, epochs = spec.run.total_training_steps, spec.executor.data.total_epochs
    reason = "total_training_steps" if total is not None and step >= total else "data_exhausted"
    doc = {"step": step, "reason": reason, "total_epochs": epochs, "finished_at": time.time()}
    (Path(run_dir) / FINISHED_FILE).write_text(json.dumps(doc) + "\n")


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """Move an earlier run's outputs into RUN_DIR/previous-<UTC time>/ (returned); None when there are none."""
    present = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not present:
        return None
    target = run_dir / time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime())
    suffix = 1
    while target.exists():  # two fresh starts within a second
        target, suffix = target.with_name(f"{target.name.split('.')[0]}.{suffix}"), suffix + 1
    target.mkdir()
    for path in present:
        shutil.move(str(path), str(target / path.name))
    logger.info("moved %s into %s", ", ".join(p.name for p in present), target)
    return target


def check_resume_config(saved: Mapping[str, Any] | None, cfg: DictConfig, run_dir: Path) -> None:
    """Refuse a resume whose config changes keys outside the safe list (ResumeConfigError names them)."""
    if saved is None:
        logger.warning("no %s in %s: resuming without comparing configs", CONFIG_FILE, run_dir)
        return

    megatron = str(cfg.actor_rollout_ref.actor.strategy) == "megatron"
    refused = refused_changes(saved, _container(cfg), defaults=_container(base_config(megatron)))
    if refused:
        shown = "; ".join(f"{key} {old} -> {new}" for key, old, new in refused[:12])
        more = f" (and {len(refused) - 12} more)" if len(refused) > 12 else ""
        raise ResumeConfigError(
            f"cannot resume {run_dir}: changed since its checkpoint, which would corrupt the run: {shown}{more}. "
            "Put them back, or start fresh with trainer.resume_mode=disable or another run.dir"
        )


def refused_changes(
    saved: Mapping[str, Any], new: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> list[tuple[str, str, str]]:
    """(key, old, new) for every leaf that differs between two configs and is not safe to change on resume.

    A key that one side lacks is compared with `defaults` (this build's base config): a key added to the project
    since the run was saved, left at its default, is no change (otherwise every new key would forbid resuming the
    runs written before it); a key the project no longer has cannot be set and is logged, not refused.
    """
    old_leaves, new_leaves = _flatten(saved), _flatten(new)
    default_leaves = _flatten(defaults) if defaults is not None else {}
    missing = "<unset>"
    out = []
    for key in sorted(old_leaves.keys() | new_leaves.keys()):
        old, value = old_leaves.get(key, missing), new_leaves.get(key, missing)
        if old == value or is_safe_key(key):
            continue
        if old is missing and key in default_leaves and value == default_leaves[key]:
            continue  # added since the run was saved, and left at its default
        if value is missing and key not in default_leaves and defaults is not None:
            logger.warning("config key %s of the saved run no longer exists (was %s): ignored", key, _short(old))
            continue
        out.append((key, _short(old), _short(value)))
    return out


def is_safe_key(key: str) -> bool:
    """Whether changing `key` (dotted) between a checkpoint and its resume is safe (see the module docstring)."""
    last = key.rsplit(".", 1)[-1]
    return key in SAFE_KEYS or key.startswith(SAFE_PREFIXES) or last.endswith(SAFE_SUFFIXES)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}  # lists are leaves: compared whole


def _container(cfg: Any) -> dict[str, Any]:
    # Unresolved: a key that only mirrors another (critic.rollout_n: ${actor_rollout_ref.rollout.n}) stays the same
    # text, so the refusal names the key the user changed, not its echoes.
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _load_saved(path: Path) -> dict[str, Any] | None:
    """The saved config, its paths with `~` expanded as load_config now does (settings/paths.py): a run saved
    before that must not read as a changed model or cache folder."""
    if not path.is_file():
        return None

    saved = OmegaConf.load(path)
    home_expanded(saved)
    return _container(saved)


def _read_marker(run_dir: Path) -> dict[str, Any]:
    try:
        doc = json.loads((run_dir / FINISHED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
