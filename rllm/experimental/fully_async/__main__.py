"""Command line: `python -m rllm.experimental.fully_async [COMMAND] [--config FILE] [key=value ...]`.

With no command it trains the embedded default (config/tiny_cpu.yaml): a tiny model learning 2-digit addition on
CPU with fully-async GRPO. Commands live in `COMMANDS`; a module adds one with `@command(name, help)` (report,
simulate, ... register themselves when their module is imported here). Exit codes: 0 success, 1 the run failed,
2 bad configuration, data or usage (`errors.py`). A known failure prints one line and no traceback; with
`run.log_level=DEBUG` the traceback follows.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import OmegaConf

from rllm.experimental.fully_async.cli.replay import main as replay_main
from rllm.experimental.fully_async.errors import EXIT_BAD_INPUT, FullyAsyncError, error_lines
from rllm.experimental.fully_async.settings.explain import diff_lines, explain, origin_of, with_task_assets
from rllm.experimental.fully_async.settings.loader import DEFAULT_CONFIG, config_layers, load_config

EXIT_BAD_CONFIG = EXIT_BAD_INPUT  # kept for callers of the old name
PROG = "python -m rllm.experimental.fully_async"


@dataclass(frozen=True)
class CommandLine:
    """What every command receives: the config file (None: the default) and the key=value overrides."""

    config_file: str | None
    overrides: list[str]


Handler = Callable[..., int]  # (CommandLine) -> int, or (argv) -> int for commands with their own arguments


@dataclass(frozen=True)
class Command:
    handler: Handler
    help: str
    # True: the command parses its own arguments (run directories, --gpus, ...) and gets argv after its name.
    own_arguments: bool = False


COMMANDS: dict[str, Command] = {}
DEFAULT_COMMAND = "train"


def command(name: str, help: str, own_arguments: bool = False) -> Callable[[Handler], Handler]:
    """Register a subcommand: `@command("config", "print the resolved config")` over `def handler(line) -> int`;
    with `own_arguments=True` the handler gets the argv after the command's name instead of a CommandLine."""

    def register(handler: Handler) -> Handler:
        COMMANDS[name] = Command(handler, help, own_arguments)
        return handler

    return register


# Where each section's fields are documented (shown by --help).
CONFIG_SECTIONS: dict[str, str] = {
    "async_training": "settings/schema.py AsyncTrainingConfig (rLLM keys: settings/compat.py)",
    "engines": "settings/schema.py EnginesConfig",
    "param_sync": "settings/schema.py ParamSyncConfig",
    "task": "settings/schema.py TaskConfig",
    "workflow": "settings/schema.py WorkflowConfig",
    "env": "settings/schema.py EnvConfig (envs/base.py)",
    "tools": "settings/schema.py ToolsConfig (workflows/tools.py)",
    "run": "settings/schema.py RunConfig",
    "algorithm.off_policy_correction": "algorithms/correction_config.py CorrectionConfig",
    "algorithm.group_filter": "algorithms/filters.py FilterConfig",
    "algorithm.gigpo": "algorithms/gigpo.py GiGPOConfig",
    "verl's sections": "actor_rollout_ref, data, algorithm, trainer, critic, reward: verl 0.7.1's meaning "
    "(verl/trainer/config/_generated_ppo_trainer.yaml); which of them are read: settings/verl_keys.py",
}


def build_parser() -> argparse.ArgumentParser:
    names = "|".join(COMMANDS)
    commands = "\n".join(f"  {name:<10} {c.help}" for name, c in COMMANDS.items())
    sections = "\n".join(f"  {name:<32} {where}" for name, where in CONFIG_SECTIONS.items())
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"%(prog)s [{names}] [--config FILE] [key=value ...]",
        description=f"Fully-asynchronous PPO on verl 0.7.1.\n\ncommands (default: {DEFAULT_COMMAND}):\n{commands}",
        epilog=f"config sections (paths under rllm/experimental/fully_async/):\n{sections}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG})")
    return parser


def parse_command_line(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """(command, config file, overrides) from argv, in any order: `train --config X a=1`, `--config X a=1`, ..."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    name = DEFAULT_COMMAND
    if rest and rest[0] in COMMANDS:
        name = rest.pop(0)
    elif rest and not any(c in rest[0] for c in "=.-"):  # a word, not an override missing its =value
        parser.error(unknown_command(rest[0]))
    for item in rest:
        if item.startswith("-") or "=" not in item:
            parser.error(f"unexpected argument {item!r}: overrides are key=value (e.g. trainer.total_training_steps=5)")
    return name, args.config, rest


def unknown_command(word: str) -> str:
    """One line for a first word that is no command: the nearest commands, and the list."""
    close = difflib.get_close_matches(word, list(COMMANDS), n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"unknown command {word!r}: {hint}commands: {', '.join(COMMANDS)} (overrides are key=value)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COMMANDS and COMMANDS[argv[0]].own_arguments:
        name, line = argv[0], CommandLine(None, [a for a in argv[1:] if "=" in a and not a.startswith("-")])
        run: Callable[[], int] = lambda: COMMANDS[name].handler(argv[1:])  # noqa: E731
    else:
        name, config_file, overrides = parse_command_line(argv)
        line = CommandLine(config_file, overrides)
        run = lambda: COMMANDS[name].handler(line)  # noqa: E731
    try:
        return run()
    except FullyAsyncError as exc:
        return _fail(exc, exc.exit_code, line)
    except KeyboardInterrupt:
        print("interrupted: engines and actors stopped", file=sys.stderr)
        return 130
    # Anything else is a bug: its traceback shows.


def _fail(exc: BaseException, code: int, line: CommandLine) -> int:
    # The root logger is at run.log_level once the config loaded; a config error comes before that.
    if logging.getLogger().isEnabledFor(logging.DEBUG) or "run.log_level=DEBUG" in line.overrides:
        traceback.print_exception(exc, file=sys.stderr)
    kind = "config error" if code == EXIT_BAD_INPUT and type(exc).__name__ == "ConfigError" else "error"
    first, *others = error_lines(exc)  # others: the further keys of a config with several refused (ConfigError)
    print("\n".join([f"{kind}: {first}", *(f"  {line}" for line in others)]), file=sys.stderr)
    return code


def _load(line: CommandLine):
    cfg = load_config(line.config_file, line.overrides)
    logging.basicConfig(level=str(cfg.run.log_level), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return cfg


@command("train", "train with the config (the default command)")
def _train(line: CommandLine) -> int:
    cfg = _load(line)
    # lazy: the driver pulls Ray, torch and verl (~5 s); the other commands and --help never pay for them
    from rllm.experimental.fully_async.runtime.run.driver import train
    from rllm.experimental.fully_async.runtime.run.run_dir import RunFinished

    try:
        train(cfg)
    except RunFinished as exc:  # the run directory holds a finished run: say so, start nothing
        print(exc)
    return 0


@command("doctor", "check the installation (python, packages, the verl patch, devices)")
def _doctor(line: CommandLine) -> int:
    # lazy: each command's module loads when it runs (doctor: ~30 ms), so the CLI's startup stays ~0.2 s
    from rllm.experimental.fully_async.cli.doctor import run_doctor

    return run_doctor()


@command("config", "print what the config changes (with meanings), --all of it, or --explain KEY", True)
def _config(argv: list[str]) -> int:
    """`config [--config FILE] [key=value ...]`: the keys set away from the defaults, as YAML, each with where it
    was set and what it means (settings/explain.py); `--all`: the whole resolved config (~800 lines);
    `--explain KEY`: a key's meaning, default, allowed values and readers."""
    parser = argparse.ArgumentParser(prog=f"{PROG} config", description=_config.__doc__)
    parser.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG})")
    parser.add_argument("--all", action="store_true", help="print the whole resolved config")
    parser.add_argument("--explain", metavar="KEY", default=None, help="explain one key (or a section's keys)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    cfg = _load(CommandLine(args.config, args.overrides))
    if args.all:
        print(OmegaConf.to_yaml(with_task_assets(cfg)[0], resolve=True), end="")  # the task's data and model
        return 0
    layers = config_layers(args.config, args.overrides)
    if args.explain:
        print("\n".join(explain(args.explain, cfg, origin_of(args.explain, layers))))
        return 0
    lines = diff_lines(cfg, layers)
    changed = sum("  # [" in line for line in lines)
    print(
        f"# {changed} keys differ from the defaults (verl 0.7.1's ppo_trainer and this project's settings/schema.py),"
        "\n# each with [where it was set] and its meaning. `config --all` prints every key; `config --explain KEY`"
        " explains one."
    )
    print("\n".join(lines))
    return 0


@command("plan", "print where engines and trainer ranks go on the GPUs, and the engine command lines", True)
def _plan(argv: list[str]) -> int:
    # lazy: plan imports the run spec, hence verl and torch (~3.5 s)
    from rllm.experimental.fully_async.cli.plan import main as plan_main

    return plan_main(argv)


@command("report", "write RUN_DIR/report.html: plots of one or more run directories side by side", True)
def _report(argv: list[str]) -> int:
    # lazy: each command's module loads when it runs (report: ~120 ms)
    from rllm.experimental.fully_async.report.cli import main as report_main

    return report_main(argv)


@command("view", "print a trajectory dump (trainer.rollout_data_dir) turn by turn, coloured by mask and version", True)
def _view(argv: list[str]) -> int:
    # lazy: each command's module loads when it runs (view: ~30 ms)
    from rllm.experimental.fully_async.observe.viewer import main as view_main

    return view_main(argv)


@command("simulate", "predict a fully-async run's wall time, idle and staleness before renting GPUs", True)
def _simulate(argv: list[str]) -> int:
    # lazy: each command's module loads when it runs (simulate: ~60 ms)
    from rllm.experimental.fully_async.simulate.cli import main as simulate_main

    return simulate_main(argv)


@command("replay", "re-run a run's training from its batch record (run.record_batches) and check it bit for bit", True)
def _replay(argv: list[str]) -> int:
    return replay_main(argv)


@command("engines", "add, remove, register or list the engines of a running run (--run-dir)", True)
def _engines(argv: list[str]) -> int:
    # lazy: each command's module loads when it runs (engines: the control client and aiohttp)
    from rllm.experimental.fully_async.cli.engines import main as engines_main

    return engines_main(argv)


if __name__ == "__main__":
    sys.exit(main())
