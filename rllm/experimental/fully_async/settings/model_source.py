"""The user's model (`task.name=null`), checked before anything starts: a folder here, or a Hub id the run can load.

Without this check a model path that does not exist reached `AutoTokenizer.from_pretrained` in the driver and ended
in an 86-line traceback (transformers takes any missing path for a Hub id); a Hub id on a machine that cannot reach
the Hub retried the connection for ~58 s before a 115-line one; a folder without tokenizer files loaded as a
Qwen2Tokenizer of one token that encodes every prompt to nothing. Here each is one `ConfigError` line naming the
key and the fix (exit 2), found in well under a second: the Hub is probed once, with a short timeout, only when
the path is not a folder; a Hub id is then looked up in the local cache (`local_files_only=True`).

A Hub id found in the cache while the Hub is unreachable puts huggingface_hub in offline mode (in this process and,
through the environment, in the engines and actors started after), so every later load reads the cache instead
of retrying the Hub.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from omegaconf import DictConfig

from rllm.experimental.fully_async.errors import ConfigError

logger = logging.getLogger(__name__)

MODEL_KEY = "actor_rollout_ref.model.path"
# verl's default model.path (`_generated_ppo_trainer.yaml`), as settings/paths.py expands it.
VERL_DEFAULT_MODEL = "~/models/deepseek-llm-7b-chat"
# The files transformers builds a tokenizer from (tokenizer.json for fast tokenizers, vocab/merges for BPE,
# SentencePiece and tiktoken models). Without one, AutoTokenizer still "loads" a tokenizer with no vocabulary.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
LORA_ADAPTER_KEY = "actor_rollout_ref.model.lora_adapter_path"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft's save_pretrained writes
HUB_PROBE_TIMEOUT_S = 3.0  # one HEAD to the Hub's endpoint; its DNS look-up included (a thread bounds it)


def check_model_source(cfg: DictConfig) -> None:
    """With task.name=null: refuse, in one line naming actor_rollout_ref.model.path, a model the run cannot load
    (module docstring). A built-in task's model is the task's own (tasks/)."""
    if cfg.task.name is not None or not cfg.actor_rollout_ref.model.path:
        return  # no path at all is refused by settings/validate.py
    path = str(cfg.actor_rollout_ref.model.path)
    named = f"'{MODEL_KEY}={path}'"
    if path == os.path.expanduser(VERL_DEFAULT_MODEL):
        named += " (verl's default: nothing set it)"
    check_model(path, named)


def check_model(path: str, named: str) -> None:
    """`path` is a model folder, or a Hub id the run can load; `named` starts the error line (the key and value)."""
    folder = Path(path)
    if folder.exists():
        check_model_folder(folder, named)
        return
    if not _is_hub_id(path):
        raise ConfigError(
            f"{named} does not exist: set it to a Hugging Face model folder (config.json, tokenizer and weights)"
        )
    why = hub_unreachable_reason()
    if why is None:
        return  # the loaders download it (a Hub id that does not exist is then the Hub's 404)
    try:
        cached = huggingface_hub.snapshot_download(path, local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError, or a cache entry without its refs/main
        cache = hf_constants.HF_HUB_CACHE
        raise ConfigError(
            f"{named} is no folder here, and as a Hugging Face Hub id it is not in the local cache ({cache}) while "
            f"the Hub is unreachable ({why}): download it first where the Hub is reachable (`hf download {path}`, "
            "then copy the cache or the folder here), or set it to a local model folder"
        ) from exc
    check_model_folder(Path(cached), f"{named} (in the Hugging Face cache at {cached})")
    logger.info("model %s from the local Hugging Face cache (%s); Hub unreachable: %s", path, cached, why)
    _go_offline()


def check_model_folder(folder: Path, named: str) -> None:
    """A folder transformers and the engines load a model and its tokenizer from."""
    if not folder.is_dir():
        raise ConfigError(f"{named} is a file, not a model folder: set it to the folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{named} has no config.json, so no model loads from it: set it to a Hugging Face model folder "
            "(save_pretrained writes config.json beside the weights)"
        )
    names = {p.name for p in folder.iterdir()}
    if not names.intersection(TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        raise ConfigError(
            f"{named} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...): save the model's tokenizer into the "
            "folder (tokenizer.save_pretrained(folder))"
        )


def hub_unreachable_reason() -> str | None:
    """None when the Hub answers within HUB_PROBE_TIMEOUT_S; else why not (offline mode, the connection's error)."""
    if hf_constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            huggingface_hub.get_session().head(hf_constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
            outcome.append(None)
        except Exception as exc:  # httpx's connect and timeout errors, DNS failures
            outcome.append(f"{hf_constants.ENDPOINT}: {type(exc).__name__}")

    # A thread, as the DNS look-up before the connection has no timeout of its own; daemon: never waited for.
    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.5)
    if not outcome:
        return f"{hf_constants.ENDPOINT}: no answer within the {HUB_PROBE_TIMEOUT_S:.0f} s timeout"
    return outcome[0]


def _is_hub_id(path: str) -> bool:
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _go_offline() -> None:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: its constant is what transformers' loaders consult here;
    # the environment carries it to the engines and actors started after this.
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf_constants.HF_HUB_OFFLINE = True


def check_lora_adapter(cfg: DictConfig) -> None:
    """actor_rollout_ref.model.lora_adapter_path (verl 0.7.1: the LoRA policy starts from a saved peft adapter, loaded
    with `PeftModel.from_pretrained(..., is_trainable=True)`, whose own adapter_config.json decides rank, alpha and
    modules): refuse, in one line naming the key, a folder peft did not write, and an adapter the other lora_* keys
    contradict. `lora_rank` must be the adapter's r (it sizes the engines' --max-lora-rank), `lora_alpha` its
    lora_alpha, `exclude_modules` null or its own; `target_modules` all-linear (the default: the adapter's modules
    are trained) or its own modules. So no key is silently overridden by the adapter's file."""
    model = cfg.actor_rollout_ref.model
    path = model.get("lora_adapter_path")
    if path is None:
        return
    named = f"'{LORA_ADAPTER_KEY}={path}'"
    folder = Path(str(path))
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(f"{named}: no adapter_config.json there; set it to a folder peft's save_pretrained wrote")
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ConfigError(f"{named}: no {' or '.join(ADAPTER_WEIGHTS)} there; set it to a folder peft wrote")
    try:
        adapter = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ConfigError(f"{named}: adapter_config.json is not JSON ({exc})") from exc
    if adapter.get("peft_type") != "LORA":
        raise ConfigError(f"{named}: a {adapter.get('peft_type')!r} adapter; only a LoRA adapter can be trained here")
    r, alpha = int(adapter.get("r", 0)), float(adapter.get("lora_alpha", 0))
    if int(model.lora_rank or 0) != r:
        raise ConfigError(
            f"{named} holds an adapter of r={r}, but actor_rollout_ref.model.lora_rank={model.lora_rank}: set "
            f"lora_rank={r} (it sizes the engines' --max-lora-rank)"
        )
    if float(model.lora_alpha) != alpha:
        raise ConfigError(
            f"{named} holds an adapter of lora_alpha={adapter.get('lora_alpha')}, but actor_rollout_ref.model."
            f"lora_alpha={model.lora_alpha}: set lora_alpha={adapter.get('lora_alpha')} (peft loads the adapter's)"
        )
    theirs = adapter.get("target_modules")
    ours = model.target_modules
    if ours != "all-linear" and _module_names(ours) != _module_names(theirs):
        raise ConfigError(
            f"{named} holds an adapter on {sorted(_module_names(theirs))}, but actor_rollout_ref.model.target_modules="
            f"{list(ours) if not isinstance(ours, str) else ours}: set target_modules to those, or all-linear"
        )
    excluded = model.get("exclude_modules")
    if excluded is not None and _module_names(excluded) != _module_names(adapter.get("exclude_modules")):
        raise ConfigError(
            f"{named} holds an adapter excluding {adapter.get('exclude_modules')}, but actor_rollout_ref.model."
            f"exclude_modules={list(excluded) if not isinstance(excluded, str) else excluded}: remove it"
        )


def _module_names(value: object) -> set[str]:
    """The module names (last dotted parts, as SGLang's --lora-target-modules) of a target_modules/exclude_modules
    value: a name, a list (peft saves all-linear as every module's full path), or None."""
    if value is None:
        return set()
    names = [value] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    return {str(name).split(".")[-1] for name in names}
