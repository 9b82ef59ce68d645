"""The trainer's policy update on two ranks takes the step of one rank, on the `device` parameter
(tests/gpu/conftest.py): two NCCL ranks on two GPUs where there are two, two gloo ranks on CPU everywhere.

The ranks are the project's worker group (runtime/trainer/ranks.py: Ray actors, FSDP2 over the group); the single
rank is an in-process FSDPPolicyBackend from the same weights. On CUDA the ranks autocast to bf16 (the config's
`fsdp_config.dtype`) against an fp32 single rank, hence the loose tolerances; on CPU both compute in fp32.
"""

from __future__ import annotations

import pytest
import torch

RESPONSE_LEN = 5


def _batch(seed: int, backend) -> object:
    from verl_helpers import make_batch

    data = make_batch(seed)
    data.batch["response_mask"] = data.batch["response_mask"].float()
    noise = 0.3 * torch.randn(len(data), RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
    data.batch["old_log_probs"] = backend.compute_log_prob(data) + noise
    return data


@pytest.mark.slow  # a Ray worker group of two ranks started and stopped
def test_two_ranks_take_the_step_of_one_rank(device, ray_session, tiny_model_dir):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs CUDA (2 devices): one rank per GPU")
    from backend_helpers import actor_cfg

    from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend
    from rllm.experimental.fully_async.runtime.trainer.ranks import DistributedPolicyBackend

    cfg = actor_cfg(fsdp_config={"dtype": "bfloat16"})
    single = FSDPPolicyBackend(tiny_model_dir, cfg)
    single.actor.param_dtype = torch.float32
    data = _batch(4, single)
    group = DistributedPolicyBackend(tiny_model_dir, cfg, world=2, device=device, call_timeout_s=300.0)
    try:
        torch.testing.assert_close(group.compute_log_prob(data), single.compute_log_prob(data), rtol=0, atol=5e-2)
        m_group, m_single = group.update_policy(data), single.update_policy(data)
        assert m_group["actor/optimizer_step"] == m_single["actor/optimizer_step"] == 1.0
        assert m_group["actor/grad_norm"] == pytest.approx(m_single["actor/grad_norm"], rel=5e-2)
        # the step itself: both policies now give the same log-probs
        torch.testing.assert_close(group.compute_log_prob(data), single.compute_log_prob(data), rtol=0, atol=5e-2)
    finally:
        group.shutdown()
