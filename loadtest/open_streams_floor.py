#!/usr/bin/env python3
"""What 2,000 open streams cost a server that does nothing else, beside what they cost tokengate.

Opens N ConverseStream calls that stall half-way (raw HTTP/1.1, one connection each, the way an
SDK holds a stream) first at the simulator itself, then at tokengate in front of the simulator
(each `upstream.http` asked for), and reads each process's RSS from /proc once every response's
first bytes are in. The simulator is the floor: the same server stack as tokengate's listener
(hyper's HTTP/1.1 server under axum, tokio, the allocator), holding the same streams, with nothing
of tokengate's per call (no upstream connection, no reservation, no metering). Each process is its
own; loopback only; Linux.

    python3 loadtest/open_streams_floor.py target/release/tokengate [--streams 2000] [--at-once 200] [--http http2 http1]

It prints one JSON line per process: idle RSS, RSS with the streams open, and KiB per stream.

`--waiting` holds N Converse calls still waiting for their answer instead (the simulator takes
longer than the run to answer, as a long generation does): what a call costs tokengate from its
admission to its response head, when the handler's state is still alive. Only tokengate is
measured then (ready when its `tokengate_inflight_requests` reaches N; the simulator alone has no
such count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import rss_kib, start  # noqa: E402

MODEL = "us.anthropic.claude-sonnet-4-20250514-v1:0"
PATH = f"/model/{MODEL.replace(':', '%3A')}/converse-stream"
BODY = json.dumps({"messages": [{"role": "user", "content": [{"text": "[sim:fault=stall] [sim:output=20] hi"}]}],
                   "inferenceConfig": {"maxTokens": 100}}).encode()
AUTH = "AWS4-HMAC-SHA256 Credential=x/20260101/us-east-1/bedrock/aws4_request, SignedHeaders=host, Signature=0"


def simulator_config() -> str:
    """A simulator that stalls each stream after its first event, for longer than the run."""
    return ('[server]\nlisten = "127.0.0.1:0"\n[upstream]\nregion = "us-east-1"\nendpoint = "simulated"\n'
            '[simulator]\ntime_to_first_token_ms = 0\ntokens_per_second = 0\nstall_ms = 120000\n'
            'default_tokens_per_minute = 1000000000\n')


def waiting_simulator_config() -> str:
    """A simulator that answers a Converse call after longer than the run."""
    return ('[server]\nlisten = "127.0.0.1:0"\n[upstream]\nregion = "us-east-1"\nendpoint = "simulated"\n'
            '[simulator]\ntime_to_first_token_ms = 600000\ntokens_per_second = 0\n'
            'default_tokens_per_minute = 1000000000\n')


WAITING_PATH = f"/model/{MODEL.replace(':', '%3A')}/converse"
WAITING_BODY = json.dumps({"messages": [{"role": "user", "content": [{"text": "[sim:output=20] hi"}]}],
                           "inferenceConfig": {"maxTokens": 100}}).encode()


def proxy_config(sim_addr: str, http: str) -> str:
    return (f'[server]\nlisten = "127.0.0.1:0"\n[upstream]\nregion = "us-east-1"\n'
            f'endpoint = "http://{sim_addr}"\nhttp = "{http}"\n[[pools]]\nname = "sonnet4-us"\n'
            f'models = ["{MODEL}"]\ntokens_per_minute = 1000000000\nmax_concurrency = 4096\n'
            'output_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n')


async def open_stream(addr: str, opening: asyncio.Semaphore):
    host, port = addr.rsplit(":", 1)
    async with opening:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"POST {PATH} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n"
                      f"authorization: {AUTH}\r\ncontent-length: {len(BODY)}\r\n\r\n").encode() + BODY)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise SystemExit(f"{addr}: {head[:200]!r}")
        await reader.read(1)  # the stream's first bytes: it is open end to end
    return writer


async def send_waiting(addr: str, opening: asyncio.Semaphore):
    """A Converse call, sent whole; its answer is not waited for."""
    host, port = addr.rsplit(":", 1)
    async with opening:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"POST {WAITING_PATH} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n"
                      f"authorization: {AUTH}\r\ncontent-length: {len(WAITING_BODY)}\r\n\r\n").encode()
                     + WAITING_BODY)
        await writer.drain()
    return writer


def inflight(addr: str) -> int:
    """tokengate's admitted calls not yet settled, from its /metrics."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("tokengate_inflight_requests{"))


async def hold_waiting(addr: str, n: int, at_once: int, pid: int) -> dict:
    """Sends `n` calls to tokengate at `addr`; `pid`'s RSS once all of them are in flight."""
    opening = asyncio.Semaphore(at_once)
    writers = await asyncio.wait_for(asyncio.gather(*(send_waiting(addr, opening) for _ in range(n))), 120)
    deadline = time.monotonic() + 120
    while (admitted := await asyncio.to_thread(inflight, addr)) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {admitted} of {n} calls in flight after 120 s")
        await asyncio.sleep(0.05)
    open_kib = rss_kib(pid)
    for w in writers:
        w.close()
    return {"streams": len(writers), "rss_open_kib": open_kib}


async def hold_streams(addr: str, n: int, at_once: int, pid: int) -> dict:
    """Opens `n` streams at `addr`; `pid`'s RSS with all of them open."""
    opening = asyncio.Semaphore(at_once)
    writers = await asyncio.wait_for(asyncio.gather(*(open_stream(addr, opening) for _ in range(n))), 120)
    open_kib = rss_kib(pid)
    for w in writers:
        w.close()
    return {"streams": len(writers), "rss_open_kib": open_kib}


def measure(name: str, addr: str, pid: int, n: int, at_once: int, waiting: bool = False) -> None:
    idle = rss_kib(pid)
    held = asyncio.run((hold_waiting if waiting else hold_streams)(addr, n, at_once, pid))
    per_stream = (held["rss_open_kib"] - idle) / n
    print(json.dumps({"process": name, "idle_mib": round(idle / 1024, 1),
                      "open_mib": round(held["rss_open_kib"] / 1024, 1), "streams": held["streams"],
                      "kib_per_stream": round(per_stream, 1)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("binary", help="a release build of tokengate")
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--at-once", type=int, default=200,
                        help="streams being opened at a time (all stay open); --at-once 2000 opens them in one burst")
    parser.add_argument("--http", nargs="+", default=["http2", "http1"], help="upstream.http values to measure")
    parser.add_argument("--waiting", action="store_true",
                        help="calls waiting for their answer instead of open streams (tokengate only)")
    opts = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 2 * opts.streams + 100:
        sys.exit(f"the open-files limit ({hard}) is too low for {opts.streams} streams")
    env = dict(os.environ, AWS_ACCESS_KEY_ID="floor", AWS_SECRET_ACCESS_KEY="floor",
               AWS_EC2_METADATA_DISABLED="true", RUST_LOG="warn")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sim.toml").write_text(waiting_simulator_config() if opts.waiting else simulator_config())
        sim_args = [opts.binary, "simulate", "--listen", "127.0.0.1:0", "--config", str(Path(tmp, "sim.toml"))]
        what = "calls waiting" if opts.waiting else "streams"
        runs = [] if opts.waiting else [("simulator", None)]
        runs += [(f"tokengate (upstream.http = {h}, {what})", h) for h in opts.http]
        for name, http in runs:
            procs = []
            try:
                sim, sim_addr = start(sim_args, "simulator", env)
                procs.append(sim)
                target, addr = sim, sim_addr
                if http is not None:
                    Path(tmp, "proxy.toml").write_text(proxy_config(sim_addr, http))
                    target, addr = start([opts.binary, "serve", "--config", str(Path(tmp, "proxy.toml"))],
                                         "tokengate", env)
                    procs.append(target)
                measure(name, addr, target.pid, opts.streams, opts.at_once, opts.waiting)
            finally:
                for p in reversed(procs):
                    p.terminate()
                    p.wait(timeout=30)


if __name__ == "__main__":
    main()
