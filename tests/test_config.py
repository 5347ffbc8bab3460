"""Config loading: layered TOML, dotted overrides, all errors on one line each."""

import pytest

from agentrl.config import Config, ConfigError, load_config, parse_overrides
from agentrl.types import Message, Task, TokenSequence, ToolCall, Trajectory


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_files_merge_left_to_right_and_overrides_win(tmp_path):
    a = write(tmp_path, "a.toml", "[trainer]\nlr = 1e-3\nsteps = 5\n[env]\nname = 'calc'\n")
    b = write(tmp_path, "b.toml", "[trainer]\nlr = 2e-3\n")
    cfg = load_config([a, b], ["--trainer.steps=7", "--env.args", '{"max_operand": 9}'])
    assert cfg.trainer.lr == 2e-3
    assert cfg.trainer.steps == 7
    assert cfg.env.name == "calc"
    assert cfg.env.args == {"max_operand": 9}


def test_a_table_given_whole_replaces_the_files_and_dotted_keys_merge(tmp_path):
    """A file's env.args could not be dropped: `--env.name=other --env.args='{}'` kept them, and the
    other env rejected the file's arguments."""
    a = write(tmp_path, "a.toml", "[env]\nname = 'calc'\nargs = { max_operand = 99, ops = '+' }\n")
    assert load_config([a], ["--env.args={}"]).env.args == {}
    assert load_config([a], ["--env.args", '{"show_tools": true}']).env.args == {"show_tools": True}
    assert load_config([a], ["--env.args.show_tools=true"]).env.args == {"max_operand": 99, "ops": "+",
                                                                          "show_tools": True}
    both = load_config([a], ["--env.args={ops = '-'}", "--env.args.show_tools=true"])
    assert both.env.args == {"ops": "-", "show_tools": True}


def test_override_values_parse_as_toml_literals():
    over = parse_overrides(["--a.b=3", "--a.c=true", "--a.d=hello", "--a.e=[1, 2]"])
    assert over == {"a": {"b": 3, "c": True, "d": "hello", "e": [1, 2]}}


def test_every_error_is_reported_at_once(tmp_path):
    p = write(tmp_path, "bad.toml", "[trainer]\nlr = 'fast'\nbogus = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config([p])
    msg = str(e.value)
    assert "unknown key 'trainer.bogus'" in msg
    assert "trainer.lr" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "args, needle",
    [(["--nope.x=1"], "unknown key 'nope'"), (["trainer.lr=1"], "unexpected argument"), (["--a.=1"], "bad override"), (["--a.b"], "has no value")],
)
def test_bad_overrides_are_config_errors(args, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([], args)


@pytest.mark.parametrize(
    "arg, where",
    [("--trainer.lr=nan", "trainer.lr"), ("--trainer.lr=inf", "trainer.lr"), ("--trainer.lr=-inf", "trainer.lr"),
     ("--env.args.x=NaN", "env.args.x"), ("--env.args.x=-Infinity", "env.args.x"),
     ("--env.args.x=[1.0, nan]", "env.args.x[1]"), ("--env.args={a = {b = inf}}", "env.args.a.b")],
)
def test_non_finite_overrides_are_refused(arg, where):
    # model_dump(mode="json") turns NaN into null, so such a value vanished from --dry-run and
    # config.toml while reaching load_environment(): refuse it with the path that held it
    with pytest.raises(ConfigError, match=r"is not a finite number") as e:
        load_config([], [arg])
    assert where in str(e.value) and "\n" not in str(e.value)
    assert parse_overrides(["--trainer.lr=1e-5", "--env.args.x=[1.5, -2]"]) == {
        "trainer": {"lr": 1e-5}, "env": {"args": {"x": [1.5, -2]}}}


def test_non_finite_values_in_a_file_are_refused(tmp_path):
    p = write(tmp_path, "c.toml", "[env.args]\nx = nan\n")
    with pytest.raises(ConfigError, match=r"c.toml: env.args.x is not a finite number"):
        load_config([p])


def test_missing_file_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([tmp_path / "missing.toml"])
    p = write(tmp_path, "x.toml", "[trainer\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config([p])


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config([], ["--trainer.lr=3e-4", "--run.name=demo"])
    p = write(tmp_path, "resolved.toml", cfg.to_toml())
    assert load_config([p]) == cfg
    assert Config().run_dir.name == "run"


def test_trajectory_json_round_trip_keeps_token_provenance():
    task = Task(prompt=[Message("user", "What is 2+3?")], answer=5)
    seq = TokenSequence()
    seq.extend_forced([1, 2, 3])
    seq.extend_sampled([4, 5], [-0.5, -0.25], [7, 8])
    traj = Trajectory(
        task=task,
        messages=[*task.prompt, Message("assistant", "", tool_calls=[ToolCall("calculator", '{"e": "2+3"}')])],
        sequences=[seq],
        reward=1.0,
    )
    back = Trajectory.from_json(traj.to_json())
    assert back == traj
    assert back.oldest_version() == 7
    assert back.sequences[0].loss_mask == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        seq.extend_sampled([1], [], [1])


def test_tool_parser_is_checked_with_every_other_error():
    with pytest.raises(ConfigError) as info:
        load_config([], ["--inference.tool_parser=hermse", "--trainer.lr=-1"])
    assert "did you mean 'hermes'" in str(info.value) and "trainer.lr" in str(info.value)
    assert load_config([], ["--inference.tool_parser=llama4_json"]).inference.tool_parser == "llama4_json"
    assert Config().inference.tool_parser == "auto"


def test_ray_roles_need_the_ray_backend():
    from agentrl.config import load_config
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match='trainer_actor = true needs cluster.backend = "ray"'):
        load_config([], ["--cluster.trainer_actor=true"])
    assert load_config([], ["--cluster.trainer_actor=true", "--cluster.backend=ray"]).cluster.trainer_actor
    with pytest.raises(ConfigError, match='rollout_workers = 2 needs cluster.backend = "ray"'):
        load_config([], ["--cluster.rollout_workers=2"])
    cfg = load_config([], ["--cluster.rollout_workers=2", "--cluster.backend=ray"])
    assert cfg.cluster.rollout_workers == 2


def test_ray_placed_trainer_ranks_are_one_device_each():
    # trainer_actor with world_size = N places N rank actors; a rank is one device (a GPU or the CPU), and nccl needs
    # a GPU per rank
    from agentrl.config import load_config
    from agentrl.errors import ConfigError

    ray_ranks = ["--cluster.backend=ray", "--cluster.trainer_actor=true", "--trainer.world_size=2"]
    assert load_config([], ray_ranks).trainer.world_size == 2
    assert load_config([], [*ray_ranks, "--cluster.trainer_gpus=1", "--trainer.backend=nccl"]).cluster.trainer_gpus == 1
    with pytest.raises(ConfigError, match="trainer_gpus = 2 with trainer.world_size = 2: each trainer rank is one device"):
        load_config([], [*ray_ranks, "--cluster.trainer_gpus=2"])
    with pytest.raises(ConfigError, match='backend = "nccl" needs a GPU per rank actor'):
        load_config([], [*ray_ranks, "--trainer.backend=nccl"])


def test_failure_rewards_that_leave_out_a_policy_kind_warn():
    """An episode of a kind left out leaves its group untrained: a config written before the
    ``program`` kind existed would silently reopen a way out of a wrong answer's 0."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config([])  # the default names every kind the policy causes
    with pytest.warns(UserWarning, match=r"leaves out program: .* add program = 0.0"):
        cfg = load_config([], ['--buffer.failure_rewards={"timeout": 0.0, "context_length": -0.5}'])
    assert cfg.buffer.failure_rewards == {"timeout": 0.0, "context_length": -0.5}
