"""Plugin discovery: entry points, package directories, defaults, did-you-mean errors."""

import textwrap

import pytest

from agentrl.errors import AgentrlError, EnvironmentNotFound, RubricNotFound
from agentrl.plugins import find, installed, load_environment, load_rubric, parse_env_args


def write_env_package(root, name="toy-env", module="toy_env_mod", body=None, args="greeting = 'hi'"):
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [project]
        name = "{name}"
        version = "1.2.3"
        [project.entry-points."agentrl.environments"]
        {name} = "{module}:load_environment"
        [tool.agentrl.args]
        {args}
    """))
    (root / f"{module}.py").write_text(body or textwrap.dedent("""\
        from agentrl.envs import SingleTurnEnv
        from agentrl.rubrics import Rubric

        def load_environment(greeting="hello", size=2):
            env = SingleTurnEnv(dataset=[greeting] * size, rubric=Rubric([lambda completion: 1.0]))
            env.greeting = greeting
            return env
    """))
    return root


def test_path_loads_uninstalled_package_with_pyproject_defaults(tmp_path):
    pkg = write_env_package(tmp_path / "toy")
    env = load_environment(str(pkg))
    assert env.greeting == "hi"  # from [tool.agentrl.args]
    assert env.name == "toy-env" and env.version == "1.2.3"  # filled from the package metadata
    env = load_environment(str(pkg), greeting="yo", size=3)  # kwargs beat the defaults
    assert env.greeting == "yo" and len(env.dataset()) == 3


def test_two_copies_of_one_module_each_load_from_their_own_directory(tmp_path):
    """A worktree and an editable install hold the same module name: a path loads its own copy."""
    body = "from agentrl.envs import SingleTurnEnv\nfrom agentrl.rubrics import Rubric\n" \
           "def load_environment(greeting=''):\n" \
           "    return SingleTurnEnv(dataset=[{!r}], rubric=Rubric([lambda completion: 1.0]))\n"
    one = write_env_package(tmp_path / "one", body=body.format("one"), args="")
    two = write_env_package(tmp_path / "two", body=body.format("two"), args="")
    assert load_environment(str(one)).dataset()[0].prompt[-1].content == "one"
    assert load_environment(str(two)).dataset()[0].prompt[-1].content == "two"
    assert load_environment(str(one)).dataset()[0].prompt[-1].content == "one"  # both on sys.path now


def test_bad_kwargs_and_bad_factory_are_one_line_errors(tmp_path):
    pkg = write_env_package(tmp_path / "toy")
    with pytest.raises(AgentrlError, match="rejected its arguments"):
        load_environment(str(pkg), nope=1)
    bad = write_env_package(tmp_path / "bad", name="bad-env", module="bad_env_mod",
                            body="def load_environment(**kw):\n    return 42\n")
    with pytest.raises(AgentrlError, match="not an agentrl Environment"):
        load_environment(str(bad))
    broken = write_env_package(tmp_path / "broken", name="broken-env", module="broken_env_mod",
                               body="import does_not_exist_xyz\n")
    with pytest.raises(AgentrlError, match="failed to import"):
        load_environment(str(broken))


def test_directory_without_package_is_not_found(tmp_path):
    with pytest.raises(EnvironmentNotFound, match="no pyproject.toml"):
        find(str(tmp_path))


def test_installed_calc_is_found_by_name_with_did_you_mean():
    names = [p.name for p in installed("agentrl.environments")]
    assert "calc" in names
    assert load_environment("CALC", max_operand=5).max_operand == 5  # names are case/dash-insensitive
    with pytest.raises(EnvironmentNotFound, match="did you mean 'calc'"):
        load_environment("calcc")
    with pytest.raises(RubricNotFound, match="no rubric"):
        load_rubric("definitely-not-a-rubric")


def test_env_args_parsing():
    assert parse_env_args('{"k": 1}') == {"k": 1} and parse_env_args(None) == {}
    for bad in ["{k: 1}", "[1, 2]"]:
        with pytest.raises(AgentrlError, match="--env-args"):
            parse_env_args(bad)
