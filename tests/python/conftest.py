"""Fixtures for the boto3 compatibility suite: the simulator and the proxy as real processes.

Every process listens on 127.0.0.1:0 and announces its address on stdout; fixtures read that line
(bounded wait, no fixed sleeps), and stop the process with SIGTERM at teardown. The proxy must then
exit 0 (it drains gracefully). Nothing here talks to anything but loopback.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

REPO_ROOT = Path(__file__).resolve().parents[2]

HAIKU = "anthropic.claude-3-haiku-20240307-v1:0"
SONNET_US = "us.anthropic.claude-sonnet-4-20250514-v1:0"
SONNET_US_ARN = (
    "arn:aws:bedrock:us-east-1:123456789012:inference-profile/"
    "us.anthropic.claude-sonnet-4-20250514-v1:0"
)

# The simulator most tests use: instant answers, a quota far above anything the tests send.
FAST_SIMULATOR = """
time_to_first_token_ms = 0
tokens_per_second = 0
default_tokens_per_minute = 10000000
"""

START_TIMEOUT_S = 60.0  # generous: a loaded 2-core machine
STOP_TIMEOUT_S = 30.0
LEDGER_TIMEOUT_S = 10.0

# No network but loopback: no instance metadata, no proxies, no ambient AWS identity or bearer key
# (boto3 >= 1.44 would pick up AWS_BEARER_TOKEN_BEDROCK and refuse it over plain HTTP).
for _name in [n for n in os.environ if n.startswith("AWS_")]:
    del os.environ[_name]
for _name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

_LOOPBACK_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def tokengate_bin() -> Path:
    """The binary under test: $TOKENGATE_BIN, else target/debug/tokengate in the repo."""
    path = Path(os.environ.get("TOKENGATE_BIN", REPO_ROOT / "target" / "debug" / "tokengate"))
    if not path.is_file():
        pytest.fail(f"tokengate binary not found at {path}: build it or set TOKENGATE_BIN")
    return path


def process_env() -> dict[str, str]:
    """Environment for child processes: the proxy's own (fake) AWS credentials, loopback only."""
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID="AKIATOKENGATEPROXY01",
        AWS_SECRET_ACCESS_KEY="proxy-secret-key",
        AWS_EC2_METADATA_DISABLED="true",
        NO_COLOR="1",
    )
    return env


def http_json(url: str, timeout: float = 10.0) -> dict:
    """GET a JSON document over loopback."""
    with _LOOPBACK_OPENER.open(url, timeout=timeout) as response:
        return json.load(response)


def bedrock_client(endpoint_url: str, max_attempts: int = 1):
    """A boto3 bedrock-runtime client for `endpoint_url`, standard retry mode, making at most
    `max_attempts` attempts in all. (botocore's `retries.max_attempts` counts retries, not
    attempts: `max_attempts: 1` means two attempts; `total_max_attempts` counts attempts.)"""
    return boto3.client(
        "bedrock-runtime",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=Config(
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            connect_timeout=10,
            read_timeout=60,
        ),
    )


class Process:
    """A tokengate child process whose stdout announces addresses, one `... listening on URL` line each."""

    def __init__(self, args: list[str], workdir: Path, name: str, *, env: dict[str, str] | None = None,
                 cwd: Path | None = None, preexec_fn=None):
        self.name = name
        self.stderr_path = workdir / f"{name}.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.popen = subprocess.Popen(
            [str(tokengate_bin()), *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=process_env() if env is None else env,
            cwd=cwd,
            preexec_fn=preexec_fn,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self._lines.put(raw.decode("utf-8", "replace").strip())
        self._lines.put(None)

    def stderr_tail(self, n: int = 30) -> str:
        self._stderr.flush()
        lines = self.stderr_path.read_text("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_for_address(self, prefix: str) -> str:
        """The URL from the stdout line `{prefix} listening on URL`, waiting at most START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                pytest.fail(f"{self.name}: no '{prefix} listening on' line\n{self.stderr_tail()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                rc = self.popen.wait()
                pytest.fail(f"{self.name} exited ({rc}) before listening\n{self.stderr_tail()}")
            if line.startswith(f"{prefix} listening on "):
                return line.split(" listening on ", 1)[1].strip()

    def stop(self) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            rc = self.popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -9
        self._stderr.close()
        return rc

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def write_config(workdir: Path, name: str, *, endpoint: str, pools: str = "", extra: str = "") -> Path:
    """A complete config file: proxy on 127.0.0.1:0, region us-east-1, the given upstream."""
    text = (
        '[server]\nlisten = "127.0.0.1:0"\n\n'
        f'[upstream]\nregion = "us-east-1"\nendpoint = "{endpoint}"\n\n'
        '[log]\nformat = "text"\nlevel = "info"\n\n'
        f"{extra}\n\n{pools}\n"
    )
    path = workdir / f"{name}.toml"
    path.write_text(text)
    return path


def pool(name: str, model: str, *, tokens_per_minute: int, burndown: int,
         max_concurrency: int = 16, default_max_tokens: int = 500, max_wait_ms: int = 0,
         extra: str = "") -> str:
    """One `[[pools]]` table. Queueing is off unless asked for (`max_wait_ms`), so that tests of
    rejections see them at once."""
    return (
        f'[[pools]]\nname = "{name}"\nmodels = ["{model}"]\n'
        f"tokens_per_minute = {tokens_per_minute}\nmax_concurrency = {max_concurrency}\n"
        f"output_burndown = {burndown}\ndefault_max_tokens = {default_max_tokens}\n"
        f"max_wait_ms = {max_wait_ms}\n{extra}\n"
    )


class Simulator:
    """`tokengate simulate` on an ephemeral port."""

    def __init__(self, workdir: Path, simulator_toml: str):
        config = write_config(workdir, "simulator", endpoint="simulated",
                              extra=f"[simulator]\n{simulator_toml}")
        self.process = Process(["simulate", "--listen", "127.0.0.1:0", "--config", str(config)],
                               workdir, "simulator")
        self.url = self.process.wait_for_address("simulator")

    def client(self, max_attempts: int = 1):
        return bedrock_client(self.url, max_attempts)

    def stats(self) -> dict:
        return http_json(f"{self.url}/_sim/stats")


class Proxy:
    """`tokengate serve` on an ephemeral port."""

    def __init__(self, config_path: Path, workdir: Path, name: str = "proxy"):
        self.process = Process(["serve", "--config", str(config_path)], workdir, name)
        self.url = self.process.wait_for_address("tokengate")

    def client(self, max_attempts: int = 1):
        return bedrock_client(self.url, max_attempts)

    def pools(self) -> dict:
        return http_json(f"{self.url}/v1/pools")

    def pool(self, name: str) -> dict:
        return next(p for p in self.pools()["pools"] if p["name"] == name)

    def assert_ledger_zero(self) -> None:
        """Polls (bounded) until no pool holds a reservation or a permit, then asserts it, and that
        no reservation was ever dropped unsettled."""
        deadline = time.monotonic() + LEDGER_TIMEOUT_S
        while True:
            state = self.pools()
            busy = [
                (p["name"], p["ledger"]["reserved_tokens"], p["ledger"]["in_flight_requests"])
                for p in state["pools"]
                if p.get("ledger")
                and (p["ledger"]["reserved_tokens"] != 0 or p["ledger"]["in_flight_requests"] != 0)
            ]
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert busy == [], f"ledger did not return to zero: {busy}"
        assert state["unsettled_reservations"] == 0, "a reservation was dropped unsettled"

    def stop(self) -> None:
        rc = self.process.stop()
        assert rc == 0, f"proxy exited {rc} on SIGTERM\n{self.process.stderr_tail()}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (CI=true, which .ci/run sets) a skipped test is a failure: CI must run every
    test, so a missing tool there has to show. Elsewhere skips stay skips, named by `-rs`."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, and CI runs every test: {reason}"


@pytest.fixture(scope="session")
def session_dir():
    with tempfile.TemporaryDirectory(prefix="tokengate-py-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def simulator(session_dir):
    """One fast simulator for the whole session."""
    sim = Simulator(session_dir, FAST_SIMULATOR)
    yield sim
    sim.process.stop()


@pytest.fixture(scope="session")
def proxy(simulator, session_dir):
    """The proxy in front of the fast simulator, with pools for Sonnet 4 (`us.` profile,
    burndown 5) and Claude 3 Haiku (on demand, burndown 1)."""
    pools = (
        pool("sonnet4-us", SONNET_US, tokens_per_minute=1_000_000, burndown=5)
        + pool("haiku3", HAIKU, tokens_per_minute=1_000_000, burndown=1)
    )
    config = write_config(session_dir, "proxy", endpoint=simulator.url, pools=pools)
    p = Proxy(config, session_dir)
    yield p
    p.stop()


@pytest.fixture
def start_proxy(simulator, tmp_path):
    """Starts a dedicated proxy with the given `[[pools]]` (and optional extra tables) in front of
    the fast simulator, or of `endpoint` (e.g. "simulated" with a `[simulator]` table in `extra`);
    each one is stopped at teardown and must exit 0."""
    started: list[Proxy] = []

    def start(pools: str, extra: str = "", endpoint: str | None = None) -> Proxy:
        name = f"proxy{len(started)}"
        config = write_config(tmp_path, name, endpoint=endpoint or simulator.url, pools=pools,
                              extra=extra)
        p = Proxy(config, tmp_path, name)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def python_executable() -> str:
    """The interpreter running this suite (the project's .venv under scripts/test.sh)."""
    return sys.executable
