"""Token ids of one chat message appended to a running conversation, from the tokenizer's own chat template.

A multi-turn rollout never re-renders the whole conversation: the model's tokens are kept exactly as generated
and each new message (an observation, a tool result) is appended as the ids the chat template would put there.
Those ids are found once per role by rendering a probe conversation with and without the message and taking the
difference (the method verl's agent loop uses), so any template works: a Qwen-style template gives
"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n", the tiny tasks' verbatim template gives the
content alone.

What the template places after the assistant's end-of-turn token (Qwen: "\\n") is the `tail`: the engine stops at
the end-of-turn token, so the tail is added before the next message. A turn cut by the token limit has no
end-of-turn token; it gets one (and the tail), so the next message starts a well-formed turn. These tokens are
appended with loss mask 0 like the message itself.
"""

from __future__ import annotations

from typing import Any

_PROBE = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )


class ChatTurns:
    """`message_ids(role, content, after)`: the ids to append after the model's turn `after`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id
        base = _render(tokenizer, _PROBE, add_generation_prompt=False)
        self._base = base
        self.tail: list[int] = []
        # Whether the template ends an assistant turn with the EOS token (Qwen's <|im_end|>); the tiny tasks'
        # verbatim template does not, and the model's own EOS is then all there is.
        self.closes_turns = self.eos_id is not None and self.eos_id in base
        if self.closes_turns:
            last = len(base) - 1 - base[::-1].index(self.eos_id)
            self.tail = base[last + 1 :]
        self._roles: dict[str, str] = {}

    def _role(self, role: str) -> str:
        """The role as the template accepts it: a template that rejects "tool" gets the message as "user"."""
        if role not in self._roles:
            try:
                _render(self.tokenizer, [*_PROBE, {"role": role, "content": "C"}], add_generation_prompt=True)
                self._roles[role] = role
            except Exception:  # jinja raises whatever the template author chose (TemplateError, ValueError, ...)
                self._roles[role] = "user"
        return self._roles[role]

    def content_ids(self, role: str, content: str) -> list[int]:
        """The ids of one message plus the generation prompt for the next assistant turn."""
        message = {"role": self._role(role), "content": content}
        full = _render(self.tokenizer, [*_PROBE, message], add_generation_prompt=True)
        if full[: len(self._base)] == self._base:
            return full[len(self._base) :]
        # The template re-renders earlier turns differently once a message follows (some strip reasoning):
        # fall back to the text difference, tokenized without special-token insertion.
        base_text = self.tokenizer.apply_chat_template(_PROBE, add_generation_prompt=False, tokenize=False)
        full_text = self.tokenizer.apply_chat_template([*_PROBE, message], add_generation_prompt=True, tokenize=False)
        if not full_text.startswith(base_text):
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation")
        return list(self.tokenizer.encode(full_text[len(base_text) :], add_special_tokens=False))

    def message_ids(self, role: str, content: str, after: list[int]) -> list[int]:
        """Ids to append after a model turn `after` (its generated ids): end-of-turn fix-up + tail + message."""
        if not self.closes_turns:
            return self.content_ids(role, content)
        closing = [] if after and after[-1] == self.eos_id else [self.eos_id]  # a turn cut by the token limit
        return [*closing, *self.tail, *self.content_ids(role, content)]
