"""The trainer's policy update on two GPUs: the 2-rank NCCL worker group takes the step of one rank.

Skipped without CUDA (or with fewer than two GPUs); never run in this project's CI. The one-GPU bf16 update
against fp32 is tests/gpu/test_trainer_bf16.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RESPONSE_LEN = 5


def _batch(seed: int, backend) -> object:
    from verl_helpers import make_batch

    data = make_batch(seed)
    data.batch["response_mask"] = data.batch["response_mask"].float()
    noise = 0.3 * torch.randn(len(data), RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
    data.batch["old_log_probs"] = backend.compute_log_prob(data) + noise
    return data


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA (2 devices)")
def test_two_nccl_ranks_take_the_step_of_one_rank(ray_session, tiny_model_dir):
    from backend_helpers import actor_cfg

    from rllm.experimental.fully_async.backends.fsdp import FSDPPolicyBackend
    from rllm.experimental.fully_async.runtime.trainer.ranks import DistributedPolicyBackend

    cfg = actor_cfg(fsdp_config={"dtype": "bfloat16"})
    single = FSDPPolicyBackend(tiny_model_dir, cfg)
    single.actor.param_dtype = torch.float32
    data = _batch(4, single)
    group = DistributedPolicyBackend(tiny_model_dir, cfg, world=2, device="cuda", call_timeout_s=300.0)
    try:
        torch.testing.assert_close(group.compute_log_prob(data), single.compute_log_prob(data), rtol=0, atol=5e-2)
        m_group, m_single = group.update_policy(data), single.update_policy(data)
        assert m_group["actor/grad_norm"] == pytest.approx(m_single["actor/grad_norm"], rel=5e-2)
    finally:
        group.shutdown()
