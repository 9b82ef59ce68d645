"""What a sample in flight has done so far: the part of it a checkpoint saves and a resumed run continues.

A workflow that can be resumed takes a `SampleProgress` from the executor and keeps it current: the engine client
writes the tokens of the generation in progress into its `GenerationProgress` as each piece comes back (with their
log-probs and the policy version of each token), and a multi-turn workflow puts the episode so far into `episode`
at every turn. The executor owns the record from the sample's start until the sample is queued or ended, so a
checkpoint taken between two events of the rollout service's loop sees, for every sample the ledger has in flight
and the queue does not hold, exactly what it had generated (`runtime/rollout/executor.py`).

Given a record restored from a checkpoint, the client continues the generation from its tokens (prompt + tokens so
far, the budget that is left) as it does after a weight sync, and returns a finished one without calling an engine.

How a resumed sample went on is one of `RESUME_OUTCOMES`, written to the ledger's journal as it leaves the rollout
side (`core/ledger.py`, event "resumed"): `continued` kept saved work; every other outcome started again from the
prompt and names why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONTINUED = "continued"  # the sample went on from its saved tokens (and, for agents, its saved episode)
NOTHING_SAVED = "nothing_saved"  # no token generated yet at the checkpoint: nothing to continue, nothing lost
PARTIAL_ROLLOUT_OFF = "partial_rollout_off"  # async_training.partial_rollout=false: as after a sync, from the prompt
WORKFLOW_NOT_RESUMABLE = "workflow_not_resumable"  # e.g. an rLLM rollout function: arbitrary code, restarted
ENV_NOT_RESTORED = "env_not_restored"  # the agent's environment could not be loaded back from its pickled state
# The checkpoint could not hold the sample's progress (a value JSON cannot store, e.g. in an environment's step
# info): the checkpoint names the sample and counts its tokens, and it restarts.
PROGRESS_NOT_SAVED = "progress_not_saved"
RESUME_OUTCOMES = (
    CONTINUED,
    NOTHING_SAVED,
    PARTIAL_ROLLOUT_OFF,
    WORKFLOW_NOT_RESUMABLE,
    ENV_NOT_RESTORED,
    PROGRESS_NOT_SAVED,
)


@dataclass
class GenerationProgress:
    """One model call's tokens so far; the three per-token lists have equal length.

    `finish_reason` is None while the call generates and stop | length once it is done (a finished call is kept
    until its sample leaves the rollout side: its reward, or the rest of a batched group, may still be pending).
    """

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that produced each token
    num_resumes: int = 0  # pieces interrupted (weight syncs, checkpoints) and continued
    finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.output_ids)

    def discard(self) -> int:
        """Forget the tokens (a restart from the prompt); returns how many were thrown away."""
        n = len(self.output_ids)
        self.output_ids, self.logprobs, self.versions, self.finish_reason = [], [], [], None
        return n

    def to_json(self) -> dict[str, Any]:
        return {
            "output_ids": list(self.output_ids),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "num_resumes": self.num_resumes,
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> GenerationProgress:
        """Rebuild from `to_json`'s object; ValueError naming `where` if it is malformed."""
        if not isinstance(doc, dict):
            raise ValueError(f"{where} must be an object, got {type(doc).__name__}")
        try:
            progress = cls(
                output_ids=[int(t) for t in doc["output_ids"]],
                logprobs=[float(x) for x in doc["logprobs"]],
                versions=[int(v) for v in doc["versions"]],
                num_resumes=int(doc.get("num_resumes", 0)),
                finish_reason=doc.get("finish_reason"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where} is not a generation's progress: {type(exc).__name__}: {exc}") from None
        if not len(progress.output_ids) == len(progress.logprobs) == len(progress.versions):
            raise ValueError(f"{where}: output_ids, logprobs and versions differ in length")
        if progress.finish_reason not in (None, "stop", "length"):
            raise ValueError(f"{where}: finish_reason {progress.finish_reason!r} is not null, stop or length")
        return progress


@dataclass
class SampleProgress:
    """One sample in flight: the generation in progress and, for a multi-turn workflow, the episode before it.

    `episode` is the workflow's own state before the current model call (multi_turn: the conversation, each turn's
    tokens, rewards and steps, the environment's pickled state), set at the start of each turn, so that with
    `generation` it describes one consistent moment: a JSON object, or an object whose `to_json()` returns one
    (serialized only when a checkpoint is taken). Its JSON's `generated_tokens` counts the model tokens it holds.
    `outcome` is how a restored sample went on (`RESUME_OUTCOMES`; None for a fresh one); a workflow that cannot
    use what was restored calls `restart` with another outcome and starts over.
    """

    uid: str
    generation: GenerationProgress = field(default_factory=GenerationProgress)
    episode: Any = None  # a JSON object, or an object with to_json() (see above); None: no episode
    outcome: str | None = None
    restored_tokens: int = 0  # tokens loaded from the checkpoint (the generation's and the episode's turns')
    discarded_tokens: int = 0  # of those, thrown away because the sample could not go on from them

    def tokens(self) -> int:
        """Model tokens it holds: the generation's and the saved episode's turns'."""
        episode = self.episode.to_json() if hasattr(self.episode, "to_json") else self.episode
        return len(self.generation) + episode_tokens(episode if isinstance(episode, dict) else None)

    def saved_anything(self) -> bool:
        return bool(self.generation.output_ids) or self.generation.finish_reason is not None or bool(self.episode)

    def restart(self, outcome: str) -> None:
        """Start again from the prompt: forget the episode and the generation, counting what is thrown away."""
        episode = self.episode if isinstance(self.episode, dict) else None
        self.discarded_tokens += self.generation.discard() + episode_tokens(episode)
        self.episode = None
        self.outcome = outcome

    def to_json(self) -> dict[str, Any]:
        episode = self.episode.to_json() if hasattr(self.episode, "to_json") else self.episode
        return {"uid": self.uid, "generation": self.generation.to_json(), "episode": episode}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> SampleProgress:
        if not isinstance(doc, dict) or not isinstance(doc.get("uid"), str):
            raise ValueError(f"{where} must be an object with a string 'uid'")
        episode = doc.get("episode")
        if episode is not None and not isinstance(episode, dict):
            raise ValueError(f"{where}.episode must be an object or null")
        generation = GenerationProgress.from_json(doc.get("generation"), f"{where}.generation")
        progress = cls(uid=doc["uid"], generation=generation, episode=episode)
        progress.restored_tokens = len(generation) + episode_tokens(episode)
        return progress


def episode_tokens(episode: dict[str, Any] | None) -> int:
    """Model tokens a saved episode holds (its finished turns): the workflow records them as `generated_tokens`."""
    return int(episode.get("generated_tokens", 0)) if episode else 0
