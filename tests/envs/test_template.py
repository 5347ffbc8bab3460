"""Prefix stability of chat templates: the checker and `agentrl model check-template`."""

import subprocess
import sys

import pytest
from chat_families import template

from agentrl.envs.template import check_template
from agentrl.tiny_model import build_tokenizer

# Qwen3-like: thinking is dropped from assistant turns that precede the last user message.
STRIPPING = template("qwen3_stripping").rstrip("\n")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    good = build_tokenizer()
    good.save_pretrained(root / "good")
    good.chat_template = STRIPPING
    good.save_pretrained(root / "stripping")
    return root


def test_tiny_template_is_prefix_stable(tokenizers):
    from transformers import AutoTokenizer

    report = check_template(AutoTokenizer.from_pretrained(tokenizers / "good"))
    assert report.prefix_stable and report.end_of_turn == "<|im_end|>"
    assert {c.conversation for c in report.checks} == {"chat", "tools", "thinking"}


def test_history_rewriting_template_is_reported(tokenizers):
    from transformers import AutoTokenizer

    report = check_template(AutoTokenizer.from_pretrained(tokenizers / "stripping"))
    assert not report.prefix_stable
    broken = {c.conversation for c in report.checks if not c.ok}
    assert broken == {"thinking"}
    assert all("re-rendered differently" in c.detail for c in report.checks if not c.ok)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_exit_codes(tokenizers, tmp_path):
    ok = cli("model", "check-template", str(tokenizers / "good"))
    assert ok.returncode == 0 and "prefix-stable" in ok.stdout
    bad = cli("model", "check-template", str(tokenizers / "stripping"))
    assert bad.returncode == 1 and "NOT prefix-stable" in bad.stdout
    missing = cli("model", "check-template", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("error:") and "Traceback" not in missing.stderr


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_each_family_template_is_prefix_stable_and_its_calls_parse_back(family):
    from chat_families import family_tokenizer

    from agentrl.envs.template import check_tool_format

    tok = family_tokenizer(family)
    assert check_template(tok).prefix_stable
    fmt = check_tool_format(tok)
    assert fmt.ok and fmt.parser == fmt.detected == family
    wrong = check_tool_format(tok, "pythonic" if family != "pythonic" else "hermes")
    assert not wrong.ok and "parsed []" in wrong.detail


@pytest.mark.slow
def test_cli_names_the_tool_parser(tmp_path):
    from chat_families import family_tokenizer

    family_tokenizer("llama3_json").save_pretrained(tmp_path / "llama")
    ok = cli("model", "check-template", str(tmp_path / "llama"))
    assert ok.returncode == 0 and "tool-call parser llama3_json (detected): ok" in ok.stdout, ok.stdout + ok.stderr
    forced = cli("model", "check-template", str(tmp_path / "llama"), "--tool-parser", "hermes")
    assert forced.returncode == 1 and "tool-call parser hermes (given): FAIL" in forced.stdout
