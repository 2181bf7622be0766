"""KernelConfig validation and the backward's memory plan."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from cce_compile.config.kernel_config import ConfigError, KernelConfig
from cce_compile.config.keys import ProblemKey, n_bucket
from cce_compile.plan.backward import BackwardPlan, plan_backward, planning_tokens
from cce_compile.plan.tokens import traced_n_bucket
from cce_compile.plan.policy import Policy
from cce_compile.resolve.heuristic import heuristic_config

POLICY = Policy()
SCRATCH_FRACTION = POLICY.scratch_fraction
FILTERED_SCRATCH_FRACTION = POLICY.filtered_scratch_fraction
OTHER_BUFFERS_FRACTION = POLICY.other_buffers_fraction
MAX_DC_ROUNDINGS = POLICY.max_dc_roundings
SCRATCH_FLOOR_BYTES = POLICY.scratch_floor_bytes


def test_round_trip_through_json() -> None:
    config = KernelConfig()
    assert KernelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"forward": {"block_m": 48}}, "forward.block_m must be a power of two"),
        ({"forward": {"block_m": 512}}, r"forward.block_m must be in \[16, 256\]"),
        ({"grad_hidden": {"num_warps": 3}}, "grad_hidden.num_warps must be one of"),
        ({"grad_logits": {"num_stages": 0}}, r"grad_logits.num_stages must be in \[1, 8\]"),
        ({"slab_v": "4096"}, "slab_v must be an integer, got str"),
        ({"slab_v": True}, "slab_v must be an integer, got bool"),
        ({"forward": {"pre_hook": "os.system('x')"}}, "forward has unknown keys"),
        ({"evil": 1}, "config has unknown keys"),
        ([1, 2], "config must be an object"),
        ({"forward": 3}, "forward must be an object"),
    ],
)
def test_rejects_malformed_configs(data, pattern) -> None:
    with pytest.raises(ConfigError, match=pattern):
        KernelConfig.from_dict(data)


def test_shared_memory_limit() -> None:
    config = KernelConfig.from_dict({"forward": {"block_m": 256, "block_n": 256, "block_k": 128, "num_stages": 4}})
    with pytest.raises(ConfigError, match="forward needs"):
        config.check_limits(shared_memory_bytes=232448, element_bytes=2)


@pytest.mark.parametrize(("n", "d", "v"), [(8192, 2304, 256000), (8192, 4096, 128256), (16384, 896, 151936)])
def test_backward_scratch_fits_ten_percent_of_the_gradients(n: int, d: int, v: int) -> None:
    plan = plan_backward(n_bucket(n), v, d, 2, KernelConfig())
    grads = (n * d + v * d) * 2
    assert plan.scratch_bytes(n_bucket(n), d, 2, KernelConfig().grad_logits.block_m) <= SCRATCH_FRACTION * grads
    assert plan.slab_v >= 1024, "slabs this narrow would starve the GEMMs"


@pytest.mark.parametrize(("n", "d", "v"), [(8192, 2304, 256000), (8192, 4096, 128256), (16384, 896, 151936)])
def test_filtered_slots_fill_their_own_budget(n: int, d: int, v: int) -> None:
    """Filtered mode's steps hold kept tiles: more slots than exact mode's slab holds, with
    the fp32 accumulator still inside FILTERED_SCRATCH_FRACTION of the gradients."""
    config = KernelConfig()
    tile = config.grad_logits
    exact, filtered = (plan_backward(n_bucket(n), v, d, 2, config, mode) for mode in (False, True))
    rows = -(-n_bucket(n) // filtered.n_chunks)
    scratch = rows * d * 4 + filtered.slots * tile.block_m * tile.block_n * 2
    assert scratch <= FILTERED_SCRATCH_FRACTION * (n * d + v * d) * 2
    exact_slots = -(-n_bucket(n) // exact.n_chunks // tile.block_m) * (exact.slab_v // tile.block_n)
    assert exact_slots < filtered.slots
    assert exact.slots == 0


@pytest.mark.parametrize("n", [4096, 16384])
@pytest.mark.parametrize(("d", "v"), [(2304, 256000), (4096, 128256), (896, 151936), (8192, 128256)])
def test_untuned_exact_plans_take_the_least_traffic_within_the_budget(n: int, d: int, v: int) -> None:
    """Where no config was tuned, exact mode's slab cap leaves the plan to the traffic model:
    the same plan as with no cap at all, and wider slabs than 4096 where they fit (Gemma-2
    and Llama-3, which won on the H200 at the power limit). Filtered mode keeps 4096."""
    bucket = n_bucket(n)
    config = heuristic_config(ProblemKey("cuda", v, d, "bfloat16", bucket, "exact"))
    uncapped = plan_backward(bucket, v, d, 2, replace(config, slab_v=65536))
    assert plan_backward(bucket, v, d, 2, config) == uncapped
    if d in (2304, 4096):
        assert uncapped.slab_v > 4096
    assert heuristic_config(ProblemKey("cuda", v, d, "bfloat16", bucket, "filtered")).slab_v == 4096


@pytest.mark.parametrize(("n", "d", "v"), [(65536, 896, 151936), (131072, 896, 151936), (65536, 4096, 128256)])
def test_large_batches_round_dc_at_most_sixteen_times(n: int, d: int, v: int) -> None:
    """dC sums over token chunks in bf16, one rounding per chunk: where a plan of at most
    MAX_DC_ROUNDINGS chunks fits the budget it is taken, though the traffic model alone would
    take more chunks on Qwen2.5's head from N = 65536."""
    bucket = n_bucket(n)
    config = heuristic_config(ProblemKey("cuda", v, d, "bfloat16", bucket, "exact"))
    plan = plan_backward(bucket, v, d, 2, config)
    assert plan.n_chunks <= MAX_DC_ROUNDINGS
    assert plan.scratch_bytes(bucket, d, 2, config.grad_logits.block_m) <= SCRATCH_FRACTION * (n * d + v * d) * 2
    if d == 896 and n == 65536:
        unbounded = replace(POLICY, max_dc_roundings=1 << 20)
        assert plan_backward(bucket, v, d, 2, config, policy=unbounded).n_chunks > MAX_DC_ROUNDINGS


def test_a_known_token_count_is_planned_for_itself_a_traced_one_for_its_bucket() -> None:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    symbolic = shape_env.create_symintnode(shape_env.create_symbol(20000, source=ConstantSource("n")), hint=20000)
    assert planning_tokens(20000) == 20000
    assert planning_tokens(0) == 1
    assert planning_tokens(symbolic) == 32768


def _symbols(*values: int) -> tuple:
    """Backed sizes of a fresh ShapeEnv, as torch.compile traces dynamic dimensions (range 2..inf)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    return shape_env, *(shape_env.create_symintnode(shape_env.create_symbol(value, source=ConstantSource(f"s{i}")),
                                                    hint=value) for i, value in enumerate(values))


@pytest.mark.parametrize(("n_of", "values", "bucket"), [
    (lambda s: s, (100,), 128),  # a sequence dimension: one graph per bucket
    (lambda s: 512 * s, (3,), 2048),  # batch 3 of 512: (1024, 2048] holds batches 3 and 4
    (lambda s: 512 * s, (2,), 2048),  # batch 2 of 512 is alone in (512, 1024]: N <= 2048, batches 2-4
    (lambda s: 5 * s, (2,), 16),  # batch 2 of 5: (8, 16] holds batches 2 and 3
    (lambda s: 10 * (s - 1), (2,), 32),  # 10 x (s - 1) at s = 2: 20, the next N, passes 16
    (lambda s, t: s * t, (2, 2), 8),  # both dimensions at their minimum: N = 4 alone in (2, 4]
    (lambda s, t: s * t, (5, 2), 16),
])
def test_a_traced_n_guards_its_bucket_without_pinning_a_dimension(n_of, values, bucket) -> None:
    """plan.tokens.traced_n_bucket: the traced value's bucket, guarded (one graph per bucket);
    where N, at its least value, has no other value in its bucket, N <= twice the bucket
    (mark_dynamic refuses a guard that pins its dimension): every dimension keeps a range."""
    shape_env, *symbols = _symbols(*values)
    assert traced_n_bucket(n_of(*symbols)) == bucket
    assert shape_env.guards
    for symbol in symbols:
        value_range = shape_env.bound_sympy(symbol.node.expr)
        assert value_range.lower < value_range.upper, f"{symbol} pinned to {value_range}"
    assert planning_tokens(n_of(*symbols)) == bucket  # the same function decides the plan's


@pytest.mark.parametrize(("n", "d", "v"), [
    (20000, 896, 151936), (12000, 4096, 128256), (12288, 3584, 152064), (24000, 2048, 128256),
    (10000, 2304, 256000), (3000, 8192, 128256), (16376, 896, 151936), (5000, 4096, 128256),
])
def test_token_counts_between_powers_of_two_fill_their_own_budget(n: int, d: int, v: int) -> None:
    """Planned for N itself, a chunk's padded rows, accumulator and slab stay within 10% of the
    gradients less the op's other buffers, and are never smaller than the bucket's plan makes
    them: Qwen2.5's head at N = 20000 takes 8 chunks of 2560 rows where its bucket's plan took
    16 of 1280 (608 steps; 5.34 -> 4.84 x GEMM on the H200)."""
    config = heuristic_config(ProblemKey("cuda", v, d, "bfloat16", n_bucket(n), "exact"))
    block_m = config.grad_logits.block_m
    own, bucket = plan_backward(n, v, d, 2, config), plan_backward(n_bucket(n), v, d, 2, config)
    grads = (n * d + v * d) * 2
    assert own.scratch_bytes(n, d, 2, block_m) <= (SCRATCH_FRACTION - OTHER_BUFFERS_FRACTION) * grads
    assert own.chunk_rows(n, block_m) * own.slab_v >= bucket.chunk_rows(n, block_m) * bucket.slab_v
    if (n, d) == (20000, 896):
        assert (own.n_chunks, own.slab_v, bucket.n_chunks) == (8, 4096, 16)


def test_small_problems_take_a_few_large_slab_steps() -> None:
    """A 32k x 512 head over 4096 tokens: 10% of its gradients would mean ~100 slab steps;
    the floor lets it take a handful, still within the floor."""
    n, d, v = 4096, 512, 32000
    config = KernelConfig()
    plan = plan_backward(n_bucket(n), v, d, 2, config)
    steps = plan.n_chunks * -(-v // plan.slab_v)
    assert steps <= 16
    assert SCRATCH_FRACTION * (n * d + v * d) * 2 < plan.scratch_bytes(n, d, 2, config.grad_logits.block_m) <= SCRATCH_FLOOR_BYTES


def test_n_bucket() -> None:
    assert [n_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]


def test_kernel_version_follows_the_launched_code_only() -> None:
    """Comments, docstrings and layout do not change what a kernel compiles to; code does."""
    from cce_compile.resolve.platform import launched_source

    kernel = 'def f(x):\n    """Why."""\n    # a note\n    return x + 1  # another\n'
    same = "def f(x):\n\n    return x + 1\n"
    other = "def f(x):\n    return x + 2\n"
    assert launched_source(kernel) == launched_source(same) != launched_source(other)


def test_kernel_version_covers_the_kernels_and_the_policy(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cce_compile.resolve import platform

    def version() -> str:
        platform.kernel_version.cache_clear()
        return platform.kernel_version()

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "k.py").write_text("def k(x):\n    return x\n")
    monkeypatch.setattr(platform, "KERNELS_DIR", kernels)
    try:
        first = version()
        (kernels / "k.py").write_text('def k(x):\n    """A docstring."""\n    return x  # why\n')
        assert version() == first
        (kernels / "k.py").write_text("def k(x):\n    return -x\n")
        changed = version()
        assert changed != first
        monkeypatch.setattr(platform, "Policy", lambda: replace(Policy(), forward_chunk_rows=4096))
        assert version() != changed
    finally:
        monkeypatch.undo()
        platform.kernel_version.cache_clear()


def test_the_gluon_kernels_run_for_the_options_they_compute() -> None:
    """On a Hopper GPU at short K: the plain loss runs every Gluon kernel; linear_log_probs'
    entropy the Gluon recompute (its entropy term) and, where the policy lets it, the Gluon
    forward (its entropy statistic), but not the Gluon fused forward, which has neither; a
    bias none of them."""
    from cce_compile.plan.launch import Options, Problem, plan_launch

    qwen = Problem(n=16384, v=151_936, d=896, dtype="bfloat16", on_cuda=True, hopper=True, descriptors_fit=True,
                   capturing=False)
    calls = {"plain": (Options(), Policy()), "entropy": (Options(has_entropy=True), Policy()),
             "entropy, Gluon forward": (Options(has_entropy=True), Policy(forward_gluon_with_entropy=True)),
             "bias": (Options(has_bias=True), Policy(forward_gluon_with_entropy=True))}
    kernels = {}
    for name, (options, policy) in calls.items():
        plan = plan_launch(qwen, options, KernelConfig(), policy)
        kernels[name] = (plan.forward, plan.recompute, plan.fused)
    assert kernels == {"plain": ("gluon", "gluon", "gluon"), "entropy": ("tma", "gluon", "tma"),
                       "entropy, Gluon forward": ("gluon", "gluon", "tma"), "bias": ("tma", "pointer", "tma")}


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
@pytest.mark.parametrize("field", ["gluon_programs_per_sm", "filtered_strided_programs_per_sm"])
def test_programs_per_sm_must_be_a_positive_integer(field: str, value: object) -> None:
    """A launch of no programs leaves its outputs unwritten without an error: refused where a
    Policy is made (A/B scripts pass values as text)."""
    with pytest.raises(ValueError, match=f"Policy.{field}: expected an integer >= 1"):
        replace(Policy(), **{field: value})
    assert getattr(replace(Policy(), **{field: 3}), field) == 3


@pytest.mark.parametrize(("change", "said"), [
    ({"min_chunk_rows": 0}, "min_chunk_rows: expected an integer >= 1"),  # planned forever
    ({"forward_chunk_rows": 0}, "forward_chunk_rows: expected an integer >= 1"),
    ({"fused_gluon_max_k_steps": -1}, "fused_gluon_max_k_steps: expected an integer >= 0"),
    ({"cuda_graphs": "no"}, "cuda_graphs: expected True or False"),  # once read as true
    ({"gemm_backend": "cuBLAS"}, "gemm_backend: expected one of ('cublas', 'triton')"),  # once ran Triton's GEMMs
    ({"workspace_fraction": float("nan")}, "workspace_fraction: expected a finite number"),
    ({"dense_fraction": -0.5}, "dense_fraction: expected a finite number >= 0"),
    ({"scratch_fraction": 0.0}, "must be > 0"),
])
def test_a_policy_field_of_the_wrong_kind_is_refused_where_it_is_made(change: dict, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        replace(Policy(), **change)


def test_a_backward_plan_needs_a_chunk_and_a_slab() -> None:
    for fields in ((0, 1024, True), (2, 0, True), (2, 1024, True, -1)):
        with pytest.raises(ValueError, match="BackwardPlan: expected n_chunks >= 1"):
            BackwardPlan(*fields)


def test_one_row_chunks_allowed_still_end_the_plan() -> None:
    """Policy(min_chunk_rows=1), which the Policy accepts: chunks of one row always have >= 1
    row, so the search over chunk counts doubled forever (a CPU call under the interpreter hung
    in plan_backward); it stops at one row per chunk."""
    import threading

    tiny_budget = Policy(min_chunk_rows=1, scratch_floor_bytes=0, scratch_fraction=0.01)
    plans: list[BackwardPlan] = []
    planner = threading.Thread(target=lambda: plans.append(plan_backward(150, 23, 8, 4, KernelConfig(),
                                                                         policy=tiny_budget)), daemon=True)
    planner.start()
    planner.join(timeout=30)
    assert plans, "plan_backward did not return"
    assert 1 <= plans[0].n_chunks <= 150
