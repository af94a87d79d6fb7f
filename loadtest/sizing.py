#!/usr/bin/env python3
"""Resource sizing for the Kubernetes manifests: the proxy's idle RSS, its RSS after load, and its
CPU time per proxied call, measured from /proc while a closed loop of HTTP/1.1 keep-alive clients
sends Converse calls through it to an instant simulator (separate process, so its CPU is not
counted). Linux only; loopback only; bounded in calls and time.

    python3 loadtest/sizing.py target/release/tokengate [--calls 20000] [--clients 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = "us.anthropic.claude-sonnet-4-20250514-v1:0"
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def start(args: list[str], prefix: str, env: dict, stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """Starts a command (a tokengate subcommand, or one wrapping it) and waits for its `<prefix>
    listening on` line; answers the process and the address it listens on."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, env=env, text=True)
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"{prefix} listening on "):
            return proc, line.split(" listening on ", 1)[1].strip().removeprefix("http://")
        if time.monotonic() > deadline:
            break
    proc.kill()
    sys.exit(f"{prefix} did not start")


def start_instant_simulator(binary: str, tmp: str, env: dict) -> tuple[subprocess.Popen, str]:
    """A simulator that answers at once, with a quota nobody reaches, as its own process."""
    sim_config = Path(tmp, "sim.toml")
    sim_config.write_text('[server]\nlisten = "127.0.0.1:0"\n[upstream]\nregion = "us-east-1"\n'
                          'endpoint = "simulated"\n[simulator]\ntime_to_first_token_ms = 0\n'
                          'tokens_per_second = 0\ndefault_tokens_per_minute = 1000000000\n')
    return start([binary, "simulate", "--listen", "127.0.0.1:0", "--config", str(sim_config)], "simulator", env)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def client(addr: str, calls: int, errors: list[int]) -> None:
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"messages": [{"role": "user", "content": [{"text": "[sim:output=50] " + "hello " * 150}]}],
                       "inferenceConfig": {"maxTokens": 200}})
    path = f"/model/{MODEL.replace(':', '%3A')}/converse"
    for _ in range(calls):
        conn.request("POST", path, body, {"content-type": "application/json",
                                          "authorization": "AWS4-HMAC-SHA256 Credential=x/20260101/us-east-1/bedrock/aws4_request, SignedHeaders=host, Signature=0"})
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            errors.append(response.status)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=16)
    opts = parser.parse_args()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="sizing", AWS_SECRET_ACCESS_KEY="sizing",
               AWS_EC2_METADATA_DISABLED="true", RUST_LOG="warn")
    with tempfile.TemporaryDirectory() as tmp:
        sim, sim_addr = start_instant_simulator(opts.binary, tmp, env)
        proxy_config = Path(tmp, "proxy.toml")
        proxy_config.write_text(f'[server]\nlisten = "127.0.0.1:0"\n[upstream]\nregion = "us-east-1"\n'
                                f'endpoint = "http://{sim_addr}"\n[[pools]]\nname = "sonnet4-us"\n'
                                f'models = ["{MODEL}"]\ntokens_per_minute = 1000000000\nmax_concurrency = 1024\n'
                                'output_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n')
        proxy, addr = start([opts.binary, "serve", "--config", str(proxy_config)], "tokengate", env)
        try:
            time.sleep(1.0)  # let the runtime settle before the idle figure (not a readiness wait)
            idle = rss_kib(proxy.pid)
            cpu0, t0 = cpu_seconds(proxy.pid), time.monotonic()
            errors: list[int] = []
            per = opts.calls // opts.clients
            threads = [threading.Thread(target=client, args=(addr, per, errors)) for _ in range(opts.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            cpu1, t1 = cpu_seconds(proxy.pid), time.monotonic()
            calls = per * opts.clients
            print(json.dumps({
                "idle_rss_mib": round(idle / 1024, 1),
                "rss_after_load_mib": round(rss_kib(proxy.pid) / 1024, 1),
                "calls": calls, "errors": len(errors), "clients": opts.clients,
                "calls_per_s": round(calls / (t1 - t0)),
                "proxy_cpu_ms_per_call": round((cpu1 - cpu0) * 1000 / calls, 3),
                "proxy_cores_busy": round((cpu1 - cpu0) / (t1 - t0), 2),
            }))
        finally:
            for p in (proxy, sim):
                p.terminate()
                p.wait(timeout=30)


if __name__ == "__main__":
    main()
