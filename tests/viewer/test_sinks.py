"""Metric sinks behind the logger protocol: TensorBoard (from a real run with
``metrics.tensorboard = true``), W&B offline (no network), the fan-out, and the config."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.metrics import JSONLLogger, TeeLogger, UnknownMetric, open_metrics_logger, read_jsonl


def test_tensorboard_holds_trainer_and_rollout_metrics_of_the_run(real_run, steps):
    event_acc = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_acc.EventAccumulator(str(real_run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # trainer, rollout, buffer and ledger metrics side by side, under their schema names
    assert {"train/loss", "train/mismatch_kl", "rollout/tokens_per_s", "buffer/staleness_mean",
            "ledger/trained", "eval/reward_mean"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(steps))
    rows = read_jsonl(real_run / "metrics.jsonl")
    assert [e.value for e in loss] == pytest.approx([r["train/loss"] for r in rows], rel=1e-6)
    assert "buffer/adaptive_reason" not in tags and "step" not in tags  # strings and the x axis stay out


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config([], {"metrics": {"wandb": True, "wandb_project": "agentrl-test"}})
    assert cfg.metrics.wandb_mode == "offline"
    logger = open_metrics_logger(tmp_path, cfg.metrics, {"trainer": {"lr": 1e-3}})
    assert isinstance(logger, TeeLogger)
    logger.log({"step": 0, "train/loss": 1.5, "rollout/reward_mean": 0.25, "buffer/adaptive_reason": "init"})
    logger.log({"step": 1, "train/loss": 1.0, "rollout/reward_mean": None})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_fan_out_checks_names_before_any_sink_sees_them(tmp_path):
    seen = []

    class Sink:
        def log(self, row):
            seen.append(row)

        def close(self):
            pass

    tee = TeeLogger([JSONLLogger(tmp_path / "m.jsonl", schema=True), Sink()])
    tee.log({"step": 0, "train/loss": 1.0})
    with pytest.raises(UnknownMetric):
        tee.log({"step": 1, "train/made_up": 1.0})
    tee.close()
    assert seen == [{"step": 0, "train/loss": 1.0}]


def test_only_jsonl_by_default_and_config_errors(tmp_path):
    logger = open_metrics_logger(tmp_path, load_config([], []).metrics)
    assert isinstance(logger, JSONLLogger)
    logger.close()
    with pytest.raises(ConfigError, match="metrics.wandb_mode"):
        load_config([], ["--metrics.wandb_mode=cloud"])
    with pytest.raises(ConfigError, match="unknown key 'metrics.mlflow'"):
        load_config([], ["--metrics.mlflow=true"])
