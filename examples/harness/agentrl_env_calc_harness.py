"""The calc task as an existing agent program (``calc_agent.py``), trained unchanged.

``form = "command"`` runs the agent as a subprocess per episode; ``"agent"`` calls its async
loop in-process.  Tasks, held-out split, demonstrations (for the warm start) and the reward
are the native calc environment's; the reward reads the agent's printed answer (``result``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from agentrl_env_calc import CalcEnv, correct_answer

from agentrl.envs import HarnessEnv
from agentrl.rubrics import Rubric

sys.path.insert(0, str(Path(__file__).parent))
from calc_agent import TOOLS, asolve  # noqa: E402


async def agent(client, task: dict) -> str:
    return await asolve(client, list(task["prompt"]))


def correct(result: str, answer: int) -> float:
    return correct_answer(result or "", answer)


class CalcHarness(HarnessEnv):
    name = "calc-harness"

    def __init__(self, form: str = "command", timeout_s: float = 60.0, **calc_args) -> None:
        if form not in ("command", "agent"):
            raise ValueError(f"form must be 'command' or 'agent', not {form!r}")
        self.calc = CalcEnv(**calc_args)
        program = {"command": [sys.executable, str(Path(__file__).with_name("calc_agent.py"))]} if form == "command" \
            else {"agent": agent}
        super().__init__(**program, dataset=self.calc.dataset(), eval_dataset=self.calc.eval_dataset(),
                         rubric=Rubric([correct]), timeout_s=timeout_s, max_turns=4)  # fmt: skip

    def tool_schemas(self):
        return TOOLS  # the warm start sees the tools exactly as the agent sends them

    def demonstrations(self, n: int, seed: int = 0, **kwargs):
        return self.calc.demonstrations(n, seed, **kwargs)


def load_environment(**kwargs) -> CalcHarness:
    return CalcHarness(**kwargs)
