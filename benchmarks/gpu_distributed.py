"""DDP and FSDP2 against one process, on CUDA with NCCL, in fp32 and bf16: the checks of
tests/test_distributed.py (a patched tiny Llama, each rank on its rows, the per-rank loss
divided by the global number of valid tokens). Run with

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc_per_node 2 benchmarks/gpu_distributed.py --out dist.json

Each check prints PASS/FAIL with its relative errors; rank 0 writes them to --out. Without
CUDA it runs on CPU with gloo (a dry run of the script, fp32 and bf16 alike).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

# never NVLink multicast (NVLS) or symmetric-memory multicast on the lent machines
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_distributed import CHECKS, passed  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_check(name: str, device: torch.device, dtype: torch.dtype) -> dict:
    """One check's errors and verdict; an exception is a FAIL with its traceback, not a hang
    of the other rank (the exception is raised on every rank alike: same code, same data)."""
    try:
        errors = CHECKS[name](device, dtype)
    except Exception:  # noqa: BLE001 (reported, the remaining checks still run)
        return {"status": "FAIL", "error": traceback.format_exc()}
    return {"status": "PASS" if passed(errors) else "FAIL", **errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        from dataclasses import replace

        from cce_compile.plan.policy import active_policy, override_policy

        # the whole process on the PyTorch path: the Triton interpreter would take minutes
        override_policy(replace(active_policy(), triton_on_cpu=False)).__enter__()
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timedelta(minutes=5))
    results = {}
    for dtype_name, dtype in DTYPES.items():
        for name in CHECKS:
            result = run_check(name, device, dtype)
            results[f"{name}/{dtype_name}"] = result
            if dist.get_rank() == 0:
                details = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in result.items() if k != "status")
                print(f"{result['status']} {name} {dtype_name}: {details}", flush=True)
    if dist.get_rank() == 0:
        environment = {
            "torch": torch.__version__, "world_size": dist.get_world_size(), "backend": backend,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
        args.out.write_text(json.dumps({"environment": environment, "checks": results}, indent=2, default=str))
        print(f"{sum(r['status'] == 'PASS' for r in results.values())}/{len(results)} PASS; wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
