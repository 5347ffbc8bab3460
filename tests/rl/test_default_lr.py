"""An unset learning rate follows the model: the tiny model's calibrated rates, a pretrained model's usual ones."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from agentrl.config import SFTConfig, TrainerConfig, load_config
from agentrl.tiny_model import build_family_model
from agentrl.trainer.trainer import TINY_PARAMS, Trainer, default_sft_lr, param_count
from agentrl.types import SamplingParams


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Random weights, 17M parameters: above the tiny threshold, as any pretrained model is."""
    return build_family_model(tmp_path_factory.mktemp("wide") / "m", "llama", hidden_size=512, intermediate_size=2048,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8)  # fmt: skip


def _loaded_count(model_dir) -> int:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())  # tied embeddings counted once, as stored once


def test_param_count_reads_the_headers_and_a_weightless_dir_from_its_config(tiny_model, wide_model, tmp_path):
    assert param_count(tiny_model) == _loaded_count(tiny_model) < TINY_PARAMS
    assert param_count(wide_model) == _loaded_count(wide_model) > TINY_PARAMS
    (tmp_path / "config.json").write_text((wide_model / "config.json").read_text())  # no weights: meta device
    assert param_count(tmp_path) == _loaded_count(wide_model)


@pytest.mark.parametrize(("which", "lora", "want"), [("tiny", 0, 1e-4), ("tiny", 8, 1e-4), ("wide", 0, 1e-6),
                                                     ("wide", 8, 1e-5)])  # fmt: skip
def test_an_unset_trainer_lr_is_chosen_from_the_model_and_a_set_one_is_kept(tiny_model, wide_model, which, lora, want):
    model = tiny_model if which == "tiny" else wide_model
    sampling = SamplingParams(max_tokens=8, temperature=1.0)
    trainer = Trainer(model, TrainerConfig(lora_rank=lora, num_threads=1), sampling, seed=0)
    assert trainer.lr == want and [g["lr"] for g in trainer.optimizer.param_groups] == [want]
    trainer = Trainer(model, TrainerConfig(lora_rank=lora, lr=3e-3, num_threads=1), sampling, seed=0)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [3e-3]


@pytest.mark.parametrize(("which", "lr", "want"), [("tiny", None, 1e-3), ("wide", None, 2e-5), ("wide", 3e-4, 3e-4)])
def test_the_sft_default_follows_the_model_too(tiny_model, wide_model, tmp_path, which, lr, want):
    """train_sft steps at the chosen rate (its sft_metrics.jsonl records each step's lr)."""
    from agentrl.recipes.sft import train_sft

    assert SFTConfig().lr is None and TrainerConfig().lr is None
    assert default_sft_lr(TINY_PARAMS - 1) == 1e-3 and default_sft_lr(TINY_PARAMS) == 2e-5
    model = tiny_model if which == "tiny" else wide_model
    out = train_sft(model, None, SFTConfig(steps=2, batch_size=2, lr=lr), seed=0, out_dir=tmp_path / "sft",
                    device="cpu", progress=False, data=[([5, 6, 7, 8], [0, 0, 1, 1])] * 4)  # fmt: skip
    rows = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == [want, want]  # 2 steps: warm-up of max(1, 2 // 20) = 1 step


def test_a_set_lr_survives_the_config_round_trip_and_an_unset_one_stays_unset():
    cfg = load_config([], ["--trainer.lr=5e-6"])
    assert cfg.trainer.lr == 5e-6 and load_config([], []).trainer.lr is None
    dumped = json.loads(load_config([], []).model_dump_json())
    assert dumped["trainer"]["lr"] is None and dumped["sft"]["lr"] is None
    with pytest.raises(Exception, match="trainer.lr"):
        load_config([], ["--trainer.lr=0"])
