#!/usr/bin/env bash
# What a session owes the H200 after a kernel change, as named steps run in the order given,
# each under its own time limit, logs under $OUT; a failed step does not stop the next, and the
# script exits non-zero if any failed. A device call may run 600 s, so give it the steps that
# fit: `filtered-tests bench` (with a bench budget of ~300 s), `gpu-tests`, `gpu-log-probs-tests`,
# `first-call`.
#   filtered-tests  test_gpu.py's filtered, sparse and reuse tests (~1.5 min)
#   bench           cce bench on $SHAPES x $IMPLS x $COMPILE, LM-like inputs, within $BENCH_BUDGET_S
#                   (~1 min a shape and compile mode); rows labeled $CCE_BENCH_COMMIT
#   gpu-tests       test_gpu.py (~9 min on a fresh H100: the two files together overran a call)
#   gpu-log-probs-tests  test_gpu_log_probs.py
#   first-call      benchmarks/first_call.py on three heads, with a profile (~3 min)
#   profile-ro      filtered mode's kernels eager and under reduce-overhead, Gemma-2 and Qwen2.5
#                   heads (profile_kernels.py; ~3 min): where the compiled time above eager goes
#   ab-strided      filtered mode under reduce-overhead at 2, 4 and 8 strided programs per SM
#                   (Policy.filtered_strided_programs_per_sm), alternated, on $AB_SHAPES (one a call)
# e.g. CCE_BENCH_COMMIT=abc1234 BENCH_BUDGET_S=300 benchmarks/h200_checks.sh filtered-tests bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
SHAPES="${SHAPES:-llama3-8b,qwen2.5-0.5b,gemma2-2b,large-d,llama3.2-1b,mistral-nemo}"
IMPLS="${IMPLS:-cce_filtered,cce_exact,torch}"
COMPILE="${COMPILE:-eager,reduce-overhead}"
BENCH_BUDGET_S="${BENCH_BUDGET_S:-450}"
if [[ " $* " == *" bench "* && -z "${CCE_BENCH_COMMIT:-}" ]]; then
  echo "bench: set CCE_BENCH_COMMIT to the commit of the tree (a copy of it has no history)" >&2
  exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-}"
source benchmarks/device_env.sh

status=0
run_step() {  # name, limit in seconds, command...
  local name=$1 limit=$2 started=$SECONDS code
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  code=$?
  echo "== $name: exit $code after $((SECONDS - started)) s"
  tail -n 15 "$OUT/$name.log"
  if ((code != 0)); then status=1; fi
}

pytest_gpu=(python3 -m pytest -q -m gpu -p no:cacheprovider)
for step in "$@"; do
  case "$step" in
    filtered-tests) run_step "$step" 240 "${pytest_gpu[@]}" tests/test_gpu.py -k "filtered or sparse or reuse" ;;
    bench)
      run_step "$step" $((BENCH_BUDGET_S + 60)) python3 -m cce_compile.cli.bench --shapes "$SHAPES" --impls "$IMPLS" \
        --compile "$COMPILE" --kinds lm_like --budget-s "$BENCH_BUDGET_S" --out "$OUT" ;;
    gpu-tests) run_step "$step" 560 "${pytest_gpu[@]}" tests/test_gpu.py ;;
    gpu-log-probs-tests) run_step "$step" 560 "${pytest_gpu[@]}" tests/test_gpu_log_probs.py ;;
    first-call)
      run_step "$step" 300 python3 benchmarks/first_call.py --shapes llama3-8b,qwen2.5-0.5b,gemma2-2b --rounds 2 \
        --out "$OUT/first-call.json" --profile "$OUT/first-call-profile.txt" ;;
    profile-ro)
      run_step "$step" 300 bash -c 'for shape in 8192x2304x256000 16384x896x151936; do
        for mode in eager reduce-overhead; do
          python3 benchmarks/profile_kernels.py --shape "$shape" --modes filtered --compile "$mode" \
            --out "$0/profile-filtered-$shape-$mode.json" || exit 1
        done; done' "$OUT" ;;
    ab-strided)
      run_step "$step" 540 python3 benchmarks/ab_switch.py --policy filtered_strided_programs_per_sm=2,4,8 \
        --impls cce_filtered --compile reduce-overhead --shapes "${AB_SHAPES:-gemma2-2b}" --rounds 1 ;;
    *) echo "unknown step: $step (filtered-tests, bench, gpu-tests, gpu-log-probs-tests, first-call, profile-ro, ab-strided)" >&2
       status=2 ;;
  esac
done
exit "$status"
