"""Probe: do persistent tensor-descriptor (TMA) logits kernels, warp-specialized or not, beat
the op's logits kernels on the H200? Times, per shape and against one cuBLAS GEMM:
the op's exact forward, a persistent lse kernel (WS off / on), the op's recompute of one
slab and a persistent recompute of the same slab. `--compile-only` compiles the probes for
sm_90 on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from cce_compile.kernels.tiles import grouped_tile, logits_tile_tma


@triton.jit
def tile_dot(e_desc, c_desc, tile, N, V, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr):
    """Tile `tile`'s (row block, vocab tile) and its raw logits."""
    pid_m, pid_n = grouped_tile(tile, tl.cdiv(N, BLOCK_M), tl.cdiv(V, BLOCK_N), GROUP_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = logits_tile_tma(e_desc, c_desc, None, pid_m * BLOCK_M, pid_n * BLOCK_N, cols, cols < V, D, 0.0,
                          False, False, BLOCK_M, BLOCK_N, BLOCK_K, False, False)
    return acc, pid_m, pid_n


@triton.jit
def lse_persistent(
    e_ptr, c_ptr, targets_ptr, partial_ptr, target_logit_ptr, N, V, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr,
):
    e_desc = tl.make_tensor_descriptor(e_ptr, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_M, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[V, D], strides=[D, 1], block_shape=[BLOCK_N, BLOCK_K])
    num_n = tl.cdiv(V, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.cdiv(N, BLOCK_M) * num_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        acc, pid_m, pid_n = tile_dot(e_desc, c_desc, tile, N, V, D, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
        logits = tl.where(cols[None, :] < V, acc, float("-inf"))
        tile_max = tl.max(logits, axis=1)
        sumexp = tl.sum(tl.exp(logits - tile_max[:, None]), axis=1)
        out = partial_ptr + pid_n.to(tl.int64) * N + rows
        tl.store(out, tile_max, mask=row_mask)
        tl.store(out + num_n.to(tl.int64) * N, sumexp, mask=row_mask)
        hit = (targets >= pid_n * BLOCK_N) & (targets < pid_n * BLOCK_N + BLOCK_N) & row_mask
        target = tl.sum(tl.where(cols[None, :] == targets[:, None], acc, 0.0), axis=1)
        tl.store(target_logit_ptr + rows, target, mask=hit)


@triton.jit
def recompute_persistent(
    e_ptr, c_ptr, lse_ptr, grad_ptr, N, V, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr,
):
    """softmax of rows x V written as bf16 (the exact backward's d-logits without coefficients)."""
    g_desc = tl.make_tensor_descriptor(grad_ptr, shape=[N, V], strides=[V, 1], block_shape=[BLOCK_M, BLOCK_N])
    e_desc = tl.make_tensor_descriptor(e_ptr, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_M, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[V, D], strides=[D, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles = tl.cdiv(N, BLOCK_M) * tl.cdiv(V, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        acc, pid_m, pid_n = tile_dot(e_desc, c_desc, tile, N, V, D, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_ptr + rows, mask=rows < N, other=0.0)
        g_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], tl.exp(acc - lse[:, None]).to(tl.bfloat16))


VARIANTS = [  # (name, WS, FLATTEN, num_warps, num_stages)
    ("plain-w8-s3", False, False, 8, 3),
    ("plain-w8-s4", False, False, 8, 4),
    ("flat-w8-s4", False, True, 8, 4),
    ("ws-w4-s3", True, False, 4, 3),
    ("ws-w4-s4", True, False, 4, 4),
    ("ws-w4-s2", True, False, 4, 2),
]


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 64)
    common = {"N": "i32", "V": "i32", "D": "i32", "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "NUM_SMS": 132}
    kernels = {
        "lse": (lse_persistent, {"e_ptr": "*bf16", "c_ptr": "*bf16", "targets_ptr": "*i64", "partial_ptr": "*fp32", "target_logit_ptr": "*fp32"}),
        "recompute": (recompute_persistent, {"e_ptr": "*bf16", "c_ptr": "*bf16", "lse_ptr": "*fp32", "grad_ptr": "*bf16"}),
    }
    for kname, (kernel, ptrs) in kernels.items():
        for name, ws, flatten, warps, stages in VARIANTS:
            args = {**ptrs, **common, "WS": ws, "FLATTEN": flatten}
            signature, constexprs, attrs = {}, {}, {}
            for index, param in enumerate(kernel.params):
                kind = args[param.name]
                if isinstance(kind, (bool, int)) and not isinstance(kind, str):
                    signature[param.name] = "constexpr"
                    constexprs[(index,)] = kind
                else:
                    signature[param.name] = kind
                    attrs[(index,)] = [["tt.divisibility", 16]]
            try:
                compiled = triton.compile(
                    ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                    target=target, options={"num_warps": warps, "num_stages": stages},
                )
                ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
                print(kname, name, "ws" if "ttg.warp_specialize" in ttgir else "-",
                      "tma" if "cp.async.bulk.tensor" in ptx else "-", "wgmma" if "wgmma" in ptx else "-",
                      "setmaxnreg" if "setmaxnreg" in ptx else "-", "local" if ".local" in ptx else "-",
                      "smem", compiled.metadata.shared, "warps", compiled.metadata.num_warps)
            except Exception as error:  # noqa: BLE001 - a probe reports every failure
                print(kname, name, "FAILED", type(error).__name__, str(error).splitlines()[0][:200])


def run(shapes: list[tuple[int, int, int]], out: str) -> None:
    from triton.testing import do_bench

    from cce_compile.bench.inputs import lm_like_inputs
    from cce_compile.ops.forward import linear_cross_entropy_forward

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for n, d, v in shapes:
        e, c, targets = lm_like_inputs(n, d, v, torch.bfloat16, "cuda", seed=0)
        row = {"shape": [n, d, v]}
        gemm = do_bench(lambda: e @ c.T, warmup=50, rep=300)
        row["gemm_ms"] = gemm
        op = lambda: linear_cross_entropy_forward(e, c, targets, None, None, -100, 0.0, 0.0, 0.0)  # noqa: E731
        row["op_forward"] = do_bench(op, warmup=50, rep=300) / gemm
        lse_ref = torch.logsumexp(e[:512].float() @ c.float().T, dim=1)
        num_n = triton.cdiv(v, 256)
        partial = torch.empty((2, num_n, n), dtype=torch.float32, device="cuda")
        target_logit = torch.empty(n, dtype=torch.float32, device="cuda")
        slab_v = 4096
        grad = torch.empty((n, slab_v), dtype=torch.bfloat16, device="cuda")
        lse = op()[1]
        slab_gemm = do_bench(lambda: e @ c[:slab_v].T, warmup=50, rep=300)
        row["slab_gemm_ms"] = slab_gemm
        for name, ws, flatten, warps, stages in VARIANTS:
            try:
                def lse_call() -> torch.Tensor:
                    lse_persistent[(sms,)](e, c, targets, partial, target_logit, n, v, d, 128, 256, 64, 8, sms, ws, flatten,
                                           num_warps=warps, num_stages=stages)
                    return torch.logsumexp(partial[0] + partial[1].log(), dim=0)
                got = lse_call()
                row[f"lse_{name}"] = do_bench(lse_call, warmup=50, rep=300) / gemm
                row[f"lse_{name}_kernel_only"] = do_bench(
                    lambda: lse_persistent[(sms,)](e, c, targets, partial, target_logit, n, v, d, 128, 256, 64, 8, sms, ws, flatten,
                                                   num_warps=warps, num_stages=stages), warmup=50, rep=300) / gemm
                row[f"lse_{name}_err"] = (got - lse).abs().max().item()
                row[f"lse_{name}_err_fp32"] = (got[:512] - lse_ref).abs().max().item()
                rec = lambda: recompute_persistent[(sms,)](e, c[:slab_v], lse, grad, n, slab_v, d, 128, 256, 64, 8, sms, ws, flatten,  # noqa: E731
                                                           num_warps=warps, num_stages=stages)
                rec()
                ref = torch.exp((e[:256].float() @ c[:slab_v].float().T) - lse[:256, None])
                row[f"rec_{name}_err"] = (grad[:256].float() - ref).abs().max().item()
                row[f"rec_{name}"] = do_bench(rec, warmup=50, rep=300) / slab_gemm
            except Exception as error:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row.update(op_recompute_slab=recompute_slab_ratio(e, c, targets, lse, slab_v, slab_gemm))
        print(json.dumps(row), flush=True)
        results.append(row)
        del e, c, targets, partial, grad
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def recompute_slab_ratio(e, c, targets, lse, slab_v, slab_gemm) -> float:
    """The op's grad_logits_kernel on the same N x slab_v slab, its bundled tile."""
    from triton.testing import do_bench

    from cce_compile.kernels.backward import grad_logits_kernel
    from cce_compile.ops.dispatch import config_for

    tile = config_for(e, c, 0.0).grad_logits
    n, d = e.shape
    grad = torch.empty((n, slab_v), dtype=e.dtype, device=e.device)
    coef = torch.ones(n, dtype=torch.float32, device=e.device)
    grid = (triton.cdiv(n, tile.block_m) * triton.cdiv(slab_v, tile.block_n),)

    def call() -> None:
        grad_logits_kernel[grid](
            e, c, None, targets, None, lse, coef, coef, coef, coef, targets, grad, targets, targets, 0, 0, 1,
            0, n, 0, slab_v, d, e.stride(0), e.stride(1), c.stride(0), c.stride(1), grad.stride(0), grad.stride(1), 0.0,
            HAS_BIAS=False, HAS_SOFTCAP=False, HAS_WEIGHT=False, HAS_SMOOTHING=False, FILTER=False, SCALED=False,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
            EVEN_K=d % tile.block_k == 0, UPCAST=False, IEEE=False, num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
    return do_bench(call, warmup=50, rep=300) / slab_gemm


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--out", default="probe-persistent.json")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        sys.exit(0)
    run([(8192, 2304, 256000), (8192, 4096, 128256), (16384, 896, 151936), (4096, 8192, 128256)], args.out)
