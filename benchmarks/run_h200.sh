#!/usr/bin/env bash
# The H200 benchmark in one command: cce_compile against its peers (Apple CCE, Liger,
# torch eager and torch.compile) on the four model shapes, LM-like and uniform inputs.
#
# About 4-6 minutes of GPU time: the harness starts nothing new after BUDGET_S seconds
# (default 390), uniform inputs come last and time only the filtering impls (plus
# cce_compile exact), and results are rewritten after every (shape, inputs) run, so a
# cut-short run still leaves numbers. Peers and the CLI's libraries come from wheels in .whl/ (the GPU machine has no
# network): carry .whl. Writes $OUT/$NAME.{json,md,log} and copies them into
# benchmarks/results; the PNG needs matplotlib: re-render on any machine with
#   python -m cce_compile.cli.bench --render benchmarks/results/$NAME.json
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-benchmarks/results}"
NAME="${NAME:-bench-h200}"
BUDGET_S="${BUDGET_S:-390}"
# Another set of shapes, inputs or impls (e.g. a survey of shapes with no bundled config):
SHAPES="${BENCH_SHAPES:-gemma2-2b,llama3-8b,qwen2.5-0.5b,large-d}"
KINDS="${BENCH_KINDS:-lm_like,uniform}"
IMPLS="${BENCH_IMPLS:+--impls $BENCH_IMPLS}"
EXTRA="${BENCH_ARGS:-}"  # more of `cce bench`'s options, e.g. --frozen-head
mkdir -p "$OUT" benchmarks/results

source benchmarks/device_env.sh

nvidia-smi || echo "nvidia-smi failed" >&2
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'

status=0
python3 -m cce_compile.cli.bench --name "$NAME" --out "$OUT" --budget-s "$BUDGET_S" \
  --shapes "$SHAPES" --kinds "$KINDS" $IMPLS $EXTRA 2>&1 | tee "$OUT/$NAME.log" || status=$?

if [ "$(realpath "$OUT")" != "$(realpath benchmarks/results)" ]; then
  for ext in json md png log; do
    if [ -f "$OUT/$NAME.$ext" ]; then cp "$OUT/$NAME.$ext" benchmarks/results/; fi
  done
fi
if [ -f "$OUT/$NAME.md" ]; then cat "$OUT/$NAME.md"; fi
exit "$status"
