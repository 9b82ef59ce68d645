"""A user tool: a plain function run in the worker pool (a call past `tools.timeout_s` is killed).

Plug it in with `tools.functions={distance: examples/agents/my_tool.py:distance}` and `tools.format=compact`: a
model turn that is exactly `distance[3>7]` calls it, and its return value ("4") is appended as a tool message with
loss mask 0 before the model's next turn. An exception is shown to the model as "error: ..." (the episode goes on).
"""


def distance(state: str) -> str:
    position, _, target = state.partition(">")
    return str(abs(int(target.rstrip(":")) - int(position)))
