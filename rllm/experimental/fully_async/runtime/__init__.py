"""The Ray and asyncio shells: the run (driver), the rollout side's actor, the trainer's actor, ParamSync and
checkpoints. They wire the pure code of `core/` and `algorithms/` to processes; policy decisions live there."""
