"""A complete agentrl environment: look up a country's capital with a tool, then answer."""

from agentrl.envs import ToolEnv
from agentrl.rubrics import Rubric

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Canada": "Ottawa",
    "Egypt": "Cairo", "Norway": "Oslo", "Chile": "Santiago", "India": "New Delhi", "Spain": "Madrid",
}  # fmt: skip


def lookup(country: str) -> str:
    """Look up facts about a country.

    Args:
        country: the country's English name, e.g. "France"
    """
    if country not in CAPITALS:
        raise KeyError(f"unknown country {country!r}")  # the model sees this as a tool error
    return f"The capital of {country} is {CAPITALS[country]}."


def correct(completion: str, answer: str) -> float:
    return float(answer.lower() in completion.lower())


def load_environment(num_eval: int = 3) -> ToolEnv:
    tasks = [{"question": f"What is the capital of {c}?", "answer": a} for c, a in CAPITALS.items()]
    return ToolEnv(
        tools=[lookup],
        dataset=tasks[num_eval:],
        eval_dataset=tasks[:num_eval],
        rubric=Rubric([correct]),
        system_prompt="Use the lookup tool, then answer with the city.",
        max_turns=3,
        name="capitals",
    )
