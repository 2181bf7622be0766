"""The real Triton kernels, run by the interpreter on CPU tensors (small shapes)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import triton
import triton.language as tl

import cce_compile
from cce_compile.config.kernel_config import KernelConfig, TileConfig
from cce_compile.kernels import tiles
from cce_compile.ops import linear_cross_entropy_forward
from cce_compile.ops.problem import config_for
from cce_compile.plan.backward import plan_backward
from cce_compile.plan.policy import active_policy

from .op_cases import (
    FROZEN_MODES, check_against_reference, check_frozen_operands, make_inputs, on_kernels, relative_error, with_row_stride,
)
from .reference import reference_loss
from .test_op_options import check_mean_over_cancelling_weights, make_case

pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("seed", range(9))
def test_random_option_combinations(seed: int) -> None:
    e, c, targets, options, bias, weight = make_case(100 + seed, DTYPES[seed % 3], lead=(2, 37), v=203, d=45)
    check_against_reference(e, c, targets, options, bias=bias, weight=weight)


@pytest.mark.parametrize("layout", ["every other entry", "one entry expanded"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.2, "reduction": "sum"}], ids=["mean", "smoothed sum"])
def test_class_weights_in_any_layout(layout: str, options: dict) -> None:
    """The kernels index the class weights as a dense vector: a strided view once gave dE off
    by 0.75 relative, an expanded one read past its single element."""
    e, c, targets = make_inputs("zipf", (64,), 203, 45, torch.float32, seed=3)
    if layout == "every other entry":
        weight = (torch.rand(406, generator=torch.Generator().manual_seed(4)) + 0.5)[::2]
    else:
        weight = torch.tensor(0.5).expand(203)
    check_against_reference(e, c, targets, options, weight=weight)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "cpu path"])
def test_the_upstream_gradient_scales_in_float32(kernels: bool) -> None:
    """(loss / 3).backward() in bf16 once scaled the gradients by bf16(1/3) = 0.33398: every
    entry 0.18% off, a bias rather than rounding noise."""
    e, c, targets = make_inputs("zipf", (64,), 203, 45, torch.bfloat16, seed=5)
    gradients = []
    for divisor in (1.0, 3.0):
        leaves = [t.detach().clone().requires_grad_() for t in (e, c)]
        with on_kernels(kernels):
            (cce_compile.linear_cross_entropy(*leaves, targets, reduction="sum") / divisor).backward()
        gradients.append([leaf.grad.double() for leaf in leaves])
    for whole, third in zip(*gradients):
        kept = whole.abs() > 0
        assert abs((3 * third[kept] / whole[kept]).median().item() - 1) < 5e-4


def test_fp16_rows_far_below_the_largest_upstream_keep_their_gradient() -> None:
    """fp16's d-logits are stored divided by one scale per call (ops/backward._d_logits_scale).
    It was the call's bound on them, leaving 16 of fp16's normal binades unused above: with
    per-token upstream gradients 4096 x 10^[-8, 0] (a loss scale on reduction="none"'s weights)
    most stored d-logits sank to zero, and dE rows whose fp16 values are normal erred by up to
    0.22 relative where the plain-PyTorch path (fp32 d-logits) errs by 2e-4. Now each row within
    2e-3 of that path's error (rows near one-hot err by ~5e-2 on both: fp32's p - 1)."""
    e, c, targets = make_inputs("zipf", (96,), 512, 32, torch.float16, seed=2)
    g = torch.Generator().manual_seed(3)
    upstream = 4096.0 * 10.0 ** -torch.linspace(0.0, 8.0, 96)[torch.randperm(96, generator=g)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (e, c)]
    reference_loss(*ref_leaves, targets, reduction="none").backward(upstream.double())
    ref_e = ref_leaves[0].grad
    normal = ref_e.abs().amax(dim=1) > 64 * torch.finfo(torch.float16).tiny  # rows fp16 holds to its precision
    assert int(normal.sum()) > 60
    row_errors = []
    for kernels in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (e, c)]
        with on_kernels(kernels):
            cce_compile.linear_cross_entropy(*leaves, targets, reduction="none").backward(upstream)
        row_errors.append(((leaves[0].grad.double() - ref_e).norm(dim=1) / ref_e.norm(dim=1))[normal])
        assert relative_error(leaves[1].grad, ref_leaves[1].grad) < 1e-3
    excess = row_errors[0] - row_errors[1]
    assert float(excess.max()) < 2e-3, (excess.max(), row_errors[0].max())


def test_fp16_d_logits_at_their_bound_stay_finite() -> None:
    """With the lse's upstream gradient against the loss's (-2 against 1), a one-hot row's
    target d-logit is a p_y - b = -2: |a - b|, above both coefficients. The scale's bound takes
    it, so fp16's stored d-logits, up to FP16_HEADROOM, never pass 65504."""
    g = torch.Generator().manual_seed(5)
    c = torch.randn(300, 32, generator=g)
    targets = torch.randint(0, 300, (40,), generator=g)
    e, c = (10.0 * c[targets]).half(), c.half()
    leaves = [t.detach().clone().requires_grad_() for t in (e, c)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (e, c)]
    for (ee, cc), fn in ((leaves, cce_compile.linear_cross_entropy), (ref_leaves, reference_loss)):
        loss, lse = fn(ee, cc, targets, reduction="none", return_lse=True)
        (loss.double().sum() - 2.0 * lse.double().sum()).backward()
    for leaf, ref in zip(leaves, ref_leaves):
        assert torch.isfinite(leaf.grad).all()
        assert relative_error(leaf.grad, ref.grad) < 3e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_shape(dtype: torch.dtype) -> None:
    """N=253, V=1031, D=97 on LM-like data: every tile edge is ragged."""
    e, c, targets = make_inputs("zipf", (253,), 1031, 97, dtype, seed=1)
    targets[::5] = -100
    check_against_reference(e, c, targets, {"label_smoothing": 0.1, "softcap": 20.0})


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tiles.tanh(tl.load(x_ptr + offsets, mask=mask)), mask=mask)


def test_kernel_tanh_keeps_fp32_relative_error() -> None:
    """The soft-cap's tanh against float64 over the whole line: a dense sweep across the switch
    from its series at |x| = 0.25, geometric down to 1e-30 and up to the tails, and the
    specials. An exp form alone erred by eps / |x| relative for small |x|."""
    near = torch.linspace(-1.0, 1.0, 40_001)
    far = torch.logspace(-30, 1.5, 20_001)
    switch = torch.tensor(0.25).repeat(201) + torch.arange(-100, 101) * torch.finfo(torch.float32).eps / 8
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.25, -0.25, 20.0, -20.0, 1e30, -1e30])
    x = torch.cat([near, far, -far, switch, -switch, specials])
    out = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), BLOCK=4096)
    expected = torch.tanh(x.double())
    relative = ((out.double() - expected).abs() / expected.abs()).nan_to_num(0.0)  # 0 / 0 at x = 0
    assert relative.max().item() < 4 * torch.finfo(torch.float32).eps, x[relative.argmax()].item()
    assert out[-10:].tolist() == torch.tanh(specials).tolist()
    ends = torch.tensor([float("inf"), float("-inf"), float("nan")])
    _tanh_kernel[(1,)](ends, out, 3, BLOCK=4)
    assert out[:2].tolist() == [1.0, -1.0] and out[2].isnan()


def test_a_large_softcap_is_exact() -> None:
    """softcap * tanh(logit / softcap) at softcap 1e6, where logit / softcap is ~1e-5: an
    absolute tanh error of eps gave loss 2.8e-3 and dE 7.3e-3 off."""
    e, c, targets = make_inputs("zipf", (64,), 203, 45, torch.float32, seed=6)
    check_against_reference(e, c, targets, {"softcap": 1e6})


@pytest.mark.usefixtures("no_scratch_floor")
def test_several_token_chunks_and_slabs() -> None:
    """Enough tokens that the backward's plan splits them into chunks, each swept over
    several vocab slabs, with the dC GEMM accumulating across chunks."""
    e, c, targets = make_inputs("peaked", (520,), 300, 16, torch.bfloat16, seed=3)
    tile = TileConfig(32, 32, 16, 4, 4, 1)
    config = KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=2)
    plan = plan_backward(1024, 300, 16, 2, config, policy=active_policy())
    assert plan.n_chunks > 1 and plan.slab_v < 300
    with cce_compile.override_config(config):
        check_against_reference(e, c, targets, {"reduction": "sum"}, bias=torch.randn(300).bfloat16())


@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize("mode", FROZEN_MODES)
def test_frozen_head_or_hidden_states_skip_that_gradient(mode: str, backward_outputs: list, fused_outputs: list) -> None:
    """The kernels' path over several token chunks and slabs: a frozen operand's GEMMs are
    skipped (the op returns its gradient empty) and the other gradients are unchanged bit for bit."""
    e, c, targets = make_inputs("zipf", (260,), 300, 16, torch.bfloat16, seed=4)
    targets[::9] = -100
    tile = TileConfig(32, 32, 16, 4, 4, 1)
    with cce_compile.override_config(KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=2)):
        check_frozen_operands(e, c, targets, FROZEN_MODES[mode], bias=torch.randn(300).bfloat16())
    outputs = fused_outputs if mode == "fused" else backward_outputs
    assert outputs == [(260 * 16, 300 * 16), (260 * 16, 0), (0, 300 * 16)]


def test_tile_stats_merge_streams_like_torch() -> None:
    """merge_tile_stats_kernel against torch.logsumexp and the entropy of the tiles' softmax
    (the entropy of their shares plus their entropies, weighted by the shares), ragged in tiles
    and rows, in both layouts the forward hands it (the entropies in another layout than the
    log-sum-exps), with -inf tiles (whose NaN entropies add nothing), an all -inf row, +inf and
    NaN, and a near one-hot row, one tile 20 nats above 44 (each share under fp32's rounding of
    1: a log of the shares' sum would lose them all) to within 1e-5 relatively; neither input
    changes."""
    from cce_compile.ops.forward import merge_tile_stats

    generator = torch.Generator().manual_seed(0)
    tile_lse = torch.randn(45, 150, generator=generator) * 8.0 + 50.0
    tile_entropy = torch.rand(45, 150, generator=generator) * 5.0
    tile_lse[::3, 10] = float("-inf")
    tile_entropy[::3, 10] = float("nan")
    tile_lse[:, 11] = float("-inf")
    tile_lse[7, 12] = float("inf")
    tile_lse[40, 13] = float("nan")
    tile_lse[:, 14], tile_entropy[:, 14] = 30.0, 1e-3
    tile_lse[5, 14], tile_entropy[5, 14] = 50.0, 1e-9
    expected_lse = torch.logsumexp(tile_lse.double(), dim=0)
    shares = torch.exp(tile_lse.double() - expected_lse)
    expected_entropy = torch.where(shares > 0, shares * (tile_entropy.double() - torch.log(shares)), 0.0).sum(dim=0)
    kept = (tile_lse.clone(), tile_entropy.clone())
    for lse_layout in (tile_lse, tile_lse.T.contiguous().T):
        lse, entropy, _ = merge_tile_stats(lse_layout, tile_entropy)
        torch.testing.assert_close(lse, expected_lse.float(), equal_nan=True)
        finite = torch.isfinite(expected_lse)
        torch.testing.assert_close(entropy[finite], expected_entropy[finite].float())
        assert bool((entropy[finite] >= 0.0).all())
        assert abs(float(entropy[14]) / float(expected_entropy[14]) - 1.0) < 1e-5, float(entropy[14])
        assert torch.isnan(entropy[13])  # a NaN log-sum-exp's row
    for buffer, before in zip((tile_lse, tile_entropy), kept):
        torch.testing.assert_close(buffer, before, rtol=0, atol=0, equal_nan=True)
    lse, no_entropy, no_lse_minus_mean = merge_tile_stats(tile_lse)
    assert no_entropy is None and no_lse_minus_mean is None and lse[11] == float("-inf") and lse[12] == float("inf")


@pytest.mark.parametrize("seed", [201, 202, 209, 213])
@pytest.mark.usefixtures("descriptor_kernels")
def test_exact_mode_through_tensor_descriptors(seed: int, launch_plans: list) -> None:
    """16-bit inputs whose rows are 16-byte aligned take the persistent tensor-descriptor
    kernels (lse_forward_tma_kernel; grad_logits_tma_kernel, which the op picks for long K
    loops only): ragged N and V, D a multiple of 8 but not of BLOCK_K (the copy engine's zero
    fill makes the K tail). The seeds' options cover bias, softcap, label smoothing with and
    without weights, shift, ignored targets."""
    dtype = (torch.float16, torch.bfloat16)[seed % 2]
    e, c, targets, options, bias, weight = make_case(seed, dtype, lead=(253,), v=1031, d=104)
    check_against_reference(e, c, targets, options, bias=bias, weight=weight)
    assert [(plan.forward, plan.recompute) for plan in launch_plans[:2]] == [("tma", "tma")] * 2


@pytest.mark.parametrize("v", [1, 3])
@pytest.mark.usefixtures("descriptor_kernels")
def test_a_vocabulary_of_a_few_classes_through_tensor_descriptors(v: int, launch_plans: list) -> None:
    """The recompute describes its slab's buffer: slabs as narrow as V's next power of two (1 to
    4 columns, rows 2 to 8 bytes apart) failed Triton's descriptor ("strides must be 16-byte
    aligned"); fp16 always takes the recompute."""
    e, c, targets = make_inputs("zipf", (40,), v, 32, torch.float16, seed=7)
    check_against_reference(e, c, targets, {})
    assert launch_plans[1].recompute == "tma" and launch_plans[1].backward.slab_v == 8


@pytest.mark.usefixtures("descriptor_kernels")
@pytest.mark.parametrize(("label_smoothing", "softcap"), [(0.1, 0.0), (0.0, 20.0)])
def test_filtered_forward_through_tensor_descriptors(label_smoothing: float, softcap: float, launch_plans: list) -> None:
    """Filtered mode's forward on 16-bit inputs walks a copy of c in vocab order with the
    persistent kernel (filtering.in_vocab_order): the loss, lse, kept tiles and tile
    log-sum-exps (by position in the order) of the pointer kernel, which gathers c's rows
    through the order and sums each tile's exps at its running maximum; with a bias,
    class weights under label smoothing, and ignored targets, whose positions stay outside."""
    e, c, targets = make_inputs("zipf", (253,), 1031, 104, torch.bfloat16, seed=7)
    targets[::7] = -100
    g = torch.Generator().manual_seed(8)
    bias = (torch.randn(1031, generator=g) * 0.5).bfloat16()
    weight = torch.rand(1031, generator=g) + 0.5
    options = (bias, weight, -100, label_smoothing, softcap, 2.0**-12)
    through_descriptors = linear_cross_entropy_forward(e, c, targets, *options)
    through_pointers = linear_cross_entropy_forward(with_row_stride(e, 105), with_row_stride(c, 105), targets, *options)
    assert [plan.forward for plan in launch_plans] == ["tma", "split"]
    kept_tiles, tile_lse = through_descriptors[2:4]
    assert kept_tiles.dtype == torch.int8 and kept_tiles.any() and not kept_tiles.all()
    forward_n = config_for(e, c, True, active_policy()).forward.block_n
    assert tile_lse.dtype == torch.float16 and tile_lse.shape == (253, -(-1031 // forward_n))
    assert (tile_lse <= 1e-3).all()  # each tile's share of its row's softmax, in log space
    for got, expected in zip(through_descriptors, through_pointers):
        # fp16 tile log-sum-exps: one rounding step apart where the two kernels' fp32 sums differ
        tolerance = {"rtol": 2e-3, "atol": 2e-3} if got.dtype == torch.float16 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.usefixtures("descriptor_kernels")
@pytest.mark.parametrize("filter_eps", [0.0, 2.0**-12], ids=["exact", "filtered"])
def test_persistent_forward_in_row_chunks(filter_eps: float, launch_plans: list, use_policy) -> None:
    """The persistent forward launched per row chunk (Policy.forward_chunk_rows) gives what
    one launch over all rows gives: chunks of 48 rows, narrower than a row block, so every
    chunk's tiles hold rows of the next chunk that it must neither count nor store, and a
    ragged last chunk; label smoothing's per-tile sums and filtered mode's tile statistics too."""
    e, c, targets = make_inputs("zipf", (253,), 1031, 104, torch.bfloat16, seed=11)
    targets[::7] = -100
    args = (e, c, targets, None, None, -100, 0.1, 0.0, filter_eps)
    one_launch = linear_cross_entropy_forward(*args)
    use_policy(forward_chunk_rows=48)
    in_chunks = linear_cross_entropy_forward(*args)
    assert [(plan.forward, plan.forward_chunk_rows) for plan in launch_plans] == [("tma", 2048), ("tma", 48)]
    for got, expected in zip(in_chunks, one_launch):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


FILTER_CASES = {
    "one chunk": dict(lead=(96,), v=512, d=32, options={}, config=None),
    "chunks, slabs, bias, smoothing": dict(
        lead=(520,), v=300, d=16, options={"label_smoothing": 0.1, "reduction": "sum"}, chunked=True,
        config=KernelConfig(*(TileConfig(32, 32, 16, 4, 4, 1),) * 4, slab_v=128, vocab_splits=2),
    ),
    # The forward's tile maxima come per forward tile; the backward's tiles may be narrower or wider.
    "forward tiles wider": dict(
        lead=(96,), v=512, d=32, options={},
        config=KernelConfig(TileConfig(32, 64, 16, 4, 4, 1), *(TileConfig(32, 32, 16, 4, 4, 1),) * 3, slab_v=128),
    ),
    "forward tiles narrower": dict(
        lead=(96,), v=500, d=32, options={},
        config=KernelConfig(TileConfig(32, 16, 16, 4, 4, 1), *(TileConfig(32, 32, 16, 4, 4, 1),) * 3, slab_v=128),
    ),
}


@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize("read_back", [True, False], ids=["read back", "device only"])
@pytest.mark.parametrize("case", FILTER_CASES, ids=list(FILTER_CASES))
def test_kernels_and_cpu_path_filter_the_same_tiles(case: str, read_back: bool, use_policy) -> None:
    """Filtered mode's sorted vocab, tile masks and block-sparse GEMMs (kernels) against the
    CPU path's dense arithmetic on the same tiles; and filtering really drops tiles. Calls
    read their packed steps back; under a CUDA graph capture they launch every step packing
    may make, forced here."""

    use_policy(filtered_read_back=read_back)

    spec = FILTER_CASES[case]
    e, c, targets = make_inputs("zipf", spec["lead"], spec["v"], spec["d"], torch.float32, seed=4)
    e = e * 3.0  # a sharp LM-like softmax: the sorted vocabulary's tail tiles are negligible
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(spec["v"], generator=g) * 0.1
    # class weights where there is no smoothing: with both, the backward runs exact (api.py)
    weight = None if spec["options"] else torch.rand(spec["v"], generator=g) + 0.5
    if spec.get("chunked"):
        assert plan_backward(1024, spec["v"], spec["d"], 4, spec["config"], policy=active_policy()).n_chunks > 1

    def grads(interpret: bool, filter_eps: float | None):
        leaves = [t.clone().requires_grad_() for t in (e, c, bias)]
        with on_kernels(interpret):
            loss = cce_compile.linear_cross_entropy(
                leaves[0], leaves[1], targets, bias=leaves[2], weight=weight, filter_eps=filter_eps, **spec["options"]
            )
            loss.backward()
        return [t.grad for t in leaves]

    with cce_compile.override_config(spec["config"]) if spec["config"] else contextlib.nullcontext():
        kernels, cpu, exact = grads(True, 2.0**-12), grads(False, 2.0**-12), grads(False, None)
    assert not torch.equal(cpu[1], exact[1]), "no tile was filtered: the test shows nothing"
    for kernel_grad, cpu_grad in zip(kernels, cpu):
        assert relative_error(kernel_grad, cpu_grad) < 1e-5


@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
def test_device_only_steps_give_the_same_gradients_for_any_strided_program_count(
    use_policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps only the device knows are walked by Policy.filtered_strided_programs_per_sm programs
    per SM (three SMs under the interpreter): one program walking several slots and columns, or
    more programs than a step has, compute each tile as the read-back launch does, to the bit."""
    from cce_compile.ops import backward_filtered

    launched = []
    launch_steps = backward_filtered.FilteredBackward.launch_steps
    monkeypatch.setattr(backward_filtered.FilteredBackward, "launch_steps", lambda self: (
        self.read_back or launched.append(self.strided_sizes), launch_steps(self))[1])
    spec = FILTER_CASES["chunks, slabs, bias, smoothing"]
    e, c, targets = make_inputs("zipf", spec["lead"], spec["v"], spec["d"], torch.float32, seed=4)
    e = e * 3.0
    bias = torch.randn(spec["v"], generator=torch.Generator().manual_seed(5)) * 0.1

    def grads(read_back: bool, per_sm: int) -> list[torch.Tensor]:
        use_policy(filtered_read_back=read_back, filtered_strided_programs_per_sm=per_sm)
        leaves = [t.clone().requires_grad_() for t in (e, c, bias)]
        with cce_compile.override_config(spec["config"]), on_kernels(True):
            cce_compile.linear_cross_entropy(leaves[0], leaves[1], targets, bias=leaves[2], filter_eps=2.0**-12,
                                             **spec["options"]).backward()
        return [t.grad for t in leaves]

    read_back = grads(True, 2)
    for per_sm in (1, 2, 40):
        for got, want in zip(grads(False, per_sm), read_back):
            assert torch.equal(got, want)
    slots, columns = zip(*launched)
    assert slots[0] == 3 < slots[1] == 6 < slots[2] and columns[0] <= columns[1] <= columns[2]


@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
def test_flat_rows_are_computed_whole() -> None:
    """Rows whose softmax reaches filter_eps nowhere (an untrained head's; filtering.flat_rows)
    get exact mode's dE from the kernels and from the CPU path, with their row blocks; the
    peaked rows beside them stay filtered."""

    e, c, targets = make_inputs("zipf", (96,), 2048, 32, torch.float32, seed=4)
    e[:40] *= 0.01  # flat: every softmax entry ~1/2048, under 2^-7
    tile = TileConfig(32, 32, 16, 4, 4, 1)
    config = KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=2)

    def grad_e(interpret: bool, filter_eps: float | None) -> torch.Tensor:
        leaf = e.clone().requires_grad_()
        with cce_compile.override_config(config), on_kernels(interpret):
            cce_compile.linear_cross_entropy(leaf, c, targets, filter_eps=filter_eps).backward()
        return leaf.grad

    exact = grad_e(False, None)
    for filtered in (grad_e(True, 2.0**-7), grad_e(False, 2.0**-7)):
        assert relative_error(filtered[:64], exact[:64]) < 1e-5  # two 32-row blocks, each holding a flat row
        assert relative_error(filtered[64:], exact[64:]) > 1e-4, "nothing was filtered: the test shows nothing"


@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize(("read_back", "weighted"), [(True, True), (False, False)],
                         ids=["read back, class weights", "device only, label smoothing"])  # a minute each
def test_kernels_and_cpu_path_put_back_the_same_skipped_tiles(read_back: bool, weighted: bool,
                                                             monkeypatch: pytest.MonkeyPatch, use_policy) -> None:
    """Where the skipped tiles hold real mass (an LM-like head whose rows share a mean, and
    a coarse filter_eps, 2^-7: at this size 2^-12 skips nothing): the kernels put back each
    skipped tile's row sums and dE's tilt (filtering.Tilt) from the forward's tile
    log-sum-exps, the CPU path from the recomputed softmax, and the two agree, bias and class
    weights or label smoothing included (with both the backward runs exact: api.py); without
    either the gradients move by far more.
    Equal forward and backward tile widths, so the two paths skip the same tiles."""
    from cce_compile.ops import backward_filtered, cpu_path, filtering

    use_policy(filtered_read_back=read_back)
    tile = TileConfig(32, 32, 16, 4, 4, 1)
    config = KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=2)
    e, c, targets = make_inputs("zipf", (160,), 4000, 32, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(4000, generator=g) * 0.1
    weight = torch.rand(4000, generator=g) + 0.5 if weighted else None
    options = {"label_smoothing": 0.0 if weighted else 0.05, "reduction": "sum"}

    def grads(interpret: bool):
        leaves = [t.clone().requires_grad_() for t in (e, c, bias)]
        with cce_compile.override_config(config), on_kernels(interpret):
            cce_compile.linear_cross_entropy(leaves[0], leaves[1], targets, bias=leaves[2], weight=weight,
                                             filter_eps=2.0**-7, **options).backward()
        return [t.grad for t in leaves]

    kernels, cpu = grads(True), grads(False)
    for kernel_grad, cpu_grad in zip(kernels, cpu):
        # The kernels read the forward's tile log-sum-exps in fp16: dE 9e-6 apart without the
        # tilt, 1.2e-5 with it (which moves dE by 3% here).
        assert relative_error(kernel_grad, cpu_grad) < 2e-5
    monkeypatch.setattr(backward_filtered, "tilt_sample_size", lambda n, v, d: 0)
    monkeypatch.setattr(cpu_path, "tilt_sample_size", lambda n, v, d: 0)
    untilted = grads(True), grads(False)
    for path, without_tilt in zip((kernels, cpu), untilted):
        assert relative_error(without_tilt[0], path[0]) > 1e-2, "the tilt moved dE little: the test shows nothing"
    monkeypatch.setattr(filtering.SkippedTiles, "d_logits", lambda self, tile_lse, *_: (
        torch.zeros_like(tile_lse, dtype=torch.float32), torch.zeros(tile_lse.shape[0])))
    monkeypatch.setattr(cpu_path, "_tile_row_means", lambda x, block_n: torch.zeros_like(x))
    for without in (grads(True), grads(False)):
        assert relative_error(without[0], kernels[0]) > 1e-2, "the skipped tiles held little: the test shows nothing"
        for corrected, dropped in zip(kernels[1:], without[1:]):
            assert relative_error(dropped, corrected) > 1e-4


@pytest.mark.usefixtures("block_sparse_always")
@pytest.mark.parametrize("slots", [8, 2], ids=["8 slots", "fewer slots than a column's tiles"])
def test_device_only_steps_in_16_bit_write_de_from_their_last_step(slots: int, use_policy,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 inputs (dE summed in an fp32 accumulator) over three token chunks, launched as under
    a CUDA graph capture (no read-back): each chunk runs the most steps packing can make, the
    ones past its packed steps empty, and the last of them writes dE from the accumulator. The
    gradients are the read-back path's (within a bf16 rounding: the interpreter truncates where
    torch rounds). A forced plan of fewer slots than a tile column's 3 tiles gets a column's."""
    from cce_compile.ops import backward_filtered
    from cce_compile.plan.backward import BackwardPlan

    launched = []
    launch_steps = backward_filtered.FilteredBackward.launch_steps

    def spy(self) -> None:
        if self.steps.columns is None:
            bounds = self.steps.step_bounds.tolist()
            launched.append([(sum(b[s] < self.vocab_tiles for s in range(self.steps.n_steps)), self.steps.n_steps)
                             for b in bounds])
        launch_steps(self)

    monkeypatch.setattr(backward_filtered.FilteredBackward, "launch_steps", spy)
    e, c, targets = make_inputs("zipf", (200,), 600, 32, torch.bfloat16, seed=7)
    e = e * 3.0
    tile = TileConfig(32, 32, 16, 4, 4, 1)
    config = KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=2)

    def grads(read_back: bool) -> list[torch.Tensor]:
        use_policy(filtered_read_back=read_back, backward_plan=BackwardPlan(3, 128, True, slots=slots))
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        with cce_compile.override_config(config), on_kernels(True):
            cce_compile.linear_cross_entropy(*leaves, targets, filter_eps=2.0**-7).backward()
        return [leaf.grad for leaf in leaves]

    device_only, read_back = grads(False), grads(True)
    (chunks,) = launched
    assert len(chunks) == 3 and any(steps < most for steps, most in chunks), f"no empty step launched: {chunks}"
    for got, expected in zip(device_only, read_back):
        assert relative_error(got, expected) < 4e-3


def lm_like_tile_mask(tile_rows: int, tile_columns: int, seed: int) -> torch.Tensor:
    """Kept tiles as a sorted vocabulary has them: the first columns nearly full, a sparse tail."""
    g = torch.Generator().manual_seed(seed)
    density = torch.linspace(0.95, 0.0, tile_columns) ** 3 + 0.03
    return (torch.rand(tile_rows, tile_columns, generator=g) < density).to(torch.int8)


MASKS = {
    # tile rows x columns, token chunks, chunk tile rows, slab columns
    "small": (11, 19, 2, 6, 2),
    # wider than the list kernel's column blocks (64 columns at 40 rows): sums carried
    # across blocks
    "lm-like": (90, 150, 3, 40, 4),
    # one-column slabs: a step holds one full column, so packing's step numbers jump
    "one-column slabs": (12, 30, 1, 12, 1),
}


@pytest.mark.parametrize("read_back", [True, False], ids=["read back", "device only"])
@pytest.mark.parametrize("case", MASKS)
def test_step_lists_match_the_mask(case: str, read_back: bool) -> None:
    """The filtered backward's work lists (step_lists_kernel), per (chunk, step), against the
    mask they come from: the step's kept tiles in column-major slots (grad_logits), each tile
    column's contiguous slots and their tile rows (dC), each tile row's slots and tile
    columns in column order (dE). Packed steps never hold more than their capacity, never
    split a column, and take fewer steps than slabs of that capacity; the steps the host
    launches without reading them back (under a CUDA graph capture) past a chunk's last are
    empty."""
    from cce_compile.ops.filtering import chunk_tile_mask, filtered_steps, step_lists

    tile_rows, tile_columns, n_chunks, rows, slab_tiles = MASKS[case]
    tile_mask = lm_like_tile_mask(tile_rows, tile_columns, seed=0)
    tile_mask[2] = 0  # a tile row with no kept tile
    tile_mask[:6, 4] = 1  # a full column
    if case == "lm-like":
        tile_mask[(n_chunks - 1) * rows:] = 0  # a chunk with no kept tile
    mask = chunk_tile_mask(tile_mask, n_chunks, rows)
    capacity = rows * slab_tiles
    plan = filtered_steps(mask, capacity, read_back)
    lists = step_lists(mask, plan, capacity)
    if read_back:
        plan = plan.on_host()
        columns = plan.columns
    else:
        assert plan.on_host().columns is None
        bounds = plan.step_bounds.tolist()
        # Cut to n_steps: a chunk whose steps outran them would not end at the last column (below).
        columns = [[(b[s], b[s + 1]) for s in range(plan.n_steps) if b[s] < tile_columns] for b in bounds]
        for chunk in range(n_chunks):
            for step in range(len(columns[chunk]), plan.n_steps):
                assert bounds[chunk][step] == bounds[chunk][step + 1] == tile_columns
                assert lists.step_counts[chunk, step] == 0 and not lists.de_count[chunk, step].any()
    assert max(map(len, columns)) <= plan.n_steps, "lists sized for fewer steps than packing made"
    if case == "lm-like":
        assert max(map(len, columns)) < len(range(0, tile_columns, slab_tiles)), "packing saved no step"
    for chunk in range(n_chunks):
        assert columns[chunk][0][0] == 0 and columns[chunk][-1][1] == tile_columns
        for step, (first, end) in enumerate(columns[chunk]):
            assert end > first, "an empty step"
            tiles = [(col, row) for col in range(first, end) for row in range(rows) if mask[chunk, row, col]]
            assert len(tiles) <= capacity and lists.step_counts[chunk, step] == len(tiles)
            if plan.counts is not None:
                assert plan.counts[chunk][step] == len(tiles)
            for slot, (col, row) in enumerate(tiles):
                assert lists.step_tiles[chunk, step, slot] == col * rows + row
                assert lists.dc_rows[chunk, step, slot] == row
            for col in range(first, end):
                slots = [slot for slot, (c, _) in enumerate(tiles) if c == col]
                assert lists.dc_count[chunk, col] == len(slots)
                assert slots == list(range(lists.dc_begin[chunk, col], lists.dc_begin[chunk, col] + len(slots)))
            for row in range(rows):
                entries = [(slot, c) for slot, (c, r) in enumerate(tiles) if r == row]
                begin, count = int(lists.de_begin[chunk, step, row]), int(lists.de_count[chunk, step, row])
                assert count == len(entries)
                assert lists.de_slots[chunk, step, begin:begin + count].tolist() == [s for s, _ in entries]
                assert lists.de_cols[chunk, step, begin:begin + count].tolist() == [c for _, c in entries]


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating-point torch.empty comes back full of NaN, so an op that reads memory
    it never wrote (a scratch slot past a step's count, a gradient element no kernel covers)
    shows it, whatever the allocator happened to hand out."""
    empty = torch.empty

    def poisoned(*args, **kwargs) -> torch.Tensor:
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize("filter_eps", [None, 2.0**-12], ids=["exact", "filtered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_gradient_reads_unwritten_memory(
    dtype: torch.dtype, filter_eps: float | None, poisoned_empty: None
) -> None:
    """Token chunks, slabs or several packed steps per chunk, and a bias (whose filtered sums
    once read the scratch's unset slots: NaN on a GPU whose memory held NaN there)."""

    e, c, targets = make_inputs("zipf", (300,), 700, 32, dtype, seed=3)
    e = e * 3.0  # peaked: filtered mode drops most tiles
    bias = (torch.randn(700, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    tile = TileConfig(32, 32, 16, 4, 4, 1)

    def grads(interpret: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (e, c, bias)]
        with cce_compile.override_config(KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=2)), \
                on_kernels(interpret):
            cce_compile.linear_cross_entropy(*leaves[:2], targets, bias=leaves[2], filter_eps=filter_eps).backward()
        return [t.grad for t in leaves]

    for kernel_grad, cpu_grad in zip(grads(True), grads(False)):
        assert torch.isfinite(kernel_grad).all()
        assert relative_error(kernel_grad, cpu_grad) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "cpu path"])
@pytest.mark.parametrize("inputs", ["flat", "mostly kept", "peaked"])
def test_filtered_backward_runs_dense_when_most_tiles_are_kept(
    inputs: str, kernels: bool, block_sparse_backwards: list[int]
) -> None:
    """A flat softmax (uniform logits) keeps nearly every tile, a mildly peaked one 92% of
    them, where the block-sparse backward is slower than exact mode's dense one: the filtered
    backward then runs the dense path and returns exact mode's gradients (up to the forwards'
    summation order), on the kernels and the plain-PyTorch path alike (which once always
    filtered: dE 5.3e-4 from float64 on the mostly kept inputs). A peaked one stays
    block-sparse."""
    if inputs == "flat":
        e, c, targets = make_inputs("signed", (96,), 2048, 32, torch.float32, seed=6)
    elif inputs == "mostly kept":
        e, c, targets = make_inputs("peaked", (96,), 2048, 32, torch.float32, seed=6)
        e = e * 0.5
    else:  # 31% of the tiles kept
        e, c, targets = make_inputs("peaked", (96,), 2048, 32, torch.float32, seed=4)
        e = e * 2.0
    tile = TileConfig(32, 32, 16, 4, 4, 1)
    config = KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=2)

    def grads(filter_eps: float | None) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        with cce_compile.override_config(config), on_kernels(kernels):
            cce_compile.linear_cross_entropy(*leaves, targets, filter_eps=filter_eps).backward()
        return [t.grad for t in leaves]

    filtered, exact = grads(2.0**-12), grads(None)
    if inputs != "peaked":
        assert not block_sparse_backwards, "the block-sparse path ran"
        reference = [t.double().requires_grad_() for t in (e, c)]
        reference_loss(*reference, targets).backward()
        for got, expected, float64 in zip(filtered, exact, reference):  # the forwards sum in different orders
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            assert relative_error(got, float64.grad) < 2e-5
    else:
        assert block_sparse_backwards, "the peaked inputs ran dense"
        assert not torch.equal(filtered[1], exact[1])


def test_backward_on_another_thread_launches_with_the_forwards_config() -> None:
    """Autograd runs a CUDA backward on its device thread, where the caller's override_config
    is not active; the backward must still launch with the forward's config (filtered mode's
    tile maxima are laid out by the forward's tile, and the tuner times backward tiles this
    way). Here the backward runs on a thread of its own, as on a GPU."""
    e, c, targets = make_inputs("zipf", (96,), 500, 32, torch.float32, seed=4)
    e = e * 3.0
    config = KernelConfig(TileConfig(32, 16, 16, 4, 4, 1), *(TileConfig(32, 32, 16, 4, 4, 1),) * 3, slab_v=128)

    def grads(on_thread: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        with cce_compile.override_config(config):
            loss = cce_compile.linear_cross_entropy(*leaves, targets, filter_eps=2.0**-12)
            if not on_thread:
                loss.backward()
        if on_thread:
            failures: list[BaseException] = []

            def backward() -> None:
                try:
                    loss.backward()
                except BaseException as error:  # re-raised on the test's thread
                    failures.append(error)

            thread = threading.Thread(target=backward)
            thread.start()
            thread.join()
            if failures:
                raise failures[0]
        return [t.grad for t in leaves]

    for threaded, same_thread in zip(grads(True), grads(False)):
        torch.testing.assert_close(threaded, same_thread)


def test_filtered_forward_when_the_last_split_runs_past_v() -> None:
    """10 vocab tiles in 4 splits of 3: the last split's final tiles lie wholly past V, where
    filtered mode reads vocab id 0 for the order. Rows whose target is token 0 must still get
    exactly their own logit (the H200 benchmark caught a 4e-2 loss error here)."""
    e, c, targets = make_inputs("signed", (64,), 300, 16, torch.float32, seed=2)
    targets[::3] = 0
    tile = TileConfig(32, 32, 16, 4, 4, 1)
    with cce_compile.override_config(KernelConfig(tile, tile, tile, tile, slab_v=128, vocab_splits=4)):
        exact = cce_compile.linear_cross_entropy(e, c, targets, reduction="none")
        filtered = cce_compile.linear_cross_entropy(e, c, targets, reduction="none", filter_eps=2.0**-12)
    torch.testing.assert_close(filtered, exact)


@pytest.mark.parametrize("bias_view", ["strided", "expanded"])
@pytest.mark.parametrize("reduction", ["none", "mean"])  # the recompute's path and the fused forward's
def test_strided_or_expanded_targets_and_bias_give_their_values_answer(reduction: str, bias_view: str) -> None:
    """targets, tokens and bias as strided or expanded views: the loss, the log-probs and the
    gradients of their contiguous copies. The kernels read the three as dense vectors (e and
    c they take with their strides), so a view must reach them as its values, not its storage."""
    e, c, targets = make_inputs("zipf", (37,), 53, 33, torch.bfloat16, seed=5)
    targets[::6] = -100
    spread = torch.stack([targets, targets.flip(0)], dim=1)[:, 0]
    assert spread.stride() == (2,)
    base = torch.randn(2 * 53).bfloat16() if bias_view == "strided" else torch.full((1,), 0.5).bfloat16()
    view = (lambda b: b[::2]) if bias_view == "strided" else (lambda b: b.expand(53))

    def run(tokens: torch.Tensor, bias_base: torch.Tensor, as_bias) -> list[torch.Tensor]:
        ee, cc, bb = (t.detach().clone().requires_grad_() for t in (e, c, bias_base))
        loss = cce_compile.linear_cross_entropy(ee, cc, tokens, bias=as_bias(bb), reduction=reduction)
        loss.backward(torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape))
        log_probs = cce_compile.linear_log_probs(e, c, tokens, bias=as_bias(bias_base))
        return [loss, log_probs, ee.grad, cc.grad, as_bias(bb.grad) if bias_view == "strided" else bb.grad]

    dense_bias = view(base).contiguous()
    views = run(spread, base, view)
    copies = run(spread.contiguous(), dense_bias, lambda b: b)
    copies[4] = copies[4] if bias_view == "strided" else copies[4].float().sum(0, keepdim=True)
    for name, got, expected in zip(("loss", "log_probs", "dE", "dC", "dbias"), views, copies):
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # pointer and tensor-descriptor forwards
def test_out_of_range_target_gives_nan_without_reading_it(dtype: torch.dtype) -> None:
    """Past the API's CPU check (as on the GPU), a bad target poisons only its own token."""
    e, c, targets = make_inputs("signed", (40,), 64, 16, dtype, seed=0)
    targets[5] = 10**9
    targets[6] = -7
    loss, lse, *_ = torch.ops.cce.linear_cross_entropy_forward(e, c, targets, None, None, -100, 0.0, 0.0, 0.0)
    assert torch.isnan(loss[5]) and torch.isnan(loss[6])
    assert torch.isfinite(loss[:5]).all() and torch.isfinite(loss[7:]).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_mean_over_cancelling_weights_is_zero(memory: str) -> None:
    check_mean_over_cancelling_weights(memory)


def test_all_ignored_batch() -> None:
    e, c, targets = make_inputs("signed", (33,), 70, 16, torch.bfloat16, seed=0)
    e.requires_grad_()
    c.requires_grad_()
    loss = cce_compile.linear_cross_entropy(e, c, torch.full_like(targets, -100))
    loss.backward()
    assert loss.item() == 0.0 and not e.grad.any() and not c.grad.any()


@pytest.mark.parametrize("filter_eps", [None, 2**-10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch(dtype: torch.dtype, filter_eps: float | None) -> None:
    """No tokens: a loss of 0 and zero gradients, exact or filtered, on the kernels and the
    plain-PyTorch path (a tensor descriptor cannot describe an empty tensor, so the 16-bit
    call takes the pointer kernels); the log-probs alike."""
    for kernels in (True, False):
        e = torch.randn(0, 16, dtype=dtype, requires_grad=True)
        c = torch.randn(40, 16, dtype=dtype, requires_grad=True)
        tokens = torch.zeros(0, dtype=torch.long)
        with on_kernels(kernels):
            loss = cce_compile.linear_cross_entropy(e, c, tokens, reduction="sum", filter_eps=filter_eps)
            loss.backward()
            assert loss.item() == 0.0 and e.grad.shape == (0, 16) and not c.grad.any(), kernels
            log_probs, entropy = cce_compile.linear_log_probs(e, c, tokens, entropy=True, filter_eps=filter_eps)
            (log_probs.sum() + entropy.sum()).backward()
            assert log_probs.shape == entropy.shape == (0,) and not c.grad.any(), kernels


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["cpu", "kernels"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("output", ["loss", "log_probs"])
def test_filtered_mode_follows_a_saturating_softcap(kernels: bool, temperature: float, output: str,
                                                    block_sparse_always: None) -> None:
    """Logits spread 16 wide under a soft-cap of 30 (the cap saturates): a skipped entry's logit moves
    its softmax entry by the cap's slope, far under 1, which the put-back of skipped tiles and
    the tilt must follow (filtering.SkippedTiles). Without the slope dE erred by 7.3-10e-3
    here (1.6 on a sharper head at T = 0.3), against 1.1-2.6e-3 with it."""
    generator = torch.Generator().manual_seed(2)
    n, d, v = 16, 64, 4096
    e = torch.randn(n, d, generator=generator) * 4 / d**0.25
    c = torch.randn(v, d, generator=generator) * 4 / d**0.25
    tokens = (e @ c.T).argmax(dim=-1)
    grad_log_probs, grad_entropy = torch.randn(n, generator=generator), torch.randn(n, generator=generator) * 0.1

    def objective(e: torch.Tensor, c: torch.Tensor, filter_eps: str | None) -> torch.Tensor:
        if filter_eps is None:  # float64, materialized
            log_probs = torch.log_softmax(30.0 * torch.tanh(e @ c.T / 30.0) / temperature, dim=-1)
            picked, entropy = log_probs.gather(1, tokens[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(dim=-1)
        elif output == "loss":
            return cce_compile.linear_cross_entropy(e, c, tokens, softcap=30.0, temperature=temperature,
                                                    filter_eps=filter_eps, reduction="sum")
        else:
            picked, entropy = cce_compile.linear_log_probs(e, c, tokens, softcap=30.0, temperature=temperature,
                                                          entropy=True, filter_eps=filter_eps)
        if output == "loss":
            return -picked.sum()
        return (picked * grad_log_probs).sum() + (entropy * grad_entropy).sum()

    reference = e.double().requires_grad_()
    objective(reference, c.double(), None).backward()
    filtered = e.clone().requires_grad_()
    objective(filtered, c, "auto").backward()
    error = relative_error(filtered.grad.double(), reference.grad)
    assert error < 4e-3, error
