"""A plain OpenAI-SDK tool-calling agent for arithmetic questions: it imports nothing from agentrl.

Run it against any OpenAI-compatible endpoint (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``):

    python calc_agent.py "What is 12*7?"

Under agentrl (``HarnessEnv``) the question comes in ``AGENTRL_TASK`` and the endpoint is the
episode's gateway.  The model may call ``calculator``; the agent runs it and asks again; the
last line it prints is its answer.  ``solve`` (sync) and ``asolve`` (async) are the same loop.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'numbers with + - * and parentheses, e.g. "12*7"'}},
            "required": ["expression"],
        },
    },
}]  # fmt: skip
MAX_CALLS = 2  # call the calculator, then answer
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """+ - * on integers, nothing else (model-written input: no eval)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.operand))
        raise ValueError("only integers, + - * and parentheses")

    if len(expression) > 100:
        raise ValueError("expression too long")
    return str(value(ast.parse(expression.strip(), mode="eval").body))


def _tool_replies(message) -> list[dict]:
    replies = []
    for call in message.tool_calls:
        try:
            result = calculator(json.loads(call.function.arguments)["expression"])
        except Exception as e:  # the model's mistake goes back to it
            result = f"error: {e}"
        replies.append({"role": "tool", "tool_call_id": call.id, "name": "calculator", "content": result})
    return replies


def solve(client, messages: list, model: str = "policy") -> str:
    for _ in range(MAX_CALLS):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages += [message, *_tool_replies(message)]
    return ""


async def asolve(client, messages: list, model: str = "policy") -> str:
    for _ in range(MAX_CALLS):
        message = (await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)).choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages += [message, *_tool_replies(message)]
    return ""


if __name__ == "__main__":
    from openai import OpenAI

    task = os.environ.get("AGENTRL_TASK")
    messages = json.loads(task)["prompt"] if task else [{"role": "user", "content": " ".join(sys.argv[1:])}]
    answer = solve(OpenAI(), messages, os.environ.get("OPENAI_MODEL", "policy"))
    print(answer.replace("\n", " "))
