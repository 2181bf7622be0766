"""torch.autocast: the op runs in autocast's dtype, as the F.linear it replaces would, and
keeps its own fp32 accumulation (autocast does not recast its inner matmuls). On CPU with
bf16 autocast; CUDA takes the same code path with device type "cuda"."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

import cce_compile

from .op_cases import make_inputs, relative_error
from .reference import reference_loss

pytestmark = pytest.mark.filterwarnings("ignore:.*autocast.*:UserWarning")


def loss_and_grads(e: Tensor, c: Tensor, targets: Tensor, bias: Tensor, *, autocast: bool,
                   backward_inside: bool = True, fn=cce_compile.linear_cross_entropy) -> tuple[Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_() for t in (e, c, bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(leaves[0], leaves[1], targets, bias=leaves[2], label_smoothing=0.1)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return (loss, *(leaf.grad for leaf in leaves))


@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward inside", "backward after"])
def test_fp32_leaves_under_autocast_run_the_op_in_bf16(backward_inside: bool) -> None:
    """Same loss and gradients as calling the op on the bf16-cast tensors outside autocast:
    bit for bit, so autocast changed nothing inside the op; gradients land on the fp32
    leaves in fp32."""
    e, c, targets = make_inputs("zipf", (4, 33), 1031, 64, torch.float32, seed=2)
    bias = torch.randn(1031, generator=torch.Generator().manual_seed(3)) * 0.1
    autocast = loss_and_grads(e, c, targets, bias, autocast=True, backward_inside=backward_inside)
    bf16 = loss_and_grads(e.bfloat16(), c.bfloat16(), targets, bias.bfloat16(), autocast=False)
    assert torch.equal(autocast[0], bf16[0])
    for grad, bf16_grad in zip(autocast[1:], bf16[1:]):
        assert grad.dtype == torch.float32
        assert torch.equal(grad, bf16_grad.float())


def test_autocast_loss_is_the_bf16_problem_computed_in_fp32() -> None:
    """Against float64 on the bf16-rounded inputs: only the inputs are rounded, not the
    accumulation (a bf16 matmul inside would miss this by ~1e-2)."""
    e, c, targets = make_inputs("zipf", (4, 33), 1031, 64, torch.float32, seed=2)
    bias = torch.randn(1031, generator=torch.Generator().manual_seed(3)) * 0.1
    loss = loss_and_grads(e, c, targets, bias, autocast=True)[0]
    rounded = [t.bfloat16().double() for t in (e, c, bias)]
    expected = reference_loss(rounded[0], rounded[1], targets, bias=rounded[2], label_smoothing=0.1)
    assert relative_error(loss, expected) < 1e-6


def test_autocast_compiles_fullgraph_and_matches_eager() -> None:
    """emulate_precision_casts: by default Inductor may fuse away the fp32 -> bf16 -> fp32
    round trip of the CPU path's inputs (computing from the unrounded fp32 values, 0.7% off
    eager's gradients here); with it, compiled equals eager."""
    e, c, targets = make_inputs("peaked", (2, 40), 300, 32, torch.float32, seed=4)
    bias = torch.randn(300, generator=torch.Generator().manual_seed(5)) * 0.1
    torch._dynamo.reset()
    compiled = torch.compile(cce_compile.linear_cross_entropy, fullgraph=True)
    eager = loss_and_grads(e, c, targets, bias, autocast=True)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        traced = loss_and_grads(e, c, targets, bias, autocast=True, fn=compiled)
    for got, want in zip(traced, eager):
        assert relative_error(got, want) < 1e-4


def test_patched_hf_model_under_autocast_tracks_hf_autocast() -> None:
    """fp32 weights under autocast(bf16): the patched model's loss follows HF's own autocast
    loss (bf16 logits, fp32 loss) and the op sees bf16 operands."""
    pytest.importorskip("transformers")
    from cce_compile.integrations.transformers import patch

    from .test_distributed import recording_op_inputs
    from .test_transformers import batch, tiny_model

    reference = tiny_model("llama")
    patched = patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16), recording_op_inputs() as seen:
        expected = reference(input_ids, labels=labels).loss
        loss = patched(input_ids, labels=labels).loss
    assert [(e.dtype, c.dtype) for e, c in seen] == [(torch.bfloat16, torch.bfloat16)]
    assert relative_error(loss, expected) < 1e-2
    loss.backward()
    assert patched.lm_head.weight.grad.dtype == torch.float32
