"""Single-turn RLVR: one model call per sample, a verifiable reward on the decoded answer."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from rllm.experimental.fully_async.api.progress import SampleProgress
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.api.workflow import BatchGenerationClient, GenerationClient
from rllm.experimental.fully_async.workflows.base import RewardFn, score_safely

logger = logging.getLogger(__name__)


@dataclass
class SingleTurnWorkflow:
    """Generate one response to the datum's prompt and score it with the reward function.

    `sampling_params` are SGLang's (max_new_tokens, temperature, top_p, top_k, ...). The response is decoded
    without special tokens for the reward, but trained as the exact token ids the engine produced.
    """

    reward_fn: RewardFn
    sampling_params: dict[str, Any]
    reward_timeout_s: float = 30.0
    name: str = field(default="single_turn", init=False)

    async def run(
        self,
        client: GenerationClient,
        tokenizer: Any,
        datum: Any,
        sample_index: int,
        progress: SampleProgress | None = None,
    ) -> VersionedTrajectory:
        """`progress`: the sample's record (api/progress.py); its generation is continued from the tokens it holds."""
        uid = f"{datum.prompt_uid}/{sample_index}"
        kwargs = {} if progress is None else {"progress": progress.generation}
        result = await client.generate(list(datum.prompt_ids), dict(self.sampling_params), rid=uid, **kwargs)
        return await self._scored(tokenizer, datum, uid, result)

    async def run_group(
        self,
        client: BatchGenerationClient,
        tokenizer: Any,
        datum: Any,
        sample_indexes: list[int],
        progress: list[SampleProgress] | None = None,
    ) -> list[VersionedTrajectory]:
        """All samples of one prompt in one batched request (`generate_batch`). The group is consumed together, so
        waiting for its slowest sample costs nothing. `progress`: one record per sample, as for `run`."""
        uids = [f"{datum.prompt_uid}/{i}" for i in sample_indexes]
        prompt = list(datum.prompt_ids)
        kwargs = {} if progress is None else {"progress": [p.generation for p in progress]}
        results = await client.generate_batch([prompt] * len(uids), dict(self.sampling_params), rids=uids, **kwargs)
        scored = (self._scored(tokenizer, datum, u, r) for u, r in zip(uids, results, strict=True))
        return list(await asyncio.gather(*scored))

    async def _scored(self, tokenizer: Any, datum: Any, uid: str, result: Any) -> VersionedTrajectory:
        """The trajectory of one generation, with its reward or the reason it has none."""
        sequence = VersionedSequence(
            prompt_ids=list(datum.prompt_ids),
            response_ids=list(result.output_ids),
            response_logprobs=list(result.logprobs),
            response_versions=list(result.versions),
            finish_reason=result.finish_reason,
            num_resumes=result.num_resumes,
            lora_paths=result.lora_paths,
        )
        solution = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        outcome = await score_safely(
            self.reward_fn,
            self.reward_timeout_s,
            data_source=datum.data_source,
            solution_str=solution,
            ground_truth=datum.ground_truth,
            extra_info=datum.extra_info,
        )
        trajectory = VersionedTrajectory(uid=uid, prompt_uid=datum.prompt_uid, sequences=[sequence])
        if outcome.failure is not None:
            trajectory.status = TrajectoryStatus.FAILED
            trajectory.failure_reason = outcome.failure
            logger.warning("sample %s failed: %s", uid, outcome.failure)
        else:
            trajectory.reward = outcome.reward  # type: ignore[assignment]
            if outcome.extra:
                trajectory.metadata["reward_extra"] = outcome.extra
        return trajectory
