"""Filtered mode's bookkeeping (ops/filtering.py) against its dense definition, on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from cce_compile.ops.filtering import kept_tile_mask, vocab_order

from .op_cases import make_inputs

EPS = 2.0**-12


@pytest.mark.parametrize("eps", [EPS, 2.0**-6])
@pytest.mark.parametrize("forward_block_n", [16, 32, 64])
def test_kept_tile_mask_is_the_dense_softmax_test(forward_block_n: int, eps: float) -> None:
    """From the forward's per-row tile maxima and lse: exactly the (16 x 32) tiles, in
    vocab-order positions, where some row's softmax reaches eps or a row's target falls
    (ignored targets keep nothing by themselves), and every tile of a row block holding a
    counted row whose softmax reaches eps nowhere (flat: at 2^-6, rows 30-49 here). Forward
    tiles wider than the backward's decide for all the backward tiles inside them, targets
    included (never fewer kept, and what is skipped is whole forward tiles). N and V are
    ragged."""
    n, v, block_m, block_n = 70, 300, 16, 32
    e, c, targets = make_inputs("zipf", (n,), v, 24, torch.float32, seed=7)
    e = e * 3.0  # a sharp softmax, so that most tiles drop
    e[30:50] *= 0.01  # flat rows: each token's softmax ~1/300, under 2^-6 and over 2^-12
    targets[::6] = -100
    order = vocab_order(e, c, None)
    logits = (e @ c.T)[:, order]  # columns are positions in the order
    lse = torch.logsumexp(logits, dim=1)
    padded = torch.nn.functional.pad(logits, (0, (-v) % forward_block_n), value=float("-inf"))
    tile_max = padded.reshape(n, -1, forward_block_n).amax(dim=2)

    mask = kept_tile_mask(tile_max, lse, targets, order, eps, forward_block_n, block_m, block_n)

    def tiles(hit: torch.Tensor, width: int) -> torch.Tensor:
        """Backward tiles holding a hit, decided per `width` columns."""
        hit = torch.nn.functional.pad(hit, (0, (-v) % width, 0, (-n) % block_m))
        decided = hit.reshape(hit.shape[0] // block_m, block_m, -1, width).any(dim=3).any(dim=1)
        return decided.repeat_interleave(width // block_n, dim=1)[:, : -(-v // block_n)]

    softmax_hit = logits - lse[:, None] >= math.log(eps)
    target_hit = torch.zeros_like(softmax_hit)
    valid = targets >= 0
    target_hit[valid.nonzero().flatten(), torch.argsort(order)[targets[valid]]] = True
    flat = valid & ~softmax_hit.any(dim=1)
    assert flat.sum() == (16 if eps > EPS else 0), "rows 30-49 less the ignored ones should be flat at 2^-6 only"
    expected = tiles(softmax_hit | target_hit | flat[:, None], max(block_n, forward_block_n))
    assert mask.dtype == torch.int8 and mask.shape == expected.shape
    assert torch.equal(mask.bool(), expected)
    assert expected.sum() >= 5 and (~expected).sum() >= 2, "the case should keep some tiles and drop others"
