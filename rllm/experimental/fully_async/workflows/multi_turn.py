"""Multi-turn agent rollouts: the model acts, an environment (and optionally tools) answers, turn by turn.

Token in, token out. The conversation is one growing list of token ids: the datum's prompt, then the first
observation, then each model turn exactly as the engine generated it (never decoded and re-tokenized), then the
observation or tool result as the ids the chat template puts there (`chat_turns.ChatTurns`), and so on. Each
model turn is one `client.generate` call: its tokens carry their log-probs and the policy version the engine
reported; a weight sync in the middle of a turn is resumed by the client (partial rollout), so one turn may hold
tokens of two versions.

How a trajectory maps onto VersionedSequences (core/batch.py makes one training row per VersionedSequence), `layout`:

- "per_step" (default; what GiGPO needs): one VersionedSequence per model turn. Its `prompt_ids` are the whole
  conversation before the turn (datum prompt, earlier turns, observations), its `response_ids` the turn's generated
  tokens, all with loss mask 1. Observation and tool tokens are therefore never trained: they only ever sit in a prompt.
  `step_rewards[t]` and `step_state_hashes[t]` belong to VersionedSequence t, so batch rows, GiGPO steps and rewards
  line up one to one. Cost: the prompt is re-encoded per step (quadratic in turns; fine for short episodes).
- "concat": one VersionedSequence for the whole episode: prompt = datum prompt + first observation, response = every
  turn and every later observation, observation/tool tokens with loss mask 0 (log-prob 0, the version of the turn
  before). Linear cost, but one row: `step_rewards` is [total] and GiGPO's step level has one step per trajectory
  (it reduces to GRPO). Use it for long episodes trained with GRPO.
The layout changes rows, never credit: the estimators treat a trajectory's rows as one sample
(`algorithms/credit.py`), so grpo, rloo, reinforce_plus_plus(_baseline) and gae give a token the same advantage in
both (with outcome rewards; concat's single step reward is the total).

Step identity (GiGPO's anchor states): `step_state_hashes[t]` is the hash of the environment state turn t acted on
(`envs.base.state_hash` of the env's `state_key()` or, without one, of the observation). A turn that called a tool
acted on the state and the tool results seen since, so its hash covers both.

Why an episode ended, `metadata["end_reason"]`: done (the environment said so), max_turns, length (the
conversation reached `max_total_tokens`), env_error (reset/step raised or its worker crashed), timeout (a step
or tool passed its time limit and was killed). env_error and timeout also make the trajectory FAILED with a
one-line `failure_reason` ("env_timeout: ..."), so the ledger records it and the run goes on.
`metadata["steps"]` lists each turn's token span in the conversation: `start`/`end` of the model's tokens and
`obs_end`, where the observation or tool result appended after it ends; plus the turn's reward, whether it was a
tool call, and the env's info.

Rewards: without a reward function, `step_rewards` are the environment's rewards per turn (0 for tool turns) and
`reward` is their sum. With one (`reward_fn`, verl's signature, run through `score_safely`: in the worker pool for
user code), it is called once per finished episode with `solution_str` = the transcript after the datum's prompt
and `extra_info` = the datum's plus "steps" (each turn's action, observation, env reward), "end_reason" and
"env_rewards". It returns a number or `{"score": s, "step_rewards": [{"step_index": i, "reward": r}, ...]}`:
- a score only: `reward` = s, placed on the last turn (earlier turns 0; GiGPO's discounted returns carry it back);
- with step_rewards: turn i gets r (turns not listed get None, which GiGPO counts as 0), and `reward` = s is the
  reported episode reward. Indices outside the episode fail the trajectory (reason reward_bad_step_rewards).
With layout "concat" (one row) the step rewards collapse to [reward].

Resuming (token-level resume, api/progress.py): given a `SampleProgress`, the workflow puts a mark of the episode
into it at the start of every turn and when the episode ends (`_EpisodeMark`: the conversation, each finished turn's
tokens, log-probs and versions, rewards, steps and state hashes, and the environment's pickled state, which is all
the environment ever is between calls: envs/session.py), and the current turn's tokens go into its generation as
they come back. A checkpoint therefore saves the episode as of the current turn's start plus that turn's tokens so
far; a resumed run loads the environment back in a worker and plays on from that turn, continuing its generation
from the saved tokens (a step or tool call that was running at the checkpoint runs again from the saved state). An
environment whose saved state no longer loads restarts its episode from the prompt (outcome `env_not_restored`,
logged and counted by the executor).
"""

from __future__ import annotations

import base64
import logging
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

from rllm.experimental.fully_async.api.progress import ENV_NOT_RESTORED, GenerationProgress, SampleProgress
from rllm.experimental.fully_async.api.trajectory import TrajectoryStatus, VersionedSequence, VersionedTrajectory
from rllm.experimental.fully_async.api.workflow import GenerationClient
from rllm.experimental.fully_async.engines.client import EngineHTTPError, GenerationResult
from rllm.experimental.fully_async.envs.base import EnvSpec, state_hash
from rllm.experimental.fully_async.envs.session import EnvError, IsolatedEnv
from rllm.experimental.fully_async.workers.pool import WorkerPool
from rllm.experimental.fully_async.workflows.base import RewardFn, score_safely
from rllm.experimental.fully_async.workflows.chat_turns import ChatTurns
from rllm.experimental.fully_async.workflows.tools import ToolBox, ToolError

logger = logging.getLogger(__name__)

Layout = Literal["per_step", "concat"]
EndReason = Literal["done", "max_turns", "length", "env_error", "timeout"]


def episode_seed(datum: Any) -> int:
    """The env's reset seed: `extra_info["seed"]`, else a stable hash of the prompt id, so that every trajectory
    of a group starts from the same state (GiGPO compares them state by state)."""
    extra = datum.extra_info or {}
    if "seed" in extra:
        return int(extra["seed"])
    return zlib.crc32(str(datum.prompt_uid).encode())


@dataclass
class _Episode:
    """The conversation and per-turn records while an episode runs. The lists only ever grow, so a prefix of each
    is the episode as it was earlier (`_EpisodeMark`)."""

    context: list[int]
    first_obs_end: int
    identity: str = ""  # the state hash the next turn acts on (GiGPO)
    turns: list[tuple[int, Any]] = field(default_factory=list)  # (start index in context, GenerationResult)
    rewards: list[float] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    end_reason: EndReason = "max_turns"
    failure: str | None = None
    tool_seen: str = ""  # tool results since the last env step: part of the state the next turn acts on
    next_turn: int = 0
    finished: bool = False  # every turn played: only the reward is left

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> _Episode:
        """An episode saved by `_EpisodeMark.to_json` (KeyError/TypeError/ValueError if malformed)."""
        turns = [
            (
                int(t["start"]),
                GenerationResult(
                    output_ids=[int(x) for x in t["output_ids"]],
                    logprobs=[float(x) for x in t["logprobs"]],
                    versions=[int(x) for x in t["versions"]],
                    finish_reason=str(t["finish_reason"]),
                    num_resumes=int(t["num_resumes"]),
                    prompt_tokens=int(t["start"]),
                ),
            )
            for t in doc["turns"]
        ]
        return cls(
            context=[int(x) for x in doc["context"]],
            first_obs_end=int(doc["first_obs_end"]),
            identity=str(doc["identity"]),
            turns=turns,
            rewards=[float(r) for r in doc["rewards"]],
            hashes=[str(h) for h in doc["hashes"]],
            steps=[dict(step) for step in doc["steps"]],
            end_reason=doc["end_reason"],
            failure=doc["failure"],
            tool_seen=str(doc["tool_seen"]),
            next_turn=int(doc["turn"]),
            finished=bool(doc["finished"]),
        )


class _EpisodeMark:
    """The episode at the start of a turn, for a checkpoint (`SampleProgress.episode`): the lengths of its growing
    lists and the few values that change, taken in O(1) per turn; turned into JSON only when a checkpoint is taken."""

    def __init__(self, episode: _Episode, env_state: bytes | None) -> None:
        self.episode = episode
        self.lengths = tuple(len(x) for x in (episode.context, episode.turns, episode.rewards, episode.hashes))
        self.steps = len(episode.steps)
        self.values = (episode.identity, episode.end_reason, episode.failure, episode.tool_seen)
        self.turn, self.finished = episode.next_turn, episode.finished
        self.env_state = env_state  # bytes are immutable: the environment as it was at the mark

    def to_json(self) -> dict[str, Any]:
        e = self.episode
        n_context, n_turns, n_rewards, n_hashes = self.lengths
        identity, end_reason, failure, tool_seen = self.values
        turns = [
            {
                "start": start,
                "output_ids": list(r.output_ids),
                "logprobs": list(r.logprobs),
                "versions": list(r.versions),
                "finish_reason": r.finish_reason,
                "num_resumes": r.num_resumes,
            }
            for start, r in e.turns[:n_turns]
        ]
        return {
            "turn": self.turn,
            "finished": self.finished,
            "context": e.context[:n_context],
            "first_obs_end": e.first_obs_end,
            "identity": identity,
            "turns": turns,
            "rewards": e.rewards[:n_rewards],
            "hashes": e.hashes[:n_hashes],
            "steps": [dict(step) for step in e.steps[: self.steps]],
            "end_reason": end_reason,
            "failure": failure,
            "tool_seen": tool_seen,
            "env": base64.b64encode(self.env_state).decode("ascii") if self.env_state is not None else None,
            "generated_tokens": sum(len(t["output_ids"]) for t in turns),
        }


@dataclass
class MultiTurnWorkflow:
    """See the module docstring. `sampling_params` are SGLang's; `max_new_tokens` bounds one turn."""

    env: EnvSpec
    sampling_params: dict[str, Any]
    pool: WorkerPool | None = None  # None: run the environment in-process (trusted built-ins, tests)
    tools: ToolBox | None = None
    layout: Layout = "per_step"
    observation_role: str = "user"
    reward_fn: RewardFn | None = None  # None: the environment's rewards (module docstring)
    reward_timeout_s: float = 30.0
    name: str = field(default="multi_turn", init=False)

    def __post_init__(self) -> None:
        if self.layout not in ("per_step", "concat"):
            raise ValueError(f"workflow.layout must be per_step or concat, got {self.layout!r}")
        self._turns: dict[int, ChatTurns] = {}

    def _chat(self, tokenizer: Any) -> ChatTurns:
        # One probe per tokenizer object: rendering the probe conversation costs a few template calls.
        key = id(tokenizer)
        if key not in self._turns:
            self._turns[key] = ChatTurns(tokenizer)
        return self._turns[key]

    async def run(
        self,
        client: GenerationClient,
        tokenizer: Any,
        datum: Any,
        sample_index: int,
        progress: SampleProgress | None = None,
    ) -> VersionedTrajectory:
        """One episode. `progress` (api/progress.py): the episode is recorded into it turn by turn; restored from a
        checkpoint, the episode goes on from the turn it was in (module docstring, "Resuming")."""
        uid = f"{datum.prompt_uid}/{sample_index}"
        env = IsolatedEnv(self.env, self.pool)
        episode = await self._restored(env, progress, uid) if progress is not None and progress.episode else None
        if episode is None:
            task = {**(datum.extra_info or {}), "ground_truth": datum.ground_truth}
            try:
                observation, identity = await env.reset(episode_seed(datum), task)
            except EnvError as exc:
                return self._failed(uid, datum, exc)
            context = list(datum.prompt_ids)
            context += self._chat(tokenizer).content_ids(self.observation_role, observation) if observation else []
            episode = _Episode(context=context, first_obs_end=len(context), identity=identity)
            if progress is not None:
                progress.generation = GenerationProgress()  # nothing restored to continue
        if not episode.finished:
            await self._play(client, tokenizer, env, episode, uid, progress)
        if episode.end_reason == "max_turns" and len(episode.context) >= self.env.max_total_tokens:
            episode.end_reason = "length"
        trajectory = self._trajectory(uid, datum, episode)
        if self.reward_fn is not None and trajectory.status == TrajectoryStatus.OK:
            await self._score(trajectory, datum, tokenizer, episode)
        return trajectory

    async def _restored(self, env: IsolatedEnv, progress: SampleProgress, uid: str) -> _Episode | None:
        """The saved episode with its environment loaded back, or None (and the record reset) when the environment
        cannot be: that episode starts over, counted under its outcome."""
        doc = progress.episode
        episode = _Episode.from_json(doc)
        try:
            if doc.get("env") is None:
                raise EnvError("env_error", "no saved environment state")
            await env.restore(base64.b64decode(doc["env"]))
        except EnvError as exc:
            logger.warning("sample %s: its environment could not be restored (%s); restarting the episode", uid, exc)
            progress.restart(ENV_NOT_RESTORED)
            return None
        return episode

    async def _play(
        self,
        client: GenerationClient,
        tokenizer: Any,
        env: IsolatedEnv,
        episode: _Episode,
        uid: str,
        progress: SampleProgress | None,
    ) -> None:
        """Play turns from `episode.next_turn` until the episode ends; records a mark in `progress` at each turn's
        start (the generation record is new for each turn but a restored one's first) and when it ends."""
        chat = self._chat(tokenizer)
        keep_generation = True  # a restored turn goes on from its saved tokens
        for turn in range(episode.next_turn, self.env.max_turns):
            episode.next_turn = turn
            if progress is not None:
                if not keep_generation:
                    progress.generation = GenerationProgress()
                progress.episode = _EpisodeMark(episode, env.state)
            keep_generation = False
            budget = self.env.max_total_tokens - len(episode.context)
            if budget <= 0:
                episode.end_reason = "length"
                break
            params = dict(self.sampling_params)
            params["max_new_tokens"] = min(int(params.get("max_new_tokens", budget)), budget)
            kwargs = {} if progress is None else {"progress": progress.generation}
            try:
                result = await client.generate(list(episode.context), params, rid=f"{uid}/turn{turn}", **kwargs)
            except EngineHTTPError as exc:  # e.g. the conversation outgrew the engine's context length
                episode.end_reason, episode.failure = "length", f"engine_rejected: {exc}"
                break
            start = len(episode.context)
            episode.turns.append((start, result))
            tool_seen = episode.tool_seen
            episode.hashes.append(state_hash(episode.identity + tool_seen) if tool_seen else episode.identity)
            episode.context += result.output_ids
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            step: dict[str, Any] = {"index": turn, "start": start, "end": len(episode.context), "tool": False}
            call = self.tools.parse(text) if self.tools is not None else None
            try:
                if call is not None:
                    step["tool"] = True
                    reply, reward, done, info = await self.tools.run(call, self.pool), 0.0, False, {"tool": call.name}
                    role = "tool"
                    episode.tool_seen += reply
                else:
                    reply, reward, done, info, episode.identity = await env.step(text)
                    role, episode.tool_seen = self.observation_role, ""
            except (EnvError, ToolError) as exc:
                step["obs_end"] = len(episode.context)
                episode.steps.append(step)
                episode.rewards.append(0.0)
                episode.end_reason = "timeout" if exc.kind == "timeout" else "env_error"
                prefix = "tool" if isinstance(exc, ToolError) else "env"
                episode.failure = f"{prefix}_{episode.end_reason.removeprefix('env_')}: {exc.reason}"
                break
            episode.rewards.append(reward)
            step |= {"reward": reward, "info": info, "action": text, "observation": reply}
            if done:
                step["obs_end"] = len(episode.context)
                episode.steps.append(step)
                episode.end_reason = "done"
                break
            if turn + 1 < self.env.max_turns:  # the last observation would never be acted on
                episode.context += chat.message_ids(role, reply, result.output_ids)
            step["obs_end"] = len(episode.context)
            episode.steps.append(step)
        episode.finished = True
        if progress is not None:
            progress.generation = GenerationProgress()
            progress.episode = _EpisodeMark(episode, env.state)

    async def _score(self, trajectory: VersionedTrajectory, datum: Any, tokenizer: Any, episode: _Episode) -> None:
        """Replace the environment's rewards by the reward function's (rules in the module docstring)."""
        extra = dict(datum.extra_info or {}) | {
            "steps": [dict(step) for step in episode.steps],
            "end_reason": episode.end_reason,
            "env_rewards": list(episode.rewards),
        }
        transcript = tokenizer.decode(episode.context[len(datum.prompt_ids) :], skip_special_tokens=True)
        outcome = await score_safely(
            self.reward_fn,  # type: ignore[arg-type]
            self.reward_timeout_s,
            data_source=datum.data_source,
            solution_str=transcript,
            ground_truth=datum.ground_truth,
            extra_info=extra,
        )
        failure = outcome.failure
        n = len(trajectory.sequences) if self.layout == "per_step" else 1
        rewards: list[float | None] = [0.0] * n
        listed = (outcome.extra or {}).pop("step_rewards", None)
        if failure is None and listed is not None:
            rewards = [None] * n
            try:
                for item in listed:
                    index, value = int(item["step_index"]), float(item["reward"])
                    if not 0 <= index < len(episode.turns):
                        raise ValueError(f"step_index {index} outside the episode's {len(episode.turns)} turns")
                    rewards[index if self.layout == "per_step" else 0] = value
            except (KeyError, TypeError, ValueError) as exc:
                failure = f"reward_bad_step_rewards: {type(exc).__name__}: {exc}"
        elif failure is None:
            rewards[-1] = outcome.reward
        if failure is not None:
            trajectory.status, trajectory.failure_reason = TrajectoryStatus.FAILED, failure
            logger.warning("sample %s failed: %s", trajectory.uid, failure)
            return
        trajectory.reward = float(outcome.reward)  # type: ignore[arg-type]
        trajectory.step_rewards = rewards if listed is None or self.layout == "per_step" else [trajectory.reward]
        if outcome.extra:
            trajectory.metadata["reward_extra"] = outcome.extra

    def _failed(self, uid: str, datum: Any, exc: EnvError) -> VersionedTrajectory:
        reason = "timeout" if exc.kind == "timeout" else "env_error"
        trajectory = VersionedTrajectory(uid=uid, prompt_uid=datum.prompt_uid, sequences=[])
        trajectory.status = TrajectoryStatus.FAILED
        trajectory.failure_reason = f"env_{reason.removeprefix('env_')}: {exc.reason}"
        trajectory.metadata |= {"end_reason": reason, "steps": [], "num_turns": 0}
        logger.warning("sample %s failed at reset: %s", uid, exc.reason)
        return trajectory

    def _trajectory(self, uid: str, datum: Any, episode: _Episode) -> VersionedTrajectory:
        sequences = self._per_step(episode) if self.layout == "per_step" else self._concat(episode)
        total = float(sum(episode.rewards))
        trajectory = VersionedTrajectory(uid=uid, prompt_uid=datum.prompt_uid, sequences=sequences, reward=total)
        if self.layout == "per_step":
            trajectory.step_rewards = list(episode.rewards)
            trajectory.step_state_hashes = list(episode.hashes)
        else:
            trajectory.step_rewards = [total]
            trajectory.step_state_hashes = episode.hashes[:1] or [""]
        trajectory.metadata |= {
            "end_reason": episode.end_reason,
            "steps": episode.steps,
            "num_turns": len(episode.turns),
            "prompt_end": episode.first_obs_end,
            "context_tokens": len(episode.context),
        }
        if episode.failure is not None or not sequences:
            trajectory.status = TrajectoryStatus.FAILED
            trajectory.failure_reason = episode.failure or "no_turns: the episode ended before the model acted"
            logger.warning("sample %s failed: %s", uid, trajectory.failure_reason)
        return trajectory

    @staticmethod
    def _per_step(episode: _Episode) -> list[VersionedSequence]:
        return [
            VersionedSequence(
                prompt_ids=episode.context[:start],
                response_ids=list(result.output_ids),
                response_logprobs=list(result.logprobs),
                response_versions=list(result.versions),
                finish_reason=result.finish_reason,
                num_resumes=result.num_resumes,
                lora_paths=result.lora_paths,
            )
            for start, result in episode.turns
        ]

    @staticmethod
    def _concat(episode: _Episode) -> list[VersionedSequence]:
        if not episode.turns:
            return []
        begin = episode.first_obs_end
        response = episode.context[begin:]
        logprobs, versions, mask = [0.0] * len(response), [0] * len(response), [0] * len(response)
        version = episode.turns[0][1].versions[0] if episode.turns[0][1].versions else 0
        for (start, result), step in zip(episode.turns, episode.steps, strict=True):
            for i, (lp, v) in enumerate(zip(result.logprobs, result.versions, strict=True)):
                logprobs[start - begin + i], versions[start - begin + i], mask[start - begin + i] = lp, v, 1
            version = result.versions[-1] if result.versions else version
            # Observation tokens after the turn carry the version of the turn before them (masked, never trained).
            for j in range(start + len(result.output_ids), step["obs_end"]):
                versions[j - begin] = version
        return [
            VersionedSequence(
                prompt_ids=episode.context[:begin],
                response_ids=response,
                response_logprobs=logprobs,
                response_versions=versions,
                loss_mask=mask,
                finish_reason=episode.turns[-1][1].finish_reason,
                num_resumes=sum(r.num_resumes for _, r in episode.turns),
                lora_paths=_turn_adapters(episode),
            )
        ]


def _turn_adapters(episode: _Episode) -> list[str | None] | None:
    """The adapter each turn's call named (Sequence.lora_paths of a concatenated episode); None: none named one."""
    names = [result.lora_path for _, result in episode.turns]
    return None if all(name is None for name in names) else names
