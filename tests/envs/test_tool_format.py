"""The Hermes/Qwen tool-call text format: round trip, error reporting, never raising."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.tool_format import CLOSE_TAG, OPEN_TAG, format_assistant_text, format_tool_call, parse_tool_calls
from agentrl.types import ToolCall


def test_format_is_the_qwen_block():
    call = ToolCall(name="calculator", arguments='{"expression": "3+4"}')
    assert format_tool_call(call) == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'


def test_round_trip_with_content_and_two_calls():
    calls = [ToolCall("a", '{"x": 1}'), ToolCall("b", '{"s": "hi </tool"}')]
    parsed = parse_tool_calls(format_assistant_text("let me think", calls))
    assert parsed.content == "let me think"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("a", {"x": 1}), ("b", {"s": "hi </tool"})]
    assert parsed.errors == []


def test_plain_text_has_no_calls():
    parsed = parse_tool_calls("  The answer is 7.  ")
    assert parsed.content == "The answer is 7." and parsed.tool_calls == [] and parsed.errors == []


def test_double_encoded_and_missing_arguments_are_accepted():
    p = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call><tool_call>{"name": "g"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [("f", {"x": 2}), ("g", {})]


def test_each_malformation_is_an_error_not_an_exception():
    cases = {
        "<tool_call>{not json}</tool_call>": "invalid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "missing a 'name'",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>["f"]</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "f", "arguments": {}}': "unclosed",
        "text </tool_call>": "without a matching",
        "<tool_call>" + "[" * 100_000 + "</tool_call>": "invalid JSON",
        "<tool_call>" + "9" * 10_000 + "</tool_call>": "invalid JSON",
    }
    for text, expected in cases.items():
        p = parse_tool_calls(text)
        assert p.tool_calls == [], text[:40]
        assert len(p.errors) == 1 and expected in p.errors[0], (text[:40], p.errors)


def test_good_call_survives_a_bad_neighbour():
    p = parse_tool_calls('<tool_call>oops</tool_call>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert [c.name for c in p.tool_calls] == ["f"] and len(p.errors) == 1


fragments = st.sampled_from([OPEN_TAG, CLOSE_TAG, "{", "}", '"name"', '"arguments"', ":", ",", '"f"', "[", "]", "\n", "1", "null", '"'])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(fragments, st.text(max_size=8)), max_size=40))
def test_fuzz_never_raises(parts):
    p = parse_tool_calls("".join(parts))
    assert isinstance(p.content, str)
    for call in p.tool_calls:
        assert isinstance(json.loads(call.arguments), dict) and call.name


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=1, max_size=20).filter(lambda s: s.strip() and OPEN_TAG not in s and CLOSE_TAG not in s),
    st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)
def test_fuzz_round_trip(name, args):
    call = ToolCall(name=name.strip(), arguments=json.dumps(args))
    p = parse_tool_calls(format_tool_call(call))
    assert p.errors == [] or OPEN_TAG in json.dumps(args) or CLOSE_TAG in json.dumps(args)
    if not p.errors:
        assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [(name.strip(), args)]
