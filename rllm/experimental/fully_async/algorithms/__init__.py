"""RL algorithms for the fully-async trainer: what verl 0.7.1 lacks, on top of what it has.

- `advantages`  one entry point, `compute_advantages`, over verl's advantage-estimator registry (GRPO, Dr.GRPO,
                RLOO, REINFORCE++, REINFORCE++-baseline, GAE) plus GiGPO, with sane rules for degenerate groups.
- `gigpo`       GiGPO (arXiv 2505.10978): episode- plus anchor-state step-level advantages for multi-step agents,
                registered in verl as ``adv_estimator: gigpo``.
- `corrections` off-policy corrections for stale and mismatched rollouts: decoupled PPO (AReaL), truncated
                importance sampling, bypass mode, the log-linear proximal-policy approximation.
- `filters`     dynamic group filtering (DAPO / slime style) with a reason for every drop (a dropped group frees
                its budget slot, so the executor's replacements keep the trainer's batches full).

The package import is deliberately empty: `filters` is pure Python and must stay cheap to import, while the other
modules pull in torch and verl.
"""
