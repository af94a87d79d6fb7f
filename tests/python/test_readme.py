"""The README's Python snippets ("Try it": boto3, the openai SDK, the anthropic SDK) work as
written against the shipped local config."""

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


def readme_python_snippets(text: str) -> list[str]:
    """Every ```python block of the "Try it" section (up to the next `## ` heading)."""
    heading = re.search(r"^##\s*Try it\b.*$", text, re.MULTILINE)
    if not heading:
        return []
    end = re.search(r"^## ", text[heading.end():], re.MULTILINE)
    section = text[heading.end(): heading.end() + end.start()] if end else text[heading.end():]
    return [m.group(1) for m in PYTHON_BLOCK.finditer(section)]


def local_config_on_port_zero(directory) -> Path:
    """config/local.toml, copied, with only its listen address changed to 127.0.0.1:0."""
    text = LOCAL_CONFIG.read_text()
    rewritten, n = re.subn(r'(?m)^listen\s*=\s*"[^"]*"', 'listen = "127.0.0.1:0"', text)
    assert n == 1, "config/local.toml has exactly one listen line"
    path = directory / "local.toml"
    path.write_text(rewritten)
    return path


def test_readme_python_snippets_run_against_local_config(tmp_path):
    """Each Python block of README.md's "Try it" section (boto3; openai Chat Completions and
    Responses; anthropic Messages and AnthropicBedrock), pointed at a proxy started from
    config/local.toml (the built-in simulator behind it), runs with the suite's Python and prints
    the answers: exit 0 and non-empty output."""
    snippets = readme_python_snippets(README.read_text()) if README.is_file() else []
    if not snippets:
        pytest.skip("README has no python snippet under Try it")
    assert len(snippets) >= 3, "boto3, openai and anthropic snippets"
    for snippet in snippets:
        assert DOCUMENTED_ENDPOINT in snippet, \
            f"the snippet targets {DOCUMENTED_ENDPOINT}, as config/local.toml listens there"

    proxy = Proxy(local_config_on_port_zero(tmp_path), tmp_path, "local-proxy")
    try:
        for i, snippet in enumerate(snippets):
            script = tmp_path / f"snippet{i}.py"
            script.write_text(snippet.replace(DOCUMENTED_ENDPOINT, proxy.url))
            run = subprocess.run(
                [sys.executable, str(script)], capture_output=True, text=True,
                timeout=SNIPPET_TIMEOUT_S, cwd=tmp_path,
            )
            assert run.returncode == 0, f"snippet {i} failed:\n{run.stdout}\n{run.stderr}"
            assert run.stdout.strip(), f"snippet {i} printed nothing"
        proxy.assert_ledger_zero()
    finally:
        proxy.stop()
