"""agentrl.cpu_attention: sdpa attention in float32 inside CPU bf16 autocast (trainer and SFT)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl import cpu_attention


def _gqa_model():
    """A small random Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


class _AttentionDtypes(TorchDispatchMode):
    """Records the dtypes of every CPU attention kernel's query, key and value."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name():
            self.seen.append(tuple(a.dtype for a in args[:3]))
        return func(*args, **(kwargs or {}))


def _bf16_trainer(path, **fields):
    """A trainer asked for bf16 (a CPU without native bf16 is warned about; it still switches)."""
    from agentrl.config import TrainerConfig
    from agentrl.precision import EmulatedBF16Warning
    from agentrl.trainer.trainer import Trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedBF16Warning)
        return Trainer(path, TrainerConfig(dtype="bfloat16", device="cpu", **fields))


def _reference(q, k, v, visible, groups):
    """softmax(q k^T / sqrt(d) masked) v in float64, keys and values repeated per query group."""
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # [B, T, H, D] as the attention functions return


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_attention_under_autocast_matches_the_formula_in_float32(mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attn = _gqa_model().model.layers[0].self_attn
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 16, generator=gen) * 3
    k = torch.randn(2, 2, 9, 16, generator=gen) * 3
    v = torch.randn(2, 2, 9, 16, generator=gen, dtype=torch.float32).bfloat16()  # v_proj's autocast output
    visible = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].expand(2, 1, 9, 9).clone()
    visible[1, :, :, :3] = False  # row 1: a packed second sequence starting at column 3
    visible[1, :, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    mask = visible if mask_kind == "bool" else torch.where(visible, 0.0, torch.finfo(torch.bfloat16).min).bfloat16()
    want = _reference(q, k, v.float(), visible, 2)
    kw = {"dropout": 0.0, "scaling": 0.25}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = cpu_attention._attention(attn, q, k, v, mask, **kw)
        plain, _ = sdpa_attention_forward(attn, q, k, v, mask, **kw)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5
    assert (plain.double() - want).abs().max() > 1e-3  # autocast's own bf16 attention: what the test tells apart


def test_outside_autocast_it_is_the_models_own_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attn = _gqa_model().model.layers[0].self_attn
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 5, 16, generator=gen) for h in (4, 2, 2))
    got, _ = cpu_attention._attention(attn, q, k, v, None, dropout=0.0, scaling=0.25, is_causal=True)
    want, _ = sdpa_attention_forward(attn, q, k, v, None, dropout=0.0, scaling=0.25, is_causal=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("padded", [True, False])
def test_a_switched_model_runs_every_attention_in_float32_under_autocast(padded):
    model = _gqa_model()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    attn = torch.ones(2, 7, dtype=torch.long)
    if padded:
        attn[1, 5:] = 0  # a padded row: the mask builder still runs for the new name (else: no mask, is_causal)

    def run():
        rec = _AttentionDtypes()
        with torch.autocast("cpu", dtype=torch.bfloat16), rec:
            logits = model(input_ids=ids, attention_mask=attn).logits
        return rec.seen, logits

    before, logits_before = run()
    assert before and all(torch.bfloat16 in d for d in before)  # autocast's own: bf16 attention
    assert cpu_attention.float32_attention(model)
    after, logits_after = run()
    assert len(after) == len(before) == 2
    assert all(d == (torch.float32,) * 3 for d in after)
    assert (logits_after.float() - logits_before.float()).abs().max() < 0.1  # the same model, less rounding
    with torch.no_grad():  # and without autocast, exactly the model it was
        plain = model(input_ids=ids, attention_mask=attn).logits
        model.set_attn_implementation("sdpa")
        assert torch.equal(plain, model(input_ids=ids, attention_mask=attn).logits)


def test_other_attention_implementations_are_left_alone():
    model = _gqa_model()
    model.set_attn_implementation("eager")
    assert not cpu_attention.float32_attention(model)
    assert model.config._attn_implementation == "eager"


def test_the_bf16_trainer_switches_keeps_packing_and_saves_a_plain_config(tmp_path):
    from agentrl.config import TrainerConfig
    from agentrl.tiny_model import build_tiny_model
    from agentrl.trainer.trainer import Trainer

    path = build_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, vocab_size=320)
    bf16 = _bf16_trainer(path)
    assert bf16.model.config._attn_implementation == cpu_attention.NAME
    assert bf16.share_prompt  # packing still sees sdpa attention (boolean masks)
    bf16.model.save_pretrained(tmp_path / "saved")
    assert cpu_attention.NAME not in (tmp_path / "saved" / "config.json").read_text()
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "llama"
    f32 = Trainer(path, TrainerConfig(dtype="float32", device="cpu"))
    assert f32.model.config._attn_implementation == "sdpa"


def test_a_bf16_position_bias_joins_the_float32_attention():
    """A model that adds a learned bias (transformers' ``position_bias``) computes it in bf16 under autocast."""
    attn = _gqa_model().model.layers[0].self_attn
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 6, 16, generator=gen) for h in (4, 2, 2))
    bias = torch.randn(1, 4, 6, 6, generator=gen).bfloat16()
    visible = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = cpu_attention._attention(attn, q, k, v, visible, dropout=0.0, scaling=0.25, position_bias=bias)
    qq, kk, vv = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = (qq @ kk.transpose(-1, -2) * 0.25 + bias.double()).masked_fill(~visible, float("-inf"))
    want = (scores.softmax(-1) @ vv).transpose(1, 2)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-5


def test_a_model_with_a_sub_model_off_sdpa_is_left_alone():
    model = _gqa_model()
    sub = type(model.config)(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8)
    sub._attn_implementation = "eager"
    model.config.vision_config = sub  # as a multimodal config holds its tower's
    assert not cpu_attention.float32_attention(model)
    assert model.config._attn_implementation == "sdpa" and sub._attn_implementation == "eager"


def test_a_bf16_trainer_step_runs_its_attention_in_float32(tmp_path):
    """The trainer's own step (packed rows, a group's shared prompt) through the switched model."""
    from agentrl.config import LossConfig
    from agentrl.tiny_model import build_tiny_model
    from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

    path = build_tiny_model(tmp_path / "m", layers=2, hidden=64, heads=2, vocab_size=320)
    trainer = _bf16_trainer(path, lr=1e-3, loss=LossConfig(trust_low=1e-30, trust_high=1e30))
    assert trainer.share_prompt
    task = Task(prompt=[Message("user", "q")])
    group = Group(task=task)
    for r in range(4):
        s = TokenSequence()
        s.extend_forced(list(range(10, 30)))
        s.extend_sampled([40 + r, 50 + r, 60 + r], [-1.0] * 3, [0] * 3)
        group.trajectories.append(Trajectory(task=task, sequences=[s], reward=float(r % 2)))
    group.assign_advantages()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rec = _AttentionDtypes()
    with rec:
        trainer.step([group])
    assert rec.seen and all(d == (torch.float32,) * 3 for d in rec.seen)
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert any("q_proj" in n for n in moved)  # gradients flowed back through the float32 attention
