"""Why the benchmark's wall clock sits above the profile's GPU time (exact mode on the H200).

    PYTHONPATH=$PWD python benchmarks/probe_wall.py --out probe-wall.json

At 6ed39cd exact mode's forward+backward took 4.51 x GEMM in `cce bench` (do_bench, back to
back) against 4.26 x of summed kernel time in profile_kernels.py, and the forward alone 1.11
against 1.04 x: ~7% more time with no host sync in the pass to explain it. Candidates: the
GPU's clock under sustained load (power), or time between kernels. For each shape and mode
this times, in one process and on the same inputs:
- `gemm`, `gemm_x4`: one cuBLAS e @ c.T, and four back to back (the exact floor's work) in do_bench;
- `do_bench`: the pass as the benchmark times it (grads to None, L2 cleared, back to back);
- `kernels`: the pass's summed kernel time under torch.profiler (what profile_kernels reports);
- `rested`: single passes after 0.3 s of GPU rest, timed by CUDA events;
and counts each phase's cudaMalloc calls (time between kernels that no kernel shows),
while nvidia-smi samples the SM clock and power every 50 ms (`smi` rows, with each phase's
start and end on the same clock), so a slower phase can be matched to a lower clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import lm_like_inputs  # noqa: E402
from profile_kernels import kernel_times, pass_step  # noqa: E402

SMI_FIELDS = ("timestamp,clocks.sm,power.draw,temperature.gpu,total_energy_consumption",
              "timestamp,clocks.sm,power.draw,temperature.gpu")
"""The energy counter (mJ since the driver loaded) gives joules per phase where the driver has it."""
SMI_REASONS = (",clocks_event_reasons.active", ",clocks_throttle_reasons.active", "")
"""Why the clock is held down: the field's name depends on the driver's age."""
TIMED_PHASES = ("gemm", "gemm_x4", "do_bench")
"""The back-to-back phases, long enough (>= 2 s) for the counter: joules per pass from them."""


def start_smi(path: Path) -> tuple[subprocess.Popen | None, str]:
    """nvidia-smi sampling into `path` every 50 ms (None where it cannot run), and its fields."""
    for fields in (base + reasons for base in SMI_FIELDS for reasons in SMI_REASONS):
        try:
            smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "-lms", "50"],
                                   stdout=path.open("w"), stderr=subprocess.STDOUT)
        except OSError:
            return None, ""
        time.sleep(0.5)
        if smi.poll() is None:
            return smi, fields
    return None, ""


def read_smi(path: Path, fields: str) -> list[dict]:
    """The samples as dicts of floats (time in seconds since the epoch; nvidia-smi prints UTC
    on the device machine), skipping lines it could not fill."""
    names = fields.split(",")
    samples = []
    for line in path.read_text().splitlines():
        values = [value.strip() for value in line.split(",")]
        if len(values) != len(names):
            continue
        try:
            when = datetime.strptime(values[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            row = {"time": when}
            for name, value in zip(names[1:], values[1:]):
                if name in ("clocks.sm", "power.draw", "total_energy_consumption"):
                    row[name] = float(value.split()[0])
        except ValueError:
            continue
        samples.append(row)
    return samples


POWER_WINDOW_S = 1.1
"""power.draw is an average over the last second on recent drivers (the H200's showed the
phase before bleeding 1 s into the next): without the energy counter, a phase's power is
read from its samples after this long."""


def phase_energy(samples: list[dict], phase: dict) -> dict | None:
    """Median SM clock, mean power and joules per pass (mean power x the phase's time per
    pass) over the samples inside a phase: the power from the energy counter where the driver
    has one, else from power.draw after its averaging window."""
    inside = [row for row in samples if phase["start"] <= row["time"] <= phase["end"]]
    if len(inside) >= 2 and "total_energy_consumption" in inside[0]:
        span = inside[-1]["time"] - inside[0]["time"]
        watts = (inside[-1]["total_energy_consumption"] - inside[0]["total_energy_consumption"]) / 1000 / span
    else:
        inside = [row for row in inside if row["time"] >= phase["start"] + POWER_WINDOW_S]
        if len(inside) < 2:
            return None
        watts = statistics.mean(row["power.draw"] for row in inside)
    return {"clock_mhz": statistics.median(row["clocks.sm"] for row in inside), "watts": watts,
            "joules_per_pass": watts * phase["ms"] / 1000, "samples": len(inside)}


def energy_table(report: dict, samples: list[dict]) -> None:
    """Adds each back-to-back phase's energy to `report` and prints them. The pass's joules
    are compared with a quarter of gemm_x4's: four GEMMs back to back are the exact floor's
    work, and a lone GEMM phase idles between calls while do_bench clears the L2."""
    print(f"\n{'shape':18s} {'mode':8s} " + " ".join(f"{name:>22s}" for name in TIMED_PHASES)
          + "   (MHz / W / J per pass)")
    for run in report["runs"]:
        cells = []
        for name in TIMED_PHASES:
            run[name]["energy"] = energy = phase_energy(samples, run[name])
            cells.append(f"{energy['clock_mhz']:5.0f} {energy['watts']:5.0f} {energy['joules_per_pass']:7.3f}"
                         if energy else "-")
        if run["gemm_x4"]["energy"] and run["do_bench"]["energy"]:
            gemm_joules = run["gemm_x4"]["energy"]["joules_per_pass"] / 4
            run["joules_x_gemm"] = run["do_bench"]["energy"]["joules_per_pass"] / gemm_joules
            cells.append(f"pass = {run['joules_x_gemm']:.2f} x a GEMM's joules, "
                         f"{run['do_bench']['ms'] / run['gemm']['ms']:.2f} x its time")
        print(f"{run['shape']:18s} {run['mode']:8s} " + " ".join(f"{cell:>22s}" for cell in cells))


def rested_ms(step, passes: int = 5, rest_s: float = 0.3) -> float:
    """Median of single calls, each after the GPU has rested `rest_s`."""
    times = []
    for _ in range(passes):
        torch.cuda.synchronize()
        time.sleep(rest_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_allocs() -> int:
    """cudaMalloc calls so far: the caching allocator calls it (and cudaFree, which waits for
    the device) only when no cached block fits, so a phase that counts any paid for it."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8192x2304x256000,8192x4096x128256,16384x896x151936")
    parser.add_argument("--modes", default="exact,filtered", help="exact, filtered, forward (exact, no autograd)")
    parser.add_argument("--rep-ms", type=float, default=2000.0, help="do_bench's time per back-to-back phase")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--energy-of", action="store_true",
                        help="no run: recompute the energy table of --out from it and its .smi.csv")
    args = parser.parse_args()
    if args.energy_of:
        report = json.loads(args.out.read_text(encoding="utf-8"))
        energy_table(report, read_smi(args.out.with_suffix(".smi.csv"), report["smi_fields"]))
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        return
    smi, smi_fields = start_smi(args.out.with_suffix(".smi.csv"))
    report: dict = {"device": torch.cuda.get_device_name(), "smi_fields": smi_fields, "runs": []}

    def phase(run: dict, name: str, measure) -> None:
        started, allocs = time.time(), device_allocs()
        run[name] = {"ms": measure(), "start": started, "end": time.time(), "device_allocs": device_allocs() - allocs}
        print(f"  {name:9s} {run[name]['ms']:8.3f} ms = {run[name]['ms'] / run['gemm']['ms']:.3f} x GEMM, "
              f"{run[name]['device_allocs']} cudaMalloc", flush=True)

    for spec in args.shapes.split(","):
        shape = parse_shape(spec)
        e, c, targets = lm_like_inputs(shape.n, shape.d, shape.v, torch.bfloat16, "cuda", seed=0)
        e.requires_grad_()
        c.requires_grad_()
        e_plain, c_plain = e.detach(), c.detach()
        for mode in args.modes.split(","):
            run: dict = {"shape": spec, "mode": mode}
            print(f"{spec} {mode}", flush=True)
            phase(run, "gemm", lambda: triton.testing.do_bench(
                lambda: e_plain @ c_plain.T, rep=args.rep_ms, return_mode="median"))
            phase(run, "gemm_x4", lambda: triton.testing.do_bench(
                lambda: [e_plain @ c_plain.T for _ in range(4)], rep=args.rep_ms, return_mode="median"))

            step = pass_step(mode, e, c, targets)  # gradients cleared first, as grad_to_none does
            phase(run, "kernels", lambda: sum(t["ms"] for t in kernel_times(step, 1, True)[0].values()))
            phase(run, "rested", lambda: rested_ms(step))
            phase(run, "do_bench", lambda: triton.testing.do_bench(
                step, rep=max(args.rep_ms, 5 * run["rested"]["ms"]), grad_to_none=[e, c], return_mode="median"))
            phase(run, "rested_2", lambda: rested_ms(step))
            report["runs"].append(run)
            e.grad = c.grad = None
        torch.cuda.empty_cache()
    if smi is not None:
        smi.terminate()
        smi.wait()
        energy_table(report, read_smi(args.out.with_suffix(".smi.csv"), smi_fields))
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
