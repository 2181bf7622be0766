#!/usr/bin/env bash
# Issue 4's H200 run in one command: tune the four benchmark shapes, publishing every
# measurement over HTTP into a real `cce serve` (SQLite in $OUT), then export the store and
# write the best configs as the bundled defaults ($OUT/h200.json, to be copied into
# cce_compile/config/bundled/). About 50 s of GPU time per shape at BUDGET_S=40.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
BUDGET_S="${BUDGET_S:-40}"
MODE="${MODE:-exact}"  # or filtered: its block-sparse GEMMs are Triton's, so their tiles are tuned too
SHAPES="${SHAPES:-8192x2304x256000 8192x4096x128256 16384x896x151936 4096x8192x128256}"
PORT="${PORT:-8765}"
mkdir -p "$OUT"
source benchmarks/device_env.sh

export CCE_TUNING_DB_URL="sqlite:///$OUT/tuning.db" CCE_SERVICE_TOKENS="tuner-token:read,write" CCE_TUNING_TOKEN=tuner-token
python3 -m cce_compile.cli.main serve --port "$PORT" --log-level warning > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$PORT/healthz" > /dev/null && break; sleep 0.2; done

cp cce_compile/config/bundled/h200.json "$OUT/h200.json"
status=0
for shape in $SHAPES; do
  IFS=x read -r n d v <<< "$shape"
  timeout $((BUDGET_S + 60)) python3 -m cce_compile.cli.tune --tokens "$n" --hidden "$d" --vocab "$v" --dtype bf16 --mode "$MODE" \
    --budget-s "$BUDGET_S" --publish "http://127.0.0.1:$PORT" --out "$OUT/tune-h200-$MODE-$shape.json" \
    --bundle "$OUT/h200.json" > "$OUT/tune-h200-$MODE-$shape.log" 2>&1 || status=$?
  tail -n 25 "$OUT/tune-h200-$MODE-$shape.log"
done
python3 -m cce_compile.cli.main export --url "http://127.0.0.1:$PORT" --token tuner-token > "$OUT/tuning-export.jsonl" || status=$?
wc -l "$OUT/tuning-export.jsonl"
exit "$status"
