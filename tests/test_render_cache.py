"""RenderCache: the same ids as a fresh render, by exact content, bounded, never aliased."""

from __future__ import annotations

from agentrl.render import RenderCache, render_chat_ids
from agentrl.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]  # fmt: skip


def convo(question: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]


def test_a_hit_is_the_fresh_rendering_and_every_input_is_part_of_the_key():
    tok = build_tokenizer()
    cache = RenderCache(tok)
    cases = [(convo(q), tl, gen) for q in ("1+1?", "2+2?") for tl in (None, TOOLS) for gen in (True, False)]
    fresh = [render_chat_ids(tok, m, tl, gen) for m, tl, gen in cases]
    assert len({tuple(f) for f in fresh}) == len(cases)  # each input changes the ids: a key that drops one fails
    for _ in range(2):
        assert [cache.ids(m, tl, gen) for m, tl, gen in cases] == fresh
    assert (cache.hits, cache.misses) == (len(cases), len(cases))
    edited = convo("1+1?")
    edited[0]["name"] = "x"  # a field that may not change the text still is a different input
    cache.ids(edited)
    assert cache.misses == len(cases) + 1


def test_key_order_is_part_of_the_input():
    tok = build_tokenizer()
    cache = RenderCache(tok)
    params = TOOLS[0]["function"]["parameters"]
    swapped = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "required": ["a"]}}}]  # fmt: skip
    first = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": {**params, "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}}}}}]  # fmt: skip
    assert render_chat_ids(tok, convo("1+1?"), first) != render_chat_ids(tok, convo("1+1?"), swapped)  # tojson keeps order
    assert cache.ids(convo("1+1?"), first) == render_chat_ids(tok, convo("1+1?"), first)
    assert cache.ids(convo("1+1?"), swapped) == render_chat_ids(tok, convo("1+1?"), swapped)
    assert cache.hits == 0


def test_a_returned_list_is_the_callers_own():
    cache = RenderCache(build_tokenizer())
    first = cache.ids(convo("1+1?"))
    want = list(first)
    first.append(-1)
    second = cache.ids(convo("1+1?"))
    assert second == want
    second.clear()
    assert cache.ids(convo("1+1?")) == want


def test_it_keeps_the_most_recent_renderings_only():
    cache = RenderCache(build_tokenizer(), size=2)
    for q in ("a", "b", "a", "c"):  # "a" was used after "b": "b" is the one evicted
        cache.ids(convo(q))
    misses = cache.misses
    cache.ids(convo("a"))
    cache.ids(convo("c"))
    assert cache.misses == misses
    cache.ids(convo("b"))
    assert cache.misses == misses + 1


def test_content_that_is_not_plain_json_is_rendered_every_time():
    tok = build_tokenizer()
    cache = RenderCache(tok)

    odd = [{"role": "user", "content": "hi", "meta": object()}]
    assert cache.ids(odd) == render_chat_ids(tok, odd)
    assert cache.ids(odd) == render_chat_ids(tok, odd)
    assert cache.hits == cache.misses == 0
