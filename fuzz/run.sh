#!/usr/bin/env bash
# Runs every fuzz target for SECS seconds (default 600), one at a time, in one process each, and keeps
# each run's log in fuzz/logs/. Needs nightly and cargo-fuzz. Usage: fuzz/run.sh [SECS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-600}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(target_path request_body body_read eventstream usage)
fi
mkdir -p logs
cargo +nightly fuzz build
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  cargo +nightly fuzz run "$t" "corpus/$t" "${seeds[@]}" -- \
    -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb=2048 \
    >"logs/$t.log" 2>&1 || echo "$t: exited $? (see logs/$t.log)"
  echo "$t: corpus $(ls "corpus/$t" | wc -l) files"
done
