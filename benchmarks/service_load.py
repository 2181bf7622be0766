"""Load benchmark of the tuning service's lookups (a measurement, not a test).

For each database (SQLite file, PostgreSQL scratch schema) and uvicorn worker count, it
seeds a fresh database through the store, starts `cce serve` on a loopback port, and lets
CLIENTS concurrent httpx.AsyncClient loops send GET /v1/configs/best for a fixed time
after a warm-up: a mix of exact hits, nearest-bucket hits and misses. It prints lookups/s
and p50/p99 latency as a Markdown table (and writes JSON with --json).

    python benchmarks/service_load.py --duration 10 --json benchmarks/results/service_load.json

The clients share the machine with the server, so on a small machine the numbers are a
floor for the server alone. Traffic goes to 127.0.0.1 only, and every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from service.process import serving
from tuning_db import store
from tuning_db.engine import make_engine
from tuning_db.migrate import upgrade
from tuning_db.records import MeasurementIn
from tuning_db.scratch import scratch_schema

TOKEN = "bench-token-0001"
GPUS = [
    {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 85_899_345_920},
    {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "sm_count": 108, "memory_bytes": 85_899_345_920},
    {"name": "NVIDIA H200", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 150_754_820_096},
]
DTYPES = ("bfloat16", "float16", "float32")
SEEDED_BUCKETS = [2**power for power in range(10, 18, 2)]  # 1K, 4K, 16K, 64K tokens
PROBLEM = {"kernel": "cce", "kernel_version": "bench1", "triton_version": "3.5.0", "V": 128_256, "D": 4096, "mode": "exact"}
MAX_REQUESTS_PER_CLIENT = 100_000


def seed(url: str) -> int:
    """Fill a migrated database with entries (and slower measurements under them)."""
    upgrade(url)
    engine = make_engine(url)
    count = 0
    for gpu in GPUS[:2]:  # the H200 stays unknown: its lookups miss
        for dtype in DTYPES:
            for tokens in SEEDED_BUCKETS:
                for median_ms in (tokens / 1000, tokens / 900):
                    measured = {
                        **PROBLEM, "gpu": gpu, "dtype": dtype, "tokens": tokens, "torch_version": "2.9.0",
                        "config": {"slab_v": 8192}, "median_ms": median_ms, "p20_ms": median_ms,
                        "p80_ms": median_ms, "default_ms": median_ms * 1.3, "method": "bench",
                        "submitter": "bench", "host": "bench",
                    }
                    store.record_measurement(engine, MeasurementIn.model_validate(measured))
                    count += 1
    engine.dispose()
    return count


def lookup_params(rng: random.Random) -> dict[str, Any]:
    """About 2/3 exact, 1/6 nearest-bucket and 1/6 unknown-GPU lookups."""
    gpu = rng.choice(GPUS[:2]) if rng.random() < 5 / 6 else GPUS[2]
    tokens = rng.choice(SEEDED_BUCKETS)
    if rng.random() < 0.2:
        tokens *= 2
    return {**PROBLEM, "gpu": gpu["name"], "dtype": rng.choice(DTYPES), "tokens": tokens}


async def client_loop(
    base_url: str, seconds: float, seed_value: int, latencies: list[float], levels: Counter[str]
) -> int:
    """One client: lookups back to back until the time is up; returns its error count."""
    rng = random.Random(seed_value)
    errors = 0
    deadline = time.perf_counter() + seconds
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=10) as client:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.perf_counter() >= deadline:
                break
            started = time.perf_counter()
            response = await client.get("/v1/configs/best", params=lookup_params(rng))
            latencies.append(time.perf_counter() - started)
            if response.status_code == 200:
                levels[response.json()["match_level"]] += 1
            else:
                errors += 1
    return errors


async def load(base_url: str, clients: int, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    levels: Counter[str] = Counter()
    started = time.perf_counter()
    errors = await asyncio.gather(*(client_loop(base_url, seconds, n, latencies, levels) for n in range(clients)))
    elapsed = time.perf_counter() - started
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "requests": len(latencies),
        "errors": sum(errors),
        "lookups_per_s": len(latencies) / elapsed,
        "p50_ms": quantiles[49] * 1000,
        "p99_ms": quantiles[98] * 1000,
        "match_levels": dict(levels),
    }


@contextmanager
def database(kind: str, postgres_url: str, workdir: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{workdir / 'bench.db'}"
    else:
        with scratch_schema(postgres_url, prefix="cce_bench") as url:
            yield url


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for kind in args.databases:
        for workers in args.workers:
            with tempfile.TemporaryDirectory(prefix="cce-bench-") as workdir, database(
                kind, args.postgres_url, Path(workdir)
            ) as url:
                entries = seed(url)
                serve_args = ["--db-url", url, "--workers", str(workers), "--log-level", "warning"]
                env = {"CCE_SERVICE_TOKENS": f"{TOKEN}:read"}
                with serving(Path(workdir) / "serve.log", *serve_args, env=env) as base_url:
                    asyncio.run(load(base_url, args.clients, args.warmup))
                    result = asyncio.run(load(base_url, args.clients, args.duration))
            result |= {"database": kind, "workers": workers, "clients": args.clients, "seeded": entries}
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def markdown(results: list[dict[str, Any]]) -> str:
    rows = [
        "| database | workers | clients | lookups/s | p50 ms | p99 ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rows.append(
            f"| {r['database']} | {r['workers']} | {r['clients']} | {r['lookups_per_s']:.0f} | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per configuration")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
