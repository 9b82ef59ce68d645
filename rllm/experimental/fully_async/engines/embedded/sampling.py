"""Sampling parameters and the batched sampler of the embedded engine.

`SamplingParams` parses the `sampling_params` object of SGLang's `/generate` (field names and defaults as in
SGLang 0.5.6's `sampling_params.py`). The embedded engine has no tokenizer, so text-only knobs (`stop` strings,
detokenisation flags) are accepted only at their no-op values, and anything it cannot honour is rejected with a
message naming the key rather than silently ignored: a caller must never believe a penalty was applied when it
was not.

`sample` turns one row of logits per request into one token per request. The log-prob it reports is the one the
trainer recomputes (verl's `logprobs_from_logits(logits / T)`): `log_softmax(logits / T)` in float32, before any
top-k/top-p/min-p truncation, and `log_softmax(logits)` for greedy rows. Truncation changes only which token is
drawn, as in SGLang's sampler.

A request's `sampling_seed` (SGLang 0.5.6's `SamplingParams.sampling_seed`) makes its draws its own: the token at a
position is drawn with a uniform that is a function of (seed, position of the token fed) alone (`seeded_draw`:
splitmix64, then the inverse CDF of the row's probabilities), so the same seed, weights and tokens so far give the
same token whatever else runs in the batch, whatever the engine drew before, and after a resume (the positions
continue). Requests without a seed draw from the engine's one generator, as before: their tokens depend on arrival
order and batch makeup.

SGLang 0.5.6 draws a seeded request differently (`multinomial_with_seed`, layers/sampler.py: Gumbel-max with noise
hashed from seed, position and column), and that rule is not a sampler of the distribution: the noise of the
columns is the same hash XOR-ed with a per-column constant, so it is correlated, and the draws are biased
(probabilities [0.5, 0.3, 0.2] come out as [0.47, 0.50, 0.03]; on a random 1000-token softmax the total-variation
distance over 20,000 draws is 0.21 where sampling noise alone is 0.04; tests/engines/test_sampling_seed.py). The
engine's rollout log-probs then describe a policy other than the one that drew the tokens. The embedded engine therefore
draws exactly; the SGLang stand-in
(`seeded_rule="sglang-0.5.6"`, `sglang_seeded_choice`) reproduces SGLang's rule, quirk included. SGLang reads the
seed only with `--enable-deterministic-inference` (default 42 there, for every request); the embedded engine honours
one that is sent, always, and with that flag (scheduler.py) also gives every request the default and runs each
alone, so log-probs too are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# SGLang treats any temperature below this as greedy (sampling_params.py: _SAMPLING_EPS).
GREEDY_EPS = 1e-6
# SGLang's SamplingParams.sampling_seed default, applied under --enable-deterministic-inference.
DEFAULT_SAMPLING_SEED = 42
_INT32 = (-(2**31), 2**31 - 1)  # SGLang puts the seeds in an int32 tensor

# Text-only or unsupported SGLang keys, with the value at which they are a no-op for a token-in/token-out engine.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "stop": (None, "", []),
    "n": (1,),
    "min_new_tokens": (0,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "skip_special_tokens": (True, False),
    "spaces_between_special_tokens": (True, False),
    "no_stop_trim": (True, False),
    "stream_interval": (None,),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "logit_bias": (None,),
    "custom_params": (None,),
}


@dataclass(frozen=True)
class SamplingParams:
    """The SGLang sampling fields the embedded engine implements (defaults as SGLang's)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or any value <= 0) disables top-k
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False  # as SGLang: also disables stop_token_ids
    sampling_seed: int | None = None  # this request's own draws (module docstring); None: the engine's generator

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Parse and validate a `sampling_params` object; raises ValueError naming the offending key."""
        raw = dict(raw or {})
        for key, allowed in _NO_OP_VALUES.items():
            if key in raw:
                value = raw.pop(key)
                if value not in allowed:
                    raise ValueError(
                        f"sampling_params.{key}={value!r} is not supported by the embedded engine "
                        f"(it has no tokenizer/penalties); allowed: {allowed}"
                    )
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params key(s): {unknown}")
        try:
            params = cls(
                max_new_tokens=int(raw.get("max_new_tokens", 128)),
                temperature=float(raw.get("temperature", 1.0)),
                top_p=float(raw.get("top_p", 1.0)),
                top_k=int(raw.get("top_k", -1)),
                min_p=float(raw.get("min_p", 0.0)),
                stop_token_ids=frozenset(int(t) for t in (raw.get("stop_token_ids") or ())),
                ignore_eos=bool(raw.get("ignore_eos", False)),
                sampling_seed=_seed(raw.get("sampling_seed")),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed sampling_params: {exc}") from exc
        if params.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {params.max_new_tokens}")
        if params.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
        if not 0.0 <= params.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p must be in [0, 1], got {params.min_p}")
        return params


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not _INT32[0] <= value <= _INT32[1]:
        raise ValueError(f"sampling_seed must be an integer in [-2**31, 2**31), got {value!r}")
    return value


@dataclass(frozen=True)
class SampleOutput:
    """One token and its log-prob per row, as plain Python lists (the scheduler's bookkeeping is in Python)."""

    token_ids: list[int]
    logprobs: list[float]


SEEDED_RULES = ("exact", "sglang-0.5.6")


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generator: torch.Generator,
    positions: list[int] | None = None,
    seeded_rule: str = "exact",
) -> SampleOutput:
    """Draw one token per row of `logits` [B, V] under each row's parameters.

    Log-probs are `log_softmax(logits / T)` (float32) of the drawn token; greedy rows use T = 1 for the log-prob
    and argmax for the token. Rows with a `sampling_seed` draw at their `positions` (the position of the token each
    row fed; required when any row has a seed) with `seeded_draw`, or with SGLang's rule (`seeded_rule=
    "sglang-0.5.6"`: the stand-in), the others from `generator`. All rows
    are handled in one vectorised pass; the sort needed for top-k/top-p is only paid when some row asks for
    truncation.
    """
    logits = logits.float()
    vocab = logits.shape[1]
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    logprobs = torch.log_softmax(logits / temps.unsqueeze(1), dim=-1)
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        probs = logprobs.exp()
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        truncates = (top_k < vocab) | (top_p < 1.0) | (min_p > 0)
        sorted_kept = sorted_idx = None
        if bool(truncates.any()):
            sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab).unsqueeze(0)
            # Keep a token if it is within the top k and the mass strictly before it is below top_p, so the
            # most likely token always survives; min-p against the most likely token (which always survives).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            keep_sorted = (ranks < top_k.unsqueeze(1)) & (mass_before < top_p.unsqueeze(1))
            keep_sorted &= sorted_probs >= min_p.unsqueeze(1) * sorted_probs[:, :1]
            sorted_kept = sorted_probs * keep_sorted
            keep = torch.zeros_like(keep_sorted).scatter(1, sorted_idx, keep_sorted)
            probs = torch.where(truncates.unsqueeze(1), probs * keep, probs)
        seeded = torch.tensor([p.sampling_seed is not None for p in params], dtype=torch.bool) & ~greedy
        drawn = tokens.clone()
        shared = ~greedy & ~seeded
        if bool(shared.any()):
            # multinomial renormalises each row itself
            drawn[shared] = torch.multinomial(probs[shared], 1, generator=generator).squeeze(1)
        if bool(seeded.any()):
            if positions is None:
                raise ValueError("sample: rows with a sampling_seed need their positions")
            rows = seeded.nonzero().squeeze(1)
            seeds = torch.tensor([params[int(r)].sampling_seed for r in rows], dtype=torch.int32)
            where = torch.tensor([positions[int(r)] for r in rows], dtype=torch.long)
            if seeded_rule == "exact":
                drawn[rows] = seeded_draw(probs[rows], seeds, where)
            else:
                drawn[rows] = _sglang_rows(probs, sorted_kept, sorted_idx, truncates, rows, seeds, where)
        tokens = torch.where(greedy, tokens, drawn)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return SampleOutput(token_ids=tokens.tolist(), logprobs=chosen.tolist())


def seeded_draw(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One column per row of `weights` [n, m] (unnormalised probabilities), drawn exactly from them with a uniform
    that depends on the row's seed [n] and position [n] alone: u = splitmix64(splitmix64(seed) ^ position) as 53
    bits in (0, 1), the column the first whose cumulative weight (float64) exceeds u * total. A zero weight is never
    drawn."""
    state = _splitmix64(_splitmix64(seeds.to(torch.long)) ^ positions.to(torch.long))
    uniform = ((_shift_right(state, 11).double() + 0.5) / float(1 << 53)).unsqueeze(1)
    cumulative = weights.double().cumsum(dim=-1)
    chosen = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(1)
    return chosen.clamp(max=weights.shape[1] - 1)


def sglang_seeded_choice(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SGLang 0.5.6's `multinomial_with_seed` rule (biased: module docstring), for the stand-in: the argmax over
    columns of log(w + 1e-10) - log(-log(u)), u = ((((seed * 19349663) ^ (position * 73856093)) * 8589934591) ^
    (column * 479001599)) mod 2^24 / 2^24 clamped to [1e-10, 1 - 1e-10], the products wrapping in int32 (seed)
    then int64, as SGLang's tensors do."""
    columns = torch.arange(weights.shape[1], dtype=torch.long).unsqueeze(0)
    step_seed = (seeds.to(torch.int32) * 19349663) ^ (positions.to(torch.long) * 73856093)  # int32 wraps, then int64
    hashed = (step_seed.unsqueeze(1) * 8589934591) ^ (columns * 479001599)
    uniform = ((hashed % (1 << 24)).float() / (1 << 24)).clamp(1e-10, 1.0 - 1e-10)
    gumbel = -torch.log(-torch.log(uniform))
    return torch.argmax(torch.log(weights + 1e-10) + gumbel, dim=1)


def _sglang_rows(
    probs: torch.Tensor,
    sorted_kept: torch.Tensor | None,
    sorted_idx: torch.Tensor | None,
    truncates: torch.Tensor,
    rows: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """SGLang's two paths: without truncation over the probabilities in vocabulary order, with it over the kept ones
    in sorted order (the drawn rank mapped back to its token)."""
    out = torch.empty(len(rows), dtype=torch.long)
    direct = ~truncates[rows]
    if bool(direct.any()):
        out[direct] = sglang_seeded_choice(probs[rows[direct]], seeds[direct], positions[direct])
    if bool((~direct).any()):
        assert sorted_kept is not None and sorted_idx is not None
        rank = sglang_seeded_choice(sorted_kept[rows[~direct]], seeds[~direct], positions[~direct])
        out[~direct] = sorted_idx[rows[~direct]].gather(1, rank.unsqueeze(1)).squeeze(1)
    return out


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> sign-extends)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """Steele, Lea and Flood's splitmix64 finaliser on int64 bit patterns (wrapping products = uint64 arithmetic)."""
    z = x + _signed(0x9E3779B97F4A7C15)
    z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shift_right(z, 31)
