"""Plugin discovery: entry points, package directories, defaults, did-you-mean errors."""

import sys
import textwrap
from pathlib import Path

import pytest
from agentrl_cli import agentrl

from agentrl.errors import AgentrlError, EnvironmentNotFound, RubricNotFound
from agentrl.plugins import find, installed, load_environment, load_rubric, parse_env_args


def write_env_package(root, name="toy-env", module="toy_env_mod", body=None, args=""):
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [project]
        name = "{name}"
        version = "1.2.3"
        [project.entry-points."agentrl.environments"]
        {name} = "{module}:load_environment"
        {"[tool.agentrl.args]" if args else ""}
        {args}
    """))
    (root / f"{module}.py").write_text(body or textwrap.dedent("""\
        from agentrl.envs import SingleTurnEnv
        from agentrl.rubrics import Rubric

        def load_environment(greeting="hi", size=2):
            env = SingleTurnEnv(dataset=[greeting] * size, rubric=Rubric([lambda completion: 1.0]))
            env.greeting = greeting
            return env
    """))
    return root


def test_path_loads_uninstalled_package_with_its_factorys_defaults(tmp_path, recwarn):
    pkg = write_env_package(tmp_path / "toy")
    env = load_environment(str(pkg))
    assert env.greeting == "hi" and not recwarn.list  # load_environment's own default
    assert env.name == "toy-env" and env.version == "1.2.3"  # filled from the package metadata
    env = load_environment(str(pkg), greeting="yo", size=3)  # kwargs beat the defaults
    assert env.greeting == "yo" and len(env.dataset()) == 3


def test_a_pyproject_args_table_still_applies_from_source_but_warns_that_a_wheel_drops_it(tmp_path):
    """A wheel does not carry pyproject.toml: the same package installed with ``pip install DIR``
    silently ran with other arguments, so the table is applied from a source dir with a warning."""
    pkg = write_env_package(tmp_path / "toy", args="greeting = 'from-table'")
    with pytest.warns(UserWarning, match=r"\[tool.agentrl.args\] in .*toy/pyproject.toml applies only when the "
                                          r"package is loaded from its source; a wheel install .* ignores it"):
        assert load_environment(str(pkg)).greeting == "from-table"
    with pytest.warns(UserWarning), pytest.raises(AgentrlError, match=r"rejected its arguments \['bogus'\]"):
        load_environment(str(pkg), bogus=1)  # names what the user gave, not the table's keys too


def test_no_bundled_package_or_scaffold_keeps_defaults_where_a_wheel_loses_them(tmp_path):
    from agentrl.envs.scaffold import scaffold_environment

    root = Path(__file__).resolve().parents[1]
    scaffolded = scaffold_environment("fresh-env", tmp_path)
    for pyproject in [*root.glob("environments/*/pyproject.toml"), *root.glob("rubrics/*/pyproject.toml"),
                      scaffolded / "pyproject.toml"]:
        assert "[tool.agentrl" not in pyproject.read_text(), pyproject


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


# ----------------------------------------------------------------------------- names vs paths, duplicate names

PLANTED = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('planted code ran')\n" \
          "def load_rubric(**kw):\n    raise SystemExit('planted')\nload_environment = load_rubric\n"


def plant_package(root, group, name, module="planted_mod"):
    """A folder that impersonates an installed plugin: pyproject + module that leaves a RAN file."""
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "planted"\nversion = "6.6.6"\n[project.entry-points."{group}"]\n{name} = "{module}:load_rubric"\n'
    )
    for mod in (module, "agentrl_rubric_code_tests", "agentrl_env_calc"):  # also shadow the real modules
        (root / f"{mod}.py").write_text(PLANTED)
    return root


def test_a_bare_name_is_the_installed_plugin_even_with_a_same_named_folder_here(tmp_path, monkeypatch):
    """A folder named like an installed plugin in the run's directory is never loaded by that name."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    rubric_dir = plant_package(tmp_path / "code-tests", "agentrl.rubrics", "code-tests")
    env_dir = plant_package(tmp_path / "calc", "agentrl.environments", "calc")
    monkeypatch.chdir(tmp_path)
    assert find("code-tests", "agentrl.rubrics").dist == "agentrl-rubric-code-tests"
    assert type(load_rubric("code-tests")).__name__ == "CodeTestsRubric"
    assert load_environment("calc", max_operand=5).max_operand == 5
    assert not (rubric_dir / "RAN").exists() and not (env_dir / "RAN").exists()
    assert str(tmp_path / "code-tests") not in sys.path and str(tmp_path / "calc") not in sys.path
    # a bare name that is only a folder here says how to ask for the folder
    write_env_package(tmp_path / "toy")
    with pytest.raises(EnvironmentNotFound, match=r"no environment 'toy'.*pass \./toy to load it from source"):
        find("toy")


def test_path_looking_names_still_load_a_local_env(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    write_env_package(tmp_path / "toy")
    write_env_package(tmp_path / "envs" / "deep", name="deep-env", module="deep_env_mod")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_environment("./toy").greeting == "hi"
    assert load_environment("envs/deep").name == "deep-env"
    assert load_environment("~/toy", greeting="yo").greeting == "yo"
    assert load_environment(str(tmp_path / "toy")).name == "toy-env"


def test_a_source_dir_goes_after_the_installed_packages_and_shadows_nothing(tmp_path, monkeypatch):
    """Only the entry point's own module comes from the env's folder; a stdlib-named file beside it does not."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    pkg = write_env_package(tmp_path / "toy")
    (pkg / "colorsys.py").write_text("raise ImportError('the planted colorsys shadowed the standard library')\n")
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    assert load_environment(str(pkg)).greeting == "hi"
    import colorsys  # before the fix: the planted one, first on sys.path

    assert Path(colorsys.__file__).parent != pkg
    assert sys.path[0] != str(pkg.resolve()) and str(pkg.resolve()) in sys.path  # siblings still import


def fake_dist(site, dist, version, entry_points):
    """A ``*.dist-info`` directory on ``site``: what pip leaves behind, minus the code."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)
    return info


def test_two_distributions_with_one_entry_point_name_are_an_error_naming_both(tmp_path, monkeypatch):
    site, again = tmp_path / "site", tmp_path / "site-again"
    twin = '[agentrl.environments]\ntwin-env = "twin_mod:load_environment"\n'
    fake_dist(site, "fake-one", "1.0", twin)
    fake_dist(site, "fake-two", "2.0", twin.replace("twin-env", "Twin_Env"))  # the same name, normalised
    solo = '[agentrl.environments]\nsolo-env = "solo_mod:load_environment"\n'
    fake_dist(site, "fake-solo", "1.0", solo)
    fake_dist(again, "fake-solo", "1.0", solo)  # the same distribution found twice: no conflict
    monkeypatch.syspath_prepend(str(again))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(site))  # a repeated sys.path entry: no conflict either
    with pytest.raises(AgentrlError) as err:
        find("twin-env")
    message = str(err.value)
    assert "\n" not in message and "fake-one 1.0" in message and "fake-two 2.0" in message
    assert "pip uninstall" in message and str(site) in message
    assert find("solo-env").dist == "fake-solo"  # looked up alone, a duplicated dist is fine
    assert find("calc").name == "calc"  # and unrelated names are unaffected
    assert [p.dist for p in installed("agentrl.environments") if p.name.lower().replace("_", "-") == "twin-env"] \
        == ["fake-one", "fake-two"]  # `agentrl env list` shows both claimants
    # through the CLI: exit 2, one line
    r = agentrl("env", "test", "twin-env", env={"PYTHONPATH": str(site)})
    assert r.returncode == 2, r.stderr
    assert "fake-one" in r.stderr and "fake-two" in r.stderr and len(r.stderr.strip().splitlines()) == 1
