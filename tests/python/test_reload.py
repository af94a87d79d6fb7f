"""SIGHUP reloads the config file of a running proxy: a valid file swaps the limits, an invalid
one is refused and counted while the running config stays, and the proxy keeps serving."""

from __future__ import annotations

import re
import signal
import time
import urllib.request

from conftest import HAIKU, Proxy, pool, write_config

RELOAD_TIMEOUT_S = 10.0


def metrics(proxy: Proxy) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return opener.open(f"{proxy.url}/metrics", timeout=10).read().decode()


def reloads(proxy: Proxy, result: str) -> float:
    m = re.search(rf'^tokengate_config_reloads_total\{{result="{result}"\}} (\S+)$', metrics(proxy), re.M)
    assert m, "the reload counter is exported"
    return float(m.group(1))


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def converse(proxy: Proxy) -> dict:
    return proxy.client().converse(
        modelId=HAIKU,
        messages=[{"role": "user", "content": [{"text": "[sim:output=5] hi"}]}],
        inferenceConfig={"maxTokens": 50},
    )


def test_sighup_reloads_a_valid_file_and_refuses_an_invalid_one(simulator, tmp_path):
    def write(tokens_per_minute: int):
        return write_config(tmp_path, "reload", endpoint=simulator.url,
                            pools=pool("haiku3", HAIKU, tokens_per_minute=tokens_per_minute, burndown=1))

    path = write(1_000_000)
    proxy = Proxy(path, tmp_path, "reload-proxy")
    try:
        assert proxy.pool("haiku3")["tokens_per_minute"] == 1_000_000
        converse(proxy)

        write(500_000)
        proxy.process.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: proxy.pool("haiku3")["tokens_per_minute"] == 500_000, "the new limit applies")
        assert reloads(proxy, "ok") == 1
        assert proxy.pool("haiku3")["admitted"] == 1, "the pool's counts carry over"

        path.write_text(path.read_text().replace("tokens_per_minute = 500000", "tokens_per_minute = 0"))
        proxy.process.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: reloads(proxy, "error") == 1, "the invalid file is counted")
        assert proxy.pool("haiku3")["tokens_per_minute"] == 500_000, "the running config stays"
        assert "tokens_per_minute: must be greater than zero" in proxy.process.stderr_tail(), \
            "the refusal is logged with the key at fault"
        converse(proxy)
        proxy.assert_ledger_zero()
    finally:
        proxy.stop()
