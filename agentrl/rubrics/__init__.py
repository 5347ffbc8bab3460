"""Rubrics: reward functions asked for by argument name, weighted, plugin-discoverable."""

from agentrl.rubrics.rubric import (
    Rubric,
    RubricGroup,
    as_reward,
    completion_text,
    episode_args,
    last_assistant_text,
    score_episodes,
    tagged,
)

__all__ = [
    "JudgeRubric",
    "Rubric",
    "RubricGroup",
    "as_reward",
    "completion_text",
    "episode_args",
    "last_assistant_text",
    "score_episodes",
    "tagged",
]


def __getattr__(name: str):
    if name == "JudgeRubric":  # imports openai lazily
        from agentrl.rubrics.judge import JudgeRubric

        return JudgeRubric
    raise AttributeError(name)
