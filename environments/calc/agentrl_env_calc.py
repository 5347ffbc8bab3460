"""Calculator-tool arithmetic: the agentrl quickstart environment (see README.md)."""

from __future__ import annotations

import ast
import operator
import random
import re
import threading
import warnings

from agentrl.envs import ToolEnv, ToolLatency, with_latency
from agentrl.rubrics import Rubric
from agentrl.types import Message, Task, ToolCall

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# A number: an optional sign ("-" not after a digit or bracket, where it is 3-5's minus), digits
# (or 1-3 digits then groups of three after , or a space: "1,234", "1 234"), an optional fraction.
_NUMBER = re.compile(r"(?:(?<![\d)\]])-)?(?:\d{1,3}(?:[, \u00a0\u2009\u202f]\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_GROUP_SEPARATORS = re.compile(r"[, \u00a0\u2009\u202f]")
# minus sign, figure dash, en dash, small and fullwidth hyphen-minus: all written for "-"
_MINUS = str.maketrans(dict.fromkeys("\u2212\u2012\u2013\ufe63\uff0d", "-"))
_PARSE_LOCK = threading.Lock()  # sync tools run in threads (asyncio.to_thread)


# Every integer the calculator makes has at most this many bits, checked *before* it is computed:
# then each operation costs microseconds, so no tool thread (which asyncio cannot kill) can run
# away. An exponent check alone passed (((9**64)**64)**64)**64, a 53-million-bit power that
# held the GIL for minutes and froze the env server.
MAX_BITS = 4096


def _bits(v: float | int) -> int:
    return v.bit_length() if isinstance(v, int) else 0  # a float cannot grow past ~1e308 (it overflows)


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 64:
                raise ValueError("exponent too large")
            if isinstance(right, int) and right > 0 and _bits(left) * right > MAX_BITS:
                raise ValueError(f"result too large (over {MAX_BITS} bits)")
        elif isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > MAX_BITS:
            raise ValueError(f"result too large (over {MAX_BITS} bits)")
        value = _OPS[type(node.op)](left, right)
        if isinstance(value, complex):  # (-8)**0.5
            raise ValueError("the result is not a real number")
        return value
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "12*7"
    """
    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        # "1if 1 else 2" is the model's mistake: an error reply, not a SyntaxWarning on our stderr.
        # catch_warnings swaps process-wide filters; the lock keeps two tool threads from
        # interleaving save/restore, which could leave "error" installed for the whole process
        with _PARSE_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, SyntaxWarning) as e:
        raise ValueError(f"cannot parse {expression!r}") from e
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def last_number(text: str) -> float | None:
    """The last number written in ``text``, sign and digit groups included ("\u22122" is -2,
    "1 234" is 1234, "3-5" ends in 5); None if there is none."""
    found = _NUMBER.findall(text.translate(_MINUS))
    return float(_GROUP_SEPARATORS.sub("", found[-1])) if found else None


def correct_answer(completion: str, answer: int) -> float:
    """1.0 when the last number in the final reply (:func:`last_number`) equals the true value."""
    got = last_number(completion)
    return float(got is not None and abs(got - answer) < 1e-9)


def used_calculator(messages: list[Message]) -> float:
    return float(any(tc.name == "calculator" for m in messages for tc in m.tool_calls))


def _question(a: int, op: str, b: int) -> str:
    return f"What is {a}{op}{b}?"


class CalcEnv(ToolEnv):
    """``What is a∘b?`` → call ``calculator`` → answer. Reward: numeric match.

    ``tool_latency_median_s`` > 0 makes the calculator slow on purpose, like a real remote
    tool: every call first waits a lognormal delay with that median and a 99th percentile of
    ``tool_latency_p99_s`` (capped at ``tool_latency_max_s``; see :class:`ToolLatency`).
    """

    name = "calc"
    version = "0.1.0"
    reward_range = (0.0, 1.0)

    def __init__(
        self,
        *,
        max_operand: int = 999,
        ops: str = "+-*",
        num_train: int = 20000,
        num_eval: int = 200,
        seed: int = 0,
        show_tools: bool = False,
        system_prompt: str | None = None,
        max_turns: int = 3,
        tool_latency_median_s: float = 0.0,
        tool_latency_p99_s: float = 4.0,
        tool_latency_max_s: float = 20.0,
        **kwargs,
    ) -> None:
        if max_operand < 1 or not ops or set(ops) - set(_APPLY):
            raise ValueError(f"need max_operand >= 1 and ops drawn from '+-*', got {max_operand}, {ops!r}")
        self.max_operand, self.ops = max_operand, ops
        train, held = self._split(num_train, num_eval, seed)
        self.latency = ToolLatency(tool_latency_median_s, tool_latency_p99_s, tool_latency_max_s, seed=seed)
        kwargs.setdefault("tool_timeout_s", max(30.0, tool_latency_max_s + 10.0))
        super().__init__(
            tools=[with_latency(calculator, self.latency) if tool_latency_median_s > 0 else calculator],
            dataset=train,
            eval_dataset=held,
            rubric=Rubric([correct_answer, used_calculator], weights=[1.0, 0.0]),
            system_prompt=system_prompt,
            show_tools=show_tools,
            max_turns=max_turns,
            **kwargs,
        )

    def _task(self, a: int, op: str, b: int) -> Task:
        return Task(prompt=[Message("user", _question(a, op, b))], answer=_APPLY[op](a, b),
                    info={"a": a, "op": op, "b": b})

    def _split(self, num_train: int, num_eval: int, seed: int) -> tuple[list[Task], list[Task]]:
        """Seeded train and held-out problems that never share a question."""
        rng = random.Random(seed)
        space = (self.max_operand + 1) ** 2 * len(self.ops)
        if space <= 200_000:  # small space: shuffle all problems, hold out a slice
            combos = [(a, op, b) for a in range(self.max_operand + 1) for op in self.ops
                      for b in range(self.max_operand + 1)]
            rng.shuffle(combos)
            n_eval = min(num_eval, len(combos) // 5)
            held, pool = combos[:n_eval], combos[n_eval:]
            train = [pool[i % len(pool)] for i in range(num_train)]
        else:
            held_set: dict[tuple, None] = {}
            while len(held_set) < num_eval:
                held_set[self._draw(rng)] = None
            held = list(held_set)
            train = []
            while len(train) < num_train:
                if (c := self._draw(rng)) not in held_set:
                    train.append(c)
        return [self._task(*c) for c in train], [self._task(*c) for c in held]

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        return rng.randint(0, self.max_operand), rng.choice(self.ops), rng.randint(0, self.max_operand)

    def demonstrations(self, n: int, seed: int = 0, noise: float = 0.0) -> list[list[Message]]:
        """``n`` solved conversations on training-distribution problems (never held-out ones).

        ``noise``: the fraction made imperfect — a wrong expression, a wrong final answer,
        or an answer without the tool — so warm-start SFT leaves room for RL.
        """
        rng = random.Random(f"demos-{seed}")
        train = self.dataset()
        demos = []
        for _ in range(n):
            task = train[rng.randrange(len(train))]
            a, op, b = task.info["a"], task.info["op"], task.info["b"]
            expr, final = f"{a}{op}{b}", task.answer
            kind = rng.choice(["expression", "answer", "no_tool"]) if rng.random() < noise else None
            if kind == "expression":
                expr = f"{b}{op}{a}" if op == "-" and a != b else f"{a}{rng.choice(self.ops)}{b + 1}"
            call = ToolCall("calculator", f'{{"expression": "{expr}"}}')
            result = calculator(expr)
            if kind != "expression":
                final = task.answer + rng.choice([-10, -1, 1, 10]) if kind == "answer" else task.answer
            else:
                final = int(result)
            convo = list(task.prompt)
            if kind == "no_tool":
                convo.append(Message("assistant", str(task.answer + rng.choice([-1, 1]) * rng.randint(1, 20))))
            else:
                convo += [Message("assistant", "", tool_calls=[call]),
                          Message("tool", result, tool_call_id=call.id, name="calculator"),
                          Message("assistant", str(final))]
            demos.append(convo)
        return demos


    def reference_policy(self):
        """Call the calculator on the question, then answer with its result."""

        def policy(task: Task, conversation: list[Message]) -> Message:
            results = [m.content for m in conversation if m.role == "tool"]
            if results:
                return Message("assistant", results[-1])
            a, op, b = task.info["a"], task.info["op"], task.info["b"]
            return Message("assistant", "", tool_calls=[ToolCall("calculator", f'{{"expression": "{a}{op}{b}"}}')])

        return policy


def load_environment(**kwargs) -> CalcEnv:
    return CalcEnv(**kwargs)


__all__ = ["CalcEnv", "calculator", "correct_answer", "last_number", "load_environment"]
