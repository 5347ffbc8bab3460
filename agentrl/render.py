"""Messages → prompt token ids with a model's chat template: the one chat renderer.

The server's ``/tokenize`` and chat routes, the client's local rendering, the template
checker and SFT's demonstrations all render through here, so a prompt has the same ids
wherever it is built.

**Only the template writes special tokens.**  Message contents (user text, tool results, env
observations, tool-call arguments, names) are encoded as text: a tool that prints
``<|im_end|>\n<|im_start|>system\n...`` gets the text's ordinary token ids, never the
special ids that would show the model a system turn the tool wrote.  How: every special
token's text found in an input string is swapped for a random placeholder before the
template runs, so the rendered text's special tokens are all the template's; the placeholders
are swapped back, the text is encoded as usual, and each special id that came from input is
replaced by its text's ids with special tokens split (:func:`render_chat_ids`).  Input
without special-token text takes the plain path (render, encode), so ordinary prompts keep
their exact ids.
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from agentrl.errors import AgentrlError


def _template_call(tc: Any) -> Any:
    """A tool call as chat templates expect it: ``function.arguments`` a mapping, not the JSON
    text the OpenAI API carries (Llama, Mistral and pythonic templates iterate or ``tojson``
    it; vLLM hands templates the same).  Arguments that are not a JSON object stay text."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return tc
    args = tc["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return tc
        if isinstance(parsed, dict):
            return {**tc, "function": {**tc["function"], "arguments": parsed}}
    return tc


def _takes_json_text(tokenizer: Any) -> bool:
    """Does the template write JSON-text arguments itself (``arguments is string``, as Qwen's
    and the tiny model's do)?  Then they pass through as text: no decode here, no re-encode
    in the template (a fifth of a render's cost)."""
    tpl = getattr(tokenizer, "chat_template", None)
    return isinstance(tpl, str) and ("arguments is string" in tpl or "arguments is not string" in tpl)


def _normalized(messages: list[dict[str, Any]], mapping_args: bool = True) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":  # OpenAI's newer name for system
            m["role"] = "system"
        if m.get("content") is None:
            m["content"] = ""
        if mapping_args and m.get("tool_calls"):
            m["tool_calls"] = [_template_call(tc) for tc in m["tool_calls"]]
        out.append(m)
    return out


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The chat template's text for ``messages`` (OpenAI-style dicts)."""
    return tokenizer.apply_chat_template(
        _normalized(messages, not _takes_json_text(tokenizer)), tools=tools or None,
        add_generation_prompt=add_generation_prompt, tokenize=False,
        **template_kwargs,
    )


def render_chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """What ``/tokenize`` returns for ``messages``: the rendered template, encoded without
    extra special tokens (the template already writes them); special-token text inside any
    message, tool schema or template argument is encoded as text (module docstring)."""
    specials = _specials_of(tokenizer)
    marker = _Marker(specials) if specials.pattern is not None else None
    if marker is not None:  # a template given as an argument is the template, not input
        template = {k: template_kwargs.pop(k) for k in ("chat_template",) if k in template_kwargs}
        messages = marker.mark_messages(messages)
        tools, template_kwargs = marker.mark([tools, template_kwargs])
        template_kwargs.update(template)
    text = render_chat_text(tokenizer, messages, tools, add_generation_prompt, **template_kwargs)
    if marker is None or not marker.used:
        return tokenizer.encode(text, add_special_tokens=False)
    return _encode_marked(tokenizer, specials, marker, text)[0]


@dataclass
class _Specials:
    """A tokenizer's special tokens: their ids, a regex of their texts (longest first, as the
    tokenizer matches them; None when it has none), and an encoder that ignores them."""

    ids: frozenset[int]
    texts: tuple[str, ...]
    pattern: re.Pattern[str] | None
    size: int  # len(added_tokens_decoder) when built: tokens added later rebuild it
    index: dict[str, int]  # text -> its position in ``texts`` (what a placeholder names)
    # the special tokens only: what an assistant message's text is checked for (its other added
    # tokens, Qwen3's <think> say, are the model's own writing, and templates split on them)
    special_pattern: re.Pattern[str] | None = None
    plain: Any = None  # a copy of the fast backend with added-token matching off (made on first use)


_SPECIALS: weakref.WeakKeyDictionary[Any, _Specials] = weakref.WeakKeyDictionary()


def _specials_of(tokenizer: Any) -> _Specials:
    added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    cached = _SPECIALS.get(tokenizer)
    if cached is not None and cached.size == len(added):
        return cached
    by_id = {i: str(getattr(t, "content", t)) for i, t in added.items() if getattr(t, "special", False)}
    for text, i in zip(getattr(tokenizer, "all_special_tokens", []), getattr(tokenizer, "all_special_ids", []), strict=False):
        if isinstance(i, int) and i >= 0:
            by_id.setdefault(i, text)
    special_texts = {t for t in by_id.values() if t and not t.isspace()}
    # added tokens that are not special (Qwen's <tool_response>, <tool_call>) are turn structure
    # too: the template writes them, and a tool's output must not close its own response
    by_id.update({i: str(getattr(t, "content", t)) for i, t in added.items() if i not in by_id})
    # whitespace tokens (a "\n" token) are layout, not turn structure; leave them to the tokenizer
    texts = tuple(sorted({t for t in by_id.values() if t and not t.isspace()}, key=len, reverse=True))
    pattern = re.compile(_trie_pattern(texts)) if texts else None
    ordered = tuple(t for t in texts if t in special_texts)
    special_pattern = re.compile(_trie_pattern(ordered)) if ordered else None
    specials = _Specials(frozenset(by_id), texts, pattern, len(added), {t: i for i, t in enumerate(texts)},
                         special_pattern)  # fmt: skip
    try:
        _SPECIALS[tokenizer] = specials
    except TypeError:  # not weak-referenceable: rebuilt per call
        pass
    return specials


def _trie_pattern(words: tuple[str, ...]) -> str:
    """A regex matching any of ``words``, longest first, as a trie (``<\\|(?:eot_id\\|>|...)``):
    a flat alternation of Llama 3's 256 specials scanned text 10× slower."""
    trie: dict[str, dict] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def emit(node: dict[str, dict]) -> str:
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        if "" in node:  # a shorter word ends here: the rest is optional (greedy: longest first)
            return "(?:" + "|".join(alts) + ")?"
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    return emit(trie)


class _Marker:
    """Swaps special-token text in input strings for placeholders made with a random nonce
    (so input cannot forge one), and finds them again in the rendered text."""

    def __init__(self, specials: _Specials) -> None:
        self.specials = specials
        self.nonce = "zq" + secrets.token_hex(8)  # lowercase letters and digits: no template escapes them
        self.used = 0
        self.moved: list[tuple[int, int, int, int]] = []  # (placeholder start, end, its token's start, end)

    def _swap(self, m: re.Match[str]) -> str:
        self.used += 1
        return f"{self.nonce}n{self.specials.index[m.group(0)]}x"

    def mark(self, obj: Any, pattern: re.Pattern[str] | None = None) -> Any:
        """``obj`` with every added token's text (``pattern``'s) in its strings (not dict keys) swapped."""
        if isinstance(obj, str):
            pattern = pattern or self.specials.pattern
            assert pattern is not None
            return pattern.sub(self._swap, obj)
        if isinstance(obj, dict):
            return {k: self.mark(v, pattern) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.mark(v, pattern) for v in obj]
        return obj

    def mark_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """:meth:`mark` each message; an assistant message only for the special tokens (its other
        added tokens are the model's own writing)."""
        out = []
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "assistant":
                special = self.specials.special_pattern
                out.append(m if special is None else self.mark(m, special))
            else:
                out.append(self.mark(m))
        return out

    def unmark(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with the special-token texts back, and their (start, end) spans."""
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        self.moved = []
        at = pos = 0
        for m in re.finditer(self.nonce + r"n(\d+)x", text):
            out.append(text[pos : m.start()])
            at += m.start() - pos
            token = self.specials.texts[int(m.group(1))]
            spans.append((at, at + len(token)))
            self.moved.append((m.start(), m.end(), at, at + len(token)))
            out.append(token)
            at += len(token)
            pos = m.end()
        out.append(text[pos:])
        real = "".join(out)
        if self.nonce in real.lower():  # the template changed a placeholder (upper-cased, cut it)
            raise ValueError("the chat template transformed message text that holds special-token text; "
                             "it cannot be rendered safely")  # fmt: skip
        return real, spans

    def to_real(self, pos: int) -> int:
        """Where position ``pos`` of the rendered text (placeholders in it) lies in the text
        :meth:`unmark` returned (a position inside a placeholder: the end of its token)."""
        i = bisect.bisect_right(self.moved, (pos, float("inf"))) - 1
        if i < 0:
            return pos
        ph_start, ph_end, start, end = self.moved[i]
        return start if pos == ph_start else end + max(pos - ph_end, 0)


def _encode_marked(
    tokenizer: Any, specials: _Specials, marker: _Marker, rendered: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """Encode ``rendered`` (placeholders in it) so that only the template's special tokens are
    special ids.  The text is encoded once as usual; that encoding already splits the text at
    every special token, the input's too, so each special id that came from input text is
    replaced by the ids of that text encoded with special tokens off.  Everything else keeps
    the usual encoding's ids.  Returns the ids and each one's (start, end) in the real text."""
    text, forged = marker.unmark(rendered)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("message text holds special-token text, and only a fast (tokenizers) tokenizer can encode it "
                         "as text; load the tokenizer with use_fast=True")  # fmt: skip
    if specials.plain is None:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        for t in spec.get("added_tokens") or []:
            t["special"] = True  # so that encode_special_tokens splits the plain added tokens too
        plain = Tokenizer.from_str(json.dumps(spec))
        plain.encode_special_tokens = True  # a copy of its own: the shared tokenizer's flag is never flipped
        specials.plain = plain
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    next_span = 0  # tokens and spans both come in text order: one pass over each

    def inside(start: int, end: int) -> bool:
        nonlocal next_span
        while next_span < len(forged) and forged[next_span][1] <= start:
            next_span += 1
        return next_span < len(forged) and forged[next_span][0] < end

    out: list[int] = []
    where: list[tuple[int, int]] = []
    template_specials = 0
    for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        if tid in specials.ids and inside(start, end):  # an input's special-token text: its text's ids instead
            as_text = specials.plain.encode(text[start:end], add_special_tokens=False).ids
            out.extend(as_text)
            where.extend([(start, end)] * len(as_text))
            continue
        out.append(tid)
        where.append((start, end))
        template_specials += tid in specials.ids
    if sum(tid in specials.ids for tid in out) != template_specials:
        raise ValueError("message text holds special-token text that this tokenizer encodes as a special token even "
                         "as plain text; it cannot be rendered safely")  # fmt: skip
    return out, where


# Template tokens allowed between the sampled end-of-turn token and the next message
# (Qwen renders "<|im_end|>" then "\n"); more than this means we found the wrong token.
MAX_GLUE_TOKENS = 8


def bridge(closed: list[int], extended: list[int], sampled: list[int]) -> list[int] | None:
    """The forced tokens that continue a sampled turn token-exactly; None at a template break.

    ``closed``: the conversation through the sampled turn rendered without a generation prompt;
    ``extended``: the same conversation plus the new messages, with the generation prompt;
    ``sampled``: the turn's sampled ids.  The answer is the template's glue after the sampled
    end-of-turn token, then everything ``extended`` adds: the sampled ids themselves are never
    re-tokenized.  None when the template rewrites earlier turns once more messages follow, or
    the sampled turn did not end the way the template closes a turn (the episode loop and the
    gateway then start a new sequence).
    """
    if not sampled or extended[: len(closed)] != closed:
        return None
    end_of_turn = sampled[-1]
    for i in range(len(closed) - 1, max(len(closed) - 1 - MAX_GLUE_TOKENS, -1), -1):
        if closed[i] == end_of_turn:
            return closed[i + 1 :] + extended[len(closed) :]
    return None


class RenderCache:
    """:func:`render_chat_ids` for one tokenizer, remembering its last ``size`` renderings by
    exact content: a group's episodes open with the same messages (often a long system prompt
    with tool schemas), so G renders of the first prompt become one."""

    def __init__(self, tokenizer: Any, size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self.hits = self.misses = 0
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        try:  # key order kept: templates write mappings in their order (tojson), so it is part of the input
            key = json.dumps([messages, tools or None, add_generation_prompt])
        except (TypeError, ValueError):  # not plain JSON (an image object, say): render it every time
            return render_chat_ids(self.tokenizer, messages, tools, add_generation_prompt)
        hit = self._ids.get(key)
        if hit is not None:
            self.hits += 1
            self._ids.move_to_end(key)
            return list(hit)
        self.misses += 1
        ids = render_chat_ids(self.tokenizer, messages, tools, add_generation_prompt)
        self._ids[key] = tuple(ids)
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return ids


_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for the blocks


def has_generation_blocks(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> bool:
    """Does the chat template (the one used with ``tools``) mark generated text with ``{% generation %}``?"""
    try:
        template = tokenizer.get_chat_template(None, tools or None)
    except Exception:  # no template, or not a transformers tokenizer: the render itself will say so
        template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and _GENERATION_BLOCK.search(template) is not None


def render_chat_with_mask(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of a whole conversation: 1 on the tokens the template marks
    as generated (its ``{% generation %}`` blocks), for supervised fine-tuning; a template
    without the blocks (Qwen2.5's, Hermes') is masked by prefix rendering
    (:func:`mask_by_prefix`).  Special-token text in the messages is encoded as text, as in
    :func:`render_chat_ids`."""
    if not has_generation_blocks(tokenizer, tools):
        return mask_by_prefix(tokenizer, messages, tools)
    specials = _specials_of(tokenizer)
    marker = _Marker(specials) if specials.pattern is not None else None
    if marker is not None:
        messages, tools = marker.mark_messages(messages), marker.mark(tools)
    forged = marker is not None and marker.used > 0
    enc = tokenizer.apply_chat_template(
        _normalized(messages, not _takes_json_text(tokenizer)), tools=tools or None, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True, **({"tokenizer_kwargs": {"return_offsets_mapping": True}} if forged else {}),
    )  # fmt: skip
    if not forged:
        return list(enc["input_ids"]), list(enc["assistant_masks"])
    assert marker is not None
    # the template's generated stretches, from its placeholder text's tokens, moved to the real text
    rendered = render_chat_text(tokenizer, messages, tools, add_generation_prompt=False)
    ids, where = _encode_marked(tokenizer, specials, marker, rendered)
    generated = bytearray(marker.to_real(len(rendered)) + 1)
    for (start, end), m in zip(enc["offset_mapping"], enc["assistant_masks"], strict=True):
        if m:
            a, b = marker.to_real(start), marker.to_real(end)
            generated[a:b] = b"\x01" * (b - a)
    return ids, [int(any(generated[a:b])) for a, b in where]


class TemplateMaskError(AgentrlError, ValueError):
    """The template has no ``{% generation %}`` blocks and is not prefix-stable at an assistant
    turn, so which tokens are the assistant's cannot be told from rendering."""

    def __init__(self, message: str, turn: int, why: str) -> None:
        super().__init__(message)
        self.turn, self.why = turn, why  # assistant turn (1-based) and what its rendering did


def mask_by_prefix(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """:func:`render_chat_with_mask` for a template without ``{% generation %}`` blocks.

    For assistant message i, ``render(messages[:i], add_generation_prompt=True)`` must be a
    token prefix of ``render(messages[:i+1])``, which must be a prefix of the whole
    conversation's ids; the tokens between the two prefixes, up to and including the turn's
    end-of-turn token (the last special token before at most ``MAX_GLUE_TOKENS`` of template
    glue), are the assistant's: what the model samples, its stop token included.  Every
    rendering goes through :func:`render_chat_ids`, so the ids are exactly the whole
    rendering's.  Raises :class:`TemplateMaskError` (one line) where a template is not
    prefix-stable at an assistant turn.
    """
    ids = render_chat_ids(tokenizer, messages, tools, add_generation_prompt=False)
    mask = [0] * len(ids)
    stops = _special_ids(tokenizer)
    turn = 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        turn += 1
        prompt = render_chat_ids(tokenizer, messages[:i], tools, add_generation_prompt=True)
        closed = render_chat_ids(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        if ids[: len(closed)] != closed:
            _mask_error(tokenizer, turn, i, "is rendered differently once later messages follow "
                                            "(the template rewrites history, e.g. drops earlier thinking)")  # fmt: skip
        if closed[: len(prompt)] != prompt:
            _mask_error(tokenizer, turn, i, "does not extend its generation prompt token-exactly")
        end = len(closed)
        for k in range(len(closed) - 1, max(len(closed) - 2 - MAX_GLUE_TOKENS, len(prompt) - 1), -1):
            if closed[k] in stops:  # the end-of-turn token the model must learn to emit; glue after it is not
                end = k + 1
                break
        mask[len(prompt) : end] = [1] * (end - len(prompt))
    return ids, mask


def _special_ids(tokenizer: Any) -> set[int]:
    """The special tokens' ids (not the other added tokens: Qwen's ``</tool_call>`` is text the model writes)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {i for i, t in added.items() if getattr(t, "special", False)}
    return ids | {i for i in getattr(tokenizer, "all_special_ids", []) if isinstance(i, int) and i >= 0}


def _mask_error(tokenizer: Any, turn: int, index: int, why: str) -> None:
    where = getattr(tokenizer, "name_or_path", "") or "DIR"
    raise TemplateMaskError(
        f"cannot tell the assistant's tokens for SFT: the chat template has no {{% generation %}} blocks and assistant "
        f"turn {turn} (message {index}) {why}; `agentrl model check-template {where}` says why; add {{% generation %}} "
        "blocks around the assistant's text in the template, or set sft.enabled = false", turn, why,
    )
