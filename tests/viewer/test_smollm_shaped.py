"""The viewer and `agentrl plot` on a run shaped like a short SmolLM2 one (examples/smollm.toml
stopped by its wall budget after one step): a byte-level BPE tokenizer that splits characters
outside ASCII over several tokens, ChatML special tokens, a Hermes ``<tool_call>`` written as
plain text, one trainer step, and a warm-start eval that only eval_rollouts.jsonl holds (a
metrics row carries one eval, and the first step's row carries the final one).

The run directory is written here, small: the tokenizer (bytes, one merge, the specials) and
a few episodes whose token ids come from it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from agentrl.plot import plot_run
from agentrl.viewer.data import RunView, token_texts
from agentrl.viewer.server import ViewerServer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n"
          "You can call these tools:\n<tools>\n"
          '{"name": "calculator", "description": "Evaluate an arithmetic expression.", "parameters": '
          '{"properties": {"expression": {"type": "string"}}, "required": ["expression"], "type": "object"}}\n'
          "</tools><|im_end|>\n")
QUESTION = "What is √16 × π?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "sqrt(16)*pi"}}\n</tool_call><|im_end|>'
TOOL = "\n<|im_start|>tool\n<tool_response>\n12.566\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
ANSWER = "≈ 12.57 🙂<|im_end|>"


def _tokenizer():
    """Byte-level BPE like SmolLM2's: every byte a token, one merge (a space with the first byte of
    'π', so ' π' is a space-led partial token plus one byte), ChatML specials; '<tool_call>' is text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    space, pi0 = "Ġ", _byte_char(0xCF)
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab[space + pi0] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(space, pi0)]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def _byte_char(b: int) -> str:
    """The printable character GPT-2's byte-level alphabet uses for byte ``b``."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in keep:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in keep].index(b))


def _episode(tok, eid: str, question: str, parts: list[tuple[str, int]], messages: list[dict], reward: float,
             **extra) -> dict:
    ids, mask = [], []
    for text, sampled in parts:
        got = tok.encode(text).ids
        ids += got
        mask += [sampled] * len(got)
    return {
        "id": eid, "group_id": "grp_0", "task": {"id": f"task_{eid}", "prompt": [{"role": "user", "content": question}],
                                                 "answer": 12.57},
        "messages": [{"role": "user", "content": question}, *messages], "reward": reward, "advantage": 0.5,
        "sequences": [{"token_ids": ids, "loss_mask": mask, "logprobs": [-0.2 if m else 0.0 for m in mask],
                       "versions": [0] * len(ids)}],
        "stop_reason": "done", "turns": [], "error": None, "error_kind": None, **extra,
    }


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("smollm-shaped") / "r4"
    (run / "final").mkdir(parents=True)
    tok = _tokenizer()
    tok.save(str(run / "final" / "tokenizer.json"))
    (run / "config.toml").write_text('[run]\nname = "smollm"\n[model]\npath = "runs/models/smollm2-135m"\n'
                                     "[trainer]\nsteps = 200\n")
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "sqrt(16)*pi"}'}}]}
    tools_episode = [call, {"role": "tool", "content": "12.566", "tool_call_id": "call_1_0", "name": "calculator"},
                     {"role": "assistant", "content": "≈ 12.57 🙂"}]
    prompt = SYSTEM + f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    with_tool = _episode(tok, "ep_tool", QUESTION, [(prompt, 0), (CALL, 1), (TOOL, 0), (ANSWER, 1)], tools_episode, 1.0)
    direct = _episode(tok, "ep_direct", "What is 2+2?", [(SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                                                          "<|im_start|>assistant\n", 0), ("5<|im_end|>", 1)],
                      [{"role": "assistant", "content": "5"}], 0.0)
    (run / "rollouts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (with_tool, direct)))
    (run / "ledger.jsonl").write_text("".join(json.dumps({"id": e, "group": "grp_0", "task": "t", "fate": "trained",
                                                           "step": 0}) + "\n" for e in ("ep_tool", "ep_direct")))
    # held-out: 0.5 at the warm start (version 0), 1.0 after the one step; only version 1 is in metrics.jsonl
    evals = [dict(with_tool, id=f"ev{v}{i}", eval_version=v, reward=float(v or i), advantage=None)
             for v in (0, 1) for i in (0, 1)]
    (run / "eval_rollouts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    (run / "metrics.jsonl").write_text(json.dumps({
        "step": 0, "version": 1, "rollout/reward_mean": 0.375, "train/reward_mean": 0.4375, "train/mismatch_kl": 6.6e-4,
        "train/masked_frac": 0.0, "train/clip_frac": 0.0, "train/ess": 0.9986, "rollout/tokens_per_s": 5.5,
        "train/idle_frac": 0.41, "weights/push_s": 4.0, "buffer/staleness_mean": 0.0, "buffer/staleness_max": 0,
        "buffer/max_staleness": 1, "ledger/started": 2, "ledger/trained": 2, "ledger/in_flight": 0,
        "eval/reward_mean": 1.0, "eval/version": 1}) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 200, "version": 1}))
    return run


def test_token_text_keeps_characters_split_over_tokens(smol_run):
    view = RunView(smol_run)
    tok = view.tokenizer()
    ep = view.episode("ep_tool")
    (seq,) = ep["sequences"]
    whole = tok.decode(seq["ids"], skip_special_tokens=False)
    assert "".join(seq["text"]) == whole  # nothing lost, nothing doubled
    assert "√16 × π" in whole and "🙂" in whole
    assert not any("\ufffd" in t for t in seq["text"]), [t for t in seq["text"] if "\ufffd" in t]
    # the token that completes a character carries all of it (a space-led one keeps its space);
    # the tokens before it carry nothing
    for char in ("√", " π", "🙂", "≈"):
        assert char in seq["text"], char
    assert seq["text"].count("") == 2 + 1 + 1 + 2 + 3  # the first bytes of √ × π ≈ 🙂
    assert {"<|im_start|>", "<|im_end|>"} <= set(seq["text"])  # specials are one token, as text
    sampled = "".join(t for t, m in zip(seq["text"], seq["mask"], strict=True) if m)
    assert sampled == CALL + ANSWER  # the Hermes call is shown as the model wrote it


def test_broken_bytes_stay_on_their_own_token(smol_run):
    """A sampled first byte that nothing completes is U+FFFD on that token, not on the next one."""
    tok = RunView(smol_run).tokenizer()
    lead = tok.encode("√").ids[0]
    ids = [lead, *tok.encode("<|im_end|>x").ids, lead]
    texts = token_texts(tok, ids)
    assert texts == ["\ufffd", "<|im_end|>", "x", "\ufffd"]
    assert "".join(texts) == tok.decode(ids, skip_special_tokens=False)


def test_plot_of_a_one_step_run_shows_its_points(smol_run, tmp_path):
    out = tmp_path / "curves.png"
    result = plot_run(smol_run, out)
    panels = {p["id"]: p["series"] for p in result["panels"]}
    assert result["steps"] == 1
    assert panels["reward"]["held-out eval"] == 2  # the warm-start eval comes from eval_rollouts.jsonl
    assert panels["mismatch_kl"] == {"mismatch KL": 1}
    img = np.asarray(Image.open(out).convert("RGB")).astype(int)
    for colour in ("#9467bd", "#e377c2", "#17becf", "#ff7f0e"):  # KL, ESS, tokens/s, push: one point each
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(img - rgb).sum(axis=-1) < 40).sum() > 10, f"{colour}: a one-point series is not drawn"


def test_viewer_shows_the_episode_and_the_one_step_curves(smol_run, page, tmp_path):
    with ViewerServer(smol_run) as srv:
        page.goto(srv.login_url)
        page.wait_for_function("document.querySelector('#status').textContent.includes('finished')")
        # one step: each series is a dot; the eval has two (0.5 at the warm start, 1.0 after)
        for chart in ("mismatch_kl", "ess", "tokens_per_s", "push"):
            assert page.locator(f"svg[data-chart={chart}] circle").count() == 1, chart
            # a single value sits at mid-height, between the axis ends, not on the x axis
            cy, top, bottom = page.evaluate(f"""() => {{ const svg = document.querySelector('svg[data-chart={chart}]');
                const axis = [...svg.querySelectorAll('line.axis')].find(l => l.getAttribute('x1') === l.getAttribute('x2'));
                return [+svg.querySelector('circle').getAttribute('cy'), +axis.getAttribute('y1'), +axis.getAttribute('y2')]; }}""")
            assert abs(cy - (top + bottom) / 2) < 0.1 * (bottom - top), (chart, cy, top, bottom)
        eval_dots = page.eval_on_selector_all("svg[data-chart=reward] circle[fill='#d62728']",
                                              "els => els.map(e => +e.getAttribute('cy'))")
        assert len(eval_dots) == 2 and eval_dots[0] > eval_dots[1]  # 0.5 is drawn lower than 1.0
        page.screenshot(path=str(tmp_path / "smollm-curves.png"))

        page.click("nav button[data-tab=episodes]")
        page.click("#episodes tbody tr[data-id='ep_tool']")
        page.wait_for_selector("#detail .tok.sampled")
        assert "calculator" in page.locator("#detail .tool-call").first.text_content()
        assert "≈ 12.57 🙂" in page.locator("#detail .msg.assistant").last.text_content()
        tokens = page.locator("#detail .tokens").first.text_content()
        assert "\ufffd" not in tokens and "√16 × π" in tokens and "<tool_call>" in tokens
        assert page.locator("#detail .tok.part").count() >= 9  # first bytes of √ π 🙂 ≈, shown as such
        assert "character" in page.locator("#detail .tok.part").first.get_attribute("title")
        page.screenshot(path=str(tmp_path / "smollm-episode.png"))
