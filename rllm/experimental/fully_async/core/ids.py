"""Sample ids: one typed value, one string form, one parser (the ledger's journal and checkpoints keep the string).

A prompt drawn from the PromptIterator in epoch e from source row r is the prompt `e{e}/{r}`; its i-th sample
is `e{e}/{r}/{i}`. A prompt left out before any rollout (too long, filtered at load) is ledgered as
`prompt/{r}`: it was never drawn in an epoch. A generation request's id is its sample's (an agent's turn k:
`e{e}/{r}/{i}/turn{k}`), and with engines.sampling_seed its SGLang `sampling_seed` is a function of that id
(`sampling_seed_for`).
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

_SAMPLE = re.compile(r"^e(\d+)/(\d+)/(\d+)$")
_PROMPT = re.compile(r"^e(\d+)/(\d+)$")


def prompt_uid(epoch: int, record: int) -> str:
    """The string id of a prompt drawn in `epoch` from source row `record`."""
    return f"e{epoch}/{record}"


def rejected_prompt_uid(record: int) -> str:
    """The ledger's id for a source row left out before any rollout (never drawn, so no epoch)."""
    return f"prompt/{record}"


def parse_prompt_uid(text: str) -> tuple[int, int]:
    """(epoch, record) of a prompt id `e{epoch}/{record}`; ValueError names the text otherwise."""
    match = _PROMPT.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a prompt id of the form e<epoch>/<record>")
    return int(match.group(1)), int(match.group(2))


class SampleId(NamedTuple):
    """One sample: the `index`-th of the n samples of source row `record`, drawn in `epoch`."""

    epoch: int
    record: int
    index: int

    @property
    def prompt_uid(self) -> str:
        return prompt_uid(self.epoch, self.record)

    def __str__(self) -> str:
        return f"{self.prompt_uid}/{self.index}"

    @classmethod
    def parse(cls, text: str) -> SampleId:
        """The inverse of `str()`; ValueError names the text when it is not `e<epoch>/<record>/<index>`."""
        match = _SAMPLE.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a sample id of the form e<epoch>/<record>/<index>")
        return cls(int(match.group(1)), int(match.group(2)), int(match.group(3)))


def sampling_seed_for(run_seed: int, request_id: str) -> int:
    """A request's SGLang `sampling_seed` from the run's generation seed (engines.sampling_seed) and its id: the
    first four bytes of sha256(f"{run_seed}:{request_id}") as a non-negative int32 (SGLang keeps seeds in an int32
    tensor). Distinct ids draw independently; the same id draws the same tokens from the same weights."""
    digest = hashlib.sha256(f"{run_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
