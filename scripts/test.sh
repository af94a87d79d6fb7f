#!/usr/bin/env bash
# Runs every test: the Rust suites (unit, property, integration with aws-sdk-bedrockruntime) and
# the Python suite (boto3 against the proxy). Needs Rust with cargo-nextest and Python 3.
# Creates .venv with the Python test requirements on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt

# One build of everything; the Python suite runs the same debug binary.
cargo build --workspace --all-targets --locked
cargo nextest run --workspace --locked --no-fail-fast
TOKENGATE_BIN="$PWD/target/debug/tokengate" .venv/bin/python -m pytest tests/python -q
