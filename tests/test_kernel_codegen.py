"""What the kernels compile to for an H100/H200 (sm_90), checked on CPU: Triton compiles for a
GPU target without a GPU. The interpreter tests check the arithmetic; these check that every
GEMM-shaped loop loads its operands with 16-byte asynchronous copies that Triton pipelines
into wgmma. Clamped indices once turned the gradient GEMMs' loads into 2-byte scalar ones
(filtered mode's sparse GEMMs ran at ~1/30 of cuBLAS per FLOP on the H200) and every
numerical test still passed.

The tests run under TRITON_INTERPRET=1, where kernels cannot be compiled, so the compiling
happens in a child process without it: this file run as a script prints what it found.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from cce_compile.config.kernel_config import TileConfig
from cce_compile.kernels.backward import grad_logits_kernel, grad_logits_tma_kernel, matmul_kernel, sparse_matmul_kernel
from cce_compile.kernels.forward import lse_forward_kernel, lse_forward_tma_kernel
from cce_compile.kernels.fused_forward import fused_forward_kernel, fused_forward_tma_kernel
from cce_compile.kernels.warp_specialized import fused_forward_ws_kernel, grad_logits_ws_kernel, lse_forward_ws_kernel
from cce_compile.ops.problem import stages_beside_output
from cce_compile.plan.policy import Policy

HOPPER = GPUTarget("cuda", 90, 32)
ONE = "one"
"""An integer argument equal to 1 (a unit stride), which Triton specializes."""
FALSE, TRUE = ("constexpr", False), ("constexpr", True)


def constexpr(value: Any) -> tuple[str, Any]:
    return ("constexpr", value)


def compile_for_hopper(kernel: Any, args: dict[str, Any], num_warps: int = 8, num_stages: int = 3) -> Any:
    """Compile `kernel` as a launch with these arguments would: pointers and other integers
    16-aligned (as the op's buffers and sizes are), unit strides specialized."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        kind = args[param.name]
        if isinstance(kind, tuple):
            signature[param.name] = "constexpr"
            constexprs[(index,)] = kind[1]
        elif kind == ONE:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = 1
        else:
            signature[param.name] = kind
            if kind.startswith("*") or kind in ("i32", "i64"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


def load_kinds(compiled: Any) -> dict[str, bool]:
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    return {
        "asynchronous copies": "async_copy_global_to_local" in ttgir,
        "16-byte copies": "cp.async.cg.shared.global" in ptx and ", 0x10," in ptx,
        "wgmma": "wgmma.mma_async" in ptx,
    }


def wgmma_pipelined(ptx: str) -> bool:
    """Whether ptxas keeps the wgmmas asynchronous. A non-wgmma instruction touching the
    accumulator between a wgmma and its wait (a branch that reads the dot's result does) makes
    it serialize every wgmma of the kernel and say so (C7514/C7515): lse_forward_tma_kernel
    went 0.93 -> 1.24 x GEMM at D = 8192 on the H200 that way, every test passing."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "kernel.ptx")
        source.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(source), "-o", str(source) + ".cubin"],
                              capture_output=True, text=True, check=True)
    return "serialized" not in done.stderr


def bare_exps(ptx: str) -> bool:
    """Whether every exponential is a bare ex2.approx.ftz (one MUFU.EX2): tl.exp's ex2.approx.f32
    carries a guard for denormal results, three more instructions per logit in the epilogues
    (Gemma-2's forward ran ~30 instructions per logit before tiles.exp_shifted, ~7 after)."""
    return "ex2.approx.ftz.f32" in ptx and "ex2.approx.f32" not in ptx


FLAGS = {"UPCAST": FALSE, "IEEE": FALSE}
GEMM = {
    "a_ptr": "*bf16", "a_offset": "i32", "b_ptr": "*bf16", "b_offset": "i64", "out_ptr": "*fp32",
    "out_offset": "i32", "final_ptr": "*bf16", "final_offset": "i32", "scale_ptr": "*fp32",
    "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "stride_on": ONE, "stride_fm": "i32", "stride_fn": ONE,
    "FINAL": FALSE, "SCALED": FALSE, "BLOCK_M": constexpr(128), "BLOCK_N": constexpr(128),
    "BLOCK_K": constexpr(64), "GROUP_M": constexpr(8), **FLAGS,
}
SPARSE = {
    "a_ptr": "*bf16", "b_ptr": "*bf16", "b_offset": "i32", "b_index_ptr": "*i64", "out_ptr": "*fp32",
    "out_offset": "i32", "out_index_ptr": "*i64", "final_ptr": "*bf16", "final_offset": "i32",
    "begin_ptr": "*i32", "count_ptr": "*i32", "lists_offset": "i32", "m_tiles": "i32",
    "step_bounds_ptr": "*i32", "step_index": "i32", "entry_slots_ptr": "*i32", "entry_tiles_ptr": "*i32",
    "entries_offset": "i32",
    "scale_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_bk": "i32", "stride_bn": ONE,
    "SKIP_EMPTY": FALSE, "FINAL": FALSE, "SCALED": FALSE, "BLOCK_N": constexpr(128), "BLOCK_K": constexpr(64),
    "GROUP_M": constexpr(8), **FLAGS,
}
# Per GEMM: which operand dimension is contiguous (stride 1) is what decides vectorization.
GEMMS = {
    "matmul dE += d_logits @ c[slab]": (matmul_kernel, {
        **GEMM, "stride_am": "i32", "stride_ak": ONE, "stride_bk": "i32", "stride_bn": ONE, "ACCUMULATE": TRUE}),
    "matmul dC = d_logits.T @ e": (matmul_kernel, {
        **GEMM, "out_ptr": "*bf16", "stride_am": ONE, "stride_ak": "i32", "stride_bk": "i32", "stride_bn": ONE,
        "ACCUMULATE": FALSE}),
    "sparse dE, gathered c rows": (sparse_matmul_kernel, {
        **SPARSE, "BY_COLUMN": FALSE, "STRIDED": FALSE, "ACCUMULATE": TRUE, "TILE_M": constexpr(128), "TILE_K": constexpr(256)}),
    # under a CUDA graph capture: a tile row with nothing kept returns at once
    "sparse dE, empty rows skipped": (sparse_matmul_kernel, {
        **SPARSE, "BY_COLUMN": FALSE, "STRIDED": FALSE, "SKIP_EMPTY": TRUE, "ACCUMULATE": TRUE, "TILE_M": constexpr(128),
        "TILE_K": constexpr(256)}),
    "sparse dC, scattered rows": (sparse_matmul_kernel, {
        **SPARSE, "out_ptr": "*bf16", "BY_COLUMN": TRUE, "STRIDED": FALSE, "ACCUMULATE": FALSE, "TILE_M": constexpr(256),
        "TILE_K": constexpr(128)}),
    # under a CUDA graph capture: each program walks the step's columns
    "sparse dC, strided columns": (sparse_matmul_kernel, {
        **SPARSE, "out_ptr": "*bf16", "BY_COLUMN": TRUE, "STRIDED": TRUE, "ACCUMULATE": TRUE, "TILE_M": constexpr(256),
        "TILE_K": constexpr(128)}),
}
LOGITS_TILE = {"BLOCK_M": constexpr(128), "BLOCK_N": constexpr(256), "BLOCK_K": constexpr(64),
               "GROUP_M": constexpr(8), "EVEN_K": TRUE, "HAS_BIAS": FALSE, "HAS_SOFTCAP": FALSE, "HAS_WEIGHT": FALSE,
               "LOGIT_SCALE": constexpr(1.0),
               "stride_en": "i32", "stride_ed": ONE, "stride_cv": "i32", "stride_cd": ONE, "softcap": "fp32",
               "e_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16", "targets_ptr": "*i64",
               "weight_ptr": "*fp32", "vocab_order_ptr": "*i64", "D": "i32", **FLAGS}
GRAD_LOGITS = {
    **LOGITS_TILE, "lse_ptr": "*fp32", "coef_softmax_ptr": "*fp32", "coef_target_ptr": "*fp32",
    "coef_smooth_ptr": "*fp32", "coef_entropy_ptr": "*fp32", "scale_ptr": "*fp32", "grad_logits_ptr": "*bf16",
    "tile_bias_sums_ptr": "*fp32", "step_tiles_ptr": "*i32",
    "step_counts_ptr": "*i32", "step_index": "i32", "capacity": "i32", "chunk_tile_rows": "i32", "row_start": "i32",
    "row_end": "i32", "col_start": "i32", "col_end": "i32", "stride_gm": "i32", "stride_gn": ONE,
    "HAS_SMOOTHING": FALSE, "HAS_ENTROPY": FALSE, "SCALED": FALSE,
}
LOGITS = {
    "lse_forward_kernel": (lse_forward_kernel, {
        **LOGITS_TILE, "partial_ptr": "*fp32", "tile_max_ptr": "*fp32", "N": "i32", "V": "i32",
        "tiles_per_split": "i32", "num_splits": "i32", "stat_stride": "i32", "stride_tile_max": "i32",
        "NEED_WEIGHTED_SUM": FALSE, "NEED_ENTROPY": FALSE, "FILTER": FALSE}),
    "grad_logits_kernel, filtered": (grad_logits_kernel, {**GRAD_LOGITS, "FILTER": TRUE, "STRIDED": FALSE}),
    # under a CUDA graph capture: each program walks the step's slots
    "grad_logits_kernel, filtered, strided": (grad_logits_kernel, {**GRAD_LOGITS, "FILTER": TRUE, "STRIDED": TRUE}),
    # with a bias: each slot's column sums stored beside it
    "grad_logits_kernel, filtered, bias": (grad_logits_kernel, {
        **GRAD_LOGITS, "HAS_BIAS": TRUE, "FILTER": TRUE, "STRIDED": FALSE}),
    # exact mode's recompute where K loops are short (Qwen2.5's D = 896)
    "grad_logits_kernel, exact": (grad_logits_kernel, {**GRAD_LOGITS, "FILTER": FALSE, "STRIDED": FALSE}),
    "fused_forward_kernel": (fused_forward_kernel, {
        **{name: value for name, value in LOGITS_TILE.items() if name != "vocab_order_ptr"},
        "shift_ptr": "*fp32", "workspace_ptr": "*bf16", "stats_ptr": "*fp32", "target_logit_ptr": "*fp32",
        "redo_ptr": "*i32", "row_start": "i32", "rows": "i32", "V": "i32", "stat_stride": "i32", "stride_w": "i32",
        "NEED_WEIGHTED_SUM": FALSE, "REDO": FALSE}),
}

TEMPERATURE = constexpr(1 / 0.7)
"""LOGIT_SCALE at a sampling temperature of 0.7."""
H200_SHARED_MEMORY = 232448
"""What one program may opt into on an H100/H200 (cudaDevAttrMaxSharedMemoryPerBlockOptin)."""
TMA_STAGES = stages_beside_output(TileConfig(128, 256, 64, 8, 8, 4), 2, H200_SHARED_MEMORY)
GRAD_LOGITS_TMA = {
    **{name: LOGITS_TILE[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "HAS_BIAS", "HAS_SOFTCAP",
                                            "HAS_WEIGHT", "LOGIT_SCALE", "softcap", "bias_ptr", "targets_ptr",
                                            "weight_ptr", "D")},
    "e_desc": "tensordesc<bf16[128, 64]>", "c_desc": "tensordesc<bf16[256, 64]>",
    "grad_logits_desc": "tensordesc<bf16[128, 256]>", "lse_ptr": "*fp32", "coef_softmax_ptr": "*fp32",
    "coef_target_ptr": "*fp32", "coef_smooth_ptr": "*fp32", "coef_entropy_ptr": "*fp32", "scale_ptr": "*fp32",
    "row_start": "i32", "rows": "i32", "col_start": "i32", "cols": "i32", "num_programs": "i32",
    "HAS_SMOOTHING": FALSE, "HAS_ENTROPY": FALSE, "SCALED": FALSE, **FLAGS,
}

LSE_FORWARD_TMA = {
    **{name: GRAD_LOGITS_TMA[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "HAS_BIAS", "HAS_SOFTCAP",
                                                "HAS_WEIGHT", "LOGIT_SCALE", "softcap", "bias_ptr", "targets_ptr",
                                                "weight_ptr", "D", "e_desc", "c_desc", "num_programs", "UPCAST",
                                                "IEEE")},
    "tile_lse_ptr": "*fp32", "target_logit_ptr": "*fp32", "tile_weighted_sum_ptr": "*fp32", "tile_max_ptr": "*fp32",
    "tile_entropy_ptr": "*fp32", "N": "i32", "row_start": "i32", "rows_in_launch": "i32", "V": "i32",
    "NEED_WEIGHTED_SUM": FALSE, "NEED_ENTROPY": FALSE, "NEED_LSE_MINUS_MEAN": FALSE, "STORE_TILE_MAX": FALSE,
}
FUSED_FORWARD_TMA = {
    **{name: LSE_FORWARD_TMA[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "HAS_BIAS", "HAS_SOFTCAP",
                                                "HAS_WEIGHT", "LOGIT_SCALE", "softcap", "bias_ptr", "targets_ptr",
                                                "weight_ptr", "D",
                                                "e_desc", "c_desc", "num_programs", "UPCAST", "IEEE", "V",
                                                "row_start", "target_logit_ptr", "NEED_WEIGHTED_SUM")},
    "workspace_desc": "tensordesc<bf16[128, 256]>", "shift_ptr": "*fp32", "stats_ptr": "*fp32", "rows": "i32",
    "stat_stride": "i32",
}
PERSISTENT = {
    "grad_logits_tma_kernel": (grad_logits_tma_kernel, GRAD_LOGITS_TMA, TMA_STAGES),
    "fused_forward_tma_kernel": (fused_forward_tma_kernel, FUSED_FORWARD_TMA, TMA_STAGES),
    "lse_forward_tma_kernel": (lse_forward_tma_kernel, LSE_FORWARD_TMA, 4),
    "lse_forward_tma_kernel, filtered": (lse_forward_tma_kernel, {**LSE_FORWARD_TMA, "STORE_TILE_MAX": TRUE}, 4),
    # filtered linear_log_probs with entropy: the tile entropies' plane stored too
    "lse_forward_tma_kernel, filtered, entropy": (
        lse_forward_tma_kernel, {**LSE_FORWARD_TMA, "STORE_TILE_MAX": TRUE, "NEED_ENTROPY": TRUE}, 4),
    # ... whose backward will run: each tile's lse less its mean logit stored too, filtered or not
    "lse_forward_tma_kernel, entropy backward": (
        lse_forward_tma_kernel, {**LSE_FORWARD_TMA, "NEED_ENTROPY": TRUE, "NEED_LSE_MINUS_MEAN": TRUE}, 4),
    "lse_forward_tma_kernel, filtered, entropy backward": (lse_forward_tma_kernel, {
        **LSE_FORWARD_TMA, "STORE_TILE_MAX": TRUE, "NEED_ENTROPY": TRUE, "NEED_LSE_MINUS_MEAN": TRUE}, 4),
    # a temperature: the logits scaled in fp32 between the dot and the epilogue
    "lse_forward_tma_kernel, temperature": (lse_forward_tma_kernel, {**LSE_FORWARD_TMA, "LOGIT_SCALE": TEMPERATURE}, 4),
    "fused_forward_tma_kernel, temperature": (
        fused_forward_tma_kernel, {**FUSED_FORWARD_TMA, "LOGIT_SCALE": TEMPERATURE}, TMA_STAGES),
    # Gemma-2's soft-cap: tiles.tanh's exponential bare too
    "grad_logits_tma_kernel, softcap": (grad_logits_tma_kernel, {**GRAD_LOGITS_TMA, "HAS_SOFTCAP": TRUE}, TMA_STAGES),
}


SIZE_PRODUCTS = {
    "offsets of lse_forward_kernel, filtered": (
        lse_forward_kernel, {**LOGITS["lse_forward_kernel"][1], "FILTER": TRUE, "NEED_WEIGHTED_SUM": TRUE},
        [("N", "stride_tile_max"), ("stat_stride", "c2_i32"), ("stat_stride", "c3_i32")]),
    "offsets of lse_forward_tma_kernel, filtered": (
        lse_forward_tma_kernel, PERSISTENT["lse_forward_tma_kernel, filtered"][1], [("N", "num_n")]),
    "offsets of lse_forward_kernel, filtered, entropy": (
        lse_forward_kernel, {**LOGITS["lse_forward_kernel"][1], "FILTER": TRUE, "NEED_ENTROPY": TRUE},
        [("N", "stride_tile_max"), ("stat_stride", "c3_i32")]),
    "offsets of lse_forward_tma_kernel, filtered, entropy": (
        lse_forward_tma_kernel, PERSISTENT["lse_forward_tma_kernel, filtered, entropy"][1], [("N", "num_n")]),
    "offsets of lse_forward_tma_kernel, entropy backward": (
        lse_forward_tma_kernel, PERSISTENT["lse_forward_tma_kernel, entropy backward"][1], [("N", "num_n")]),
    "offsets of lse_forward_tma_kernel, filtered, entropy backward": (
        lse_forward_tma_kernel, PERSISTENT["lse_forward_tma_kernel, filtered, entropy backward"][1],
        [("N", "num_n")]),
}
"""Kernels whose offsets multiply sizes (N x vocab tiles, 2 and 3 x splits x N), and those
products' operands as the TTIR names them: in 32 bits they wrap at sizes an H200 holds
(N = 2^20, V = 2^18 gives N x ceil(V / 64) = 2^32)."""


def size_products_in_i32(ttir: str, products: list[tuple[str, str]]) -> list[str]:
    """The TTIR lines that multiply one of `products`' operand pairs in 32 bits."""
    found = []
    for a, b in products:
        names = rf"%{a}(_\d+)?, %{b}(_\d+)?|%{b}(_\d+)?, %{a}(_\d+)?"
        pattern = re.compile(rf"arith\.muli ({names}) : i32\b")
        found += [line.strip() for line in ttir.splitlines() if pattern.search(line)]
    return found


H200_SHARED_MEMORY_PER_SM = 233472
"""An SM's shared memory on an H100/H200 (cudaDevAttrMaxSharedMemoryPerMultiprocessor), of
which the driver reserves 1 KiB per resident program."""


def compile_warp_specialized(kernel: Any, pointers: dict[str, str], integers: list[str], constexprs: dict[str, Any],
                              descriptors: dict[str, int]) -> Any:
    """A Gluon kernel (kernels/warp_specialized.py) as the op launches it: bf16 descriptors of
    `descriptors`' row counts by the tile's K step, pointers and integers 16-aligned, two
    programs per SM (maxnreg 128)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(rows: int) -> str:
        block = [rows, Policy().gluon_tile.block_k]
        return f"tensordesc<bf16[{rows}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"

    kinds = {name: descriptor(rows) for name, rows in descriptors.items()} | pointers | dict.fromkeys(integers, "i32")
    signature = {param.name: kinds.get(param.name, "constexpr") for param in kernel.params}
    names = list(signature)
    source = GluonASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(name),): value for name, value in constexprs.items()},
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in [*pointers, *integers]},
    )
    return triton.compile(source, target=HOPPER, options={"num_warps": 4, "maxnreg": 128})


def warp_specialized_kinds(compiled: Any) -> dict[str, bool]:
    ptx = compiled.asm["ptx"]
    return {
        "bulk tensor copies": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma.mma_async" in ptx,
        "two fit an SM": 2 * (compiled.metadata.shared + 1024) <= H200_SHARED_MEMORY_PER_SM,
        "bare exps": bare_exps(ptx), "wgmma pipelined": wgmma_pipelined(ptx),
    }


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, bool]]:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.test_kernel_codegen"], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [*GEMMS, *LOGITS])
def test_operands_load_with_pipelined_16_byte_copies(name: str, compiled: dict[str, dict[str, bool]]) -> None:
    expected = {"asynchronous copies": True, "16-byte copies": True, "wgmma": True}
    if name in LOGITS:
        expected["bare exps"] = expected["wgmma pipelined"] = True
    assert compiled[name] == expected


@pytest.mark.parametrize("name", PERSISTENT)
def test_persistent_kernels_copy_with_the_tensor_engine_and_fit(name: str, compiled: dict[str, dict[str, bool]]) -> None:
    """The tensor-descriptor kernels at the H200's bundled tile (128 x 256 x 64, 8 warps; the
    recompute with the stages stages_beside_output leaves it, the forward with 4): bulk
    tensor copies, wgmma, and shared memory (pipeline, plus the recompute's staged output
    tile) within what a program may use."""
    assert TMA_STAGES == 3
    assert compiled[name] == {
        "bulk tensor copies": True, "wgmma": True, "fits": True, "bare exps": True, "wgmma pipelined": True,
    }


@pytest.mark.parametrize("name", SIZE_PRODUCTS)
def test_size_products_in_offsets_are_64_bit(name: str, compiled: dict[str, Any]) -> None:
    assert compiled[name] == {"32-bit size products": []}


@pytest.mark.parametrize("name", ["lse_forward_ws_kernel", "grad_logits_ws_kernel", "fused_forward_ws_kernel",
                                  "lse_forward_ws_kernel (entropy)", "grad_logits_ws_kernel (entropy)"])
def test_warp_specialized_kernels_fit_two_programs_per_sm(name: str, compiled: dict[str, dict[str, bool]]) -> None:
    """The Gluon kernels (kernels/warp_specialized.py) at the op's tile: bulk tensor copies into
    wgmma kept asynchronous, bare exps, and two programs' shared memory on one SM (the
    recompute's with its half tile staged for the store), with linear_log_probs' entropy (and a
    temperature) too."""
    assert compiled[name] == {
        "bulk tensor copies": True, "wgmma": True, "two fit an SM": True, "bare exps": True, "wgmma pipelined": True,
    }


if __name__ == "__main__":
    found = {name: load_kinds(compile_for_hopper(kernel, args)) for name, (kernel, args) in GEMMS.items()}
    for name, (kernel, args) in LOGITS.items():
        logits = compile_for_hopper(kernel, args, num_stages=4)
        ptx = logits.asm["ptx"]
        found[name] = {**load_kinds(logits), "bare exps": bare_exps(ptx), "wgmma pipelined": wgmma_pipelined(ptx)}
    for name, (kernel, args, stages) in PERSISTENT.items():
        tma = compile_for_hopper(kernel, args, num_stages=stages)
        found[name] = {
            "bulk tensor copies": "cp.async.bulk.tensor" in tma.asm["ptx"], "wgmma": "wgmma.mma_async" in tma.asm["ptx"],
            "fits": tma.metadata.shared <= H200_SHARED_MEMORY, "bare exps": bare_exps(tma.asm["ptx"]),
            "wgmma pipelined": wgmma_pipelined(tma.asm["ptx"]),
        }
    for name, (kernel, args, sizes) in SIZE_PRODUCTS.items():
        ttir = compile_for_hopper(kernel, args, num_stages=4).asm["ttir"]
        found[name] = {"32-bit size products": size_products_in_i32(ttir, sizes)}
    tile = Policy().gluon_tile
    for entropy in (False, True):  # linear_log_probs' entropy: the entropy statistic, the d-logits term
        suffix = " (entropy)" * entropy
        found["lse_forward_ws_kernel" + suffix] = warp_specialized_kinds(compile_warp_specialized(
            lse_forward_ws_kernel,
            {"targets_ptr": "*i64", "tile_lse_ptr": "*fp32", "target_logit_ptr": "*fp32", "tile_entropy_ptr": "*fp32"},
            ["N", "row_start", "rows_in_launch", "V", "D"],
            {"GROUP_M": tile.group_m, "STAGES": tile.num_stages, "NEED_ENTROPY": entropy,
             "LOGIT_SCALE": TEMPERATURE[1] if entropy else 1.0},
            {"e_desc": tile.block_m, "c_desc": tile.block_n},
        ))
        found["grad_logits_ws_kernel" + suffix] = warp_specialized_kinds(compile_warp_specialized(
            grad_logits_ws_kernel,
            {"targets_ptr": "*i64", "lse_ptr": "*fp32", "coef_softmax_ptr": "*fp32", "coef_target_ptr": "*fp32",
             "coef_entropy_ptr": "*fp32", "scale_ptr": "*fp32"},
            ["row_start", "rows", "col_start", "cols", "D"],
            {"GROUP_M": tile.group_m, "STAGES": tile.num_stages, "SCALED": False, "HAS_ENTROPY": entropy,
             "LOGIT_SCALE": TEMPERATURE[1] if entropy else 1.0},
            {"e_desc": tile.block_m, "c_desc": tile.block_n, "grad_logits_desc": tile.block_m},
        ))
    found["fused_forward_ws_kernel"] = warp_specialized_kinds(compile_warp_specialized(
        fused_forward_ws_kernel,
        {"targets_ptr": "*i64", "shift_ptr": "*fp32", "stats_ptr": "*fp32", "target_logit_ptr": "*fp32"},
        ["stat_stride", "row_start", "rows", "V", "D"], {"GROUP_M": tile.group_m, "STAGES": tile.num_stages,
                                                         "LOGIT_SCALE": 1.0},
        {"e_desc": tile.block_m, "c_desc": tile.block_n, "workspace_desc": tile.block_m},
    ))
    print(json.dumps(found))
