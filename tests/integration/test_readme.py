"""The README's quick start runs as written (it is the first thing a user copies)."""

import os
import re

from paths import ROOT

README = os.path.join(str(ROOT), "README.md")


def test_quick_start_runs():
    text = open(README, encoding="utf-8").read()
    block = re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S)
    assert block, "README has no python quick start block"
    exec(compile(block.group(1), "README.md quick start", "exec"), {})


def test_readme_names_the_two_commands():
    text = open(README, encoding="utf-8").read()
    ci = open(os.path.join(os.path.dirname(README), ".ci", "run"), encoding="utf-8").read()
    assert "python3 -m pytest -q -n 2 tests" in text and "python3 -m pytest -q -n 2 tests" in ci
    assert "python3 -m kvstore.demo" in text


def test_testing_example_runs():
    """The kvstore.testing example (a real daemon for users' tests) runs as written."""
    text = open(README, encoding="utf-8").read()
    block = re.search(r"```python\n(from kvstore\.testing\.daemon import Daemon\n.*?)```", text, re.S)
    assert block, "README has no kvstore.testing example"
    exec(compile(block.group(1), "README.md kvstore.testing example", "exec"), {})
