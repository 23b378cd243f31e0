"""Turns a request's prompt (text, chat messages or token ids) into the token ids the model sees."""

from __future__ import annotations

from typing import Any

from bus.errors import ApiError
from bus.messages import GenerateRequest

CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


class PromptEncoder:
    """Applies the model's chat template and tokenizes, with errors a client can act on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def encode(self, req: GenerateRequest) -> list[int]:
        """Token ids for the one prompt form that `req` sets; raises ApiError otherwise."""
        given = [name for name in ("text", "messages", "input_ids") if getattr(req, name) is not None]
        if len(given) != 1:
            raise ApiError("give exactly one of text, messages or input_ids", param=given[-1] if given else "text")
        if req.messages is not None:
            return self._encode_chat(req)
        if req.continue_final_message:
            raise ApiError("continue_final_message needs a chat prompt (messages)", param="continue_final_message")
        if req.input_ids is not None:
            ids = req.input_ids
            if not ids or not all(0 <= t < self.vocab_size for t in ids):
                raise ApiError(f"input_ids must be a non-empty list of ids in [0, {self.vocab_size})", param="input_ids")
            return list(ids)
        if not req.text:
            raise ApiError("the prompt is empty", param="prompt")
        return self._tokenizer.encode(req.text)

    def _encode_chat(self, req: GenerateRequest) -> list[int]:
        assert req.messages is not None
        if not req.messages:
            raise ApiError("messages must be a non-empty list", param="messages")
        for i, message in enumerate(req.messages):
            if message.role not in CHAT_ROLES:
                raise ApiError(f"messages[{i}].role {message.role!r} is not one of {sorted(CHAT_ROLES)}", param="messages")
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(req, name), bool):
                raise ApiError(f"{name} must be a boolean", param=name)
        if req.continue_final_message:
            if req.add_generation_prompt:
                raise ApiError("continue_final_message and add_generation_prompt cannot both be true: set "
                               "add_generation_prompt to false to continue the final message",
                               param="continue_final_message")
            if req.messages[-1].role != "assistant":
                raise ApiError(f"continue_final_message needs the last message to be the assistant's, not "
                               f"{req.messages[-1].role!r}", param="continue_final_message")
        turns = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            text = self._tokenizer.apply_chat_template(
                turns, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=False)
        except Exception as exc:  # jinja templates raise arbitrary errors for unsupported conversations
            raise ApiError(f"the chat template rejected these messages: {exc}", param="messages") from exc
        return self._tokenizer.encode(text, add_special_tokens=False)
