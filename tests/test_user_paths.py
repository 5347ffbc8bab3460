"""User errors about paths and resumes through the real CLI: one line, exit 2, no traceback, and
nothing finished is lost or rewritten (config.toml, checkpoints, logs, model files)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from agentrl_cli import agentrl

RUN = {  # two tiny steps, a checkpoint after each
    "sft.enabled": "false", "env.name": "calc", "rollout.group_size": 2, "rollout.max_in_flight": 4,
    "rollout.max_tokens": 16, "rollout.max_turns": 2, "trainer.batch_groups": 1, "trainer.steps": 2,
    "trainer.checkpoint_every": 1, "buffer.filter_zero_variance": "false", "eval.every": 0,
    "trainer.num_threads": 1, "inference.max_batch_size": 4,
}


def run_args(model: Path, run_dir: Path, **extra) -> list[str]:
    return ["run", *(f"--{k}={v}" for k, v in ({"model.path": model, "run.dir": run_dir} | RUN | extra).items())]


def one_line_refusal(r, *needles: str) -> str:
    """Exit 2, stderr one `error: ...` line holding every needle, no traceback; returns the line."""
    err = r.stderr.strip()
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in err and "\n" not in err and err.startswith("error: "), err[-3000:]
    assert all(n in err for n in needles), err
    return err


def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative name → sha256)."""
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model) -> tuple[Path, Path]:
    """(model, run dir) of a finished 2-step run with checkpoints, made without LoRA; read-only."""
    root = tmp_path_factory.mktemp("trained")
    model = root / "model"
    shutil.copytree(tiny_model, model)
    run_dir = root / "run"
    r = agentrl(*run_args(model, run_dir), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    return model, run_dir


@pytest.fixture
def run_copy(trained, tmp_path) -> tuple[Path, Path]:
    model, run_dir = trained
    shutil.copytree(run_dir, tmp_path / "run")
    return model, tmp_path / "run"


# ----------------------------------------------------------------------------- agentrl run --resume


@pytest.mark.parametrize("key", ["trainer.lora_rank", "model.path"])
def test_resume_with_a_config_that_does_not_fit_the_checkpoints_is_refused_before_config_toml_changes(
        run_copy, small_model, key):
    """--trainer.lora_rank=8 on a full fine-tune: a PeftModel state_dict traceback (exit 1), and
    config.toml already held the new config, no longer describing the run's checkpoints.  model.path
    naming another model (another config.json) is refused the same way."""
    model, run_dir = run_copy
    change, needles = {
        "trainer.lora_rank": ({key: 8}, ["trainer.lora_rank=0", "this config says trainer.lora_rank=8"]),
        "model.path": ({key: small_model}, [f'model.path="{model}"', f'this config says model.path="{small_model}"']),
    }[key]
    before = digest(run_dir)
    r = agentrl(*run_args(model, run_dir, **{"trainer.steps": 3, **change}), "--resume", timeout=120)
    line = one_line_refusal(r, f"--resume: {run_dir}'s checkpoints were trained with", *needles)
    assert f"resume with the run's own config ({run_dir / 'config.toml'})" in line
    assert digest(run_dir) == before  # config.toml, checkpoints and logs as they were


def test_resume_with_the_model_moved_elsewhere_continues(run_copy, tmp_path):
    """The same model staged at another path (a job's scratch dir) is the same model: the resume goes on."""
    model, run_dir = run_copy
    moved = tmp_path / "staged" / "model"
    shutil.copytree(model, moved)
    r = agentrl(*run_args(moved, run_dir, **{"trainer.steps": 3}), "--resume", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").is_file()
    assert f'path = "{moved}"' in (run_dir / "config.toml").read_text()  # the run dir now names where it is


def test_a_checkpoint_that_does_not_load_is_one_line_and_keeps_the_run(run_copy):
    """The checkpoint's own load (the config.toml says LoRA, the checkpoint has none): a traceback before."""
    model, run_dir = run_copy
    cfg = run_dir / "config.toml"
    cfg.write_text(cfg.read_text().replace("lora_rank = 0", "lora_rank = 8"))
    before = digest(run_dir)
    before.pop("api_key")  # each start makes the run's engine key anew
    r = agentrl(*run_args(model, run_dir, **{"trainer.steps": 3, "trainer.lora_rank": 8}), "--resume", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --resume: {run_dir / 'checkpoints' / 'step_00000002'} does not match this "
                           "run's config"), r.stderr[-3000:]
    assert sum(ln.startswith("error:") for ln in r.stderr.splitlines()) == 1
    assert {k: v for k, v in digest(run_dir).items() if k != "api_key"} == before  # not rewritten, logs not cut


@pytest.mark.parametrize("where", ["afile", "afile/run"])
def test_a_run_dir_that_is_a_file_is_refused(tiny_model, tmp_path, where):
    (tmp_path / "afile").write_text("mine\n")
    r = agentrl(*run_args(tiny_model, tmp_path / where), timeout=120)
    one_line_refusal(r, f"{tmp_path / 'afile'} is a file, not a directory", "--run.dir")
    assert (tmp_path / "afile").read_text() == "mine\n"


# ----------------------------------------------------------------------------- a model with no chat template


@pytest.mark.parametrize("command", ["run", "sft"])
def test_a_model_without_a_chat_template_is_one_line_before_sft(tiny_model, tmp_path, command):
    """The SFT demonstrations were rendered with transformers' apply_chat_template: a ValueError
    traceback, where `eval` and `run --sft.enabled=false` already said it in one line."""
    model = tmp_path / "notmpl"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = run_args(model, tmp_path / "run", **{"sft.enabled": "true", "sft.steps": 2})
    r = agentrl(command, *args[1:], timeout=120)
    one_line_refusal(r, "has no chat template", f"agentrl model check-template {model}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("command", ["run", "sft"])
def test_a_model_path_of_other_files_is_never_replaced_by_a_built_model(tmp_path, command):
    """With model.init = tiny (the default), a model.path holding files but no config.json (a hub
    cache entry, a folder with only a .gguf) was deleted and a tiny model built in its place."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "precious.txt").write_text("keep\n")
    (mine / "sub" / "notes.md").write_text("keep too\n")
    before = digest(mine)
    args = run_args(mine, tmp_path / "run", **{"sft.enabled": "false"})
    one_line_refusal(agentrl(command, *args[1:], timeout=120), "holds files but no model (no config.json there)",
                     "or at a new or empty directory for model.init = 'tiny' to build a model in")
    assert digest(mine) == before
    (tmp_path / "afile").write_text("mine\n")
    args = run_args(tmp_path / "afile", tmp_path / "run", **{"sft.enabled": "false"})
    one_line_refusal(agentrl(command, *args[1:], timeout=120), "is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "mine\n" and not (tmp_path / "afile.building").exists()


# ----------------------------------------------------------------------------- agentrl model init


def test_model_init_never_writes_over_a_model_or_beside_other_files(tiny_model, tmp_path):
    """`model init tiny DIR` replaced DIR's model.safetensors, and wrote a model among other files."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    before = digest(model)
    one_line_refusal(agentrl("model", "init", "tiny", model, "--layers", "1", "--hidden", "32"),
                     f"{model} exists and is not an empty directory; pick a new one")
    assert digest(model) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep\n")
    one_line_refusal(agentrl("model", "init", "tiny", notes, "--layers", "1", "--hidden", "32"),
                     "exists and is not an empty directory")
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]


@pytest.mark.parametrize("where", ["afile", "afile/model"])
def test_model_init_into_a_file_is_refused(tmp_path, where):
    (tmp_path / "afile").write_text("mine\n")
    one_line_refusal(agentrl("model", "init", "tiny", tmp_path / where, "--layers", "1", "--hidden", "32"),
                     str(tmp_path / "afile"), "pick a new one")
    assert (tmp_path / "afile").read_text() == "mine\n"


# ----------------------------------------------------------------------------- agentrl eval -o


@pytest.mark.parametrize("where", ["afile", "afile/out"])
def test_eval_out_that_is_a_file_is_refused_before_the_engine_starts(tiny_model, tmp_path, where):
    """A FileExistsError traceback once the engine had started."""
    (tmp_path / "afile").write_text("mine\n")
    r = agentrl("eval", "calc", "-m", tiny_model, "-n", "1", "-r", "1", "-o", tmp_path / where, timeout=120)
    one_line_refusal(r, f"{tmp_path / 'afile'} is a file, not a directory; choose another --out")
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_eval_out_holding_results_is_refused_before_the_engine_starts(tiny_model, tmp_path):
    """Results without a meta.json were appended to; with one, refused only after the engine started."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"task_index": 0, "rollout": 0}\n')
    r = agentrl("eval", "calc", "-m", tiny_model, "-n", "1", "-r", "1", "-o", out, timeout=120)
    one_line_refusal(r, f"{out} already holds results; pass --resume")
    assert (out / "results.jsonl").read_text() == '{"task_index": 0, "rollout": 0}\n'
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl"]


# ----------------------------------------------------------------------------- agentrl view


@pytest.mark.parametrize("n", ["0", "-1"])
def test_view_rollouts_below_one_is_refused(trained, n):
    """--rollouts 0 printed every rollout, -1 all but the first."""
    one_line_refusal(agentrl("view", trained[1], "--rollouts", n), "--rollouts")


@pytest.mark.parametrize("tokenizer, what", [("nonexist", "does not exist"), ("empty", "holds no tokenizer.json")])
def test_view_serve_with_a_tokenizer_that_is_not_there_is_refused(trained, tmp_path, tokenizer, what):
    """It served silently, token ids shown as numbers."""
    (tmp_path / "empty").mkdir()
    r = agentrl("view", trained[1], "--serve", "--port", "0", "--tokenizer", tmp_path / tokenizer, timeout=30)
    one_line_refusal(r, f"--tokenizer {tmp_path / tokenizer} {what}")
