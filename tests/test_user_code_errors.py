"""User code failing outside an episode (``load_environment``, a rubric factory): one line naming
the plugin, its entry point, the function and the exception, exit 2 — in `env test`, `eval` and
`run`; ``--traceback`` / ``AGENTRL_TRACEBACK=1`` print the whole trace instead."""

import textwrap

import pytest
from agentrl_cli import agentrl

from agentrl.errors import AgentrlError, UserCodeError
from agentrl.plugins import load_environment, load_rubric

BROKEN = textwrap.dedent("""\
    def helper(size):
        raise ValueError("dataset file data/train.jsonl is missing;\\n  run make data first")

    def load_environment(size=2):
        return helper(size)
""")


def write_package(root, name, module, body, group="agentrl.environments", attr="load_environment"):
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [project]
        name = "{name}"
        version = "0.1.0"
        [project.entry-points."{group}"]
        {name} = "{module}:{attr}"
    """))
    (root / f"{module}.py").write_text(body)
    return root


EXPECTED = ("error: environment 'broken-env' (broken_env_mod:load_environment) raised ValueError: "
            "dataset file data/train.jsonl is missing; run make data first")


def test_a_raising_factory_is_a_user_code_error_naming_plugin_function_and_exception(tmp_path):
    pkg = write_package(tmp_path / "broken", "broken-env", "broken_env_mod", BROKEN)
    with pytest.raises(UserCodeError) as e:
        load_environment(str(pkg))
    assert str(e.value).startswith(EXPECTED.removeprefix("error: ")) and "\n" not in str(e.value)
    assert isinstance(e.value.__cause__, ValueError)  # the trace is kept for --traceback
    # a TypeError raised *inside* the factory is the factory's bug, not a bad argument
    typo = write_package(tmp_path / "typo", "typo-env", "typo_env_mod",
                         "def load_environment(size=2):\n    return len(size)\n")
    with pytest.raises(UserCodeError, match=r"typo-env' \(typo_env_mod:load_environment\) raised TypeError: object"):
        load_environment(str(typo))
    with pytest.raises(AgentrlError, match="rejected its arguments") as e:  # a real bad argument stays that
        load_environment(str(typo), nope=1)
    assert not isinstance(e.value, UserCodeError)
    fwd = write_package(tmp_path / "fwd", "fwd-env", "fwd_env_mod",  # **kwargs handed on to a constructor
                        "class E:\n    def __init__(self, size=2):\n        pass\n"
                        "def load_environment(**kw):\n    return E(**kw)\n")
    with pytest.raises(AgentrlError, match=r"rejected its arguments \['nope'\]: .*unexpected keyword argument 'nope'"):
        load_environment(str(fwd), nope=1)
    bad_import = write_package(tmp_path / "imp", "imp-env", "imp_env_mod", "1 / 0\n")
    with pytest.raises(UserCodeError, match=r"'imp-env' \(imp_env_mod:load_environment\) failed to import: "
                                            r"ZeroDivisionError: division by zero"):
        load_environment(str(bad_import))


def test_a_raising_rubric_factory_is_a_user_code_error(tmp_path):
    body = "def make(**kw):\n    raise KeyError('OPENAI_API_KEY')\n"
    pkg = write_package(tmp_path / "rub", "judge-x", "judge_x_mod", body, group="agentrl.rubrics", attr="make")
    with pytest.raises(UserCodeError, match=r"^rubric 'judge-x' \(judge_x_mod:make\) raised KeyError: 'OPENAI_API_KEY'"):
        load_rubric(str(pkg))


@pytest.mark.parametrize("command", ["env test", "eval", "run", "run without sft"])
@pytest.mark.slow
def test_every_command_prints_one_line_and_exits_2(tmp_path, command):
    pkg = str(write_package(tmp_path / "broken", "broken-env", "broken_env_mod", BROKEN))
    if command == "env test":
        r = agentrl("env", "test", pkg)
    elif command == "eval":  # the env loads before any endpoint is touched
        r = agentrl("eval", pkg, "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "o"))
    else:
        model = tmp_path / "model"  # never loaded: the env fails first
        model.mkdir()
        (model / "config.json").write_text("{}")
        (tmp_path / "c.toml").write_text("")
        r = agentrl("run", str(tmp_path / "c.toml"), f"--env.name={pkg}", f"--model.path={model}",
                    f"--run.dir={tmp_path / 'run'}", f"--sft.enabled={str(command == 'run').lower()}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith(EXPECTED) and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert "--traceback" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("how", ["flag", "env var"])
def test_traceback_flag_or_env_var_shows_the_full_trace(tmp_path, how):
    pkg = str(write_package(tmp_path / "broken", "broken-env", "broken_env_mod", BROKEN))
    if how == "flag":
        r = agentrl("--traceback", "env", "test", pkg)
    else:
        r = agentrl("env", "test", pkg, env={"AGENTRL_TRACEBACK": "1"})
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr
    assert 'broken_env_mod.py", line 2, in helper' in r.stderr  # the user's own frame
    assert "UserCodeError: environment 'broken-env'" in r.stderr
