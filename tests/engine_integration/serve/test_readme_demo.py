"""The README's `hicache demo` section and the demo agree on every setting both state: users,
turns, the attention plan and its replay length, the L1 and L2 pages, the page size, the
L3 directory's cap, the thread count. (The README said 12 and 16 pages while the demo used
10 and 12.)"""

from __future__ import annotations

import re
from pathlib import Path

from engine_integration.serve.demo_config import DemoConfig
from engine_integration.serve.demo_runner import DEFAULT_PAGES, DEFAULT_WINDOW_LAYERS

ROOT = Path(__file__).resolve().parents[3]


def demo_section() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## `hicache demo`", 1)[1].split("\n## ", 1)[0]
    return " ".join(section.split())  # one line: the README wraps sentences anywhere


def number(pattern: str, text: str) -> int:
    found = re.findall(pattern, text)
    assert len(found) == 1, (pattern, found)
    return int(found[0])


def test_the_readme_states_the_demos_defaults():
    text, d = demo_section(), DemoConfig()
    assert number(r"(\d+) users ask real questions", text) == d.users
    assert number(r"(\d+) turns each", text) == d.turns
    assert number(r"--window-layers (\d+) --window \d+", text) == DEFAULT_WINDOW_LAYERS
    assert number(r"--window-layers \d+ --window (\d+)", text) == d.window
    assert number(r"its last (\d+) layers attend", text) == DEFAULT_WINDOW_LAYERS
    assert number(r"over a (\d+)-token sliding window", text) == d.window
    replay = DEFAULT_WINDOW_LAYERS * (d.window - 1) + 1
    assert number(r"K \* \(W - 1\) \+ 1 = (\d+) prompt positions", text) == replay
    l1_pages, l2_pages = DEFAULT_PAGES["checkpoint"]  # the README's demo runs SmolLM2
    assert number(r"L1 is kept small \((\d+) pages", text) == l1_pages * d.concurrency
    assert number(r"L1 is kept small \(\d+ pages of (\d+) tokens\)", text) == d.page_size
    assert number(r"spill to L2 \((\d+) pages of host memory\)", text) == l2_pages * d.concurrency
    assert f"({d.l3_capacity.replace('MiB', ' MiB')} at most)" in text
    assert number(r"a first run, (\d+) thread", text) == d.threads
