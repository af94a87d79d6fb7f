"""The README's Python snippet works as written against the shipped local config."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, Proxy

README = REPO_ROOT / "README.md"
LOCAL_CONFIG = REPO_ROOT / "config" / "local.toml"
DOCUMENTED_ENDPOINT = "http://127.0.0.1:8080"
SNIPPET_TIMEOUT_S = 120

PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_python_snippet(text: str) -> str | None:
    """The first ```python block under the "Try it" heading, else the first in the file."""
    heading = re.search(r"^#+\s*Try it\b.*$", text, re.MULTILINE)
    if heading:
        block = PYTHON_BLOCK.search(text, heading.end())
        if block:
            return block.group(1)
    block = PYTHON_BLOCK.search(text)
    return block.group(1) if block else None


def local_config_on_port_zero(directory) -> Path:
    """config/local.toml, copied, with only its listen address changed to 127.0.0.1:0."""
    text = LOCAL_CONFIG.read_text()
    rewritten, n = re.subn(r'(?m)^listen\s*=\s*"[^"]*"', 'listen = "127.0.0.1:0"', text)
    assert n == 1, "config/local.toml has exactly one listen line"
    path = directory / "local.toml"
    path.write_text(rewritten)
    return path


def test_readme_python_snippet_runs_against_local_config(tmp_path):
    """The first Python block of README.md ("Try it"), pointed at a proxy started from
    config/local.toml (the built-in simulator behind it), runs with the suite's Python and
    prints the answer: exit 0 and non-empty output."""
    snippet = readme_python_snippet(README.read_text()) if README.is_file() else None
    if snippet is None:
        pytest.skip("README has no python snippet")
    assert DOCUMENTED_ENDPOINT in snippet, \
        f"the snippet targets {DOCUMENTED_ENDPOINT}, as config/local.toml listens there"

    proxy = Proxy(local_config_on_port_zero(tmp_path), tmp_path, "local-proxy")
    try:
        script = tmp_path / "snippet.py"
        script.write_text(snippet.replace(DOCUMENTED_ENDPOINT, proxy.url))
        run = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True,
            timeout=SNIPPET_TIMEOUT_S, cwd=tmp_path,
        )
        assert run.returncode == 0, f"snippet failed:\n{run.stdout}\n{run.stderr}"
        assert run.stdout.strip(), "the snippet printed nothing"
        proxy.assert_ledger_zero()
    finally:
        proxy.stop()
