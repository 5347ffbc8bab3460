"""The worked example in examples/custom_env loads from its directory and passes the checklist."""

from pathlib import Path

from agentrl.envs import check_environment
from agentrl.plugins import load_environment

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_env"


async def test_example_env_loads_by_path_and_passes_the_checklist():
    env = load_environment(str(EXAMPLE))
    report = await check_environment(env, num_episodes=2)
    assert report.ok, report.failures()
    (schema,) = env.tool_schemas()
    params = schema["function"]["parameters"]
    assert params["required"] == ["country"]
    assert "English name" in params["properties"]["country"]["description"]
    assert len(list(env.eval_dataset())) == 3


def test_example_env_is_under_40_lines():
    assert len((EXAMPLE / "agentrl_env_capitals.py").read_text().splitlines()) < 40
