"""The embedded engine's LoRA parts in this process: adapters read from peft's own folders, the mixed-adapter forward
against peft's, and SGLang 0.5.6's serving protocol (registry, reference counts, unloads that wait, implicit
reloads, LRU eviction, batch admission), each behaviour cited from SGLang's source in lora_serving.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import LOGPROB_TOL, max_abs_diff, reference_logprobs
from lora_helpers import peft_reference, write_adapter
from transformers import AutoModelForCausalLM

from rllm.experimental.fully_async.engines.embedded.lora import (
    LoRAAdapterError,
    LoRALayers,
    LoRALimits,
    build_adapter,
    normalized_target_modules,
    read_adapter_folder,
    server_target_modules,
)
from rllm.experimental.fully_async.engines.embedded.lora_serving import LoRAServing
from rllm.experimental.fully_async.engines.embedded.model_runner import ModelRunner, load_model
from rllm.experimental.fully_async.engines.embedded.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

ALL = server_target_modules(["all"])
assert ALL is not None


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory) -> dict[str, Path]:
    """peft adapters of model A: all-linear rank 4, q/v rank 8, all-linear rank 4 of another seed, rank 16."""
    base, root = models["a"][0], tmp_path_factory.mktemp("lora_adapters")
    return {
        "all4": write_adapter(base, root / "all4", seed=1),
        "qv8": write_adapter(base, root / "qv8", seed=2, rank=8, alpha=16, target_modules=["q_proj", "v_proj"]),
        "other": write_adapter(base, root / "other", seed=3),
        "rank16": write_adapter(base, root / "rank16", seed=4, rank=16),
        "rslora": write_adapter(base, root / "rslora", seed=5, use_rslora=True),
    }


def adapter_of(name: str, path: Path, model: torch.nn.Module, *, strict: bool = True):
    config, tensors = read_adapter_folder(str(path))
    return build_adapter(
        lora_id=name,
        name=name,
        path=str(path),
        pinned=False,
        config=config,
        tensors=tensors,
        model=model,
        strict=strict,
    )


# ---------------------------------------------------------------- adapters and the mixed forward


def test_a_mixed_adapter_batch_gives_each_row_its_own_adapters_logprobs_as_peft_computes_them(models, adapters):
    """Prefill and decode through the engine's batched KV cache, rows of two adapters and the base model sharing
    every pass: each row's log-probs are peft's for its adapter (PeftModel.from_pretrained on the same folders)."""
    base_dir = models["a"][0]
    model, info = load_model(base_dir)
    layers = LoRALayers()
    runner = ModelRunner(model, info, seed=0, lora_layers=layers)
    all4, qv8 = adapter_of("all4", adapters["all4"], model), adapter_of("qv8", adapters["qv8"], model)
    prompts, row_adapters = [[3, 4, 5], [6, 7], [3, 4, 5], [9]], [all4, None, qv8, all4]
    params = [SamplingParams.from_json({"temperature": 1.0})] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    sampled = runner.prefill(prompts, params, row_adapters)
    for _ in range(8):
        for row, (token, lp) in enumerate(zip(sampled.token_ids, sampled.logprobs, strict=True)):
            outputs[row].append(token)
            logprobs[row].append(lp)
        sampled = runner.decode([o[-1] for o in outputs], params, row_adapters)
    references = {
        "all4": peft_reference(base_dir, adapters["all4"]),
        "qv8": peft_reference(base_dir, adapters["qv8"]),
        None: AutoModelForCausalLM.from_pretrained(base_dir).eval(),
    }
    for prompt, adapter, out, lps in zip(prompts, row_adapters, outputs, logprobs, strict=True):
        expected = reference_logprobs(references[None if adapter is None else adapter.name], prompt, out)
        assert max_abs_diff(lps, expected) < LOGPROB_TOL
    # the adapters change the model: the base model's log-probs of the adapter rows' tokens are far off
    assert max_abs_diff(logprobs[0], reference_logprobs(references[None], prompts[0], outputs[0])) > 0.05


def test_the_base_models_parameters_keep_their_names_and_values_under_the_hooks(models, adapters):
    """Full weight updates address parameters by their HF names; peft's injection would rename them."""
    model, _ = load_model(models["a"][0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    LoRALayers().attach(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)


def test_sglangs_target_module_normalisation_and_checks(models, adapters, tmp_path):
    """lora/utils.py get_normalized_target_modules: q/k/v share qkv_proj, gate/up share gate_up_proj, so
    `--lora-target-modules q_proj` admits an adapter on k_proj (lora_manager.validate_new_adapter, can_support)."""
    assert normalized_target_modules(["model.layers.0.self_attn.k_proj", "up_proj", "o_proj"]) == {
        "qkv_proj",
        "gate_up_proj",
        "o_proj",
    }
    assert server_target_modules(None) is None and "down_proj" in ALL
    with pytest.raises(ValueError, match="should be the only module"):
        server_target_modules(["all", "q_proj"])
    model, _ = load_model(models["a"][0])
    config, tensors = read_adapter_folder(str(adapters["all4"]))
    with pytest.raises(LoRAAdapterError, match=r"^Not supported yet$"):  # lora_config.py's message
        build_adapter(
            lora_id="x",
            name="x",
            path=None,
            pinned=False,
            config={**config, "target_modules": ["lm_head", "q_proj"]},
            tensors=tensors,
            model=model,
        )
    bad = {k: (v[:, :-1] if "lora_A" in k else v) for k, v in tensors.items()}
    with pytest.raises(LoRAAdapterError, match=r"down_proj has lora_A \(4, 127\).*needs \(4, 128\)"):
        build_adapter(lora_id="x", name="x", path=None, pinned=False, config=config, tensors=bad, model=model)
    with pytest.raises(LoRAAdapterError, match="is not a folder"):
        read_adapter_folder(str(tmp_path / "missing"))


def test_peft_options_sglang_would_ignore_are_refused_by_the_engine_and_served_as_sglang_does_by_the_standin(
    models, adapters
):
    """SGLang reads only r and lora_alpha (lora/lora.py: scaling = lora_alpha / r): an adapter trained with
    use_rslora (peft: alpha / sqrt(r)) is served as another model. The embedded engine refuses it; the stand-in
    (strict=False) serves alpha / r, as SGLang does."""
    model, _ = load_model(models["a"][0])
    with pytest.raises(LoRAAdapterError, match="use_rslora=True"):
        adapter_of("rs", adapters["rslora"], model)
    served = adapter_of("rs", adapters["rslora"], model, strict=False)
    assert served.scaling == 8 / 4  # alpha / r, not peft's 8 / sqrt(4)


# ---------------------------------------------------------------- the serving protocol (SGLang's)


def serving(model: torch.nn.Module, **limits: object) -> LoRAServing:
    defaults = {"max_lora_rank": 8, "target_modules": ALL, "max_loras_per_batch": 8, "max_loaded_loras": None}
    return LoRAServing(LoRALimits(**(defaults | limits)), lambda: model)  # type: ignore[arg-type]


def test_load_answers_and_refusals_are_sglangs(models, adapters, tmp_path):
    model, _ = load_model(models["a"][0])

    async def run() -> None:
        lora = serving(model)
        ok = await lora.load_lora_adapter("v1", str(adapters["all4"]))
        assert ok.success and ok.error_message == "" and ok.loaded_adapters == {"v1": str(adapters["all4"])}
        again = await lora.load_lora_adapter("v1", str(adapters["other"]))
        assert not again.success
        assert again.error_message == "Failed to load LoRA adapter v1 because it is already loaded"
        big = await lora.load_lora_adapter("big", str(adapters["rank16"]))
        assert (
            not big.success
            and "with rank 16 is incompatible" in big.error_message
            and "--max-lora-rank" in big.error_message
        )
        narrow = serving(model, target_modules=normalized_target_modules(["q_proj"]))
        on_k = await narrow.load_lora_adapter("qv", str(adapters["qv8"]))  # q/v normalise to qkv_proj
        on_all = await narrow.load_lora_adapter("all", str(adapters["all4"]))
        assert on_k.success and not on_all.success and "--lora-target-modules" in on_all.error_message
        gone = await lora.unload_lora_adapter("nope")
        assert (
            not gone.success
            and gone.error_message == "LoRA with name nope does not exist. Loaded LoRAs: odict_keys(['v1'])"
        )
        with pytest.raises(ValueError, match=r"^Got LoRA adapter that has never been loaded: nope\n"):
            await lora.acquire("nope")
        off = LoRAServing(LoRALimits(0, frozenset()), lambda: model, enabled=False)
        refused = await off.load_lora_adapter("v1", str(adapters["all4"]))
        assert refused.error_message == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."

    asyncio.run(run())


def test_an_unload_waits_for_the_adapters_requests_and_holds_back_loads_meanwhile(models, adapters):
    """tokenizer_communicator_mixin.unload_lora_adapter: under the LoRA update lock, unregister at once, wait for the
    adapter's requests (lora_registry.wait_for_unload), then drop it. A load sent meanwhile waits for the lock."""
    model, _ = load_model(models["a"][0])

    async def run() -> None:
        lora = serving(model)
        await lora.load_lora_adapter("v1", str(adapters["all4"]))
        held = await lora.acquire("v1")
        unload = asyncio.ensure_future(lora.unload_lora_adapter("v1"))
        await asyncio.sleep(0)  # let it unregister the name and start waiting
        assert [r.lora_name for r in lora.registered()] == [] and "v1" in lora.loaded_adapters()
        load = asyncio.ensure_future(lora.load_lora_adapter("v2", str(adapters["other"])))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not unload.done() and not load.done(), "the unload waits for the request, the load for the unload"
        lora.release(held)
        result = await asyncio.wait_for(unload, 10)
        assert result.success and result.loaded_adapters == {}
        assert (await asyncio.wait_for(load, 10)).success

    asyncio.run(run())


def test_a_request_naming_an_unloaded_adapter_reloads_it_from_its_path(models, adapters):
    """tokenizer_manager.generate_request: a name loaded once (lora_ref_cache) but not registered now is reloaded
    ("Reloading evicted adapter"); a name never loaded fails the request."""
    model, _ = load_model(models["a"][0])

    async def run() -> None:
        lora = serving(model)
        await lora.load_lora_adapter("v1", str(adapters["all4"]))
        first = await lora.acquire("v1")
        lora.release(first)
        await lora.unload_lora_adapter("v1")
        again = await lora.acquire("v1")
        assert again.lora_id != first.lora_id and again.path == str(adapters["all4"])
        assert lora.stats["lora_implicit_reloads"] == 1 and [r.lora_name for r in lora.registered()] == ["v1"]
        lora.release(again)

    asyncio.run(run())


def test_past_max_loaded_loras_a_load_evicts_the_least_recently_used_after_its_requests(models, adapters, tmp_path):
    """tokenizer_communicator_mixin.load_lora_adapter: after registering, while more than --max-loaded-loras are
    registered, unload the least recently used unpinned one (a request naming an adapter counts as a use), and
    answer only then; the answer's loaded_adapters no longer lists it."""
    model, _ = load_model(models["a"][0])
    folders = {name: shutil.copytree(adapters["all4"], tmp_path / name) for name in ("v1", "v2", "v3")}

    async def run() -> None:
        lora = serving(model, max_loaded_loras=2, max_loras_per_batch=2)
        await lora.load_lora_adapter("v1", str(folders["v1"]))
        await lora.load_lora_adapter("v2", str(folders["v2"]))
        held = await lora.acquire("v1")  # v1 is now the most recently used: v2 goes
        result = await lora.load_lora_adapter("v3", str(folders["v3"]))
        assert result.success and set(result.loaded_adapters) == {"v1", "v3"}
        assert [r.lora_name for r in lora.registered()] == ["v1", "v3"] and lora.stats["lora_evictions"] == 1
        evicting = asyncio.ensure_future(lora.load_lora_adapter("v2", str(folders["v2"])))  # evicts v1, in use
        for _ in range(5):
            await asyncio.sleep(0)
        assert not evicting.done(), "the load that evicts an adapter in use answers once its requests are done"
        lora.release(held)
        assert set((await asyncio.wait_for(evicting, 10)).loaded_adapters) == {"v3", "v2"}
        with pytest.raises(
            ValueError, match="Received request with 3 unique loras requested but max loaded loras is 2"
        ):
            lora.check_request(["v2", "v3", None])  # the base model counts as one

    asyncio.run(run())


def test_batch_admission_counts_the_base_model_and_keeps_pinned_slots(models, adapters):
    """lora_manager.validate_lora_batch: at most --max-loras-per-batch distinct ids (None, the base model, is one),
    and unpinned adapters may use only the slots pinned ones leave; a pin that would leave one slot or none is
    refused (num_pinned >= max_loras_per_batch - 1)."""
    model, _ = load_model(models["a"][0])

    async def run() -> None:
        lora = serving(model, max_loras_per_batch=3)
        await lora.load_lora_adapter("p", str(adapters["all4"]), pinned=True)
        for name in ("u1", "u2"):
            await lora.load_lora_adapter(name, str(adapters["other"]))
        ids = {ref.lora_name: ref.lora_id for ref in lora.registered()}
        assert lora.can_run({None, ids["u1"]}) and lora.can_run({ids["p"], ids["u1"], ids["u2"]})
        assert not lora.can_run({None, ids["u1"], ids["u2"]}), "two unpinned + base need 3 slots, 2 are free"
        assert not lora.can_run({None, ids["p"], ids["u1"], ids["u2"]})
        assert (await lora.load_lora_adapter("p2", str(adapters["qv8"]), pinned=True)).success  # 2 of 3 pinned
        refused = await lora.load_lora_adapter("p3", str(adapters["qv8"]), pinned=True)
        assert not refused.success and "It is not allowed to pin all slots" in refused.error_message

    asyncio.run(run())


def test_an_adapter_folder_is_read_as_peft_writes_it(adapters):
    config, tensors = read_adapter_folder(str(adapters["qv8"]))
    assert json.loads((adapters["qv8"] / "adapter_config.json").read_text())["r"] == config["r"] == 8
    assert all(k.startswith("base_model.model.") and k.endswith(".weight") for k in tensors)
    assert {k.split(".")[-3] for k in tensors} == {"q_proj", "v_proj"}
