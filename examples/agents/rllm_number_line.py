"""A rollout function written for rLLM's fully-async module (its contract, its imports), unchanged here.

Plug it in with `workflow.path=examples/agents/rllm_number_line.py workflow.name=rollout_fn` (the adapter in
workflows/rllm_compat.py wraps any `async def rollout_fn(client, tokenizer, **datum)`). It plays the number-line
task through rLLM's chat API: the conversation is re-rendered from messages each turn, as rLLM agents do; turns
whose token ids extend the previous turn are merged into one sequence by `Trajectory.merge()`.
"""

from rllm.experimental.fully_async.envs.number_line import NumberLineEnv
from rllm.experimental.fully_async.protocol import Trajectory


async def rollout_fn(client, tokenizer, **kwargs):
    env = NumberLineEnv()
    observation = env.reset(0, kwargs["extra_info"])
    messages = [*kwargs["raw_prompt"], {"role": "user", "content": observation}]
    trajectory = Trajectory(sequences=[])
    reward, start_version = 0.0, client.cur_version
    for _ in range(4):
        message, output = await client.chat_completion(messages, {"max_new_tokens": 3, "temperature": 1.0})
        trajectory.append(output.to_sequence())
        observation, step_reward, done, _ = env.step(message["content"])
        reward += step_reward
        if done:
            break
        messages = [*messages, message, {"role": "user", "content": observation}]
    trajectory.sequences = trajectory.merge()
    trajectory.reward = reward
    trajectory.metadata = {"param_version_start": start_version, "param_version_end": client.cur_version}
    return trajectory
