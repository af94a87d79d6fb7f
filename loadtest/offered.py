#!/usr/bin/env python3
"""The load a loadgen run offered, in multiples of its quota.

Usage: python3 loadtest/offered.py OUT_DIR SCENARIO_NAME QUOTA_TPM MINUTES

Completed calls under-represent the long ones (they fail more under overload), so the mean charge
of completed calls understates what was asked for. Here each call sent (the direct side's
records, `OUT_DIR/SCENARIO_NAME.direct.jsonl`) counts the mean charge of completed calls of its
shape, told apart by maxTokens; the sum over the run's MINUTES of arrivals is the offered load.
"""

import json
import sys


def main() -> None:
    out, name, quota, minutes = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    with open(f"{out}/{name}.direct.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    mean = {}
    for shape in {r["max_tokens"] for r in records}:
        charged = [r["charged"] for r in records if r["max_tokens"] == shape and r["outcome"] == "ok"]
        if not charged:
            sys.exit(f"no completed call with maxTokens {shape}: cannot price that shape")
        mean[shape] = sum(charged) / len(charged)
    offered = sum(mean[r["max_tokens"]] for r in records) / minutes
    by_shape = ", ".join(f"maxTokens {k}: {v:,.0f}" for k, v in sorted(mean.items(), key=str))
    print(
        f"{name}: {len(records)} calls; mean charge of a completed call by shape: {by_shape}; "
        f"offered {offered:,.0f} tokens/min = {offered / quota:.2f}x the quota"
    )


if __name__ == "__main__":
    main()
