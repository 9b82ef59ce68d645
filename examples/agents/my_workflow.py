"""A custom workflow class: `workflow.path=examples/agents/my_workflow.py workflow.name=BestOfTwo`.

A workflow is one async method, `run(client, tokenizer, datum, sample_index) -> VersionedTrajectory`; it is built as
`cls(reward_fn=..., sampling_params=...)`. It never raises for a bad sample: it returns a FAILED trajectory with a
reason, which the ledger records. This one asks the engine twice for a single-turn answer and trains on both
generations as two rows of one trajectory, rewarded by the better of the two (each token keeps its version).
"""

from dataclasses import dataclass

from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.workflows.base import score_safely


@dataclass
class BestOfTwo:
    reward_fn: object
    sampling_params: dict
    name: str = "best_of_two"

    async def run(self, client, tokenizer, datum, sample_index):
        uid = f"{datum.prompt_uid}/{sample_index}"
        sequences, scores = [], []
        for attempt in range(2):
            out = await client.generate(list(datum.prompt_ids), dict(self.sampling_params), rid=f"{uid}/{attempt}")
            sequences.append(
                VersionedSequence(list(datum.prompt_ids), list(out.output_ids), list(out.logprobs), list(out.versions))
            )
            outcome = await score_safely(
                self.reward_fn,
                30.0,
                data_source=datum.data_source,
                solution_str=tokenizer.decode(out.output_ids, skip_special_tokens=True),
                ground_truth=datum.ground_truth,
                extra_info=datum.extra_info,
            )
            if outcome.failure is not None:
                failed = VersionedTrajectory(uid=uid, prompt_uid=datum.prompt_uid, sequences=sequences)
                failed.status, failed.failure_reason = TrajectoryStatus.FAILED, outcome.failure
                return failed
            scores.append(outcome.reward)
        return VersionedTrajectory(uid=uid, prompt_uid=datum.prompt_uid, sequences=sequences, reward=max(scores))
