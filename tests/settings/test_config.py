"""Configuration: composition on verl's defaults, one-line errors naming the key, exit code 2 from the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rllm.experimental.fully_async.settings.loader import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def test_default_config_composes_verl_defaults_with_the_tiny_cpu_file():
    cfg = load_config()
    own = OmegaConf.load(REPO / "config" / "tiny_cpu.yaml")
    assert cfg.task.name == "addition"
    assert cfg.actor_rollout_ref.rollout.n == own.actor_rollout_ref.rollout.n
    assert cfg.actor_rollout_ref.actor.optim.lr == own.actor_rollout_ref.actor.optim.lr
    # derived like verl's workers do: the LR schedule spans the run
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps == own.trainer.total_training_steps
    # untouched verl defaults are still there, with verl's values
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2.0
    # derived values are filled in
    assert cfg.async_training.queue_max_groups >= cfg.async_training.required_samples
    assert cfg.param_sync.weights_dir.endswith("weights")


def test_overrides_win_over_the_file():
    cfg = load_config(None, ["trainer.total_training_steps=7", "async_training.max_staleness=3"])
    assert cfg.trainer.total_training_steps == 7
    assert cfg.async_training.max_staleness == 3


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("actor_rollout_ref.actor.optim.lrr=1e-3", "actor_rollout_ref.actor.optim.lrr"),
        ("async_training.max_stalenes=2", "did you mean 'async_training.max_staleness'"),
        ("nonsense.key=1", "nonsense"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr"),
        ("engines.num_engines=two", "engines.num_engines"),
        ("actor_rollout_ref.rollout.n=true", "actor_rollout_ref.rollout.n"),
        ("async_training.max_staleness=-1", "async_training.max_staleness"),
        ("engines.backend=vllm", "engines.backend"),
        ("algorithm.adv_estimator=magic", "algorithm.adv_estimator"),
        ("actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.n"),
        ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node"),
        ("param_sync.transport=gloo", "param_sync.transport"),
        ("actor_rollout_ref.actor.strategy=megatron", "needs CUDA"),
        ("async_training.require_batches=2", "async_training.required_samples"),
        ("actor_rollout_ref.ref.fsdp_config.param_offload=true", "is verl's, not used by the fully-async trainer"),
        ("algorithm.use_kl_in_reward=true", "algorithm.use_kl_in_reward"),
        ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.use_kl_loss"),
        ("actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_epochs"),
        ("async_training.queue_max_groups=3", "async_training.queue_max_groups"),
        ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p"),
        ("justakey", "key=value"),
    ],
)
def test_bad_settings_give_one_line_naming_the_key(override, named):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert named in message
    assert "\n" not in message


def test_the_distributed_transport_is_honoured_for_one_and_several_ranks_and_a_bad_master_address_refused():
    from rllm.experimental.fully_async.core.addresses import resolve_master_address
    from rllm.experimental.fully_async.run_spec import build_run_spec

    for name in ("distributed", "nccl"):  # nccl: verl's and rLLM's name; gloo on CPU
        for ranks in ("1", "2"):
            spec = build_run_spec(
                load_config(None, [f"param_sync.transport={name}", f"trainer.n_gpus_per_node={ranks}"])
            )
            assert (spec.param_sync.transport, spec.trainer.world_size) == (name, int(ranks))
    assert load_config(None, []).param_sync.master_address == "auto"
    for good in ("10.1.2.3", "fe80::1", "node-7.cluster.local"):
        assert (
            build_run_spec(load_config(None, [f"param_sync.master_address={good}"])).param_sync.master_address == good
        )
    for bad in ("10.1.2.300", "http://node", "two words", "-x"):
        with pytest.raises(ConfigError, match=r"^'param_sync\.master_address' must be auto, an IP address or a host"):
            load_config(None, [f"param_sync.master_address='{bad}'"])
    # auto: loopback while every engine is on rank 0's node (an engine URL on loopback is on this process's node)
    urls = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert resolve_master_address("auto", "10.0.0.1", urls, "10.0.0.1") == "127.0.0.1"
    assert resolve_master_address("auto", "10.0.0.2", urls, "10.0.0.1") == "10.0.0.2"
    assert resolve_master_address("auto", "10.0.0.1", [*urls, "http://10.0.0.3:30000"], "10.0.0.1") == "10.0.0.1"
    assert resolve_master_address("10.9.9.9", "10.0.0.1", urls, "10.0.0.1") == "10.9.9.9"


@pytest.mark.parametrize(
    "overrides",
    [
        ("async_training.max_staleness=1",),
        ("async_training.max_staleness=0", "async_training.trigger_parameter_sync_step=2"),
        (
            "async_training.max_staleness=0",
            "async_training.adaptive_staleness.enable=true",
            "async_training.adaptive_staleness.min=0",
        ),
    ],
)
def test_the_synchronous_control_is_refused_outside_synchronous_runs_in_one_line(overrides):
    """control_prox is a control for η = 0, K = 1 only; there it loads (and its backend keeps the previous weights)."""
    control = "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: previous, control_prox: previous_step}"
    sync = ["async_training.max_staleness=0", "async_training.trigger_parameter_sync_step=1"]
    assert load_config(None, [*sync, control]).algorithm.off_policy_correction.control_prox == "previous_step"
    with pytest.raises(ConfigError, match=r"control_prox' is a control for synchronous runs only") as info:
        load_config(None, [*overrides, control])
    assert "\n" not in str(info.value)


def test_loglinear_proximal_runs_as_its_own_loss_and_refuses_another_loss_mode():
    loglinear = "algorithm.off_policy_correction={mode: decoupled, prox_log_probs: loglinear}"
    assert load_config(None, [loglinear]).algorithm.off_policy_correction.prox_log_probs == "loglinear"
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref\.actor\.policy_loss\.loss_mode' must be 'vanilla'"):
        load_config(None, [loglinear, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])


def test_rllm_staleness_threshold_is_mapped_when_max_staleness_is_unset():
    cfg = load_config(None, ["async_training.max_staleness=null", "async_training.staleness_threshold=0.5"])
    assert isinstance(cfg.async_training.max_staleness, int)
    assert cfg.async_training.max_staleness >= 0


def test_yaml_defaults_compose_sibling_files(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  total_training_steps: 11\nengines:\n  num_engines: 3\n")
    (tmp_path / "child.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - base\n  - _self_\nengines:\n  num_engines: 1\n"
    )
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.trainer.total_training_steps == 11
    assert cfg.engines.num_engines == 1


def test_unreadable_or_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2:1: YAML syntax error: .*flow sequence that starts at 1:10"):
        load_config(bad)
    unreadable = tmp_path / "folder.yaml"
    unreadable.mkdir()
    with pytest.raises(ConfigError, match="does not exist"):  # not a file
        load_config(unreadable)


def test_cli_exits_2_with_one_line_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "rllm.experimental.fully_async", "async_training.max_staleness=-2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "async_training.max_staleness" in lines[0]
    assert "Traceback" not in proc.stderr


_KEYS = [
    "async_training.max_staleness",
    "async_training.trigger_parameter_sync_step",
    "async_training.required_samples",
    "engines.num_engines",
    "engines.request_timeout_s",
    "param_sync.timeout_s",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.actor.optim.lr",
    "data.max_response_length",
    "data.train_batch_size",
]
_BAD_VALUES = st.one_of(
    st.integers(max_value=-1),
    st.just("not-a-number"),
    st.just("[1, 2]"),
    st.just("{a: 1}"),
)


@pytest.mark.slow  # 60 config loads (~80 s on a busy 2-core machine)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(_KEYS), value=_BAD_VALUES)
def test_fuzzed_bad_values_always_raise_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}={value}"])
    assert key.split(".")[-1] in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.slow  # 40 config loads (~60-160 s on a busy 2-core machine)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    section=st.sampled_from(["async_training", "engines", "trainer", "actor_rollout_ref.actor"]),
    name=st.from_regex(r"[a-z]{3,12}_zz", fullmatch=True),
)
def test_fuzzed_unknown_keys_always_raise_config_error(section, name):
    with pytest.raises(ConfigError, match=f"unknown key '{section}.{name}'"):
        load_config(None, [f"{section}.{name}=1"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ("train", None, [])),
        (["a.b=1"], ("train", None, ["a.b=1"])),
        (["--config", "x.yaml", "a.b=1"], ("train", "x.yaml", ["a.b=1"])),
        (["train", "--config", "x.yaml", "a.b=1", "c=2"], ("train", "x.yaml", ["a.b=1", "c=2"])),
        (["--config", "x.yaml", "train", "a.b=1"], ("train", "x.yaml", ["a.b=1"])),
        (["doctor"], ("doctor", None, [])),
    ],
)
def test_command_line_takes_command_config_and_overrides_in_any_order(argv, expected):
    from rllm.experimental.fully_async.__main__ import parse_command_line

    assert parse_command_line(argv) == expected


def test_command_line_rejects_a_bare_word_with_usage_exit_2():
    from rllm.experimental.fully_async.__main__ import parse_command_line

    with pytest.raises(SystemExit) as info:
        parse_command_line(["--config", "x.yaml", "oops"])
    assert info.value.code == 2


def test_run_spec_is_built_once_frozen_and_follows_the_config():
    import dataclasses

    from rllm.experimental.fully_async.run_spec import build_run_spec

    cfg = load_config(None, ["async_training.trigger_parameter_sync_step=2", "async_training.max_staleness=3"])
    spec = build_run_spec(cfg)
    assert spec == build_run_spec(cfg)
    assert spec.schedule.trigger_parameter_sync_step == 2 and spec.schedule.max_staleness == 3
    assert spec.schedule.required_samples == cfg.async_training.required_samples
    assert spec.trainer.actor["optim"]["lr"] == cfg.actor_rollout_ref.actor.optim.lr
    assert spec.engines.backend == "embedded" and spec.param_sync.transport == "disk"
    assert spec.run.task.name == "addition"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.trainer.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.trainer.actor["clip_ratio"] = 0.5  # type: ignore[index]
    cfg.actor_rollout_ref.actor.clip_ratio = 0.3  # the spec is a copy: later config edits do not leak into it
    assert spec.trainer.actor["clip_ratio"] != 0.3


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rllm.experimental.fully_async", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_config_command_prints_what_differs_from_the_defaults_with_origin_and_meaning(capsys, monkeypatch):
    from rllm.experimental.fully_async.__main__ import main

    monkeypatch.chdir(REPO)
    assert main(["config", "engines.num_engines=3", "async_training.max_staleness=null"]) == 0
    proc = capsys.readouterr()
    printed = OmegaConf.create(proc.out)  # still YAML: the notes are comments
    assert printed.engines.num_engines == 3
    assert isinstance(printed.async_training.max_staleness, int)  # derived values are filled in
    assert "clip_ratio_c" not in proc.out  # at verl's default: left out
    lines = proc.out.splitlines()
    assert any(line.startswith("  num_engines: 3  # [the command line] engine processes") for line in lines)
    assert any(line.startswith("      lr: 0.0003  # [") and "tiny_cpu.yaml] Learning rate" in line for line in lines)
    assert any(re.search(r"max_staleness: \d+  # \[derived\] .*max policy versions", line) for line in lines)
    assert main(["config", "--all", "engines.num_engines=3"]) == 0
    everything = capsys.readouterr().out
    assert OmegaConf.create(everything).actor_rollout_ref.actor.clip_ratio_c == 3.0
    assert len(everything.splitlines()) > 5 * len(lines)


def test_config_explain_gives_meaning_default_allowed_values_and_readers():
    from rllm.experimental.fully_async.settings.explain import explain, verl_comments

    lines = explain("async_training.max_staleness", load_config())
    text = "\n".join(lines)
    assert "max policy versions (weight syncs, core/versions.py) a trained token may lag" in text  # schema.py's
    assert "default:  null" in text and "allowed:  an integer or null >= 0" in text and "now:      1" in text
    assert "run_spec.py into the run spec: ScheduleSpec.max_staleness" in text and "settings/derive.py" in text
    verl_key = "\n".join(explain("actor_rollout_ref.rollout.n"))
    assert "number of responses (i.e. num sample times)" in verl_key  # verl's own yaml comment
    assert "default:  8 (this project's; verl's is 1)" in verl_key and ">= 1" in verl_key
    unread = "\n".join(explain("actor_rollout_ref.ref.fsdp_config.param_offload"))
    assert "not read by the fully-async trainer" in unread and "no reference model" in unread
    cuda_only = "\n".join(explain("actor_rollout_ref.actor.fsdp_config.param_offload"))
    assert "read only with trainer.device=cuda" in cuda_only  # settings/verl_keys.py READ_ONLY_WHEN
    # verl's comments come through its defaults list: the actor's optimizer is optim/fsdp.yaml under actor.optim
    assert verl_comments()["actor_rollout_ref.actor.optim.lr"] == "Learning rate"
    assert "dual-clip" in verl_comments()["actor_rollout_ref.actor.clip_ratio_c"].lower()
    with pytest.raises(ConfigError, match=r"did you mean async_training.max_staleness"):
        explain("async_training.max_stalenes")
    proc = _cli("config", "--explain", "engines.backend", "engines.backend=sglang")
    assert proc.returncode == 0 and "allowed:  embedded | sglang" in proc.stdout, proc.stderr
    assert "now:      sglang (set in the command line)" in proc.stdout


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_training_steps: 5\n  logger: [console\nfoo: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    assert str(caught.value) == (
        f"{bad}:4:4: YAML syntax error: expected ',' or ']', but got ':' (while parsing a flow sequence that starts "
        "at 3:11)"
    )
    tabbed = tmp_path / "tab.yaml"
    tabbed.write_text("a: 1\n\tb: 2\n")
    with pytest.raises(ConfigError, match=rf"^{tabbed}:2:1: YAML syntax error: found character"):
        load_config(tabbed)


def test_an_unknown_command_gets_the_nearest_one():
    proc = _cli("repot", "runs/x")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "error: unknown command 'repot': did you mean 'report' or 'replay'? commands: train, doctor, config, plan, "
            "report, view, simulate, replay, engines (overrides are key=value)"
        )
    )
    missing_value = _cli("trainer.total_training_steps")
    assert "overrides are key=value" in missing_value.stderr and "unknown command" not in missing_value.stderr


def test_help_lists_commands_and_sections():
    help_text = _cli("--help").stdout
    for name in ("train", "doctor", "config", "async_training", "settings/schema.py", "algorithms/filters.py"):
        assert name in help_text


@pytest.mark.parametrize(
    ("override", "named"),
    [("workflow.name=agentic", "workflow.name"), ("run.log_level=LOUD", "run.log_level")],
)
def test_unknown_workflow_or_level_is_refused_when_loading(override, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, [override])


def test_known_failures_print_one_line_and_exit_by_kind(monkeypatch, capsys):
    from rllm.experimental.fully_async import __main__ as cli
    from rllm.experimental.fully_async.backends.verl_patch import UnpatchedVerlError
    from rllm.experimental.fully_async.engines.launcher import EngineStartupError
    from rllm.experimental.fully_async.errors import DataError, FullyAsyncError
    from rllm.experimental.fully_async.runtime.checkpoints.store import CheckpointError
    from rllm.experimental.fully_async.runtime.run.driver import RunFailedError

    def raising(exc: BaseException):
        def handler(line):
            raise exc

        return cli.Command(handler, "test")

    cases = [
        (DataError("train.parquet: row 3: field 'prompt' is missing"), 2),
        (ConfigError("'x.y' must be set"), 2),
        (RunFailedError("step 4: EngineDiedError: engine 1 exited"), 1),
        (EngineStartupError("engine 0 did not answer /health within 5s"), 1),
        (UnpatchedVerlError("verl is not patched: run bash install/apply_verl_patch.sh"), 2),
        (CheckpointError("checkpoint runs/x/step_3 is incomplete"), 1),
    ]
    for exc, code in cases:
        assert isinstance(exc, FullyAsyncError)
        monkeypatch.setitem(cli.COMMANDS, "boom", raising(exc))
        assert cli.main(["boom"]) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(exc) in err and "Traceback" not in err
    monkeypatch.setitem(cli.COMMANDS, "boom", raising(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):  # an unknown failure keeps its traceback
        cli.main(["boom"])


def test_a_derived_synchronous_run_says_so_naming_the_key_and_the_value_for_eta_1():
    from rllm.experimental.fully_async.settings.derive import synchronous_notice

    sync = ["async_training.max_staleness=null", "async_training.trigger_parameter_sync_step=1"]
    threshold = load_config(None, [*sync, "async_training.staleness_threshold=0.1"])  # rLLM's default, written
    assert threshold.async_training.max_staleness == 0
    notice = synchronous_notice(threshold)
    assert notice is not None and "\n" not in notice and "training synchronously" in notice
    assert "async_training.staleness_threshold=0.1" in notice and "staleness_threshold=1.0 (η=1)" in notice
    # the value named gives η=1, and then nothing is said
    eta_1 = load_config(None, [*sync, "async_training.staleness_threshold=1.0"])
    assert eta_1.async_training.max_staleness == 1 and synchronous_notice(eta_1) is None
    unset = synchronous_notice(load_config(None, sync))  # both null: rLLM's default 0.1 derives η=0
    assert unset is not None and "async_training.max_staleness=1" in unset
    assert "default staleness_threshold 0.1" in unset
    assert synchronous_notice(load_config(None, [*sync, "async_training.trigger_parameter_sync_step=2"])) is None


def test_every_refused_key_of_a_config_is_named_in_one_error(capsys):
    from rllm.experimental.fully_async.__main__ import main

    bad = [
        "actor_rollout_ref.actor.optim.lrr=1",  # unknown
        "actor_rollout_ref.rollout.n=two",  # wrong type
        "algorithm.kl_ctrl.kl_coef=0.1",  # verl's, not read
        "trainer.default_local_dir=/x",  # verl's, not read
    ]
    with pytest.raises(ConfigError) as caught:
        load_config(None, bad)
    keys = [error.key for error in caught.value.refusals]
    assert sorted(keys) == sorted(item.split("=")[0] for item in bad)
    assert main(["config", *bad]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and err[0].startswith("config error: ")
    assert err[0].endswith("[and 3 more keys refused, listed below]")
    assert all(line.startswith("  '") or line.startswith("  unknown key") for line in err[1:])


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["actor_rollout_ref.rollout.n=-3"], "'actor_rollout_ref.rollout.n' must be an integer >= 1, got -3"),
        (["actor_rollout_ref.rollout.n=0"], "'actor_rollout_ref.rollout.n' must be an integer >= 1, got 0"),
        (["async_training.required_samples=-2"], "'async_training.required_samples' must be an integer >= 1"),
        (
            ["async_training.required_samples=null", "data.train_batch_size=-4"],
            "'data.train_batch_size' must be an integer >= 0, got -4",
        ),
        (["async_training.max_staleness=-2"], "'async_training.max_staleness' must be an integer >= 0"),
    ],
)
def test_a_bad_input_of_a_derived_value_is_named_by_the_key_the_user_set(overrides, named):
    # before: rollout.n=-3 was "'async_training.max_concurrent_rollouts' must be >= 1, got -384"
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert str(caught.value) == named or str(caught.value).startswith(named), str(caught.value)


def _our_leaf_keys() -> list[str]:
    """Every leaf key of this project's sections (settings/schema.py's and the algorithm sections), nested
    sections included, walked from the dataclasses themselves."""
    import dataclasses
    import typing

    from rllm.experimental.fully_async.settings.explain import dataclass_sections

    keys = []
    for section, cls in dataclass_sections().items():
        hints = typing.get_type_hints(cls)
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
    return keys


def test_every_key_of_our_sections_is_explained_with_its_comment_and_value():
    from rllm.experimental.fully_async.settings.explain import ALGORITHM_SECTIONS, explain
    from rllm.experimental.fully_async.settings.schema import FULLY_ASYNC_VERL_DEFAULTS, PROJECT_SECTIONS

    # The algorithm sections are the null (off) sections this project adds under verl's `algorithm`.
    added = {f"algorithm.{k}" for k, v in FULLY_ASYNC_VERL_DEFAULTS["algorithm"].items() if v is None}
    assert added == set(ALGORITHM_SECTIONS)
    keys = _our_leaf_keys()
    assert {k.split(".")[0] for k in keys} == set(PROJECT_SECTIONS) | {"algorithm"}
    assert "async_training.adaptive_staleness.max_kl" in keys and "engines.lora.max_loaded_loras" in keys
    cfg = load_config(None, ["algorithm.off_policy_correction.mode=tis"])
    uncommented = []
    for key in keys:
        lines = explain(key, cfg)
        assert lines[0] == key, lines
        meaning = next(line for line in lines if line.startswith("  meaning:  ")).removeprefix("  meaning:  ")
        if not meaning or meaning.startswith("no comment"):
            uncommented.append(key)
        assert any(line.startswith("  now:      ") and len(line) > 12 for line in lines), lines
        assert any(line.startswith("  allowed:  ") for line in lines), lines
    assert not uncommented, f"write a comment beside or above these fields (or a docstring entry): {uncommented}"


@pytest.mark.slow  # two `config` CLI calls (~7 s each quiet, 20-40 s at load 5-10)
def test_config_explain_reads_nested_and_algorithm_sections_from_the_cli():
    proc = _cli(
        "config",
        "--explain",
        "algorithm.off_policy_correction.cap_mode",
        "algorithm.off_policy_correction.cap_mode=mask",
    )
    assert proc.returncode == 0, proc.stderr
    assert "how w is limited" in proc.stdout and "allowed:  truncate | mask" in proc.stdout
    assert "now:      mask (set in the command line)" in proc.stdout
    assert "documented in algorithms/correction_config.py (CorrectionConfig)" in proc.stdout
    proc = _cli("config", "--explain", "async_training.adaptive_staleness.raise_after")
    assert proc.returncode == 0 and "Syncs in a row with every statistic clear" in proc.stdout, proc.stderr
    assert "now:      2 (the default)" in proc.stdout
    from rllm.experimental.fully_async.settings.explain import explain

    assert "  now:      null (algorithm.gigpo is null: off)" in explain("algorithm.gigpo.omega", load_config())
    section = explain("algorithm.group_filter")
    assert "  algorithm.group_filter.reward_tol: rewards within this distance count as equal." in section


@pytest.mark.slow  # two `config` CLI calls (~7 s each quiet, 20-40 s at load 5-10)
def test_config_on_a_task_shows_the_task_model_and_data_not_verls_placeholders(addition_cache, tmp_path):
    cached = _cli("config", f"task.cache_dir={addition_cache}", "task.warmup_steps=60")
    assert cached.returncode == 0, cached.stderr
    assert "deepseek" not in cached.stdout and "gsm8k" not in cached.stdout
    model = re.search(r"^    path: (\S+)  # \[task addition\] path to the huggingface model$", cached.stdout, re.M)
    train = re.search(r"^  train_files: (\S+)  # \[task addition\] Training set parquet", cached.stdout, re.M)
    assert model and train, cached.stdout
    assert (Path(model.group(1)) / "config.json").is_file() and Path(train.group(1)).is_file()
    assert Path(model.group(1)).parent.parent == addition_cache
    fresh = _cli("config", "--explain", "data.val_files", f"task.cache_dir={tmp_path}")
    assert re.search(
        rf"now:      {tmp_path}/addition-\w+/val.parquet \(set in task addition, built at its first run\)", fresh.stdout
    ), fresh.stdout
