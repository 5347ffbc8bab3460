"""The CLI's contract for bad input: one line on stderr, exit code 2, no traceback."""


import pytest
from agentrl_cli import agentrl


def test_dry_run_prints_resolved_config(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[trainer]\nlr = 1e-3\n")
    r = agentrl("run", str(cfg), "--dry-run", "--trainer.steps=3")
    assert r.returncode == 0, r.stderr
    assert "lr = 0.001" in r.stdout
    assert "steps = 3" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["run", "MISSING.toml", "--dry-run"],
        ["run", "CFG", "--dry-run", "--trainer.lr=fast"],
        ["run", "CFG", "--dry-run", "--nosuch.key=1"],
        ["run", "CFG", "--dry-run", "--env.args.x=nan"],  # would vanish from config.toml, yet reach the env
        ["run", "CFG", "--dry-run", "--trainer.lr=inf"],
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path, args):
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    args = [str(cfg) if a == "CFG" else a for a in args]
    r = agentrl(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error:")


@pytest.mark.parametrize(
    "args", [["frobnicate"], ["run"], ["model", "init", "tiny"], ["eval", "calc", "--model", "m", "-n", "-3"]]
)
def test_usage_errors_are_one_line_exit_2(args):
    r = agentrl(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error:")


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_misspelt_config_key_gets_a_suggestion(tmp_path, where):
    """Issue 23, friction 10: `unknown key 'buffer.max_stalenes'` said nothing more, while a
    misspelt environment name gets "did you mean"."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[buffer]\nmax_stalenes = 2\n" if where == "file" else "")
    r = agentrl("run", str(cfg), "--dry-run", *(["--buffer.max_stalenes=2"] if where == "override" else []))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown key 'buffer.max_stalenes'; did you mean 'buffer.max_staleness'?" in r.stderr, r.stderr
    r = agentrl("run", str(cfg), "--dry-run", "--bufer.max_staleness=2")
    assert "unknown key 'bufer'; did you mean 'buffer'?" in r.stderr, r.stderr
