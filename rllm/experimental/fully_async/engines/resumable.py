"""Resumable generation: one sequence generated across weight updates, as a plain async function.

When a piece comes back with finish reason `abort` (a weight sync paused the engine), `generate_resumable`
re-sends prompt + tokens so far with the remaining token budget - the engine holds it until
`/continue_generation` - and stitches the pieces. Every token carries the policy version the engine reported for
its piece (`meta_info.weight_version`, as int), so a resumed sequence holds segments of several versions.
The pool's failover covers an engine that dies mid-request: tokens already received are kept and the rest is
generated elsewhere. To stop a generation, cancel the task that awaits it; the closed connection makes the
engine drop the request.

Two SGLang 0.5.6 facts shape the parsing (`tokenizer_manager._handle_abort_req`): a request aborted while still in
the engine's waiting queue comes back with no `weight_version` and no `prompt_tokens`; it produced no token, so it
is an unstarted piece and is simply re-sent.

`generate_resumable_batch` does the same for several prompts at once, as SGLang's batched /generate (input_ids a
list of prompts, one rid each; the answer is the list of outputs when the last prompt ends): each round re-sends,
together, the prompts a sync interrupted, each from its own tokens so far.

Checkpoints (token-level resume): a caller may pass a `GenerationProgress` (api/progress.py) per sequence. The
tokens so far are kept in it as each piece comes back, so the rollout service can save them, and one restored from
a checkpoint is continued from its tokens exactly as after a weight sync (or, already finished, returned without
calling an engine). A checkpoint pauses the engines (mode abort) so that every piece in flight comes back with its
tokens first (`EnginePool.generates_before`).

`partial_rollout=False` (verl/rLLM's `async_training.partial_rollout: false`): a generation interrupted by a weight
sync is not continued with the new weights. Its tokens are discarded and it is regenerated from the prompt (held
by the paused engine, so it starts on the new weights); every finished sequence therefore carries exactly one
weight version. The discarded tokens are counted in `GenerationResult.discarded_tokens`.

`lora_path` (LoRA): the adapter every piece of the sequence is generated with (SGLang's `/generate` field: an
adapter NAME). The engine holds a request's adapter from its first token to its last, and SGLang does not say in its
answer which adapter it used, so the result records the name sent (`GenerationResult.lora_path`) and, for a
versioned name (`engines/lora.py`: `policy-v<N>`), every token's version is N; for another name, or none, the
version is the engine's `weight_version` as before.

`run_seed` (engines.sampling_seed): each sequence carries SGLang's `sampling_seed`, derived from the run seed and its
rid (`core.ids.sampling_seed_for`), in every piece; the engine keys a draw by the token's position, so a resumed
piece continues the draws where the interrupted one stopped (the same tokens, if the weights did not change).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from rllm.experimental.fully_async.api.progress import GenerationProgress
from rllm.experimental.fully_async.api.trajectory import VersionedSequence
from rllm.experimental.fully_async.core.ids import sampling_seed_for
from rllm.experimental.fully_async.engines.http import EngineError
from rllm.experimental.fully_async.engines.lora import adapter_version
from rllm.experimental.fully_async.engines.pool import EnginePool

logger = logging.getLogger(__name__)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # what SGLang uses when sampling_params has no max_new_tokens


@dataclass(frozen=True)
class GenerationResult:
    """One generation, stitched across resumes; the three per-token lists have equal length."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version (engine weight_version) that produced each token
    finish_reason: str  # stop | length (abort never survives: the client resumes it)
    num_resumes: int  # pieces that ended in abort (weight updates) and were continued
    prompt_tokens: int
    num_retries: int = 0  # connection failures survived (engine down, request re-sent)
    discarded_tokens: int = 0  # tokens thrown away by restarts from the prompt (partial_rollout=False)
    lora_path: str | None = None  # the LoRA adapter every piece named (None: the base model)

    def to_sequence(self, prompt_ids: list[int]) -> VersionedSequence:
        """The protocol message the trainer consumes."""
        return VersionedSequence(
            prompt_ids=list(prompt_ids),
            response_ids=list(self.output_ids),
            response_logprobs=list(self.logprobs),
            response_versions=list(self.versions),
            finish_reason=self.finish_reason,
            num_resumes=self.num_resumes,
            lora_paths=self.lora_paths,
        )

    @property
    def lora_paths(self) -> list[str | None] | None:
        """`Sequence.lora_paths` of this one call: [its adapter], or None for the base model."""
        return None if self.lora_path is None else [self.lora_path]


@dataclass(frozen=True)
class Piece:
    """What one /generate call returned."""

    output_ids: list[int]
    logprobs: list[float]
    version: int | None  # None: an unstarted piece (aborted in the waiting queue, no token)
    finish_type: str
    prompt_tokens: int


def parse_piece(url: str, data: Any) -> Piece:
    """Read one /generate body; raises EngineError naming the engine when it is not what SGLang returns."""
    try:
        output_ids = [int(t) for t in data["output_ids"]]
        meta = data["meta_info"]
        finish = meta["finish_reason"]
        finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
        entries = meta["output_token_logprobs"]
        raw_version = meta.get("weight_version")
    except (KeyError, TypeError, AttributeError) as exc:
        raise EngineError(f"{url}/generate returned an unexpected body ({exc!r}): {str(data)[:300]}") from exc
    if raw_version is None:
        if finish_type == "abort" and not output_ids:  # aborted in the waiting queue: nothing happened
            return Piece([], [], None, finish_type, 0)
        raise EngineError(f"{url}/generate returned tokens without a weight_version: {str(data)[:300]}")
    try:
        version = int(raw_version)
    except (TypeError, ValueError) as exc:
        raise EngineError(
            f"{url} reports weight_version {raw_version!r}, which is not an integer policy version; "
            "launch it with --weight-version 0 and update weights with integer versions"
        ) from exc
    logprobs = [float(e[0]) for e in entries]
    token_ids = [int(e[1]) for e in entries]
    if finish_type == "abort" and len(token_ids) != len(output_ids):
        # An abort can cut the logprob stream one token short; keep only tokens that have a log-prob.
        n = min(len(token_ids), len(output_ids))
        output_ids, token_ids, logprobs = output_ids[:n], token_ids[:n], logprobs[:n]
    if token_ids != output_ids:
        raise EngineError(f"{url}/generate: output_token_logprobs do not match output_ids")
    return Piece(output_ids, logprobs, version, finish_type, int(meta.get("prompt_tokens", 0)))


class _Resumption:
    """One sequence's state across its pieces: what to send next, and what each returned piece means.

    The tokens so far live in a `GenerationProgress` (api/progress.py): the caller's, when it passes one, so that a
    checkpoint can read them while the sequence generates, and a sequence restored from a checkpoint starts from
    its tokens (or, finished, is not sent at all).
    """

    def __init__(
        self,
        input_ids: list[int],
        params: dict[str, Any],
        rid: str,
        max_resumes: int,
        partial_rollout: bool,
        run_seed: int | None = None,
        progress: GenerationProgress | None = None,
        lora_path: str | None = None,
    ) -> None:
        self.prompt = list(input_ids)
        self.lora_path = lora_path
        self.adapter_version = adapter_version(lora_path)  # a versioned adapter's policy version, else None
        if run_seed is not None and params.get("sampling_seed") is None:
            # its own draws, the same in every piece: a resumed piece continues at its positions (SGLang's rule)
            params = {**params, "sampling_seed": sampling_seed_for(run_seed, rid)}
        self.params = params
        self.max_new = int(params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS))
        self.rid = rid
        self.max_resumes = max_resumes
        self.partial_rollout = partial_rollout
        self.progress = progress if progress is not None else GenerationProgress()
        self.retries = self.discarded = 0
        if self.progress.finish_reason is None and len(self.progress) >= self.max_new:
            self.progress.finish_reason = "length"  # restored with its whole budget used: nothing left to send

    @property
    def done(self) -> bool:
        return self.progress.finish_reason is not None

    def payload(self) -> dict[str, Any]:
        """The /generate body of the next piece (one prompt)."""
        prompt, params = self.next_input()
        body: dict[str, Any] = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        return body

    def next_input(self) -> tuple[list[int], dict[str, Any]]:
        """input_ids and sampling_params of the next piece: prompt + tokens so far, the budget that is left."""
        out = self.progress.output_ids
        return self.prompt + out, {**self.params, "max_new_tokens": self.max_new - len(out)}

    def absorb(self, piece: Piece) -> bool:
        """Take one returned piece; True when the sequence is finished, False when it must be re-sent."""
        state = self.progress
        if piece.finish_type == "abort" and not self.partial_rollout and (state.output_ids or piece.output_ids):
            # Not continued on new weights: start over from the prompt (one version per sequence).
            self.discarded += state.discard() + len(piece.output_ids)
            self._count_resume("was interrupted {n} times without finishing")
            logger.debug("request %s aborted; regenerating from the prompt (partial_rollout=False)", self.rid)
            return False
        # One step of the event loop from here to the end: a checkpoint never sees the lists half extended.
        state.output_ids += piece.output_ids
        state.logprobs += piece.logprobs
        if piece.output_ids:
            assert piece.version is not None  # parse_piece guarantees a version for any token
            version = self.adapter_version if self.adapter_version is not None else piece.version
            state.versions += [version] * len(piece.output_ids)
        if piece.finish_type != "abort":
            state.finish_reason = piece.finish_type
            return True
        if len(state.output_ids) >= self.max_new:
            state.finish_reason = "length"  # the budget ran out exactly as the pause came
            return True
        self._count_resume(
            "was aborted {n} times without finishing; an engine is aborting it repeatedly "
            "(is someone calling /abort_request?)"
        )
        logger.debug("request %s aborted after %d tokens; resuming", self.rid, len(state.output_ids))
        return False

    def _count_resume(self, why: str) -> None:
        self.progress.num_resumes += 1
        if self.progress.num_resumes > self.max_resumes:
            raise EngineError(f"request {self.rid} " + why.format(n=self.progress.num_resumes))

    def result(self) -> GenerationResult:
        state = self.progress
        assert state.finish_reason is not None
        return GenerationResult(
            output_ids=list(state.output_ids),
            logprobs=list(state.logprobs),
            versions=list(state.versions),
            finish_reason=state.finish_reason,
            num_resumes=state.num_resumes,
            prompt_tokens=len(self.prompt),
            num_retries=self.retries,
            discarded_tokens=self.discarded,
            lora_path=self.lora_path,
        )


async def generate_resumable(
    pool: EnginePool,
    input_ids: list[int],
    sampling_params: dict[str, Any] | None = None,
    *,
    rid: str | None = None,
    request_timeout_s: float = 600.0,
    max_resumes: int = 64,
    partial_rollout: bool = True,
    run_seed: int | None = None,
    progress: GenerationProgress | None = None,
    lora_path: str | None = None,
) -> GenerationResult:
    """Generate from `input_ids` on `pool`, resuming across weight updates; see the module docstring.

    `partial_rollout=False`: an interrupted generation restarts from the prompt instead of being continued.
    `run_seed`: add `sampling_seed = core.ids.sampling_seed_for(run_seed, rid)` unless the params carry one.
    `progress`: where the tokens so far are kept (and, restored from a checkpoint, where they are continued from).
    `lora_path`: the LoRA adapter (its name) every piece is generated with.
    """
    params = dict(sampling_params or {})
    state = _Resumption(
        input_ids,
        params,
        rid or uuid.uuid4().hex,
        max_resumes,
        partial_rollout,
        run_seed,
        progress=progress,
        lora_path=lora_path,
    )
    if state.done:  # restored finished: its result is already known
        return state.result()
    for piece_index in itertools.count():
        payload = state.payload()
        url, data, failures = await pool.post_generate(payload, f"{state.rid}-{piece_index}", request_timeout_s)
        state.retries += failures
        if state.absorb(parse_piece(url, data)):
            return state.result()
    raise AssertionError("unreachable")


async def generate_resumable_batch(
    pool: EnginePool,
    prompts: list[list[int]],
    sampling_params: dict[str, Any] | None = None,
    *,
    rids: list[str],
    request_timeout_s: float = 600.0,
    max_resumes: int = 64,
    partial_rollout: bool = True,
    run_seed: int | None = None,
    progress: list[GenerationProgress] | None = None,
    lora_path: str | None = None,
) -> list[GenerationResult]:
    """`generate_resumable` for several prompts sent as SGLang batched requests (one /generate per round).

    Round 1 sends every prompt in one request; each later round re-sends, together, the sequences a weight sync
    interrupted (they were all paused by the same sync), each with its own tokens so far and remaining budget. A
    group of samples of one prompt costs one HTTP call instead of n: the per-request work of the client and the
    engine (JSON, connection, task and timer bookkeeping) was most of both processes' CPU on the embedded default.
    SGLang answers a batch when its last prompt finishes, so batch only what is consumed together (a group).
    """
    if len(rids) != len(prompts) or (progress is not None and len(progress) != len(prompts)):
        raise ValueError(
            f"generate_resumable_batch: {len(prompts)} prompts but {len(rids)} rids"
            + ("" if progress is None else f" and {len(progress)} progress records")
        )
    params = dict(sampling_params or {})
    records = progress if progress is not None else [None] * len(prompts)
    states = [
        _Resumption(p, params, r, max_resumes, partial_rollout, run_seed, progress=g, lora_path=lora_path)
        for p, r, g in zip(prompts, rids, records, strict=True)
    ]
    pending = [s for s in states if not s.done]  # restored finished ones are not sent again
    for piece_index in itertools.count():
        if not pending:
            return [s.result() for s in states]
        inputs = [s.next_input() for s in pending]
        payload = {
            "input_ids": [ids for ids, _ in inputs],
            "sampling_params": [p for _, p in inputs],
            "return_logprob": True,
        }
        if lora_path is not None:
            payload["lora_path"] = lora_path  # one name for the whole batch (SGLang broadcasts it)
        round_rids = [f"{s.rid}-{piece_index}" for s in pending]
        url, data, failures = await pool.post_generate(payload, round_rids, request_timeout_s)
        if not isinstance(data, list) or len(data) != len(pending):
            raise EngineError(
                f"{url}/generate answered a batch of {len(pending)} with {str(data)[:200]}; expected a list of "
                f"{len(pending)} outputs"
            )
        still = []
        for state, item in zip(pending, data, strict=True):
            state.retries += failures
            if not state.absorb(parse_piece(url, item)):
                still.append(state)
        pending = still
    raise AssertionError("unreachable")
