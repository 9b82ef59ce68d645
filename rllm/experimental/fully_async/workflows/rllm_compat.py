"""Run a rollout function written for rLLM's fully-async module, unchanged, as this project's workflow.

rLLM's contract (rllm-org/rllm, `rllm/experimental/fully_async/rollout_executor.py`):

    async def rollout_fn(client, tokenizer, **datum) -> Trajectory

called once per sample (n times per prompt), where `client` is rLLM's `RolloutClient` (here `client.py`: one
client per workflow, as rLLM's executor holds one) and the function returns rLLM's
`Trajectory(sequences, reward, metadata)` (`protocol.py`). This module is the adapter between that contract and
this project's workflow (`run(client, tokenizer, datum, sample_index) -> VersionedTrajectory`):

| rLLM                                   | here                                                                 |
|----------------------------------------|----------------------------------------------------------------------|
| `client` (`RolloutClient`)             | `client.RolloutClient` over the rollout service's engine client;     |
|                                        | `max_tokens` = data.max_prompt_length + data.max_response_length;    |
|                                        | `cur_version` set from the trainer's version (`set_version`, called   |
|                                        | by the executor) and raised by newer tokens                           |
| `**datum`: the dataset row             | `prompt` / `raw_prompt` (messages), `data_source`, `reward_model`     |
|                                        | ({"ground_truth"}), `extra_info`, `ground_truth`, `prompt_ids`, and   |
|                                        | extra_info's keys at top level (where they clash with none of these); |
|                                        | `batched=True` wraps each in a 1-element array as verl's collate does |
|                                        | (the DAPO example indexes `kwargs["raw_prompt"][0]`)                  |
| `**datum` from `DatasetRegistry`       | the registered row itself (workflow.rllm_rows, data/rows.py); batched:|
|                                        | with verl RLHFDataset's raw_prompt/index/tools_kwargs, then wrapped   |
| `Trajectory.sequences`                 | training rows as rLLM's batch assembly makes them (`training_rows`):  |
|                                        | `Trajectory.merge()` (consecutive sequences that extend each other    |
|                                        | become one row, the tokens between turns mask 0), each row's prompt   |
|                                        | cut at data.max_prompt_length by `resize_prompt_length` (the rest     |
|                                        | joins the response, mask 0), its response cut at                      |
|                                        | data.max_response_length; then one `VersionedSequence` per row,       |
|                                        | `response_masks` -> `loss_mask`, per-token versions from              |
|                                        | `to_sequence()` (else `start_version` for every token). With          |
|                                        | `metadata["step_rewards"]` (per-step credit) there is no merge: one   |
|                                        | row per sequence, as the step fields are per sequence                 |
| `Trajectory.reward`, `.metadata`       | `VersionedTrajectory.reward`, `.metadata["rllm"]`;                    |
|                                        | `metadata["step_rewards"]` and `["step_state_hashes"]`, when present, |
|                                        | become the step fields; the rest reaches the metrics as rLLM reports  |
|                                        | it (rllm_metrics.py)                                                  |
| an exception / `None` returned         | a FAILED trajectory with the reason (rLLM logs and drops the sample)  |

rLLM's assembly (rllm-org/rllm, `utils.assemble_batch_from_trajectory_group_ls`) is `for seq in
trajectory.merge(): seq = seq.resize_prompt_length(max_prompt_length)`, then every row's response clipped to
`data.max_response_length` (its reward on the last kept token). Without the merge a conversation of N turns would
be N rows each holding the whole history as its prompt: N times the trainer's tokens, unbounded by
data.max_prompt_length. Tokens cut at the response limit are counted in `metadata["rllm_rows"]` and logged once.

The function runs in the rollout service's event loop (it must, to drive the engine client); its own reward
calls are its business. A function may also return this project's `api.trajectory.VersionedTrajectory`; it is
kept as is.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rllm.experimental.fully_async.api.token_ids import token_ids
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.api.workflow import GenerationClient
from rllm.experimental.fully_async.client import DEFAULT_MAX_TOKENS, SAMPLE_UID, RolloutClient
from rllm.experimental.fully_async.protocol import Sequence as RllmSequence
from rllm.experimental.fully_async.protocol import Trajectory as RllmTrajectory

logger = logging.getLogger(__name__)

RolloutFn = Callable[..., Awaitable[Any]]


def datum_kwargs(datum: Any, batched: bool = False) -> dict[str, Any]:
    """The keyword arguments an rLLM rollout function receives for one datum (module docstring)."""
    stored = getattr(datum, "row", None)
    if stored is not None:  # an rLLM dataset row (data/rows.py): as stored, or as verl's collate gives a batch of one
        return _collated_batch_of_one(stored) if batched else stored
    messages = list(getattr(datum, "messages", None) or [])
    extra = dict(datum.extra_info or {})
    row: dict[str, Any] = {
        "prompt": messages,
        "raw_prompt": messages,
        "data_source": datum.data_source,
        "reward_model": {"ground_truth": datum.ground_truth},
        "extra_info": extra,
        "ground_truth": datum.ground_truth,
        "prompt_ids": list(datum.prompt_ids),
    }
    for key, value in extra.items():
        row.setdefault(key, value)
    return _wrapped(row) if batched else row


def _collated_batch_of_one(row: dict[str, Any]) -> dict[str, Any]:
    """What verl's RLHFDataset adds to a row (`raw_prompt` from the `prompt` column, `extra_info` at least {},
    `index`, `tools_kwargs`, `interaction_kwargs` from it), collated as a batch of one (`_wrapped`)."""
    item = dict(row)
    extra = item.get("extra_info") or {}
    item["extra_info"] = extra
    if "prompt" in item:
        item["raw_prompt"] = item["prompt"]
    item["index"] = extra.get("index", 0)
    item["tools_kwargs"] = extra.get("tools_kwargs", {})
    item["interaction_kwargs"] = extra.get("interaction_kwargs", {})
    return _wrapped(item)


def _wrapped(row: dict[str, Any]) -> dict[str, Any]:
    """Each value in a 1-element object array, as verl's collate_fn does for non-tensor fields."""
    wrapped = {}
    for key, value in row.items():
        cell = np.empty(1, dtype=object)
        cell[0] = value
        wrapped[key] = cell
    return wrapped


def _to_sequence(seq: Any) -> VersionedSequence:
    """One training row from an rLLM sequence (ids re-read: a user may have assigned any accepted form)."""
    response_ids = token_ids(seq.response_ids, "Sequence.response_ids")
    n = len(response_ids)
    versions = getattr(seq, "response_versions", None)
    if versions is None or len(versions) != n:
        versions = [int(seq.start_version or 0)] * n
    return VersionedSequence(
        prompt_ids=token_ids(seq.prompt_ids, "Sequence.prompt_ids"),
        response_ids=response_ids,
        response_logprobs=[float(x) for x in seq.response_logprobs],
        response_versions=[int(v) for v in versions],
        loss_mask=[int(m) for m in seq.response_masks],
        lora_paths=getattr(seq, "lora_paths", None),  # LoRA: the client's record (protocol.py)
    )


@dataclass(frozen=True)
class RowCounts:
    """What `training_rows` did to one trajectory (kept in `metadata["rllm_rows"]`)."""

    sequences: int  # as the function returned them
    rows: int  # training rows after the merge
    prompt_tokens_moved: int  # prompt tokens beyond data.max_prompt_length, moved into the response (mask 0)
    response_tokens_cut: int  # response tokens beyond data.max_response_length, dropped


def training_rows(
    trajectory: RllmTrajectory,
    max_prompt_length: int | None,
    max_response_length: int | None,
    merge: bool = True,
) -> tuple[list[RllmSequence], RowCounts]:
    """The rows rLLM trains for `trajectory` (module docstring): merged, prompts resized, responses cut. A limit
    of None leaves that side as it is (a workflow built by hand, outside a run)."""
    merged = trajectory.merge() if merge else list(trajectory.sequences)
    rows, moved, cut = [], 0, 0
    for seq in merged:
        if max_prompt_length is not None:
            moved += max(0, len(seq.prompt_ids) - max_prompt_length)
            seq = seq.resize_prompt_length(max_prompt_length)
        if max_response_length is not None and len(seq.response_ids) > max_response_length:
            cut += len(seq.response_ids) - max_response_length
            seq = _cut_response(seq, max_response_length)
        rows.append(seq)
    return rows, RowCounts(len(trajectory.sequences), len(rows), moved, cut)


def _cut_response(seq: RllmSequence, length: int) -> RllmSequence:
    """The first `length` response tokens (rLLM's batch keeps those and drops the rest)."""
    versions = seq.response_versions[:length] if seq.response_versions is not None else None
    return RllmSequence(
        prompt_ids=list(seq.prompt_ids),
        response_ids=seq.response_ids[:length],
        response_logprobs=list(seq.response_logprobs[:length]),
        response_masks=list(seq.response_masks[:length]),
        start_version=seq.start_version,
        end_version=seq.end_version,
        response_versions=versions,
        lora_paths=getattr(seq, "lora_paths", None),
    )


@dataclass
class RllmRolloutWorkflow:
    """Adapter from an rLLM rollout function to this project's `Workflow` (see the module docstring)."""

    rollout_fn: RolloutFn
    batched: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS  # the client's prompt + response budget (RolloutClient.max_tokens)
    max_prompt_length: int | None = None  # data.max_prompt_length: a row's prompt beyond it joins the response
    max_response_length: int | None = None  # data.max_response_length: a row's response is cut there
    name: str = field(default="rllm_rollout_fn", init=False)
    chooses_sampling = True  # the function passes its own sampling_params (validation applies no val_kwargs)

    def __post_init__(self) -> None:
        if not inspect.iscoroutinefunction(self.rollout_fn):
            raise TypeError(f"rollout function {self.rollout_fn!r} must be `async def fn(client, tokenizer, **datum)`")
        self._client: RolloutClient | None = None
        self._version = 0
        self._warned_cut = False

    def set_version(self, version: int) -> None:
        """The policy version the engines now serve (the executor calls this; rLLM's executor calls the client's
        `set_version` after each weight sync)."""
        self._version = int(version)
        if self._client is not None:
            self._client.set_version(version)

    def client_for(self, engine: GenerationClient, tokenizer: Any) -> RolloutClient:
        """The one RolloutClient every rollout of this workflow shares (a new one only for another engine client)."""
        if self._client is None or self._client.engine is not engine or self._client.tokenizer is not tokenizer:
            version = self._version if self._client is None else self._client.cur_version
            self._client = RolloutClient(engine, tokenizer, max_tokens=self.max_tokens)
            self._client.set_version(version)
        return self._client

    async def run(self, client: GenerationClient, tokenizer: Any, datum: Any, sample_index: int) -> VersionedTrajectory:
        uid = f"{datum.prompt_uid}/{sample_index}"
        rollout_client = self.client_for(client, tokenizer)
        failure = None
        context = SAMPLE_UID.set(uid)
        try:
            result = await self.rollout_fn(rollout_client, tokenizer, **datum_kwargs(datum, self.batched))
        except Exception as exc:  # user code: a failed sample with its reason, never a failed run
            result, failure = None, f"rollout_fn_error: {type(exc).__name__}: {exc}"
        finally:
            SAMPLE_UID.reset(context)
        if isinstance(result, VersionedTrajectory):
            return result
        trajectory = VersionedTrajectory(uid=uid, prompt_uid=datum.prompt_uid, sequences=[])
        if failure is None and not isinstance(result, RllmTrajectory):
            failure = f"rollout_fn_bad_result: expected a Trajectory, got {type(result).__name__}"
        if failure is None:
            try:
                meta = dict(result.metadata or {})
                per_step = "step_rewards" in meta or "step_state_hashes" in meta
                rows, counts = training_rows(result, self.max_prompt_length, self.max_response_length, not per_step)
                self._warn_cut(uid, counts)
                trajectory.sequences = [_to_sequence(s) for s in rows]
                trajectory.metadata["rllm_rows"] = dataclasses.asdict(counts)
                trajectory.reward = float(result.reward)
                if "step_rewards" in meta:
                    trajectory.step_rewards = [None if r is None else float(r) for r in meta.pop("step_rewards")]
                if "step_state_hashes" in meta:
                    trajectory.step_state_hashes = [str(h) for h in meta.pop("step_state_hashes")]
                trajectory.metadata["rllm"] = meta
            except (TypeError, ValueError, AttributeError) as exc:
                failure = f"rollout_fn_bad_result: {type(exc).__name__}: {exc}"
        if failure is None and not trajectory.sequences:
            failure = "rollout_fn_bad_result: the trajectory has no sequences"
        if failure is not None:
            trajectory.status, trajectory.failure_reason = TrajectoryStatus.FAILED, failure
            logger.warning("sample %s failed: %s", uid, failure)
        return trajectory

    def _warn_cut(self, uid: str, counts: RowCounts) -> None:
        if counts.response_tokens_cut and not self._warned_cut:
            self._warned_cut = True
            logger.warning(
                "sample %s: %d response tokens beyond data.max_response_length=%s dropped, as rLLM's batch drops "
                "them (a merged conversation's turns share one row's response); raise data.max_response_length to "
                "train them (metadata['rllm_rows'] counts them per trajectory; this is logged once)",
                uid,
                counts.response_tokens_cut,
                self.max_response_length,
            )
