"""Write every results table of README.md and tests/bench/README.md from the committed result files.

    .venv/bin/python tests/bench/results_tables.py            # rewrite the marked regions in place
    .venv/bin/python tests/bench/results_tables.py --check    # exit 1, naming them, if a region is not up to date

A region is a pair of lines in a markdown file,

    <!-- results:KIND:FOLDER -->
    ... (written by this script) ...
    <!-- /results:KIND:FOLDER -->

and its content is the table of KIND (`RENDERERS`) over the result files in `tests/bench/results/FOLDER/`
(`_results.py`: one JSON per run). A folder without result files gives a one-line note saying so. Kinds:
- `staleness`: experiment_staleness.py's runs, one row per arm: the held-out accuracy per seed and its mean, Δ
  against the arm's synchronous control (the same objective at η=0) and against the best synchronous arm of the
  experiment, both paired per seed; time to the accuracy threshold; the trust region's bite (pg_clipfrac, masked
  fractions); the trainer's idle share; staleness; tokens generated per trained token; adaptive η. Under the table:
  the run order of every seed, the commits, the load average, and for a grid of fixed η beside adaptive arms, the
  fastest fixed η and the adaptive arms' distance from it in validation intervals;
- `default-run`: bench_default_run.py's runs (the shipped default as a newcomer runs it: whole command, start-up,
  training, final accuracy, against the issue's target);
- `previous-cost`: bench_previous_weights.py's runs (the per-step cost of prox_log_probs=previous against
  recompute);
- `signals`: experiment_staleness.py's runs again, the statistics the adaptive rule reads per arm beside its
  default gates (which gate a task crosses, early and late);
- `async-vs-sync`: bench_async_vs_sync.py's runs (wall time and trainer idle, fully-async against synchronous);
- `lora`: experiment_lora.py's runs (issue 33): held-out accuracy at the start and end per seed for full
  fine-tuning and a LoRA adapter, the gain in points, the paired lora − full difference per seed, wall time, the
  trainable-parameter share and the bytes one sync carries.
Every figure is computed from the files; no column needs a hand analysis. `tests/bench/test_results_tables.py`
checks that the committed READMEs equal what this script writes.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _results
from _metrics import mean_std
from _runs import REPO_ROOT, fmt

DOCUMENTS = (REPO_ROOT / "README.md", REPO_ROOT / "tests" / "bench" / "README.md")
REGION = re.compile(r"^<!-- results:([a-z-]+):([A-Za-z0-9._-]+) -->\n(.*?)^<!-- /results:\1:\2 -->$", re.M | re.S)
SYNC_ORDER = ("sync", "sync-prev", "sync-prev-m2", "sync-m2po")


def _pm(mean: float | None, std: float | None, pattern: str, scale: float = 1.0) -> str:
    if mean is None:
        return "n/a"
    return f"{format(mean * scale, pattern)} ± {fmt(None if std is None else std * scale, pattern.lstrip('+'))}"


def _range(values: Sequence[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "n/a"


def _commits(records: Sequence[dict[str, Any]]) -> str:
    """The commits the records were measured at (12 characters, "+dirty" kept), sorted."""
    return ", ".join(sorted({r["commit"][:12] + ("+dirty" if r["commit"].endswith("+dirty") else "") for r in records}))


def _final(record: dict[str, Any]) -> float | None:
    return record["summary"]["final_val_accuracy"] if record["ok"] else None


def _is_sync(arm: str) -> bool:
    return arm == "sync" or arm.startswith("sync-")


def _arm_key(arm: str) -> tuple:
    if _is_sync(arm):
        return (0, SYNC_ORDER.index(arm) if arm in SYNC_ORDER else len(SYNC_ORDER), 0, arm)
    match = re.match(r"eta(\d+)-(.+)", arm)
    return (1, 0, int(match.group(1)), match.group(2)) if match else (2, 0, 0, arm)


def _paired_delta(
    runs: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]]
) -> tuple[float | None, float | None, int]:
    deltas = [
        _final(r) - _final(base[seed])
        for seed, r in runs.items()
        if seed in base and _final(r) is not None and _final(base[seed]) is not None
    ]
    return mean_std(deltas)


CLOSE_POINTS = 3.0  # a Δ smaller than this needs 5 seeds: sync alone moved ~5 points between invocations
MIN_SEEDS_CLOSE = 5


def _delta_cell(delta: tuple[float | None, float | None, int]) -> str:
    """Δ in points, mean ± std; marked when it is under `CLOSE_POINTS` with fewer than `MIN_SEEDS_CLOSE` seeds."""
    mean, std, n = delta
    cell = _pm(mean, std, "+.1f", 100)
    if mean is not None and abs(100 * mean) < CLOSE_POINTS and n < MIN_SEEDS_CLOSE:
        cell += f" (n={n} < {MIN_SEEDS_CLOSE}: noise)"
    return cell


def _time_to(runs: Sequence[dict[str, Any]]) -> tuple[float | None, int, int]:
    ok = [r for r in runs if r["ok"]]
    reached = [r["summary"]["time_to_threshold_s"] for r in ok if r["summary"].get("time_to_threshold_s") is not None]
    return mean_std(reached)[0], len(reached), len(ok)


def _mean_of(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    return mean_std(r["summary"].get(key) for r in runs if r["ok"])[0]


def staleness_table(records: Sequence[dict[str, Any]]) -> str:
    """The `staleness` kind (module docstring)."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    seeds = sorted({r["seed"] for r in records})
    arms = sorted(by_arm, key=_arm_key)
    sync_means = {a: mean_std(_final(r) for r in by_arm[a].values())[0] for a in arms if _is_sync(a)}
    sync_means = {a: m for a, m in sync_means.items() if m is not None}
    best_sync = max(sync_means, key=lambda a: sync_means[a]) if sync_means else None
    params = records[0]["params"]
    threshold = params["threshold"]
    headers = [
        "arm",
        *[f"seed {s}" for s in seeds],
        "mean ± std",
        "Δ vs its control (pts)",
        f"Δ vs best sync ({best_sync or 'n/a'}, pts)",
        f"time to {threshold:.0%} (s)",
        "pg_clipfrac all / steps 1-50",
        "masked",
        "trainer idle",
        "staleness mean/max",
        "gen/trained tok",
        "η mean (final)",
        "train s",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for arm in arms:
        runs = by_arm[arm]
        ok = [r for r in runs.values() if r["ok"]]
        finals = [fmt(_final(runs[s]), ".1%", "failed") if s in runs else "-" for s in seeds]
        mean, std, _ = mean_std(_final(r) for r in runs.values())
        control = next((r["params"].get("control") for r in runs.values()), None)
        vs_control = "-" if _is_sync(arm) else "n/a"
        if control in by_arm:
            vs_control = _delta_cell(_paired_delta(runs, by_arm[control])) + f" ({control})"
        vs_best = "-" if arm == best_sync or best_sync is None else _delta_cell(_paired_delta(runs, by_arm[best_sync]))
        time_mean, reached, ran = _time_to(runs.values())
        masked = [
            v
            for v in (_mean_of(ok, "masked_token_fraction_mean"), _mean_of(ok, "m2_masked_token_fraction_mean"))
            if v is not None
        ]
        etas = [r["summary"]["eta_final"] for r in ok if r["summary"].get("eta_final") is not None]
        staleness_max = max((r["summary"]["staleness_max"] or 0.0 for r in ok), default=None)
        lines.append(
            "| "
            + " | ".join(
                [
                    arm,
                    *finals,
                    _pm(mean, std, ".1%"),
                    vs_control,
                    vs_best,
                    f"{fmt(time_mean, '.0f', 'never')} ({reached}/{ran})",
                    f"{fmt(_mean_of(ok, 'pg_clipfrac_mean'), '.3f')} / {fmt(_mean_of(ok, 'pg_clipfrac_early'), '.3f')}",
                    fmt(max(masked), ".3f") if masked else "-",
                    fmt(_mean_of(ok, "idle_frac_total"), ".0%"),
                    f"{fmt(_mean_of(ok, 'staleness_mean'))}/{fmt(staleness_max, '.0f')}",
                    fmt(_mean_of(ok, "generated_per_trained_token"), ".3f"),
                    f"{fmt(_mean_of(ok, 'eta_mean'), '.1f')} ({'/'.join(f'{e:.0f}' for e in etas)})" if etas else "-",
                    fmt(_mean_of(ok, "train_wall_s"), ".0f"),
                ]
            )
            + " |"
        )
    return "\n".join([*lines, "", *_staleness_notes(records, by_arm, seeds, best_sync)])


def _staleness_notes(
    records: Sequence[dict[str, Any]],
    by_arm: dict[str, dict[int, dict[str, Any]]],
    seeds: list[int],
    best_sync: str | None,
) -> list[str]:
    params = records[0]["params"]
    loads = [x for r in records for x in r["load_average"]]
    orders = [
        f"seed {s}: "
        + ", ".join(r["arm"] for r in sorted((r for r in records if r["seed"] == s), key=lambda r: r["order"]))
        for s in seeds
    ]
    notes = [
        f"Task {params['task']}, regime {params['regime']}, {params['steps']} steps, validation every "
        f"{params['test_freq']} steps; {len(records)} runs ({sum(r['ok'] for r in records)} ok); commits "
        f"{_commits(records)}; 1-minute load average {_range(loads)} at the runs' starts and ends. Δ: paired per "
        "seed, mean ± sample std; best sync: the synchronous arm with the highest mean. Time to the threshold: mean "
        "over the seeds that reached it (reached/ran). pg_clipfrac: mean over steps; masked: the mean masked token "
        "fraction (m2po's, or m2_threshold's); trainer idle: Σ wait / Σ step time.",
        "",
        "Run order (shuffled per seed): " + "; ".join(orders) + ".",
    ]
    verdict = _eta_grid_verdict(by_arm, params)
    return notes + (["", verdict] if verdict else [])


def _eta_grid_verdict(by_arm: dict[str, dict[int, dict[str, Any]]], params: dict[str, Any]) -> str | None:
    """For a grid of fixed η of one method beside adaptive arms: the fastest fixed η to the threshold (most seeds
    reaching it, then the shortest mean time) and each adaptive arm's distance from it in validation intervals."""
    fixed = {a: runs for a, runs in by_arm.items() if not _is_sync(a) and "adaptive" not in a}
    adaptive = {a: runs for a, runs in by_arm.items() if "adaptive" in a}
    if len(fixed) < 2 or not adaptive:
        return None

    def rank(runs: dict[int, dict[str, Any]]) -> tuple[int, float]:
        mean, reached, _ = _time_to(runs.values())
        return (-reached, mean if mean is not None else float("inf"))

    best = min(fixed, key=lambda a: rank(fixed[a]))
    best_time, best_reached, best_ran = _time_to(fixed[best].values())
    walls = [r["summary"]["train_wall_s"] for runs in by_arm.values() for r in runs.values() if r["ok"]]
    interval = statistics.fmean(walls) * params["test_freq"] / params["steps"] if walls else None
    best_figure = f"{fmt(best_time, '.0f', 'never')} s, {best_reached}/{best_ran}"
    parts = [f"fastest fixed η to {params['threshold']:.0%}: {best} ({best_figure})"]
    for arm in sorted(adaptive, key=_arm_key):
        time_mean, reached, ran = _time_to(adaptive[arm].values())
        gap = ""
        if time_mean is not None and best_time is not None and interval:
            gap = f", {(time_mean - best_time) / interval:+.1f} validation intervals ({interval:.0f} s each)"
        parts.append(f"{arm}: {fmt(time_mean, '.0f', 'never')} s ({reached}/{ran}){gap}")
    return "Adaptive against the fixed bounds: " + "; ".join(parts) + "."


def default_run_table(records: Sequence[dict[str, Any]]) -> str:
    """The `default-run` kind: bench_default_run.py's runs, one row each."""
    target = records[0]["params"]
    headers = [
        "candidate",
        "overrides",
        "held-out before → after",
        "points",
        "whole command s",
        "start-up s",
        "training s",
        "steps",
        "cache",
        "load average",
        f"target (≥ {target['target_accuracy']:.1%} in ≤ {target['target_wall_s']:.0f} s)",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in sorted(records, key=lambda r: (r["arm"], r["seed"], r["date"])):
        s = r["summary"]
        before, after = s.get("initial_val_accuracy"), s.get("final_val_accuracy")
        points = None if before is None or after is None else 100 * (after - before)
        met = after is not None and after >= target["target_accuracy"] and r["wall_s"] <= target["target_wall_s"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["arm"],
                    " ".join(
                        f"`{o}`" for o in [*r["params"]["candidate_overrides"], *r["params"].get("extra_overrides", [])]
                    )
                    or "(as shipped)",
                    f"{fmt(before, '.1%')} → {fmt(after, '.1%')}",
                    fmt(points, "+.1f"),
                    f"{r['wall_s']:.0f}",
                    fmt(r.get("startup_s"), ".0f"),
                    fmt(s.get("train_wall_s"), ".0f"),
                    str(s.get("steps")),
                    r["params"].get("cache", "?"),
                    "-".join(f"{x:.1f}" for x in r["load_average"]),
                    "met" if met else "not met",
                ]
            )
            + " |"
        )
    return "\n".join([*lines, "", f"Commits {_commits(records)}; {records[0]['host']['cpus']} cores."])


def previous_cost_table(records: Sequence[dict[str, Any]]) -> str:
    """The `previous-cost` kind: bench_previous_weights.py's runs, one row per (device, model)."""
    headers = [
        "device",
        "model",
        "parameters",
        "recompute: forward ms",
        "previous: forward ms",
        "previous: copy at sync ms",
        "previous / recompute per step",
        "update ms",
        "CPU copies held MB",
        "load average",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in sorted(records, key=lambda r: (r["params"]["device"], r["params"]["parameters"])):
        s = r["summary"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["params"]["device"],
                    r["params"]["model"],
                    f"{r['params']['parameters'] / 1e6:.1f}M",
                    f"{s['recompute_forward_ms']:.1f}",
                    f"{s['previous_forward_ms']:.1f}",
                    f"{s['publish_ms']:.1f}",
                    f"{s['previous_over_recompute_step']:.2f}x",
                    f"{s['update_ms']:.1f}",
                    f"{s['held_mb']:.0f}",
                    "-".join(f"{x:.1f}" for x in r["load_average"]),
                ]
            )
            + " |"
        )
    return "\n".join(
        [
            *lines,
            "",
            f"Medians over {records[0]['params']['repeats']} repeats; per step = forward + update (+ the copy at "
            f"the sync for previous, K = 1); commits {_commits(records)}.",
        ]
    )


def async_vs_sync_table(records: Sequence[dict[str, Any]]) -> str:
    """The `async-vs-sync` kind: bench_async_vs_sync.py's runs (one per arm and repeat) and the sync / async ratio of
    the arms' mean training wall times."""
    headers = [
        "run",
        "order",
        "train wall s",
        "whole command s",
        "trainer idle",
        "staleness max",
        "held-out before → after",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in sorted(records, key=lambda r: (r["seed"], r["order"])):
        s = r["summary"]
        lines.append(
            f"| {r['arm']} (repeat {r['seed']}) | {r['order'] + 1} | {fmt(s['train_wall_s'], '.1f')} | "
            f"{r['wall_s']:.1f} | {fmt(s['idle_frac_total'], '.1%')} | {fmt(s['staleness_max'], '.0f')} | "
            f"{fmt(s['initial_val_accuracy'], '.1%')} → {fmt(s['final_val_accuracy'], '.1%')} |"
        )

    def arm_mean(arm: str) -> float | None:
        return mean_std(r["summary"]["train_wall_s"] for r in records if r["arm"] == arm and r["ok"])[0]

    sync, fast = arm_mean("sync"), arm_mean("async")
    ratio = fmt(sync / fast if sync and fast else None, ".2f")
    loads = [x for r in records for x in r["load_average"]]
    return "\n".join(
        [
            *lines,
            "",
            f"sync / async training wall time (means over repeats): {ratio}x; {records[0]['params']['steps']} steps "
            f"per run; 1-minute load average {_range(loads)}; commits {_commits(records)}.",
        ]
    )


# The adaptive rule's default gates (core/adaptive_staleness.AdaptiveStalenessRule, calibrated on the default task):
# η is lowered when ess < min_ess, kl > max_kl or cut > max_cut, raised (after clear windows) only while wait >= w.
GATES = {"ess": ("min_ess", 0.8, "<"), "kl": ("max_kl", 0.02, ">"), "cut": ("max_cut", 0.02, ">")}
WAIT_GATE = 0.1  # raise_when_waiting


def signals_table(records: Sequence[dict[str, Any]]) -> str:
    """The `signals` kind: per arm, the statistics the adaptive rule reads (medians over steps 1-50 and after,
    mean over seeds) beside its default gates, so a table says which gate a task crosses and when: a statistic
    beyond its gate lowers η; η rises only while the trainer's wait share is at or above `WAIT_GATE`."""
    headers = ["arm", *(f"{n} 1-50 / after ({g[0]} {g[1]:g})" for n, g in GATES.items()), f"wait ({WAIT_GATE:g})"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["ok"]:
            by_arm.setdefault(r["arm"], []).append(r)

    def stat(runs: list[dict[str, Any]], name: str, key: str) -> float | None:
        return mean_std(r["summary"].get("signals", {}).get(name, {}).get(key) for r in runs)[0]

    for arm in sorted(by_arm, key=_arm_key):
        runs = by_arm[arm]
        cells = [arm]
        for name, (_, gate, beyond) in GATES.items():
            parts = []
            for key in ("early_p50", "late_p50"):
                value = stat(runs, name, key)
                crossed = value is not None and (value < gate if beyond == "<" else value > gate)
                parts.append(fmt(value, ".3f") + ("*" if crossed else ""))
            cells.append(" / ".join(parts))
        wait = stat(runs, "wait", "p50")
        cells.append(fmt(wait, ".2f") + ("" if wait is None or wait >= WAIT_GATE else " (no raise)"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(
        [
            *lines,
            "",
            "Medians over each run's steps, mean over seeds; * beyond the default gate (η would be lowered); wait: the "
            'trainer\'s wait share per step (median), "no raise" under the raise_when_waiting gate.',
        ]
    )


LORA_ARMS = ("full", "lora")


def _gain(record: dict[str, Any]) -> float | None:
    """Held-out accuracy points gained from step 0 to the final validation (None for a failed run)."""
    start, end = record["summary"].get("initial_val_accuracy"), _final(record)
    return None if start is None or end is None else end - start


def lora_table(records: Sequence[dict[str, Any]]) -> str:
    """The `lora` kind: experiment_lora.py's runs, one row per arm (full, lora): the held-out accuracy at step 0 and
    at the end per seed, the gain in points (mean ± std), the validation curve's means, wall time and the
    trainable-parameter share; under it each LoRA arm's gain minus full's, paired per seed, the bytes one sync
    carries, the run order, load and commits."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    seeds = sorted({r["seed"] for r in records})
    headers = [
        "arm",
        *(f"seed {k}: start → end" for k in seeds),
        "gain, points",
        "held-out by step (mean)",
        "whole command s",
        "training s",
        "trainable parameters",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    arm_order = sorted(by_arm, key=lambda a: (LORA_ARMS.index(a) if a in LORA_ARMS else len(LORA_ARMS), a))
    for arm in arm_order:
        runs = by_arm[arm]
        cells = [arm]
        for k in seeds:
            r = runs.get(k)
            if r is None:
                cells.append("—")
            elif not r["ok"]:
                cells.append(f"failed (rc {r['returncode']})")
            else:
                cells.append(f"{fmt(r['summary']['initial_val_accuracy'], '.1%')} → {fmt(_final(r), '.1%')}")
        cells.append(_pm(*mean_std(_gain(r) for r in runs.values())[:2], "+.1f", 100))
        curve: dict[int, list[float]] = {}
        for r in runs.values():
            if r["ok"]:
                for step, _, accuracy in r["summary"]["val_curve"]:
                    curve.setdefault(int(step), []).append(accuracy)
        cells.append(", ".join(f"{step}: {statistics.fmean(v):.1%}" for step, v in sorted(curve.items())) or "n/a")
        cells.append(_pm(*mean_std(r["wall_s"] for r in runs.values() if r["ok"])[:2], ".0f"))
        cells.append(_pm(*mean_std(r["summary"].get("train_wall_s") for r in runs.values() if r["ok"])[:2], ".0f"))
        share = next((r["lora"] for r in runs.values() if r.get("lora")), None)
        cells.append(
            "n/a"
            if share is None
            else f"{share['trainable_params']:,} of {share['total_params']:,} ({share['trainable_share']:.1%})"
        )
        lines.append("| " + " | ".join(cells) + " |")
    full = by_arm.get("full", {})
    paired_lines = []
    for arm in [a for a in arm_order if a != "full"]:
        runs = by_arm[arm]
        gains = {k: (_gain(runs[k]), _gain(full[k])) for k in seeds if k in full and k in runs}
        diffs = {k: a - b for k, (a, b) in gains.items() if a is not None and b is not None}
        per_seed = ", ".join(f"seed {k} {100 * d:+.1f}" for k, d in sorted(diffs.items())) or "n/a"
        mean, std, n = mean_std(diffs.values())
        paired_lines.append(
            f"- {arm} − full, gain in points, paired per seed: {per_seed}; mean {_pm(mean, std, '+.1f', 100)} (n={n})."
        )

    def sync_cell(arm: str) -> str:
        share = next((r["lora"] for r in by_arm.get(arm, {}).values() if r.get("lora")), None)
        if share is None:
            return f"{arm} n/a"
        on_disk = share.get("last_sync_file_bytes")
        disk = "" if on_disk is None else f", {on_disk / 1024:.0f} KiB on disk"
        return f"{arm} {share['sync_bytes_fp32'] / 1024:.0f} KiB (fp32 tensors{disk})"

    # By the records' dates (a run's end): runs of later invocations (--arms) come after the first pair's.
    order = "; ".join(
        f"seed {k}: "
        + " then ".join(r["arm"] for r in sorted(records, key=lambda r: (r["date"], r["order"])) if r["seed"] == k)
        for k in seeds
    )
    loads = [x for r in records for x in r["load_average"]]
    params = records[0]["params"]
    return "\n".join(
        [
            *lines,
            "",
            *paired_lines,
            "",
            f"{params['steps']} steps per run, validation every {params['test_freq']} (1,000 held-out prompts, "
            f"greedy). One sync carries: {sync_cell('full')}; {sync_cell('lora')}. Trainable share: peft's trainable "
            "over all parameters of the wrapped model (the adapter counted in the total). Run order: "
            f"{order}. 1-minute load average at the runs' starts and ends {_range(loads)}; commits "
            f"{_commits(records)}.",
        ]
    )


RENDERERS: dict[str, Callable[[Sequence[dict[str, Any]]], str]] = {
    "signals": signals_table,
    "async-vs-sync": async_vs_sync_table,
    "staleness": staleness_table,
    "default-run": default_run_table,
    "previous-cost": previous_cost_table,
    "lora": lora_table,
}


def render(kind: str, folder: str, results_root: Path = _results.RESULTS_ROOT) -> str:
    """A region's content (without its marker lines)."""
    if kind not in RENDERERS:
        raise ValueError(f"unknown results table kind {kind!r} (known: {', '.join(RENDERERS)})")
    records = _results.read_records(results_root / folder)
    if not records:
        where = f"tests/bench/results/{folder}/"
        return f"_No result files in `{where}` yet: the command that makes them is in tests/bench/README.md._\n"
    return RENDERERS[kind](records) + "\n"


def regenerate(text: str, results_root: Path = _results.RESULTS_ROOT) -> str:
    """`text` with every results region rewritten."""

    def replace(match: re.Match[str]) -> str:
        kind, folder = match.group(1), match.group(2)
        return (
            f"<!-- results:{kind}:{folder} -->\n{render(kind, folder, results_root)}<!-- /results:{kind}:{folder} -->"
        )

    opened = len(re.findall(r"^<!-- results:", text, re.M))
    if opened != len(REGION.findall(text)):
        raise ValueError("a '<!-- results:KIND:FOLDER -->' marker has no matching '<!-- /results:KIND:FOLDER -->'")
    return REGION.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        new = regenerate(text)
        if new != text:
            stale.append(str(path.relative_to(REPO_ROOT)))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"results tables out of date in {', '.join(stale)}: run tests/bench/results_tables.py", file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale and not args.check else "results tables up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
