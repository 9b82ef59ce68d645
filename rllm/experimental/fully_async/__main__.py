"""Command line: `python -m rllm.experimental.fully_async [train|doctor] [--config FILE] [key=value ...]`,
`... report RUN_DIR [RUN_DIR ...] [--out FILE]`.

With no arguments it trains the embedded default (config/tiny_cpu.yaml): a tiny model learning 2-digit
addition on CPU with fully-async GRPO. Exit codes: 0 success, 1 the run failed, 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rllm.experimental.fully_async.settings.loader import DEFAULT_CONFIG, ConfigError, load_config

EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2


COMMANDS = ("train", "doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rllm.experimental.fully_async",
        usage="%(prog)s [train|doctor] [--config FILE] [key=value ...]",
        description="Fully-asynchronous PPO on verl 0.7.1. Commands: train (default), doctor, report RUN_DIR...",
    )
    parser.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG})")
    return parser


def parse_command_line(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """(command, config file, overrides) from argv, in any order: `train --config X a=1`, `--config X a=1`, ..."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    command = "train"
    if rest and rest[0] in COMMANDS:
        command = rest.pop(0)
    for item in rest:
        if item.startswith("-") or "=" not in item:
            parser.error(f"unexpected argument {item!r}: overrides are key=value (e.g. trainer.total_training_steps=5)")
    return command, args.config, rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:  # its own arguments (run directories), no config: see observe/report.py
        from rllm.experimental.fully_async.observe.report import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["simulate"]:  # its own options (--from, --gpus): see simulate/cli.py
        from rllm.experimental.fully_async.simulate.cli import main as simulate_main

        return simulate_main(argv[1:])
    if argv[:1] == ["plan"]:  # its own options (--gpus-per-node, --nodes): see plan.py
        from rllm.experimental.fully_async.plan import main as plan_main

        return plan_main(argv[1:])
    command, config_file, overrides = parse_command_line(argv)
    if command == "doctor":
        from rllm.experimental.fully_async.doctor import run_doctor

        return run_doctor()

    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    logging.basicConfig(level=str(cfg.run.log_level), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from rllm.experimental.fully_async.data import DataError
    from rllm.experimental.fully_async.runtime.run import RunFailedError, train
    from rllm.experimental.fully_async.runtime.run_dir import RunFinished
    from rllm.experimental.fully_async.verl_patch import UnpatchedVerlError

    try:
        train(cfg)
    except RunFinished as exc:
        print(exc)
        return 0
    except ConfigError as exc:  # e.g. a resume that would change keys the checkpoint depends on
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (UnpatchedVerlError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:
        print("interrupted: engines and actors stopped", file=sys.stderr)
        return 130
    except RunFailedError as exc:
        print(f"run failed at {exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
