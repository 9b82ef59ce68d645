"""`python -m rllm.experimental.fully_async simulate`: a discrete-event simulator of the fully-async pipeline.

`model.py` timing/length models and settings, `engine.py` the event loop (driven by `core/staleness.py`),
`result.py` what one simulation measured, `calibrate.py` fitting from a run's metrics.jsonl, `scenarios.py`
scenario files and GPU-split sweeps, `cli.py` the command. Everything but the CLI is pure.
"""
