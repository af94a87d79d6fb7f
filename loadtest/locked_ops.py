#!/usr/bin/env python3
"""Atomic read-modify-writes per call of one function, counted by executing it under callgrind.

Callgrind counts instructions, and an atomic read-modify-write (`lock`-prefixed, or `xchg` with
memory) counts as one, though on a virtual machine it can cost as much as a hundred plain ones:
an `Arc` clone, a metric's increment, a mutex's lock. This runs a binary under
`valgrind --tool=callgrind --dump-instr=yes`, finds the binary's atomic instructions with
`objdump`, and prints how many of them one call of FUNCTION executes, in all and by the
function (after inlining) they sit in. Linux x86-64; needs `valgrind` and `objdump`.

    python3 loadtest/locked_ops.py FUNCTION BINARY [ARGS...]

For example, one admission decision plus settlement (`benches/admission.rs`):

    python3 loadtest/locked_ops.py admission::admit_settle target/dist/deps/admission-HASH \\
        --bench --profile-time 2 'admission/admit_settle_converse$'
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ATOMIC = re.compile(r"^\s*([0-9a-f]+):\s+(lock |xchg\s+\S*\()")  # xchg with memory locks implicitly
NAMED = re.compile(r"\((\d+)\)(?: (.*))?")


def atomic_addresses(binary: str) -> set[int]:
    """Addresses of the binary's lock-prefixed instructions and `xchg`s with memory."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary],
                             check=True, capture_output=True, text=True).stdout
    return {int(m.group(1), 16) for m in map(ATOMIC.match, listing.splitlines()) if m}


def count(profile: Path, atomics: set[int], function: str) -> tuple[int, collections.Counter]:
    """Calls of `function`, and atomic instructions executed by the function they sit in."""
    names: dict[str, str] = {}
    executed: collections.Counter = collections.Counter()
    calls = 0
    current = callee = None
    after_calls = False
    address = 0
    for line in profile.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("fn", "cfn", "calls", "fl", "fi", "fe", "cfi", "cfl", "ob", "cob"):
            named = NAMED.match(value)
            if key in ("fn", "cfn") and named:
                if named.group(2):
                    names[named.group(1)] = named.group(2)
                if key == "fn":
                    current = names.get(named.group(1))
                else:
                    callee = names.get(named.group(1))
            if key == "calls":
                after_calls = True
                if callee is not None and callee.endswith(function):
                    calls += int(value.split()[0])
            continue
        fields = line.split()
        if not fields or fields[0][0] not in "+-*0123456789":
            continue
        position = fields[0]
        if position.startswith("0x"):
            address = int(position, 16)
        elif position[0] == "+":
            address += int(position[1:], 16)
        elif position[0] == "-":
            address -= int(position[1:], 16)
        elif position != "*":
            address = int(position, 16)
        if after_calls:  # the cost line after `calls=` is the callee's, inclusive
            after_calls = False
            continue
        if len(fields) >= 3 and address in atomics:
            executed[current] += int(fields[2])
    return calls, executed


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    function, binary, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "callgrind.out"
        subprocess.run(["valgrind", "--tool=callgrind", "--dump-instr=yes",
                        f"--callgrind-out-file={profile}", binary, *args],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        calls, executed = count(profile, atomic_addresses(binary), function)
    if not calls:
        sys.exit(f"no call of {function} seen")
    print(f"{calls} calls of {function}: {sum(executed.values()) / calls:.1f} atomic "
          "read-modify-writes per call")
    for where, n in executed.most_common(20):
        if n / calls >= 0.05:
            print(f"{n / calls:8.2f}  {where}")


if __name__ == "__main__":
    main()
