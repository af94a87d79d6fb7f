#!/usr/bin/env python3
"""Instructions per proxied call: tokengate's CPU cost as a count that does not depend on what else
the machine runs (callgrind counts the instructions the proxy process executes, whatever the load),
so a lever can be judged on a busy shared box.

It starts the simulator made instant (as `nginx_compare.py` does) and tokengate under `valgrind
--tool=callgrind` with instrumentation off, warms it up, turns instrumentation on for exactly
`--calls` Converse calls (sequential, over `--connections` keep-alive connections in turn), turns
it off, stops the proxy and reads the total from callgrind's output. Startup and shutdown are not
counted. The count includes the runtime's own work between calls (parking and waking threads).

    python3 loadtest/instructions.py target/release/tokengate [--calls 2000] [--top 30]
        [--no-access-log] [--keep DIR]

Prints a JSON line (instructions per call) and, with `--top N`, the N functions with the highest
self cost (callgrind_annotate), to see where a call's instructions go. Linux; needs valgrind.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nginx_compare import AUTH, BODY, PATH, proxy_config, simulator_config  # noqa: E402
from sizing import start  # noqa: E402


def calls(addr: str, n: int, connections: int) -> None:
    host, port = addr.rsplit(":", 1)
    conns = [http.client.HTTPConnection(host, int(port), timeout=60) for _ in range(connections)]
    headers = {"content-type": "application/json", "authorization": AUTH}
    for i in range(n):
        c = conns[i % connections]
        c.request("POST", PATH, body=BODY, headers=headers)
        r = c.getresponse()
        r.read()
        if r.status != 200:
            sys.exit(f"call {i}: status {r.status}")
    for c in conns:
        c.close()


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--no-access-log", action="store_true")
    parser.add_argument("--keep", help="copy callgrind's output file here")
    opts = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not on PATH (Debian: apt-get install -y valgrind)")
    env = dict(os.environ, AWS_ACCESS_KEY_ID="compare", AWS_SECRET_ACCESS_KEY="compare",
               AWS_EC2_METADATA_DISABLED="true")
    env.pop("RUST_LOG", None)
    if opts.no_access_log:
        env["RUST_LOG"] = "info,tokengate::access=off"
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            (tmp / "sim.toml").write_text(simulator_config())
            sim, sim_addr = start([opts.binary, "simulate", "--listen", "127.0.0.1:0", "--config",
                                   str(tmp / "sim.toml")], "simulator", env, subprocess.DEVNULL)
            procs.append(sim)
            (tmp / "proxy.toml").write_text(proxy_config(sim_addr, '[ledger]\nbackend = "memory"\n'))
            out = tmp / "callgrind.out"
            with open(tmp / "tokengate.log", "w") as log:
                proxy, addr = start(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                     f"--callgrind-out-file={out}", opts.binary, "serve", "--config",
                                     str(tmp / "proxy.toml")], "tokengate", env, log)
            procs.append(proxy)
            calls(addr, opts.warmup, opts.connections)
            control(proxy.pid, "--instr=on")
            calls(addr, opts.calls, opts.connections)
            control(proxy.pid, "--instr=off")
            proxy.terminate()
            proxy.wait(timeout=120)
            total = int(re.search(r"^totals: (\d+)", out.read_text(), re.M).group(1))
            print(json.dumps({"calls": opts.calls, "connections": opts.connections,
                              "access_log": not opts.no_access_log,
                              "instructions_total": total,
                              "instructions_per_call": round(total / opts.calls)}), flush=True)
            if opts.top:
                annotated = subprocess.run(["callgrind_annotate", "--threshold=100", str(out)],
                                           capture_output=True, text=True, check=True).stdout
                rows = [line for line in annotated.splitlines() if re.match(r"^\s*[\d,]+ \(", line)]
                print("\n".join(rows[1:opts.top + 1]))
            if opts.keep:
                shutil.copy(out, opts.keep)
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.terminate()
                    p.wait(timeout=120)


if __name__ == "__main__":
    main()
