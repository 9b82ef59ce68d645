"""The policy version, the sync interval and the batch unit, defined once; every other docstring points here.

**Policy version.** An integer owned by the trainer. It starts at 0 (the initial weights) and is bumped by exactly
one each time the trainer pushes its weights to the engines (one weight sync), not once per optimizer step.

**Sync interval K** (`trigger_parameter_sync_step`, as verl and rLLM name it, in the YAML and in the code): the
trainer pushes its weights every K optimizer steps (`is_sync_step`), so version v covers optimizer steps
v·K+1 .. (v+1)·K. The engines are tagged with the version of the weights they hold (read back after each sync,
never assumed), and every generated token carries it. Staleness at training time = trainer version − the oldest
token version of a group (docs/design.md#rule-versions-on-every-token); η (`max_staleness`) bounds it, in versions.

**Groups and samples.** A *group* (`VersionedGroup`) is one prompt's n samples (`actor_rollout_ref.rollout.n`);
a *sample* is one trajectory. rLLM/verl's `required_samples` counts groups (prompts) per optimizer step.

**B, groups per version.** The staleness budget (core/staleness.py) counts groups per version:

    B = required_samples × trigger_parameter_sync_step
"""

from __future__ import annotations


def groups_per_version(required_samples: int, trigger_parameter_sync_step: int) -> int:
    """B: the groups the trainer consumes between two weight syncs (one version), as defined above."""
    if required_samples < 1 or trigger_parameter_sync_step < 1:
        raise ValueError(
            f"required_samples ({required_samples}) and trigger_parameter_sync_step "
            f"({trigger_parameter_sync_step}) must be >= 1"
        )
    return required_samples * trigger_parameter_sync_step


def groups_ahead_budget(max_staleness: int, required_samples: int, trigger_parameter_sync_step: int) -> int:
    """(η + 1)·B: the most groups started and not yet taken by the trainer right after a sync, which the staleness
    rule (core/staleness.py: accepted + running < (η + v + 1)·B, with v·B groups consumed by version v) allows."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return (max_staleness + 1) * groups_per_version(required_samples, trigger_parameter_sync_step)


def is_sync_step(step: int, trigger_parameter_sync_step: int) -> bool:
    """Whether optimizer step `step` (1-based; 0 = no step yet) ends with a weight sync: every K-th step.

    At the end of a run whose last step is not one, the trainer pushes the last weights anyway (`FullyAsyncTrainer
    .push_last_weights`), so the engines (and the final validation) hold what was trained.
    """
    if trigger_parameter_sync_step < 1:
        raise ValueError(f"trigger_parameter_sync_step must be >= 1, got {trigger_parameter_sync_step}")
    return step > 0 and step % trigger_parameter_sync_step == 0


def lora_versions_kept(max_staleness: int, adaptive_max: int | None = None) -> int:
    """LoRA: the adapter versions every engine keeps loaded, η_max + 1 (the newest and the η_max before it, all the
    staleness bound admits; η_max: adaptive staleness's max when it may rise above max_staleness)."""
    eta_max = max(max_staleness, adaptive_max if adaptive_max is not None else 0)
    if eta_max < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return eta_max + 1
