"""Elastic rollout capacity, the pure part: who the run's engines are, what a control request asks, whether a server
may join, how long the run may go on with none, and the record each membership change leaves
(docs/design.md#rule-engine-set-can-change).

The shells call these: the driver's control endpoint and its appliers (`runtime/run/elastic.py`), the CLI
(`cli/engines.py`). Nothing here touches HTTP, Ray, asyncio or files: a probe's answers come in as values.

- `Membership`: each engine of the run, by id ("0", "1", ... in the order they joined; an engine restarted in its
  slot keeps its id), its URL, where it came from (`launched`: the run started it; `registered`: someone else did)
  and its state (`starting` -> `active` -> `draining` -> gone).
- `parse_request`: a control request's JSON as an `ElasticRequest`, or one line saying what is wrong with it.
- `refusal_to_register`: whether a server someone launched elsewhere may join, from what it answered.
- `NoEngineClock`: with no engine left, generation waits (requests wait in the pool) until one joins or
  `engines.no_engine_timeout_s` passes; then the run stops with one line naming the key.
- `event_record`: one line of RUN_DIR/engine_events.jsonl, the contract `report` and `simulate` read. Its fields are
  exactly `EVENT_FIELDS`. `samples_moved` is non-zero only on `move` lines (so summing it counts each moved sample
  once): a `move` line precedes the `leave`, `lost` or `restart` line of the engine its samples left. A `move` line
  also says what the move cost (`SampleMoves`): `tokens_regenerated`, the tokens the engine reported generating for
  the moved samples beyond those it handed back (0 expected), and `samples_unanswered`, moved samples whose call
  never got an answer (their engine's tokens since are not known, so not counted in `tokens_regenerated`).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any, Literal

EngineSource = Literal["launched", "registered"]
EngineEventKind = Literal["join", "leave", "lost", "restart", "move"]
MemberState = Literal["starting", "active", "draining"]

CONTROL_FILE = "control.json"  # RUN_DIR/control.json: the control endpoint's URL and token, mode 0600
EVENTS_FILE = "engine_events.jsonl"  # RUN_DIR/engine_events.jsonl: one line per membership event
EVENT_FIELDS = (
    "time",
    "step",
    "event",
    "engine",
    "url",
    "samples_moved",
    "tokens_regenerated",
    "samples_unanswered",
    "engines_active",
    "source",
)
EVENT_KINDS: tuple[str, ...] = ("join", "leave", "lost", "restart", "move")
# The counts a `move` line carries, summed over the run into the engines/* metrics (`event_metrics`).
MOVE_TOTALS = ("samples_moved", "tokens_regenerated", "samples_unanswered")
OPS = ("add", "remove", "register", "list")
MAX_ADD = 64  # engines one `add` may ask for: a typo (1000) must not fork a thousand servers


@dataclass(frozen=True)
class SampleMoves:
    """What one engine handed on to the others (counted by the rollout client's pool, `EnginePool.sample_moves`).

    - `samples`: samples that continue on another engine from their tokens (aborted while it drained, cut off after
      the drain's timeout, or re-sent after a connection failure on it);
    - `tokens_regenerated`: of the aborted ones, the tokens the engine reported generating (SGLang's
      `completion_tokens`) beyond those it handed back with a log-prob (what the sample continues from): the next
      engine generates these again. 0 expected: an abort returns every token;
    - `samples_unanswered`: moved samples whose call got no answer (cut off, or the engine unreachable). Each
      continues from the tokens it had when sent; what the engine made for it since is not known, so it is not in
      `tokens_regenerated`.
    """

    samples: int = 0
    tokens_regenerated: int = 0
    samples_unanswered: int = 0


class ElasticError(ValueError):
    """A control request that cannot be applied; the message is the one line the user sees (the run unchanged)."""


@dataclass
class Member:
    """One engine of the run."""

    id: str
    url: str
    source: EngineSource
    state: MemberState = "active"
    slot: int | None = None  # the launcher's slot (launched engines), None for registered ones
    api_key: str | None = None  # a registered server's key (None: the run's own, or none)

    def listing(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "source": self.source, "state": self.state, "slot": self.slot}


@dataclass
class Membership:
    """The run's engines; see the module docstring."""

    members: dict[str, Member] = field(default_factory=dict)
    next_id: int = 0

    @classmethod
    def launched(cls, urls: list[str]) -> Membership:
        """The engines the run started with: ids "0".."N-1", slot i at urls[i]."""
        table = cls()
        for slot, url in enumerate(urls):
            table.add(url, "launched", slot=slot)
        return table

    def add(
        self,
        url: str,
        source: EngineSource,
        *,
        slot: int | None = None,
        state: MemberState = "active",
        api_key: str | None = None,
    ) -> Member:
        member = Member(str(self.next_id), normalize_url(url), source, state, slot, api_key)
        self.next_id += 1
        self.members[member.id] = member
        return member

    def get(self, engine_id: str) -> Member:
        """The engine `engine_id`; raises ElasticError naming the known ids when there is none."""
        member = self.members.get(str(engine_id))
        if member is None:
            known = ", ".join(f"{m.id} ({m.url})" for m in self.members.values()) or "none"
            raise ElasticError(f"no engine {engine_id!r} in this run; its engines: {known} (see `engines list`)")
        return member

    def by_url(self, url: str) -> Member | None:
        url = normalize_url(url)
        return next((m for m in self.members.values() if m.url == url), None)

    def by_slot(self, slot: int) -> Member | None:
        return next((m for m in self.members.values() if m.slot == slot), None)

    def drop(self, engine_id: str) -> Member:
        return self.members.pop(str(engine_id))

    @property
    def active(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == "active"]

    @property
    def starting(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == "starting"]

    def listing(self) -> list[dict[str, Any]]:
        return [m.listing() for m in self.members.values()]


def normalize_url(url: str) -> str:
    return str(url).strip().rstrip("/")


@dataclass(frozen=True)
class ElasticRequest:
    """One control request: `op` with its argument (`count` and `node` for add, `engine` for remove, `url`/`api_key`
    for register)."""

    op: str
    count: int = 0
    engine: str = ""
    url: str = ""
    api_key: str | None = None
    node: str | None = None  # add: the Ray cluster node to place the engines on (None: the launcher chooses)


def parse_request(body: Any) -> ElasticRequest:
    """A control request's JSON body; raises ElasticError with one line when it is malformed."""
    if not isinstance(body, dict) or body.get("op") not in OPS:
        op = body.get("op") if isinstance(body, dict) else None
        raise ElasticError(f"unknown control operation {op!r}: use one of {', '.join(OPS)}")
    op = body["op"]
    if op == "add":
        count = body.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_ADD:
            raise ElasticError(f"engines add N: N must be an integer from 1 to {MAX_ADD}, got {count!r}")
        node = body.get("node")
        if node is not None and (not isinstance(node, str) or not node):
            raise ElasticError(f"engines add --node: NODE must be a node id, address or id prefix, got {node!r}")
        return ElasticRequest(op, count=count, node=node)
    if op == "remove":
        engine = body.get("engine")
        if not isinstance(engine, str) or not engine:
            raise ElasticError(f"engines remove ID: ID must be an engine id from `engines list`, got {engine!r}")
        return ElasticRequest(op, engine=engine)
    if op == "register":
        url, key = body.get("url"), body.get("api_key")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ElasticError(f"engines register URL: URL must be http://host:port, got {url!r}")
        if key is not None and not isinstance(key, str):
            raise ElasticError("engines register --api-key: the key must be a string")
        return ElasticRequest(op, url=normalize_url(url), api_key=key or None)
    return ElasticRequest(op)


def authorized(header: str | None, token: str) -> bool:
    """The control endpoint's check: `Authorization: Bearer <token>`, compared in constant time."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode())


@dataclass(frozen=True)
class ServerAnswers:
    """What a server to register answered: `health_error` (None: /health answered 200), `info_status` and `info`
    (/get_model_info's HTTP status and JSON), `version` (/get_weight_version's answer, None if it gave none)."""

    health_error: str | None
    info_status: int = 0
    info: dict[str, Any] | None = None
    version: str | None = None


def refusal_to_register(
    url: str,
    answers: ServerAnswers,
    *,
    expected_model: str,
    membership: Membership,
    claimed_by: str | None = None,
    weights_dir: str | None = None,
) -> str | None:
    """Why the server at `url` may not join this run (one line), or None. `claimed_by`: the run dir of another live
    run that holds this engine (its claim), if any; `weights_dir`: where this run's disk syncs write (a server that
    served this run before holds weights from there)."""
    url = normalize_url(url)
    member = membership.by_url(url)
    if member is not None:
        return f"{url} is already engine {member.id} of this run"
    if claimed_by is not None:
        return f"{url} belongs to another run ({claimed_by}); remove it there first"
    if answers.health_error is not None:
        return f"{url} does not answer as an SGLang server ({answers.health_error}); is it running and reachable?"
    if answers.info_status == 401:
        return f"{url} refused the API key (401 Unauthorized); pass the server's --api-key with --api-key"
    if answers.info_status != 200 or answers.info is None:
        return f"{url} answered HTTP {answers.info_status} to /get_model_info; it is not an SGLang 0.5.6 server"
    mismatch = model_mismatch(expected_model, answers.info, weights_dir)
    if mismatch is not None:
        return f"{url} {mismatch}"
    return None


def model_mismatch(expected_model: str, info: dict[str, Any], weights_dir: str | None = None) -> str | None:
    """None when /get_model_info names the run's model, else what it serves instead.

    SGLang 0.5.6 answers `model_path` (the folder of the last weights loaded) and `tokenizer_path` (the launch
    path, unchanged by weight updates); the run's model is the one its engines were launched with. Paths compare
    whole; a hub id (`Org/Name`) on one side matches a local folder named `Name` on the other (the same model,
    downloaded), but two local folders must be the same path. A model_path inside `weights_dir` is this run's own
    weights (a server that served this run earlier, then left).
    """
    served = [str(p) for p in (info.get("tokenizer_path"), info.get("model_path")) if p]
    expected = normalize_url(expected_model)
    for path in served:
        path = normalize_url(path)
        if path == expected or (weights_dir and path.startswith(normalize_url(weights_dir) + "/")):
            return None
        if _is_hub_id(path) != _is_hub_id(expected) and _last_part(path) == _last_part(expected):
            return None
    return f"serves model {served[0] if served else 'unknown'!r}, not this run's {expected_model!r}"


def _is_hub_id(path: str) -> bool:
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1


def _last_part(path: str) -> str:
    return path.rsplit("/", 1)[-1]


@dataclass
class NoEngineClock:
    """How long the run has had no engine; `expired` once that passes `timeout_s` (engines.no_engine_timeout_s)."""

    timeout_s: float
    since: float | None = None

    def update(self, engines: int, now: float) -> bool:
        """Record the engine count at `now`; True when the run has just lost its last engine."""
        if engines > 0:
            self.since = None
            return False
        if self.since is None:
            self.since = now
            return True
        return False

    def expired(self, now: float) -> bool:
        return self.since is not None and now - self.since > self.timeout_s

    def message(self) -> str:
        return (
            f"no inference engine for {self.timeout_s:g}s (engines.no_engine_timeout_s): add one with "
            "`engines add N` or `engines register URL`, or raise engines.no_engine_timeout_s"
        )


def event_record(
    *,
    time: float,
    step: int,
    event: EngineEventKind,
    member: Member,
    engines_active: int,
    moves: SampleMoves | None = None,
) -> dict[str, Any]:
    """One RUN_DIR/engine_events.jsonl line (fields `EVENT_FIELDS`, see the module docstring); `moves` only on a
    `move` line."""
    if event not in EVENT_KINDS:
        raise ValueError(f"unknown engine event {event!r}")
    if moves is not None and event != "move":
        raise ValueError("samples are moved on move lines only")
    moves = moves or SampleMoves()
    return {
        "time": float(time),
        "step": int(step),
        "event": event,
        "engine": member.id,
        "url": member.url,
        "samples_moved": int(moves.samples),
        "tokens_regenerated": int(moves.tokens_regenerated),
        "samples_unanswered": int(moves.samples_unanswered),
        "engines_active": int(engines_active),
        "source": member.source,
    }


def event_metrics(counts: dict[str, int], engines_active: int) -> dict[str, float]:
    """The engines/* metrics of the events so far (`counts`: event kind -> number; `samples_moved`,
    `tokens_regenerated` and `samples_unanswered` -> their totals)."""
    return {
        "engines/active": float(engines_active),
        "engines/joined": float(counts.get("join", 0)),
        "engines/left": float(counts.get("leave", 0)),
    } | {f"engines/{total}": float(counts.get(total, 0)) for total in MOVE_TOTALS}
