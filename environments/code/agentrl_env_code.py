"""Code environment: the model writes a Python function; hidden tests run in a sandbox.

Each task asks for one small function (``Write a Python function `is_palindrome(s)` ...``).
The model may try code first with the ``python`` and ``bash`` tools (they run in the
episode's sandbox), then replies with the function in a ```python block.  The reward is the
fraction of hidden tests passed (plugin ``code-tests``: the code runs in a sandbox, the
comparison on the host).  Problems come from a built-in set; every task instance draws its
own seeded test inputs, and expected outputs come from the reference solutions here.  Every
fifth problem is held out for the eval set.
Demonstrations (for warm-start SFT) answer with the reference solution directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl_rubric_code_tests import CodeTestsRubric

from agentrl.envs.sandbox_env import SandboxEnv
from agentrl.sandbox import SandboxLimits
from agentrl.types import Message, Task

SYSTEM_PROMPT = (
    "You write Python 3 functions. You may run code with the `python` and `bash` tools. "
    "When done, reply with the complete function in one ```python code block."
)


@dataclass(frozen=True)
class Problem:
    name: str
    signature: str
    description: str
    solution: str
    inputs: Callable[[random.Random], list[Any]]  # one argument list per call

    def reference(self) -> Callable[..., Any]:
        ns: dict[str, Any] = {}
        exec(compile(self.solution, f"<reference {self.name}>", "exec"), ns)  # our own trusted code
        return ns[self.name]


def _word(r: random.Random, n: int = 6) -> str:
    return "".join(r.choice("abcde") for _ in range(r.randint(0, n)))


def _ints(r: random.Random, n: int = 8, lo: int = -50, hi: int = 50) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(0, n))]


PROBLEMS = [
    Problem("add", "add(a, b)", "returns the sum of two integers",
            "def add(a, b):\n    return a + b", lambda r: [r.randint(-999, 999), r.randint(-999, 999)]),
    Problem("is_palindrome", "is_palindrome(s)", "returns True if the string s reads the same backwards",
            "def is_palindrome(s):\n    return s == s[::-1]",
            lambda r: [(lambda w: w + w[::-1] if r.random() < 0.5 else w)(_word(r))]),
    Problem("count_vowels", "count_vowels(s)", "returns how many of the characters of s are vowels (aeiou)",
            "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)", lambda r: [_word(r, 12)]),
    Problem("reverse_words", "reverse_words(s)", "returns the words of s (split on spaces) in reverse order, joined by single spaces",
            "def reverse_words(s):\n    return ' '.join(s.split()[::-1])",
            lambda r: [" ".join(_word(r, 4) or "x" for _ in range(r.randint(1, 5)))]),
    Problem("fizzbuzz", "fizzbuzz(n)", "returns 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else str(n)",
            "def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else 'Buzz' if n % 5 == 0 else str(n)",
            lambda r: [r.randint(1, 100)]),
    Problem("factorial", "factorial(n)", "returns n! for n >= 0",
            "def factorial(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out",
            lambda r: [r.randint(0, 15)]),
    Problem("fibonacci", "fibonacci(n)", "returns the n-th Fibonacci number, with fibonacci(0) = 0 and fibonacci(1) = 1",
            "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
            lambda r: [r.randint(0, 40)]),
    Problem("is_prime", "is_prime(n)", "returns True if the integer n is a prime number",
            "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True",
            lambda r: [r.randint(-5, 200)]),
    Problem("max_of_list", "max_of_list(xs)", "returns the largest element of the list xs, or None if it is empty",
            "def max_of_list(xs):\n    return max(xs) if xs else None", lambda r: [_ints(r)]),
    Problem("second_largest", "second_largest(xs)", "returns the second largest distinct value in xs, or None if there is none",
            "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) > 1 else None",
            lambda r: [_ints(r, 6, -5, 5)]),
    Problem("running_sum", "running_sum(xs)", "returns the list of prefix sums of xs",
            "def running_sum(xs):\n    out, t = [], 0\n    for x in xs:\n        t += x\n        out.append(t)\n    return out",
            lambda r: [_ints(r)]),
    Problem("dedupe", "dedupe(xs)", "returns xs without repeated elements, keeping the first occurrence of each, in order",
            "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out",
            lambda r: [_ints(r, 10, 0, 5)]),
    Problem("count_words", "count_words(s)", "returns a dict mapping each space-separated word of s to how often it occurs",
            "def count_words(s):\n    out = {}\n    for w in s.split():\n        out[w] = out.get(w, 0) + 1\n    return out",
            lambda r: [" ".join(r.choice(["a", "b", "cd", "e"]) for _ in range(r.randint(0, 8)))]),
    Problem("gcd", "gcd(a, b)", "returns the greatest common divisor of two non-negative integers (gcd(0, 0) = 0)",
            "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
            lambda r: [r.randint(0, 500), r.randint(0, 500)]),
    Problem("digit_sum", "digit_sum(n)", "returns the sum of the decimal digits of the integer |n|",
            "def digit_sum(n):\n    return sum(int(c) for c in str(abs(n)))", lambda r: [r.randint(-10**6, 10**6)]),
    Problem("binary", "binary(n)", "returns the binary representation of the non-negative integer n as a string without prefix",
            "def binary(n):\n    return bin(n)[2:]", lambda r: [r.randint(0, 5000)]),
    Problem("caesar", "caesar(s, k)", "shifts each lowercase letter of s forward by k places in the alphabet (wrapping), leaving other characters unchanged",
            "def caesar(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)",
            lambda r: [_word(r, 8) + r.choice(["", " !", "-x"]), r.randint(0, 30)]),
    Problem("flatten", "flatten(xss)", "returns one list with the elements of the lists in xss, in order",
            "def flatten(xss):\n    return [x for xs in xss for x in xs]",
            lambda r: [[_ints(r, 3) for _ in range(r.randint(0, 4))]]),
    Problem("chunk", "chunk(xs, n)", "splits xs into consecutive lists of length n (the last may be shorter)",
            "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]",
            lambda r: [_ints(r, 9), r.randint(1, 4)]),
    Problem("is_anagram", "is_anagram(a, b)", "returns True if the strings a and b contain the same letters with the same counts",
            "def is_anagram(a, b):\n    return sorted(a) == sorted(b)",
            lambda r: (lambda w: [w, "".join(r.sample(w, len(w))) if r.random() < 0.5 else _word(r)])(_word(r))),
]  # fmt: skip


def make_task(problem: Problem, rng: random.Random, num_tests: int) -> Task:
    ref = problem.reference()
    tests = []
    for _ in range(num_tests):
        args = problem.inputs(rng)
        tests.append({"args": args, "expected": ref(*args)})
    prompt = f"Write a Python function `{problem.signature}` that {problem.description}."
    return Task(prompt=[Message("user", prompt)], answer=problem.solution,
                info={"entry_point": problem.name, "tests": tests, "problem": problem.name})  # fmt: skip


class CodeEnv(SandboxEnv):
    """Write-a-function tasks; tools run in the episode sandbox; hidden tests decide."""

    name = "code"
    version = "0.1.0"
    reward_range = (0.0, 1.0)

    def __init__(
        self,
        *,
        num_train: int = 2000,
        num_eval: int = 100,
        num_tests: int = 8,
        seed: int = 0,
        sandbox_backend: str = "auto",
        timeout_s: float = 10.0,
        max_turns: int = 4,
        system_prompt: str | None = SYSTEM_PROMPT,
        **kwargs: Any,
    ) -> None:
        rng = random.Random(seed)
        # every 5th problem is held out: the eval set measures unseen problems, not unseen inputs
        train_p = [p for i, p in enumerate(PROBLEMS) if i % 5 != 4]
        eval_p = [p for i, p in enumerate(PROBLEMS) if i % 5 == 4]
        train = [make_task(train_p[i % len(train_p)], rng, num_tests) for i in range(num_train)]
        held = [make_task(eval_p[i % len(eval_p)], rng, num_tests) for i in range(num_eval)]
        limits = SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)))
        super().__init__(
            dataset=train,
            eval_dataset=held,
            rubric=CodeTestsRubric(backend=sandbox_backend, limits=limits),
            system_prompt=system_prompt,
            sandbox_backend=sandbox_backend,
            sandbox_limits=limits,
            max_turns=max_turns,
            **kwargs,
        )

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        tasks = list(self.dataset())
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            t = rng.choice(tasks)
            out.append([*t.prompt, Message("assistant", f"```python\n{t.answer}\n```")])
        return out

    async def close(self) -> None:
        await super().close()
        await self.rubric.close()  # type: ignore[union-attr]


def load_environment(**kwargs: Any) -> CodeEnv:
    return CodeEnv(**kwargs)
