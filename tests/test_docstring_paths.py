"""Every file a docstring or comment of the package points a reader at exists in the repository
(issue 23, friction 11: docstrings named a DESIGN.md, STYLE.md and shared/reference/... it lacks)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def test_files_named_in_the_package_source_exist():
    missing = []
    for py in sorted((ROOT / "agentrl").rglob("*.py")):
        for n, line in enumerate(py.read_text().splitlines(), 1):
            for name in MENTION.findall(line):
                if not (ROOT / name).exists() and not any(ROOT.glob(f"*/{name}")):
                    missing.append(f"{py.relative_to(ROOT)}:{n}: {name}")
    assert not missing, missing
