"""Token-level resume on the rollout side: what a checkpoint saves of the samples still generating, and how a resumed
run takes them up again. The one home of the feature; its other parts, each where it acts:

- the record (`api/progress.py`: `SampleProgress`, `GenerationProgress`, the outcomes): what a sample in flight has
  done so far, kept current by the engine client (the tokens of the generation in progress, with their log-probs and
  versions) and by a multi-turn workflow (the episode so far, `workflows/multi_turn.py`);
- the executor (`executor.py`) holds one record per running sample of a resumable workflow (its `run` takes
  `progress`: single-turn and multi-turn do, an rLLM rollout function does not) from the sample's start until it
  is queued or ended, in the same step of the event loop in which the ledger and the queue change, so a snapshot
  taken in one synchronous call is consistent with both;
- the checkpoint (`service.py`, `collected_checkpoint_state`) pauses the engines as a sync does, so every call in
  flight comes back with its tokens before the state is taken;
- the client (`engines/resumable.py`) continues a restored generation from its tokens as after a weight sync.

Saving (`saved_progress`): every record with something in it goes into rollout.json's `in_flight_progress`; one that
JSON cannot hold unchanged (e.g. a tuple or a numpy number in an environment's step info) is named in
`in_flight_unsaved` with its token count instead, and restarts (`progress_not_saved`).
Resuming (`reissue_plan`): every sample the ledger has in flight and the queue does not hold runs again, first, from
its record (`restore_progress`: the outcome it is bound for); with partial_rollout off an unfinished generation
restarts from its prompt, as after a sync (an agent keeps its finished turns). The staleness rule applies to the
saved tokens as to any (their versions are kept). How each one went on is journaled (`SampleLedger.mark_resumed`)
as it leaves the rollout side and counted in the executor's stats.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from rllm.experimental.fully_async.api.progress import (
    CONTINUED,
    NOTHING_SAVED,
    PARTIAL_ROLLOUT_OFF,
    PROGRESS_NOT_SAVED,
    WORKFLOW_NOT_RESUMABLE,
    SampleProgress,
)
from rllm.experimental.fully_async.api.trajectory import VersionedGroup
from rllm.experimental.fully_async.core.ids import SampleId, prompt_uid
from rllm.experimental.fully_async.data.prompts import PromptDatum
from rllm.experimental.fully_async.runtime.checkpoints.format import check_json

logger = logging.getLogger(__name__)

# A prompt whose samples were in flight at the checkpoint: its datum, the sample indexes to run again, and each
# sample's record (by uid) to start from.
Reissue = tuple[PromptDatum, list[int], dict[str, SampleProgress]]


def saved_progress(records: Iterable[SampleProgress]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(saved, unsaved) for every record with something to continue from: saved maps uid -> its JSON record;
    unsaved, uid -> {reason, tokens} for a record JSON would not hold unchanged, which is logged and restarts from
    the prompt after a crash, counted as `progress_not_saved`."""
    saved: dict[str, Any] = {}
    unsaved: dict[str, Any] = {}
    for record in records:
        if not record.saved_anything():
            continue
        doc = record.to_json()
        try:
            check_json(doc, f"the progress of {record.uid}")
        except TypeError as exc:
            logger.warning("%s; it is not checkpointed and restarts from the prompt after a crash", exc)
            unsaved[record.uid] = {"reason": str(exc), "tokens": record.tokens()}
            continue
        saved[record.uid] = doc
    return saved, unsaved


def restore_progress(
    uid: str, doc: Any, unsaved: Any = None, *, resumable: bool, partial_rollout: bool
) -> SampleProgress:
    """The record a sample in flight at the checkpoint starts from, with the outcome it is bound for."""
    if not resumable:
        return SampleProgress(uid, outcome=WORKFLOW_NOT_RESUMABLE)
    if unsaved is not None:  # its progress was there but could not be written: its tokens are lost
        tokens = int(unsaved.get("tokens", 0)) if isinstance(unsaved, dict) else 0
        return SampleProgress(uid, outcome=PROGRESS_NOT_SAVED, restored_tokens=tokens, discarded_tokens=tokens)
    if doc is None:
        return SampleProgress(uid, outcome=NOTHING_SAVED)
    record = SampleProgress.from_json(doc, f"in_flight_progress[{uid!r}]")
    record.outcome = CONTINUED
    if not partial_rollout and record.generation.finish_reason is None and record.generation:
        # As after a weight sync without partial rollouts: the unfinished generation restarts from its prompt
        # (an agent keeps its finished turns).
        record.discarded_tokens += record.generation.discard()
        if not record.episode:
            record.outcome = PARTIAL_ROLLOUT_OFF
    return record


def reissue_plan(
    state: dict[str, Any],
    in_flight_uids: Iterable[str],
    queued: Sequence[VersionedGroup],
    dataset: Iterable[Any],
    *,
    resumable: bool,
    partial_rollout: bool,
) -> list[Reissue]:
    """What a resumed executor runs first: every sample in flight at the checkpoint that is not in `queued`, grouped
    by prompt, each from its saved record when there is one. `state` is the checkpoint's rollout part (its
    `in_flight_progress` and `in_flight_unsaved`); `dataset` the prompt records, by their index."""
    saved_docs = state.get("in_flight_progress") or {}  # absent from checkpoints of before token-level resume
    unsaved_docs = state.get("in_flight_unsaved") or {}
    queued_uids = {t.uid for g in queued for t in g.trajectories}
    by_prompt: dict[tuple[int, int], list[int]] = {}
    restored: dict[str, SampleProgress] = {}
    for uid in in_flight_uids:
        if uid in queued_uids:
            continue
        sample = SampleId.parse(uid)
        by_prompt.setdefault((sample.epoch, sample.record), []).append(sample.index)
        restored[uid] = restore_progress(
            uid, saved_docs.get(uid), unsaved_docs.get(uid), resumable=resumable, partial_rollout=partial_rollout
        )
    unknown = sorted((set(saved_docs) | set(unsaved_docs)) - set(restored))
    if unknown:
        raise ValueError(f"the checkpoint saves progress for samples its ledger does not have in flight: {unknown[:3]}")
    records = {record.index: record for record in dataset}
    plan: list[Reissue] = []
    for (epoch, record), indexes in sorted(by_prompt.items()):
        datum = PromptDatum(prompt_uid=prompt_uid(epoch, record), epoch=epoch, record=records[record])
        saved = {str(SampleId(epoch, record, i)): restored[str(SampleId(epoch, record, i))] for i in indexes}
        plan.append((datum, sorted(indexes), saved))
    if restored:
        log_resume(restored.values())
    return plan


def log_resume(records: Iterable[SampleProgress]) -> None:
    """One line for the operator: how many samples in flight at the checkpoint go on from their tokens."""
    records = list(records)
    outcomes: dict[str, int] = {}
    for record in records:
        outcomes[record.outcome] = outcomes.get(record.outcome, 0) + 1
    tokens = sum(r.restored_tokens - r.discarded_tokens for r in records if r.outcome == CONTINUED)
    restarts = ", ".join(f"{n} {why}" for why, n in sorted(outcomes.items()) if why != CONTINUED) or "none"
    logger.warning(
        "resuming %d samples that were in flight at the checkpoint: %d continue from their saved tokens (%d tokens); "
        "restarting from the prompt: %s",
        len(records),
        outcomes.get(CONTINUED, 0),
        tokens,
        restarts,
    )
    if outcomes.get(WORKFLOW_NOT_RESUMABLE):
        logger.warning(
            "the workflow does not record its samples' progress (e.g. an rLLM rollout function, which is arbitrary "
            "code): its %d samples in flight restart from the prompt",
            outcomes[WORKFLOW_NOT_RESUMABLE],
        )
