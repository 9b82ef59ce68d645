"""`python -m rllm.experimental.fully_async view DIR [--step N]`: a trajectory dump, turn by turn.

Reads `DIR/{step}.jsonl` (observe/dumps.py; the latest step without --step) and prints each trajectory: its
reward, end reason and step rewards, then each turn. Tokens the policy generated (loss mask 1) are coloured by
the policy version that produced them, so a turn resumed after a weight sync shows two colours; tokens it did
not generate (prompt, observations, tool results: loss mask 0) are dim. On a terminal the colours come from rich;
otherwise (a pipe, a file, `--plain`) the same content is plain text, with versions written inline as `[vN]`
and masked text in `{...}`.

Turns: with the per_step layout each sequence is one turn whose prompt is the whole conversation so far, so a
turn shows only what its prompt added since the previous turn (the observation); with the concat layout the
single sequence's mask-0 runs are the observations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from rllm.experimental.fully_async.observe.dumps import read_dump

# One colour per policy version (cycled); masked tokens are dim.
VERSION_STYLES = ("bold green", "bold cyan", "bold magenta", "bold yellow", "bold blue", "bold red")
MASKED_STYLE = "dim"


def _token_texts(seq: dict[str, Any]) -> list[str]:
    tokens = seq.get("response_tokens")
    if tokens is not None:
        return list(tokens)
    return [f"<{t}>" for t in seq["response_ids"]]  # a dump written without a tokenizer: ids only


def _prompt_text(seq: dict[str, Any]) -> str:
    text = seq.get("prompt_text")
    return text if text is not None else " ".join(f"<{t}>" for t in seq["prompt_ids"])


def render_trajectory(record: dict[str, Any], plain: bool) -> Text:
    """One trajectory as rich Text (styles are dropped when printed plain)."""
    out = Text()
    header = (
        f"{record['uid']}  reward {record['reward']:g}  end {record.get('end_reason') or '-'}  "
        f"status {record['status']}"
    )
    if record.get("failure_reason"):
        header += f" ({record['failure_reason']})"
    out.append(header + "\n", style="bold")
    step_rewards = record.get("step_rewards")
    previous: list[int] | None = None
    seen_text = ""
    for seq in record["sequences"]:
        index = seq["step_index"]
        adv = seq.get("advantages")
        reward = step_rewards[index] if step_rewards and index < len(step_rewards) else None
        label = f"  turn {index}"
        if reward is not None:
            label += f"  step reward {reward:g}"
        if adv:
            label += f"  advantage {sum(adv) / len(adv):+.3f}"
        out.append(label + "\n", style="underline")
        prompt = _prompt_text(seq)
        # per_step: the prompt repeats the conversation; show only what is new since the previous turn.
        if previous is not None and seq["prompt_ids"][: len(previous)] == previous and prompt.startswith(seen_text):
            new = prompt[len(seen_text) :]
        else:
            new = prompt
        out.append("    ")
        _append_masked(out, new, plain)
        _append_response(out, seq, plain)
        out.append("\n")
        previous = list(seq["prompt_ids"]) + list(seq["response_ids"])
        seen_text = prompt + "".join(_token_texts(seq))
    return out


def _append_masked(out: Text, text: str, plain: bool) -> None:
    if text:
        out.append("{" + text + "}" if plain else text, style=MASKED_STYLE)


def _append_response(out: Text, seq: dict[str, Any], plain: bool) -> None:
    """Response tokens in runs of equal (mask, version): mask 0 dim, mask 1 in its version's colour."""
    tokens, mask, versions = _token_texts(seq), seq["loss_mask"], seq["versions"]
    i = 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and mask[j] == mask[i] and (not mask[i] or versions[j] == versions[i]):
            j += 1
        text = "".join(tokens[i:j])
        if not mask[i]:
            _append_masked(out, text, plain)
        else:
            version = versions[i]
            out.append(f"[v{version}]" + text if plain else text, style=VERSION_STYLES[version % len(VERSION_STYLES)])
        i = j


def legend(versions: list[int]) -> Text:
    text = Text("legend: ")
    text.append("{masked: prompt, observation, tool}", style=MASKED_STYLE)
    for version in versions:
        text.append(f"  v{version}", style=VERSION_STYLES[version % len(VERSION_STYLES)])
    return text


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rllm.experimental.fully_async view", description=__doc__.split("\n")[0]
    )
    parser.add_argument("directory", type=Path, help="trainer.rollout_data_dir or trainer.validation_data_dir")
    parser.add_argument("--step", type=int, default=None, help="the step to show (default: the latest)")
    parser.add_argument("--limit", type=int, default=None, help="show at most this many trajectories")
    parser.add_argument("--plain", action="store_true", help="plain text even on a terminal")
    args = parser.parse_args(argv)
    try:
        step, records = read_dump(args.directory, args.step)
    except FileNotFoundError as exc:
        print(f"view: {exc}", file=sys.stderr)
        return 2
    console = console or Console(highlight=False, soft_wrap=True)
    plain = args.plain or not console.is_terminal
    if plain:
        console = Console(file=console.file, no_color=True, highlight=False, soft_wrap=True, force_terminal=False)
    shown = records[: args.limit] if args.limit is not None else records
    versions = sorted(
        {v for r in shown for s in r["sequences"] for v, m in zip(s["versions"], s["loss_mask"], strict=True) if m}
    )
    console.print(f"{args.directory} step {step}: {len(records)} trajectories", style="bold")
    console.print(legend(versions))
    for record in shown:
        console.print(render_trajectory(record, plain))
    return 0
