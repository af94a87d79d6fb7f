#!/usr/bin/env python3
"""Memory and service under attack: the proxy's RSS while unauthenticated clients send large
request bodies they never finish and open HTTP/2 connections that send only the preface, and the
latency of a legitimate Converse call made throughout. Linux only; loopback only; bounded in time.

    python3 loadtest/attack.py target/release/tokengate [--auth none|bearer|sigv4] [--bodies 20]
        [--body-mb 25] [--h2-idle 10000] [--hold 20] [--set KEY=VALUE ...]

With `--auth sigv4` the legitimate caller signs every call with its route's key pair, and the
attacker's bodies carry that route's real access key id (public: it sits in every SDK config) with a
forged signature and a current date: the worst case, since such a head passes identification and
only the body can prove the signature wrong (`--forge unknown-key` sends an access key id the proxy
never issued instead, which is refused from the head).

`--set` adds a key to the proxy's [server] table (e.g. --set max_connections=1024). The proxy runs
in front of an instant simulator (a separate process, so its memory is not counted), with the
memory ledger and one pool that never rejects. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import http.client
import json
import os
import resource
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizing import MODEL, rss_kib, start, start_instant_simulator  # noqa: E402

LEGIT_KEY = "legitimate-caller-key"
ACCESS_KEY_ID = "AKIAATTACKTEST000001"
SECRET_ACCESS_KEY = "attack-test-secret-access-key"
REGION = "us-east-1"
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
PATH = f"/model/{MODEL.replace(':', '%3A')}/converse"


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(needed, soft)), hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        sys.exit(f"need {needed} file descriptors, the hard limit allows {soft}: raise it (ulimit -Hn)")


def sigv4_headers(host: str, path: str, body: bytes, access_key_id: str, secret: str) -> dict[str, str]:
    """SigV4 headers for a POST to bedrock-runtime, as an SDK signs it (host, x-amz-date,
    content-type signed; the path double-encoded; the payload hashed)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    canonical_path = path.replace("%", "%25")
    signed = "content-type;host;x-amz-date"
    canonical = "\n".join(["POST", canonical_path, "", "content-type:application/json", f"host:{host}",
                           f"x-amz-date:{amz_date}", "", signed, hashlib.sha256(body).hexdigest()])
    scope = f"{day}/{REGION}/bedrock/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in (day, REGION, "bedrock", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return {"x-amz-date": amz_date,
            "authorization": f"AWS4-HMAC-SHA256 Credential={access_key_id}/{scope}, "
                             f"SignedHeaders={signed}, Signature={signature}"}


def proxy_config(sim_addr: str, auth: str, server: list[str]) -> str:
    lines = ['[server]', 'listen = "127.0.0.1:0"', *server,
             '[upstream]', 'region = "us-east-1"', f'endpoint = "http://{sim_addr}"',
             '[[pools]]', 'name = "sonnet4-us"', f'models = ["{MODEL}"]',
             'tokens_per_minute = 1000000000', 'max_concurrency = 1024', 'output_burndown = 5',
             'default_max_tokens = 1000', 'max_wait_ms = 0']
    if auth == "bearer":
        digest = hashlib.sha256(LEGIT_KEY.encode()).hexdigest()
        lines += ['[auth]', 'mode = "bearer"', 'allow_plaintext_bearer = true',
                  '[[routes]]', 'name = "app"', f'bearer_token_sha256 = "{digest}"']
    if auth == "sigv4":
        lines += ['[auth]', 'mode = "sigv4"',
                  '[[routes]]', 'name = "app"', f'access_key_id = "{ACCESS_KEY_ID}"',
                  f'secret_access_key = "{SECRET_ACCESS_KEY}"']
    return "\n".join(lines) + "\n"


class Legit(threading.Thread):
    """A legitimate caller: one Converse call at a time on a fresh connection, until stopped."""

    def __init__(self, addr: str, auth: str) -> None:
        super().__init__(daemon=True)
        self.host, port = addr.rsplit(":", 1)
        self.port = int(port)
        self.headers = {"content-type": "application/json"}
        if auth == "bearer":
            self.headers["authorization"] = f"Bearer {LEGIT_KEY}"
        self.auth = auth
        self.body = json.dumps({"messages": [{"role": "user", "content": [{"text": "[sim:output=20] hi"}]}],
                                "inferenceConfig": {"maxTokens": 100}})
        self.latencies: list[float] = []
        self.started: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
                headers = dict(self.headers)
                if self.auth == "sigv4":
                    headers.update(sigv4_headers(f"{self.host}:{self.port}", PATH, self.body.encode(),
                                                 ACCESS_KEY_ID, SECRET_ACCESS_KEY))
                conn.request("POST", PATH, self.body, headers)
                response = conn.getresponse()
                response.read()
                conn.close()
                if response.status != 200:
                    self.failures.append(str(response.status))
            except OSError as e:
                self.failures.append(type(e).__name__)
            self.started.append(started)
            self.latencies.append(time.monotonic() - started)
            self.stop.wait(0.05)


class Sampler(threading.Thread):
    """The proxy's resident memory every 50 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid))
            self.stop.wait(0.05)


def attacker_auth_lines(addr: str, auth: str, forge: str) -> str:
    """The credentials an attacker without a secret can put in a head."""
    if auth == "bearer":
        return "authorization: Bearer not-a-key\r\n"
    if auth == "sigv4":
        key_id = ACCESS_KEY_ID if forge == "known-key" else "AKIANEVERISSUED00000"
        headers = sigv4_headers(addr, PATH, b"forged", key_id, "not-the-secret")
        return "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return ""


def send_body(addr: str, auth_lines: str, size: int, outcomes: list[str], held: list[socket.socket]) -> None:
    """Declares `size` bytes, sends all but the last, and never finishes."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    head = (f"POST {PATH} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n"
            f"{auth_lines}content-length: {size}\r\n\r\n")
    sock.sendall(head.encode())
    chunk = b" " * 65536
    sent = 0
    sock.settimeout(0.0)
    while sent < size - 1:
        try:
            answer = sock.recv(64)
            if answer:
                outcomes.append(answer.split(b"\r\n", 1)[0].decode(errors="replace"))
                break
        except BlockingIOError:
            pass
        except OSError as e:
            outcomes.append(type(e).__name__)
            break
        try:
            sent += sock.send(chunk[: min(len(chunk), size - 1 - sent)])
        except BlockingIOError:
            time.sleep(0.001)
        except OSError as e:
            outcomes.append(type(e).__name__)
            break
    else:
        outcomes.append("held: all but the last byte sent")
    held.append(sock)


def open_h2_idle(addr: str, n: int, selector: selectors.BaseSelector) -> int:
    """Opens `n` connections that send the HTTP/2 preface and an empty SETTINGS frame only."""
    host, port = addr.rsplit(":", 1)
    opened = 0
    for _ in range(n):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(H2_PREFACE)
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
            opened += 1
        except OSError:
            pass
    return opened


def drain_closed(selector: selectors.BaseSelector, timeout: float) -> int:
    """Reads what the proxy sent; returns how many connections it has closed."""
    closed = 0
    for key, _ in selector.select(timeout):
        sock = key.fileobj
        try:
            data = sock.recv(65536)  # type: ignore[union-attr]
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if not data:
            selector.unregister(sock)
            sock.close()  # type: ignore[union-attr]
            closed += 1
    return closed


def scrape(addr: str) -> dict[str, float]:
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    wanted = ("tokengate_open_connections", "tokengate_connections_shed_total",
              "tokengate_connection_timeouts_total", "tokengate_buffered_body_bytes",
              "tokengate_body_budget_refusals_total")
    out = {}
    for line in text.splitlines():
        if line.startswith(wanted) and 'listener="admin"' not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--auth", choices=["none", "bearer", "sigv4"], default="none")
    parser.add_argument("--forge", choices=["known-key", "unknown-key"], default="known-key",
                        help="sigv4: the access key id the attacker's heads carry")
    parser.add_argument("--bodies", type=int, default=20)
    parser.add_argument("--body-mb", type=float, default=25)
    parser.add_argument("--h2-idle", type=int, default=10000)
    parser.add_argument("--hold", type=float, default=20, help="seconds to hold the attack once launched")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    opts = parser.parse_args()
    raise_fd_limit(opts.h2_idle + opts.bodies + 256)
    env = dict(os.environ, AWS_ACCESS_KEY_ID="attack", AWS_SECRET_ACCESS_KEY="attack",
               AWS_EC2_METADATA_DISABLED="true", RUST_LOG="warn")
    with tempfile.TemporaryDirectory() as tmp:
        sim, sim_addr = start_instant_simulator(opts.binary, tmp, env)
        config = Path(tmp, "proxy.toml")
        config.write_text(proxy_config(sim_addr, opts.auth, [f"{kv.split('=', 1)[0]} = {kv.split('=', 1)[1]}"
                                                              for kv in opts.set]))
        proxy, addr = start([opts.binary, "serve", "--config", str(config)], "tokengate", env)
        try:
            time.sleep(1.0)  # let the runtime settle before the idle figure (not a readiness wait)
            idle_kib = rss_kib(proxy.pid)
            sampler, legit = Sampler(proxy.pid), Legit(addr, opts.auth)
            sampler.start()
            legit.start()
            while not legit.latencies:  # the caller works before the attack
                time.sleep(0.01)
            before = len(legit.latencies)
            outcomes: list[str] = []
            held: list[socket.socket] = []
            size = int(opts.body_mb * 1_000_000)
            auth_lines = attacker_auth_lines(addr, opts.auth, opts.forge)
            bodies = [threading.Thread(target=send_body, args=(addr, auth_lines, size, outcomes, held), daemon=True)
                      for _ in range(opts.bodies)]
            for t in bodies:
                t.start()
            selector = selectors.DefaultSelector()
            launched = time.monotonic()
            opened = open_h2_idle(addr, opts.h2_idle, selector)
            closed = 0
            while time.monotonic() - launched < opts.hold:
                closed += drain_closed(selector, 0.1)
            during = legit.latencies[before:]
            slowest = max(range(before, len(legit.latencies)), key=legit.latencies.__getitem__, default=None)
            failures = list(legit.failures)
            metrics = scrape(addr)
            legit.stop.set()
            sampler.stop.set()
            sampler.join()
            print(json.dumps({
                "auth": opts.auth, "server": opts.set,
                "forge": opts.forge if opts.auth == "sigv4" else None,
                "idle_rss_mib": round(idle_kib / 1024, 1),
                "peak_rss_mib": round(sampler.peak_kib / 1024, 1),
                "rss_at_end_mib": round(rss_kib(proxy.pid) / 1024, 1),
                "bodies": {"sent": opts.bodies, "mb_each": opts.body_mb,
                           "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))}},
                "h2_idle": {"opened": opened, "closed_by_proxy": closed},
                "legit_calls_during_attack": len(during),
                "legit_failures": {f: failures.count(f) for f in sorted(set(failures))},
                "legit_latency_ms": {"p50": round(statistics.median(during) * 1000, 1) if during else None,
                                     "p99": round(percentile(during, 0.99) * 1000, 1),
                                     "max": round(max(during, default=0) * 1000, 1),
                                     "over_1s": sum(1 for d in during if d > 1.0),
                                     "slowest_began_s_into_attack": None if slowest is None
                                     else round(legit.started[slowest] - launched, 2)},
                "attack_secs": round(time.monotonic() - launched, 1),
                "proxy_metrics_at_end": metrics,
            }, indent=1))
            for sock in held:
                sock.close()
        finally:
            for p in (proxy, sim):
                p.terminate()
                p.wait(timeout=30)


if __name__ == "__main__":
    main()
