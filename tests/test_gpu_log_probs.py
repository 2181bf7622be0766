"""linear_log_probs on a CUDA GPU at realistic sizes (skipped without one): values and
gradients against fp32 under random upstream gradients, the kernels each option takes,
memory, and torch.compile."""

from __future__ import annotations

import pytest
import torch

import cce_compile

from cce_compile.bench.inputs import lm_like_inputs

from .op_cases import make_inputs, relative_error, steady_peaks

pytestmark = pytest.mark.gpu

TARGET = 5e-3
"""The issue's bound on every output's and gradient's relative error against fp32."""


def fp32_reference(e, c, tokens, bias, temperature, softcap, up_lp, up_h):
    """Materialized fp32 logits (TF32 off): log-probs, entropy, and the gradients of
    sum(up_lp * log_probs + up_h * entropy)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    leaves = [t.detach().float().requires_grad_() for t in (e, c) + ((bias,) if bias is not None else ())]
    logits = leaves[0] @ leaves[1].T
    if bias is not None:
        logits = logits + leaves[2]
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    log_softmax = torch.log_softmax(logits / temperature, dim=-1)
    log_probs = log_softmax.gather(1, tokens[:, None])[:, 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ((log_probs * up_lp).sum() + (entropy * up_h).sum()).backward()
    return log_probs.detach(), entropy.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("options", [{}, {"entropy": False}, {"temperature": 0.7},
                                     {"temperature": 0.7, "softcap": 30.0, "bias": True}])
def test_realistic_size_against_fp32(dtype: torch.dtype, options: dict) -> None:
    """Plain and with entropy (at D = 1024 the Gluon recompute, with its entropy term, on an
    H200), with a temperature (the Gluon kernels scaling their logits), and with every option
    (the tensor-descriptor forward and the recompute on pointers)."""
    options = dict(options)
    entropy = options.pop("entropy", True)
    e, c, tokens = make_inputs("zipf", (2048,), 32003, 1024, dtype, seed=0, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    bias = (torch.randn(32003, device="cuda", generator=g) * 0.5).to(dtype) if options.pop("bias", False) else None
    up_lp = torch.randn(2048, device="cuda", generator=g)
    up_h = torch.randn(2048, device="cuda", generator=g) if entropy else torch.zeros(2048, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (e, c) + ((bias,) if bias is not None else ())]
    out = cce_compile.linear_log_probs(leaves[0], leaves[1], tokens, bias=leaves[2] if bias is not None else None,
                                       entropy=entropy, **options)
    log_probs, entropies = out if entropy else (out, None)
    objective = (log_probs * up_lp).sum() + ((entropies * up_h).sum() if entropy else 0.0)
    objective.backward()
    ref_lp, ref_h, ref_grads = fp32_reference(e, c, tokens, bias, options.get("temperature", 1.0),
                                              options.get("softcap"), up_lp, up_h)
    tol = TARGET
    assert relative_error(log_probs, ref_lp) <= tol
    if entropy:
        assert relative_error(entropies, ref_h) <= tol
    for name, leaf, ref in zip(("e", "c", "bias"), leaves, ref_grads):
        err = relative_error(leaf.grad, ref)
        assert err <= tol, f"d{name}: {err:.2e} > {tol:.0e}"


def test_temperature_on_peaked_rows() -> None:
    """bf16 rows as peaked as a trained model's at T = 0.7: log-probs and entropies within 2e-3
    nat of fp32 (the kernels scale their fp32 logits; e / T rounded to bf16 moves these by
    ~1e-2), with and without gradients."""
    e, c, tokens = lm_like_inputs(4096, 2048, 32003, torch.bfloat16, "cuda", seed=3, target_loss=0.5)
    g = torch.Generator(device="cuda").manual_seed(1)
    up_lp, up_h = torch.randn(4096, device="cuda", generator=g), torch.randn(4096, device="cuda", generator=g)
    leaves = [t.clone().requires_grad_() for t in (e, c)]
    log_probs, entropy = cce_compile.linear_log_probs(*leaves, tokens, temperature=0.7, entropy=True)
    ((log_probs * up_lp).sum() + (entropy * up_h).sum()).backward()
    with torch.no_grad():
        no_grad_lp = cce_compile.linear_log_probs(e, c, tokens, temperature=0.7)
        rounded = cce_compile.linear_log_probs((e.float() / 0.7).to(torch.bfloat16), c, tokens)
    ref_lp, ref_h, ref_grads = fp32_reference(e, c, tokens, None, 0.7, None, up_lp, up_h)
    assert float(ref_h.mean()) < 0.5, "rows not peaked"
    assert float((rounded - ref_lp).abs().max()) > 5e-3, "e / T rounded to bf16 moves these rows"
    for got, want in ((log_probs, ref_lp), (no_grad_lp, ref_lp), (entropy, ref_h)):
        assert float((got - want).abs().max()) < 2e-3
    for leaf, ref in zip(leaves, ref_grads):
        assert relative_error(leaf.grad, ref) <= TARGET


@pytest.mark.parametrize(("n", "d", "v"), [(8192, 2048, 65536), (20000, 896, 151936)])
def test_peak_memory_within_ten_percent_of_gradients(n: int, d: int, v: int) -> None:
    """Forward + backward with both outputs: the recompute backward's bound, as the loss's memory="low"."""
    e, c, tokens = make_inputs("zipf", (n,), v, d, torch.bfloat16, seed=1, device="cuda")
    e.requires_grad_()
    c.requires_grad_()
    grads = (n * d + v * d) * 2

    def step() -> None:
        log_probs, entropy = cce_compile.linear_log_probs(e, c, tokens, entropy=True)
        (log_probs.sum() + 0.01 * entropy.sum()).backward()
        e.grad = c.grad = None

    step()  # compiles, and makes the streams' cuBLAS workspaces
    for call, peak in enumerate(steady_peaks(step, 2)):  # one captures the slab loop, the other replays it
        assert peak <= 1.10 * grads, f"call {call}: peak {peak / 2**20:.0f} MiB, gradients {grads / 2**20:.0f} MiB"


def test_compiled_matches_eager() -> None:
    e, c, tokens = make_inputs("zipf", (2, 1000), 32003, 1024, torch.bfloat16, seed=2, device="cuda")

    def step(e, c, tokens):
        log_probs, entropy = cce_compile.linear_log_probs(e, c, tokens, entropy=True, temperature=0.9, shift=True)
        return (log_probs * 0.5).sum() + (entropy * 0.01).sum()

    compiled_leaves = [t.clone().requires_grad_() for t in (e, c)]
    torch.compile(step, fullgraph=True, dynamic=True)(*compiled_leaves, tokens).backward()
    eager_leaves = [t.clone().requires_grad_() for t in (e, c)]
    step(*eager_leaves, tokens).backward()
    for got, want in zip(compiled_leaves, eager_leaves):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("d", [896, 1000])
def test_gluon_kernels_with_entropy_match_the_tensor_descriptor_ones(d: int, launch_plans: list, use_policy) -> None:
    """The Gluon forward's entropy statistic (where the policy lets it run: a no-grad pass, as
    it has no lse less the mean logit for the entropy's backward) and the Gluon recompute's
    entropy term against the tensor-descriptor forward and recompute, on ragged rows and
    vocabulary, a K tail (D = 1000) and ignored tokens: both as close to float64 as fp32 math
    over other tiles gets (each path sums its logits and tiles in its own order, so the two are
    a few fp32 ulps of lse apart, not equal)."""
    from .reference import reference_log_probs

    e, c, tokens = make_inputs("zipf", (3001,), 50001, d, torch.bfloat16, seed=7, device="cuda")
    tokens[::11] = -100
    g = torch.Generator(device="cuda").manual_seed(2)
    up_lp, up_h = torch.randn(3001, device="cuda", generator=g), torch.randn(3001, device="cuda", generator=g)

    def outputs() -> list[torch.Tensor]:
        with torch.no_grad():
            log_probs, entropy = cce_compile.linear_log_probs(e, c, tokens, entropy=True)
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        with_grad = cce_compile.linear_log_probs(*leaves, tokens, entropy=True)
        ((with_grad[0] * up_lp).sum() + (with_grad[1] * up_h).sum()).backward()
        return [log_probs, entropy] + [leaf.grad for leaf in leaves]

    use_policy(forward_gluon_with_entropy=True)
    on_gluon = outputs()
    use_policy(forward_gluon_max_k_steps=0, recompute_gluon_max_k_steps=0, recompute_tma_min_k_steps=1)
    on_descriptors = outputs()
    # the no-grad pass's plan, the forward's under grad and the backward's
    assert [(plan.forward, plan.recompute) for plan in launch_plans] == [
        ("gluon", "gluon"), ("tma", "gluon"), ("gluon", "gluon")] + [("tma", "tma")] * 3
    expected = reference_log_probs(e.double(), c.double(), tokens, entropy=True)
    for name, got_gluon, got_descriptors, want in zip(("log_probs", "entropy"), on_gluon, on_descriptors, expected):
        errors = [(got.double() - want).abs().max().item() for got in (got_gluon, got_descriptors)]
        assert max(errors) <= 2e-4, f"{name}: largest error against float64, Gluon / descriptors {errors}"
    assert torch.all(on_gluon[0][::11] == 0)
    for name, got, want in zip(("dE", "dC"), on_gluon[2:], on_descriptors[2:]):
        assert relative_error(got, want) < 5e-3, name  # bf16 d-logits of other tiles, rounded apart


def _large_shifted_rows(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e, c, tokens), 2048 x 50001 x 896 on the GPU: every logit shifted by +50 (a hidden unit
    every head row reads: the Gluon forward takes no bias) and token 7's raised by a gap growing
    over the rows from 0 to 30, so rows run from flat to one-hot (~2e-7 nats)."""
    n, v, d = 2048, 50001, 896
    g = torch.Generator().manual_seed(4)
    e, c = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / d**0.5
    c[:, -2:] = 0.0
    c[:, -2], e[:, -2] = 1.0, 50.0
    c[7, -1], e[:, -1] = 1.0, torch.linspace(0.0, 30.0, n)
    return e.to(dtype).cuda(), c.to(dtype).cuda(), torch.randint(0, v, (n,), generator=g).cuda()


@pytest.mark.parametrize("forward", ["gluon", "tma", "split"])
def test_entropy_of_large_logits_on_every_forward(forward: str, launch_plans: list, use_policy) -> None:
    """tests/test_log_probs.py's rows of large logits at a realistic size, on the forwards the
    interpreter cannot run: the Gluon forward's entropy epilogue (forward_gluon_with_entropy),
    the tensor-descriptor one and the split one (fp32). Every logit is shifted by +50 (a hidden
    unit every head row reads: the Gluon forward takes no bias) and token 7's raised by a gap
    growing over the rows from 0 to 30, so rows run from flat to one-hot (~2e-7 nats); each
    row's entropy is within 5e-5 of float64 relatively, and never negative."""
    from .reference import reference_log_probs

    e, c, tokens = _large_shifted_rows(torch.float32 if forward == "split" else torch.bfloat16)
    if forward == "gluon":
        use_policy(forward_gluon_with_entropy=True)
    else:
        use_policy(forward_gluon_max_k_steps=0)
    with torch.no_grad():
        _, entropy = cce_compile.linear_log_probs(e, c, tokens, entropy=True)
    assert launch_plans[0].forward == forward
    _, reference = reference_log_probs(e.double(), c.double(), tokens, entropy=True)
    assert float(reference.min()) < 1e-6 and float(reference.max()) > 8.0, "rows not from one-hot to flat"
    relative = float(((entropy.double() - reference).abs() / reference).max())
    assert relative <= 5e-5, relative
    assert bool((entropy >= 0.0).all()), float(entropy.min())


@pytest.mark.parametrize(("forward", "bound"), [("tma", 2e-2), ("split", 1e-4)])
def test_entropy_gradient_of_peaked_rows_on_every_forward(forward: str, bound: float, launch_plans: list,
                                                          use_policy) -> None:
    """tests/test_log_probs.py's entropy gradient of near one-hot rows at a realistic size, on
    the forwards that run under grad (the Gluon one's entropy has no lse less the mean logit)
    and the recomputes they meet: the backward's d-logits take lse less the mean logit from the
    forward, which holds only if the recompute's logits at each row's peak are the forward's
    (each row's dE within `bound` of float64, per row: in bf16 its d-logits and dE round, 2-8e-3 on
    every row in the interpreter, flat or peaked; 5.5e-2 on peaked rows before)."""
    from .reference import reference_log_probs

    e, c, tokens = _large_shifted_rows(torch.float32 if forward == "split" else torch.bfloat16)
    use_policy(forward_gluon_max_k_steps=0)
    upstream = torch.randn(e.shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64).cuda()
    e64 = e.double().requires_grad_()
    _, reference = reference_log_probs(e64, c.double(), tokens, entropy=True)
    (expected,) = torch.autograd.grad(reference, e64, upstream)
    peaked = reference.detach() < 1e-2
    leaf = e.clone().requires_grad_()
    _, entropy = cce_compile.linear_log_probs(leaf, c, tokens, entropy=True)
    (got,) = torch.autograd.grad(entropy, leaf, upstream.float())
    assert launch_plans[0].forward == forward and int(peaked.sum()) >= 200
    row_error = (got.double() - expected).norm(dim=1) / expected.norm(dim=1)
    assert float(row_error[peaked].max()) <= bound, float(row_error[peaked].max())


def test_no_grad_pass_peaks_at_its_per_tile_buffers(launch_plans: list) -> None:
    """The old / reference policy's pass with entropy: the forward's two (vocab tiles, N) fp32
    buffers (log-sum-exps, entropies; merged in place), nothing N x V."""
    from cce_compile.ops.problem import config_for
    from cce_compile.plan.policy import active_policy

    n, d, v = 16384, 896, 151936
    e, c, tokens = make_inputs("zipf", (n,), v, d, torch.bfloat16, seed=3, device="cuda")
    with torch.no_grad():
        cce_compile.linear_log_probs(e[:128], c, tokens[:128], entropy=True)
    plan = launch_plans[-1]
    block_n = (plan.gluon_tile if plan.forward == "gluon" else config_for(e, c, False, active_policy()).forward).block_n
    per_tile = -(-v // block_n) * n * 4
    for _ in range(2):  # the first compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            cce_compile.linear_log_probs(e, c, tokens, entropy=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 2 * per_tile + 64 * n * 4 + 2**20, f"peak {peak / 2**20:.0f} MiB, per tile {per_tile / 2**20:.0f} MiB"


@pytest.mark.parametrize(("n", "d", "v"), [(8192, 896, 151936), (8192, 2304, 256000)])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.1])
def test_filtered_on_lm_like_heads_against_fp32(n: int, d: int, v: int, entropy_weight: float) -> None:
    """filter_eps="auto" on LM-like heads (the benchmark's inputs, Qwen2.5's and Gemma-2's
    shapes): outputs and both gradients within the bound under random log-prob upstream
    gradients and entropy ones `entropy_weight` their size: the filtered backward and its
    put-back of the skipped tiles, the entropy's from each tile's mean logit."""
    from cce_compile.bench.inputs import lm_like_inputs

    e, c, tokens = lm_like_inputs(n, d, v, torch.bfloat16, "cuda", seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    up_lp = torch.randn(n, device="cuda", generator=g)
    up_h = entropy_weight * torch.randn(n, device="cuda", generator=g)
    leaves = [t.clone().requires_grad_() for t in (e, c)]
    log_probs, entropies = cce_compile.linear_log_probs(*leaves, tokens, entropy=True, filter_eps="auto")
    ((log_probs * up_lp).sum() + (entropies * up_h).sum()).backward()
    ref_lp, ref_h, ref_grads = fp32_reference(e, c, tokens, None, 1.0, None, up_lp, up_h)
    assert relative_error(log_probs, ref_lp) <= TARGET and relative_error(entropies, ref_h) <= TARGET
    for name, leaf, ref in zip(("e", "c"), leaves, ref_grads):
        err = relative_error(leaf.grad, ref)
        assert err <= TARGET, f"d{name}: {err:.2e} > {TARGET:.0e}"
