"""The supervised warm-up the agent tasks share: pad demonstration rows, then imitate them for a fixed step count.

A task builds its demonstrations as (token ids, labels) rows, labels -100 where no loss is taken (prompts,
observations, padding); `pad_rows` stacks them and `imitation_warmup` runs the fixed number of AdamW steps (a fixed
count, never until a score: the useful window of held-out accuracy is seconds wide, ENVIRONMENT.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rllm.experimental.fully_async.tasks.addition import single_torch_thread


def pad_rows(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any]:
    """[count, L] ids (padded with `pad_id`) and labels (padded with -100) from (ids, labels) rows."""

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (x, y) in enumerate(rows):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
    return ids, labels


def imitation_warmup(
    model: Any, ids: Any, labels: Any, *, pad_id: int, batch_size: int, lr: float, steps: int
) -> float:
    """`steps` AdamW steps over consecutive `batch_size` slices of (ids, labels); returns the seconds taken."""

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    start = time.perf_counter()
    with single_torch_thread():
        for step in range(steps):
            batch = slice(step * batch_size, (step + 1) * batch_size)
            attention = (ids[batch] != pad_id).long()
            loss = model(input_ids=ids[batch], attention_mask=attention, labels=labels[batch], use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    return time.perf_counter() - start
