#!/usr/bin/env bash
# One device call that checks and times a commit on the H200: the GPU test suite, the
# per-kernel profile of each benchmark shape, and the side-by-side benchmark, each under its
# own time limit. Everything lands in a scratch folder that is tarred into $OUT/session.tgz
# every 20 s and at the end (the device tool returns only a few files, and a call cut short
# at its limit still returns what the last tar holds).
#
#   STEPS="tests profile bench"   which parts, in this order (also: tune, host, sweep, wall, graphs, joules,
#                                 chunks, ncu, ab)
#   SHAPES="NxDxV ..."            profile shapes [the four benchmark shapes]
#   MODES=exact,filtered          profile modes (PROFILE_ARGS: more of profile_kernels.py's options)
#   BENCH_BUDGET_S=190            run_h200.sh starts nothing new after this (BENCH_SHAPES,
#                                 BENCH_KINDS, BENCH_IMPLS, BENCH_NAME, BENCH_ARGS: its other shapes,
#                                 inputs, impls, options such as --frozen-head)
#   TUNE_MODE=exact TUNE_BUDGET_S=30   tune: tune_h200.sh on SHAPES (~45 s per shape)
#   HOST_SHAPES="NxDxV ..."       host: probe_host.py's shapes [Qwen2.5's]
#   SWEEP_SHAPES="NxDxV ..." SWEEP_ARGS="..."   sweep: sweep_tiles.py [SHAPES, no arguments]
#   WALL_ARGS="..."               wall: probe_wall.py (wall clock against GPU time, clocks)
#   JOULES_SHAPES="NxDxV ..."     joules: probe_joules.py (each part of a pass back to back: ms and joules)
#                                 [Qwen2.5's, Gemma-2's, Llama-3's]
#   CHUNK_SHAPES="NxDxV ..."      chunks: probe_forward_chunks.py (the forward as one persistent grid against
#                                 grids of CHUNK_ROWS=2048,4096,8192 rows: ms and joules) [Llama-3's head at N = 32768]
#   NCU_SHAPES="NxDxV ..."        ncu: Nsight Compute's DRAM bytes, L2 hit rate and time of the op's persistent
#                                 forward kernel, its first launch per shape (NCU_CHUNK_ROWS rows; all by
#                                 default) [Llama-3's head at N = 8192 and 32768]; NCU_SECTIONS="SpeedOfLight
#                                 WarpStateStats ...": Nsight's sections as well (stall reasons, pipes)
#   GRAPH_SHAPES="NxDxV ..."      graphs: probe_graphs.py (the backward's CUDA graph: memory, host and wall
#                                 time per call, graphs on and off) [Qwen2.5's]
#   AB_ARGS="--switch ...[;...]"  ab: ab_switch.py (a module switch's values or --plans alternated, one
#                                 process per ';'-separated argument set; AB_TIMEOUT_S=300 each)
#   TEST_K="..."                  tests: pytest's -k selection [the whole GPU suite]; TESTS_TIMEOUT_S=420
#   CCE_BENCH_COMMIT=<hash>       the snapshot's commit (a snapshot has no git history)
#
# About 4 min of tests on a fresh machine (cold compile cache), 20-40 s per profiled shape and
# mode, 3.5 min of benchmark (BENCH_BUDGET_S=200): tests and bench fill ~7.5 min of a call's 10,
# plus the machine's start; leave the profiles to another call.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:?set OUT to the folder that comes back}"
STEPS="${STEPS:-tests profile bench}"
SHAPES="${SHAPES:-8192x2304x256000 8192x4096x128256 16384x896x151936 4096x8192x128256}"
MODES="${MODES:-exact,filtered}"
BENCH_BUDGET_S="${BENCH_BUDGET_S:-190}"
WORK="$(mktemp -d)"
source benchmarks/device_env.sh

pack() { tar -czf "$OUT/session.tgz" -C "$WORK" .; }
( while sleep 20; do pack; done ) &
packer=$!
# The packer must not outlive the script: the call would wait for it until its time limit.
trap 'kill $packer 2>/dev/null; pack' EXIT

# run_probe NAME LIMIT_S SCRIPT [ARGS...]: benchmarks/SCRIPT under a time limit, its JSON and log in
# $WORK as probe-NAME.*, the log printed.
run_probe() {
  local name=$1 limit=$2 script=$3
  shift 3
  timeout "$limit" python3 "benchmarks/$script" "$@" --out "$WORK/probe-$name.json" > "$WORK/probe-$name.log" 2>&1
  echo "$name: exit $?"
  cat "$WORK/probe-$name.log"
}

shape_options() { printf -- '--shape %s ' "$@"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$WORK/gpu.txt" 2>&1
for step in $STEPS; do
  case "$step" in
    tests)
      timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest -q -m gpu tests/test_gpu.py ${TEST_K:+-k "$TEST_K"} > "$WORK/gpu-tests.log" 2>&1
      echo "exit $?" >> "$WORK/gpu-tests.log"
      tail -n 2 "$WORK/gpu-tests.log" ;;
    profile)
      for shape in $SHAPES; do
        timeout 90 python3 benchmarks/profile_kernels.py --shape "$shape" --modes "$MODES" ${PROFILE_ARGS:-} \
          --out "$WORK/profile-$shape.json" > "$WORK/profile-$shape.log" 2>&1
        echo "profile $shape: exit $?"
      done ;;
    bench)
      OUT="$WORK" NAME="${BENCH_NAME:-bench-h200}" BUDGET_S="$BENCH_BUDGET_S" timeout $((BENCH_BUDGET_S + 90)) bash benchmarks/run_h200.sh \
        > "$WORK/bench-run.log" 2>&1
      echo "bench: exit $?"
      grep "lm_like" "$WORK/${BENCH_NAME:-bench-h200}.md" 2>/dev/null | head -n 40 ;;
    tune)
      OUT="$WORK/tune" MODE="${TUNE_MODE:-exact}" BUDGET_S="${TUNE_BUDGET_S:-30}" SHAPES="$SHAPES" \
        bash benchmarks/tune_h200.sh > "$WORK/tune.log" 2>&1
      echo "tune: exit $?"
      rm -f "$WORK/tune/tuning.db" ;;
    host)
      run_probe host 120 probe_host.py $(shape_options ${HOST_SHAPES:-16384x896x151936}) ;;
    wall)
      run_probe wall 240 probe_wall.py ${WALL_ARGS:-} ;;
    ab)
      IFS=';' read -ra ab_runs <<< "${AB_ARGS:?set AB_ARGS}"
      for index in "${!ab_runs[@]}"; do
        timeout "${AB_TIMEOUT_S:-300}" python3 benchmarks/ab_switch.py ${ab_runs[$index]} > "$WORK/ab-$index.log" 2>&1
        echo "ab ${ab_runs[$index]}: exit $?"
        grep -A20 "^medians" "$WORK/ab-$index.log"
      done ;;
    chunks)
      run_probe chunks 300 probe_forward_chunks.py --chunk-rows "${CHUNK_ROWS:-2048,4096,8192}" \
        $(shape_options ${CHUNK_SHAPES:-32768x4096x128256}) ;;
    ncu)
      for shape in ${NCU_SHAPES:-8192x4096x128256 32768x4096x128256}; do
        timeout 240 ncu --clock-control none --kernel-name regex:lse_forward --launch-count 1 \
          --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed \
          $(for section in ${NCU_SECTIONS:-}; do printf -- '--section %s ' "$section"; done) \
          python3 benchmarks/probe_forward_chunks.py --shape "$shape" --chunk-rows "${NCU_CHUNK_ROWS:-1048576}" --rounds 0 \
          > "$WORK/ncu-$shape.log" 2>&1
        echo "ncu $shape: exit $?"
        grep -E "lse_forward|duration|dram__|lts__|sm__|Throughput|Stall|Registers|Warp Cycles|Eligible|Issued|Shared Memory Config|Waves" "$WORK/ncu-$shape.log"
      done ;;
    graphs)
      run_probe graphs 180 probe_graphs.py $(shape_options ${GRAPH_SHAPES:-16384x896x151936}) ;;
    joules)
      run_probe joules 300 probe_joules.py \
        $(shape_options ${JOULES_SHAPES:-16384x896x151936 8192x2304x256000 8192x4096x128256}) ;;
    sweep)
      for shape in ${SWEEP_SHAPES:-$SHAPES}; do
        timeout 300 python3 benchmarks/sweep_tiles.py --shape "$shape" ${SWEEP_ARGS:-} \
          --out "$WORK/sweep-$shape.json" > "$WORK/sweep-$shape.log" 2>&1
        echo "sweep $shape: exit $?"
        cat "$WORK/sweep-$shape.log"
      done ;;
    *)
      echo "unknown step $step" >&2 ;;
  esac
done
