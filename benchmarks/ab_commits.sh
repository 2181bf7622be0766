#!/usr/bin/env bash
# Commits alternated on one machine, one benchmark process per run: H200 machines read the
# same code 1-6% apart (docs/performance.md, v23-v24), so a change's cost shows only against
# its parent timed on the same machine. ab_switch.py does this for module switches in one
# process; this does it for whole trees.
#
#   rm -rf .snap .snap_b && mkdir .snap .snap_b
#   git archive A | tar -x -C .snap && cp -r .whl .snap/   # the wheels once, in this tree
#   git archive B | tar -x -C .snap_b                      # (and C into .snap_c, ...)
#   device: carry [".snap", ".snap_b"], then
#     cd .snap && OUT=$OUT AB_OTHER="../.snap_b" bash benchmarks/ab_commits.sh
#
#   AB_OTHER          the other trees, space-separated [required]; labelled b, c, ...
#   AB_SHAPES         `cce bench` shapes [qwen2.5-0.5b]
#   AB_IMPLS          `cce bench` impls [cce_filtered]
#   AB_ROUNDS         rounds of (this tree, other tree) [3]
# LM-like inputs. Writes each run's bench files and ab-commits.log (fwd+bwd ms per impl, shape
# and round, each tree's median ms and x GEMM) under $OUT, tarred as $OUT/ab-commits.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:?set OUT to the folder that comes back}"
TREES=("$PWD")
for other in ${AB_OTHER:?set AB_OTHER to the other trees}; do TREES+=("$(cd "$other" && pwd)"); done
LABELS=(a b c d e f)
SHAPES="${AB_SHAPES:-qwen2.5-0.5b}"
IMPLS="${AB_IMPLS:-cce_filtered}"
ROUNDS="${AB_ROUNDS:-3}"
WORK="$(mktemp -d)"
source benchmarks/device_env.sh  # the wheels into /tmp/site, which both trees use
trap 'tar -czf "$OUT/ab-commits.tgz" -C "$WORK" .' EXIT

for round in $(seq 1 "$ROUNDS"); do
  for index in "${!TREES[@]}"; do
    tree="${TREES[$index]}" label="${LABELS[$index]}"
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" python3 -m cce_compile.cli.bench --name "ab-$label-$round" \
      --out "$WORK" --shapes "$SHAPES" --kinds lm_like --impls "$IMPLS" > "$WORK/ab-$label-$round.log" 2>&1)
    echo "round $round, tree $label: exit $?"
  done
done

python3 - "$WORK" <<'EOF' | tee "$WORK/ab-commits.log"
import json, statistics, sys
from collections import defaultdict
from pathlib import Path

runs = defaultdict(list)  # (shape, impl, tree) -> (fwd+bwd ms, x GEMM) by round
for path in sorted(Path(sys.argv[1]).glob("ab-*-*.json")):
    tree = path.stem.split("-")[1]
    for run in json.loads(path.read_text())["runs"]:
        for impl in run["impls"]:
            if impl["status"] == "ok":
                runs[(run["shape"]["name"], impl["impl"], tree)].append((impl["fwd_bwd_ms"], impl["fwd_bwd_x_gemm"]))
for (shape, impl, tree), timed in sorted(runs.items()):
    ms, ratio = zip(*timed)
    print(f"{shape} {impl} tree {tree}: fwd+bwd ms {' '.join(f'{x:.2f}' for x in ms)}; median {statistics.median(ms):.2f}"
          f" ms, {statistics.median(ratio):.3f} x GEMM")
EOF
