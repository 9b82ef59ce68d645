"""Synthetic verifiable tasks that need no download: the embedded CPU default trains on these.

`addition` is the one the embedded default uses (ENVIRONMENT.md, "Calibration of the embedded default").
"""

from rllm.experimental.fully_async.tasks.addition import (
    DATA_SOURCE,
    AdditionAssets,
    build_addition_model,
    build_addition_tokenizer,
    compute_score,
    evaluate_accuracy,
    prepare_addition_assets,
    write_addition_parquets,
)

__all__ = [
    "DATA_SOURCE",
    "AdditionAssets",
    "build_addition_model",
    "build_addition_tokenizer",
    "compute_score",
    "evaluate_accuracy",
    "prepare_addition_assets",
    "write_addition_parquets",
]
