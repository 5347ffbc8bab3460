"""The embedded engine's request bounds: what a request may cost before the engine sees it.

The HTTP layer (:mod:`agentrl.inference.server`) runs every render and tokenization through
:class:`RequestBounds`:

- a text longer than the model's context can hold, whatever it says, is refused before it is
  tokenized (``max_prompt_bytes``: ``2 × max_model_len ×`` the longest token's bytes; ×2 because a
  normalizer may shrink text before the split);
- a chat render or a tokenization runs on a few threads of its own within ``RENDER_DEADLINE_S``:
  one that overran keeps its thread, while the event loop and other renders go on;
- ``chat_template_kwargs`` only set the model's own template's variables: a caller's template,
  or apply_chat_template's own arguments, are refused (a caller's Jinja would run here:
  CVE-2025-61620's bug class).

Body size, header deadlines, keys, Host and Origin are :mod:`agentrl.guard`'s.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentrl.inference.protocol import APIError

RENDER_DEADLINE_S = 10.0  # rendering + tokenizing one request (normally milliseconds)
RENDER_THREADS = 4  # a render that overran its deadline keeps its thread: the loop and other renders go on
# apply_chat_template's own arguments and any template: chat_template_kwargs only sets template variables
REFUSED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs",
})  # fmt: skip


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of text one token stands for: its vocabulary string's UTF-8
    length (a byte-level BPE writes each byte as one character; a sentencepiece ``<0x41>`` or
    ``▁`` stands for less than it is long)."""
    vocab = tokenizer.get_vocab()
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


def content_bytes(message: dict[str, Any]) -> int:
    """The bytes a message's text brings into a prompt (content, text parts, tool-call arguments)."""
    content = message.get("content")
    if isinstance(content, str):
        size = len(content.encode("utf-8", "surrogatepass"))
    elif isinstance(content, list):
        size = sum(len(str(p.get("text", "")).encode("utf-8", "surrogatepass")) for p in content if isinstance(p, dict))
    else:
        size = 0
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            size += len(str(fn.get("arguments", "")).encode("utf-8", "surrogatepass"))
    return size


class RequestBounds:
    """The size, time and template checks of one server (module docstring)."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.max_model_len = max_model_len
        self.max_prompt_bytes = 2 * max_model_len * longest_token_bytes(tokenizer)
        self.render_pool = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="agentrl-render")

    async def off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a render or tokenization on the render threads, within RENDER_DEADLINE_S."""
        job = asyncio.get_running_loop().run_in_executor(self.render_pool, lambda: fn(*args, **kwargs))
        try:
            return await asyncio.wait_for(job, RENDER_DEADLINE_S)
        except TimeoutError:
            raise APIError(400, f"rendering or tokenizing this request took over {RENDER_DEADLINE_S:g}s; "
                                "send a shorter one", code="render_timeout") from None  # fmt: skip

    def check_bytes(self, size: int, param: str) -> None:
        """Refuse a ``param`` of ``size`` bytes that cannot fit the context."""
        if size > self.max_prompt_bytes:
            raise APIError(
                400, f"the {param} is {size} bytes: more than this model's context of {self.max_model_len} "
                     f"tokens can hold (at most {self.max_prompt_bytes} bytes); shorten it",
                param=param, code="context_length_exceeded")  # fmt: skip

    def check_messages(self, messages: list[dict[str, Any]]) -> None:
        self.check_bytes(sum(content_bytes(m) for m in messages), "messages")

    @staticmethod
    def check_template_kwargs(kwargs: dict[str, Any]) -> None:
        """Refuse a template or one of apply_chat_template's own arguments in ``chat_template_kwargs``."""
        refused = sorted(k for k in kwargs if "template" in k.lower() or k in REFUSED_TEMPLATE_KWARGS)
        if refused:
            raise APIError(400, f"chat_template_kwargs.{refused[0]} is refused: this server renders with its "
                                "model's own chat template; kwargs only set that template's variables",
                           param="chat_template_kwargs")  # fmt: skip
