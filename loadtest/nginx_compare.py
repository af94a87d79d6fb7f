#!/usr/bin/env python3
"""Throughput beside a plain reverse proxy: the same Converse call driven by `wrk -t1 -cN` at
(1) the simulator directly, (2) nginx (one worker, a plain keep-alive reverse proxy) in front of
it, and (3) tokengate in front of it, in one run, rounds alternating so that the machine's other
load falls on all three alike. The simulator answers at once (no time to first token, instant
generation) and its quota is out of reach, so only the hop's own cost shows. Each process is its
own (the simulator, nginx, tokengate, wrk), all on this machine, loopback only. Linux; needs `wrk`
and `nginx` on PATH (Debian: `nginx-light`, `wrk`) and a release build of tokengate.

    python3 loadtest/nginx_compare.py target/release/tokengate [--seconds 10] [--rounds 3]
        [--connections 32] [--ledger memory|redis] [--no-access-log]
        [--rate 1000 [--loadgen target/debug/loadgen]] [--upstream-http http1|http2] [--keep DIR]

`--rate N` measures latency at a fixed rate instead of throughput: `loadgen pace` (a thin
open-loop HTTP/1.1 client on one core, `loadtest/src/pace.rs`) sends N calls per second to each
target in turn for `--seconds`, and the summary gives each target's latency percentiles (medians
over the rounds) and what each proxy adds over the simulator direct, per round (p50 and p99 of
the proxy minus those of the direct run just before it).

`--upstream-http http2` has tokengate speak HTTP/2 (h2c) to the simulator, as it speaks HTTP/2 to
AWS (the default, `http1`, is what nginx speaks upstream, for a like-for-like hop).

Several binaries (`LABEL=PATH ...`, e.g. a build before and after a change) are each started and
driven in turn within every round, so an A/B comparison shares the machine's load too; the
simulator is the first binary's. `serve` options may follow a path in the same argument, to compare
settings of one build: `two=PATH 'one=PATH --worker-threads 1'`.

Both proxies write one access-log line per request to a file in the run's temporary directory
(tokengate's stderr; nginx's `access_log`), as each does by default; `--no-access-log` turns off
both. `--ledger redis` starts a private `redis-server` (unix socket) for tokengate's ledger.
`--keep DIR` copies the configurations and logs there (tokengate's access log is `LABEL.log`).
It prints a JSON line per measurement and a summary: median calls/s per target and tokengate's
ratio to nginx (per round and the median), with the load average beside each. Each measurement
also gives the CPU time (user + system, from /proc) its target's process spent per call, and the
simulator's, so that the cost of a call at a fixed rate can be set beside its cost at saturation.
CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import cpu_seconds, start  # noqa: E402

MODEL = "us.anthropic.claude-sonnet-4-20250514-v1:0"
PATH = f"/model/{MODEL.replace(':', '%3A')}/converse"
BODY = json.dumps({"messages": [{"role": "user", "content": [{"text": "[sim:output=10] " + "hello " * 20}]}],
                   "inferenceConfig": {"maxTokens": 100}})
AUTH = "AWS4-HMAC-SHA256 Credential=x/20260101/us-east-1/bedrock/aws4_request, SignedHeaders=host, Signature=0"


def simulator_config() -> str:
    """The simulator made instant: no time to first token, instant generation, quota out of reach."""
    return ('[server]\nlisten = "127.0.0.1:0"\n[upstream]\nregion = "us-east-1"\nendpoint = "simulated"\n'
            '[simulator]\ntime_to_first_token_ms = 0\ntokens_per_second = 0\n'
            'default_tokens_per_minute = 1000000000\n')


def proxy_config(sim_addr: str, ledger: str, upstream_http: str = "http1") -> str:
    """tokengate in front of the simulator at `sim_addr`: one pool whose quota nobody reaches."""
    return (f'[server]\nlisten = "127.0.0.1:0"\n[upstream]\nregion = "us-east-1"\n'
            f'endpoint = "http://{sim_addr}"\nhttp = "{upstream_http}"\n{ledger}[[pools]]\nname = "sonnet4-us"\n'
            f'models = ["{MODEL}"]\ntokens_per_minute = 1000000000\nmax_concurrency = 4096\n'
            'output_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on {port}")


def start_nginx(tmp: Path, upstream: str, access_log: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = f"access_log {tmp}/nginx-access.log;" if access_log else "access_log off;"
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    {log}
    client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
    upstream simulator {{ server {upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://simulator;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
""")
    proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(tmp)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_listening(port, proc, "nginx")
    return proc, f"127.0.0.1:{port}"


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    sock = tmp / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            sys.exit("redis-server did not start")
        time.sleep(0.05)
    return proc, f"redis+unix://{sock}"


def wrk(addr: str, seconds: int, connections: int, script: Path) -> dict:
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script),
                          f"http://{addr}{PATH}"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    lat = {p: re.search(rf"^\s+{p}%\s+(\S+)", out, re.M).group(1) for p in ("50", "99")}
    return {"calls_per_s": round(rps), "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": errors.group(0) if errors else None, "latency_p50": lat["50"],
            "latency_p99": lat["99"]}


def pace(loadgen: str, addr: str, seconds: int, rate: int) -> dict:
    out = subprocess.run([loadgen, "pace", addr, "--path", PATH, "--body", BODY, "--header",
                          "authorization: " + AUTH, "--rate", str(rate), "--seconds", str(seconds)],
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    lat = r["latency_ms"] or {}
    return {"calls": r["calls"], "failed": r["failed"], "first_failure": r["first_failure"],
            "connections": r["connections_opened"], "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"),
            "p999_ms": lat.get("p999"), "send_lag_p99_ms": (r["send_lag_ms"] or {}).get("p99")}


class CpuPerCall:
    """CPU time (user + system) per call of the target's own process and of the simulator, over
    one measurement."""

    def __init__(self, pids: dict[str, int], target: str):
        self.target, self.sim = pids[target], pids["simulator"]
        self.before = (cpu_seconds(self.target), cpu_seconds(self.sim))

    def per_call(self, calls: int) -> dict:
        spent = (cpu_seconds(self.target) - self.before[0], cpu_seconds(self.sim) - self.before[1])
        us = lambda s: round(s * 1e6 / calls) if calls else None  # noqa: E731
        return {"cpu_us_per_call": us(spent[0]), "simulator_cpu_us_per_call": us(spent[1])}


def pace_rounds(targets: dict, pids: dict[str, int], proxies: list, opts) -> None:
    """Fixed-rate latency of each target, rounds alternating; the proxies' added p50 and p99."""
    results: dict[str, list[dict]] = {name: [] for name in targets}
    added: list[dict] = []
    for round_no in range(1, opts.rounds + 1):
        for name, addr in targets.items():
            load = os.getloadavg()[0]
            cpu = CpuPerCall(pids, name)
            r = pace(opts.loadgen, addr, opts.seconds, opts.rate)
            r.update(cpu.per_call(r["calls"]))
            r.update(round=round_no, target=name, load_average=round(load, 2))
            print(json.dumps(r), flush=True)
            if r["failed"]:
                sys.exit(f"{name}: failed calls in the run: {r}")
            results[name].append(r)
        direct = results["simulator"][-1]
        added.append({label: {q: round(results[label][-1][q] - direct[q], 3) for q in ("p50_ms", "p99_ms")}
                      for label in [*(label for label, _ in proxies), "nginx"]})
    median = lambda xs: round(statistics.median(xs), 3)
    print(json.dumps({
        "rate": opts.rate, "seconds": opts.seconds, "rounds": opts.rounds, "ledger": opts.ledger,
        "median_latency_ms": {name: {q: median([r[q] for r in rs]) for q in ("p50_ms", "p99_ms", "p999_ms")}
                              for name, rs in results.items()},
        "added_per_round": added,
        "added_median": {label: {q: median([a[label][q] for a in added]) for q in ("p50_ms", "p99_ms")}
                         for label in added[0]},
        "median_cpu_us_per_call": {name: median([r["cpu_us_per_call"] for r in rs])
                                   for name, rs in results.items()},
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("binary", nargs="+",
                        help="tokengate binaries, each `PATH` or `LABEL=PATH` (A/B runs alternate); "
                             "`serve` options may follow the path in the same argument: "
                             "'one=PATH --worker-threads 1'")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--ledger", choices=["memory", "redis"], default="memory")
    parser.add_argument("--no-access-log", action="store_true")
    parser.add_argument("--rate", type=int, default=0,
                        help="latency at this many calls/s (loadgen pace) instead of wrk's throughput")
    parser.add_argument("--loadgen", default="target/debug/loadgen", help="the loadgen binary, for --rate")
    parser.add_argument("--upstream-http", choices=["http1", "http2"], default="http1",
                        help="the protocol tokengate speaks to the simulator (nginx speaks HTTP/1.1)")
    parser.add_argument("--keep", help="copy the run's configurations and logs to this directory")
    opts = parser.parse_args()
    for tool in ("wrk", "nginx") if not opts.rate else ("nginx", opts.loadgen):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on PATH (Debian: apt-get install -y nginx-light wrk)")
    access_log = not opts.no_access_log
    proxies = [tuple(b.split("=", 1)) if "=" in b else ("tokengate" if len(opts.binary) == 1 else b, b)
               for b in opts.binary]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="compare", AWS_SECRET_ACCESS_KEY="compare",
               AWS_EC2_METADATA_DISABLED="true")
    env.pop("RUST_LOG", None)
    if not access_log:
        env["RUST_LOG"] = "info,tokengate::access=off"
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            script = tmp / "converse.lua"
            script.write_text(f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\n'
                              'wrk.headers["content-type"] = "application/json"\n'
                              f'wrk.headers["authorization"] = "{AUTH}"\n')
            (tmp / "sim.toml").write_text(simulator_config())
            first = shlex.split(proxies[0][1])[0]
            sim, sim_addr = start([first, "simulate", "--listen", "127.0.0.1:0", "--config", str(tmp / "sim.toml")],
                                  "simulator", env, subprocess.DEVNULL)
            procs.append(sim)
            ledger = '[ledger]\nbackend = "memory"\n'
            if opts.ledger == "redis":
                redis, url = start_redis(tmp)
                procs.append(redis)
                ledger = f'[ledger]\nbackend = "redis"\nurl = "{url}"\n'
            (tmp / "proxy.toml").write_text(proxy_config(sim_addr, ledger, opts.upstream_http))
            nginx, nginx_addr = start_nginx(tmp, sim_addr, access_log)
            procs.append(nginx)
            targets = {"simulator": sim_addr, "nginx": nginx_addr}
            pids = {"simulator": sim.pid, "nginx": nginx.pid}
            for label, binary in proxies:
                with open(tmp / f"{label}.log", "w") as log:
                    path, *serve_options = shlex.split(binary)
                    proxy, proxy_addr = start([path, "serve", "--config", str(tmp / "proxy.toml"),
                                               *serve_options], "tokengate", env, log)
                procs.append(proxy)
                targets[label] = proxy_addr
                pids[label] = proxy.pid
            if opts.rate:
                pace_rounds(targets, pids, proxies, opts)
                return
            for addr in targets.values():  # warm each path up (connections, allocator pools)
                wrk(addr, 2, opts.connections, script)
            results: dict[str, list[int]] = {name: [] for name in targets}
            cpu_per_call: dict[str, list[int]] = {name: [] for name in targets}
            ratios = []
            for round_no in range(1, opts.rounds + 1):
                for name, addr in targets.items():
                    load = os.getloadavg()[0]
                    cpu = CpuPerCall(pids, name)
                    r = wrk(addr, opts.seconds, opts.connections, script)
                    r.update(cpu.per_call(r["calls_per_s"] * opts.seconds))
                    r.update(round=round_no, target=name, load_average=round(load, 2))
                    print(json.dumps(r), flush=True)
                    if r["non_2xx"] or r["socket_errors"]:
                        sys.exit(f"{name}: errors in the run: {r}")
                    results[name].append(r["calls_per_s"])
                    cpu_per_call[name].append(r["cpu_us_per_call"])
                ratios.append({label: round(results[label][-1] / results["nginx"][-1], 3)
                               for label, _ in proxies})
            summary = {name: statistics.median(v) for name, v in results.items()}
            print(json.dumps({
                "connections": opts.connections, "seconds": opts.seconds, "rounds": opts.rounds,
                "ledger": opts.ledger, "access_log": access_log,
                "median_calls_per_s": summary,
                "median_cpu_us_per_call": {name: statistics.median(c) for name, c in cpu_per_call.items()},
                "over_nginx_per_round": ratios,
                "over_nginx_median": {label: round(statistics.median(r[label] for r in ratios), 3)
                                      for label, _ in proxies},
                "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            }))
        finally:
            for p in reversed(procs):
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            if opts.keep:  # the proxies' logs (tokengate's access log has its own latency_ms)
                shutil.copytree(tmp, opts.keep, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.sock", "body", "proxy", "fcgi", "uwsgi", "scgi"))


if __name__ == "__main__":
    main()
