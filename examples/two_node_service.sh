#!/usr/bin/env bash
# Two nodes sharing tuned kernel configs through one tuning service, both played on this
# machine (each step says which node runs it on a real cluster):
#   service node: `cce serve` on a database (SQLite here; PostgreSQL for replicas, see docs/service.md)
#   GPU node:     tunes a shape and publishes the result with a write token
#   training node: the op (here `cce lookup`, which runs the op's ladder) finds the config with a read token
# Run: bash examples/two_node_service.sh   (needs the package installed: `cce` on PATH)
set -euo pipefail

PORT="${PORT:-8765}"
SERVICE_URL="http://127.0.0.1:${PORT}"   # on a cluster: the service node's (or load balancer's) address
WORK="$(mktemp -d)"

# --- service node ----------------------------------------------------------------------------
READ_TOKEN="$(cce token)"
WRITE_TOKEN="$(cce token)"
export CCE_SERVICE_TOKENS="${READ_TOKEN}:read;${WRITE_TOKEN}:write"
# On a cluster: --host 0.0.0.0 behind TLS, and --db-url postgresql+psycopg://... (pip install "cce-compile[postgres]").
cce serve --port "$PORT" --db-url "sqlite:///${WORK}/tuning.db" --log-level warning >"${WORK}/serve.log" 2>&1 &
SERVE_PID=$!
stop_service() {
  local status=$?  # the script's own, not the stopped server's
  kill "$SERVE_PID" 2>/dev/null || true
  wait "$SERVE_PID" 2>/dev/null || true
  rm -rf "$WORK"
  exit "$status"
}
trap stop_service EXIT
python - "$SERVICE_URL" <<'PY'
import sys, time, httpx
for _ in range(300):
    try:
        if httpx.get(sys.argv[1] + "/readyz", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.TransportError:
        pass
    time.sleep(0.2)
sys.exit("the service did not become ready")
PY
head -n 3 "${WORK}/serve.log"

# --- GPU node: tune and publish -----------------------------------------------------------------
# With a GPU this is one command:
#   CCE_TUNING_TOKEN="$WRITE_TOKEN" cce tune --vocab 128256 --hidden 4096 --tokens 8192 --publish "$SERVICE_URL"
# Without one, the example publishes a measurement as `cce tune` would (same kernel version as this checkout).
CCE_TUNING_TOKEN="$WRITE_TOKEN" python - "$SERVICE_URL" <<'PY'
import os, sys, httpx
from cce_compile.resolve.platform import kernel_version, triton_version
measurement = {
    "gpu": {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 85899345920},
    "kernel": "cce", "kernel_version": kernel_version(), "triton_version": triton_version(), "torch_version": "2.13.0",
    "V": 128256, "D": 4096, "dtype": "bfloat16", "tokens": 8192, "mode": "exact",
    "config": {"slab_v": 8192, "vocab_splits": 8}, "median_ms": 10.0, "p20_ms": 9.8, "p80_ms": 10.3,
    "default_ms": 12.0, "method": "triton.do_bench", "submitter": "example", "host": "gpu-node-1",
}
response = httpx.post(sys.argv[1] + "/v1/measurements", json=measurement,
                      headers={"Authorization": f"Bearer {os.environ['CCE_TUNING_TOKEN']}"})
response.raise_for_status()
print("GPU node published measurement", response.json()["measurement_uid"], "best:", response.json()["is_best"])
PY

# --- training node: what the op would launch with -----------------------------------------------
# A training job sets these two variables and nothing else: its first op call per shape asks the service.
export CCE_TUNING_URL="$SERVICE_URL" CCE_TUNING_TOKEN="$READ_TOKEN"
export CCE_CONFIG_CACHE_DIR="${WORK}/config-cache"   # the node's disk cache (default: the user cache dir)
cce lookup --gpu "NVIDIA H100 80GB HBM3" --vocab 128256 --hidden 4096 --tokens 8192 --json

# --- backup, from any node with a read token ----------------------------------------------------
cce export --url "$SERVICE_URL" >"${WORK}/backup.jsonl"
echo "exported $(($(wc -l <"${WORK}/backup.jsonl") - 1)) best entry(ies)"
