"""Filtered mode's bookkeeping (ops/filtering.py) against its dense definition, on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from cce_compile.ops import filtering
from cce_compile.ops.filtering import Tilt, kept_tile_mask, tilt_sample_size, vocab_order

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


@pytest.mark.parametrize("tile_sums", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tilt_is_the_heaviest_tiles_covariance(with_bias: bool, tile_sums: bool) -> None:
    """Tilt.estimate: over the `rows // width` whole tiles (in vocab-order positions; the
    ragged last one never) with the most skipped mass, the mean of each tile's covariance of
    c's rows about their mean (and of c and bias), with the tiles' sums given or not; the
    lighter tiles play no part. Its columns against its rows add m * (S e + K)."""
    g = torch.Generator().manual_seed(3)
    v, d, width = 70, 6, 16  # 4 whole tiles and a ragged one of 6 positions
    c = torch.randn(v, d, generator=g, dtype=torch.float64) + 3.0  # a shared mean, as a head's rows have
    bias = torch.randn(v, generator=g, dtype=torch.float64) if with_bias else None
    order = torch.randperm(v, generator=g)
    tile_mass = torch.tensor([0.5, 0.0, 2.0, 0.1, 9.0])
    sums = torch.nn.functional.pad(c[order], (0, 0, 0, 10)).view(5, width, d).sum(dim=1).float() if tile_sums else None
    tilt = Tilt.estimate(c.float(), None if bias is None else bias.float(), order, tile_mass, width, 3 * width,
                         tensor_cores=False, tile_sums=sums)

    heaviest = [2, 0, 3]  # the ragged tile's 9.0 is no candidate
    expected_s = torch.zeros(d, d, dtype=torch.float64)
    expected_k = torch.zeros(d, dtype=torch.float64)
    for tile in heaviest:
        ids = order[tile * width:(tile + 1) * width]
        deviation = c[ids] - c[ids].mean(dim=0)
        expected_s += deviation.T @ deviation / width / len(heaviest)
        if bias is not None:
            expected_k += deviation.T @ (bias[ids] - bias[ids].mean()) / width / len(heaviest)
    torch.testing.assert_close(tilt.covariance.double(), expected_s, rtol=1e-4, atol=1e-4)
    if bias is None:
        assert tilt.bias_covariance is None
    else:
        torch.testing.assert_close(tilt.bias_covariance.double(), expected_k, rtol=1e-4, atol=1e-4)

    e = torch.randn(9, d, generator=g)
    row_mass = torch.rand(9, generator=g)
    added = tilt.columns(e, row_mass, out=torch.empty(9, tilt.rows().shape[0])) @ tilt.rows()
    expected = row_mass[:, None].double() * (e.double() @ expected_s + expected_k)
    torch.testing.assert_close(added.double(), expected, rtol=1e-4, atol=1e-4)


def test_tilt_sample_size_stays_within_its_cost() -> None:
    """Every tile on small problems; on the benchmark heads TILT_ROWS_PER_D x D rows where the
    cost allows (Qwen2.5), fewer where it binds (Gemma-2), none where fewer than
    TILT_MIN_ROWS_PER_D x D fit (Llama-3, D = 8192); never more than TILT_COST of the logits
    GEMM's FLOPs beyond the free ones."""
    assert tilt_sample_size(256, 32768, 256) == 32768
    qwen, gemma = tilt_sample_size(16384, 151936, 896), tilt_sample_size(8192, 256000, 2304)
    assert qwen == filtering.TILT_ROWS_PER_D * 896
    assert filtering.TILT_MIN_ROWS_PER_D * 2304 <= gemma < filtering.TILT_ROWS_PER_D * 2304
    assert tilt_sample_size(8192, 128256, 4096) == 0 and tilt_sample_size(4096, 128256, 8192) == 0
    for n, v, d, rows in ((16384, 151936, 896, qwen), (8192, 256000, 2304, gemma)):
        assert (rows + n) * d * d <= filtering.TILT_COST * n * v * d


def test_tilt_of_a_vocabulary_under_one_tile_is_zero() -> None:
    """With no whole tile to estimate from (V under the forward tile), the tilt adds nothing
    (and no NaN from an empty average)."""
    c = torch.randn(20, 8)
    tilt = Tilt.estimate(c, torch.randn(20), torch.arange(20), torch.ones(1), 32, 20, tensor_cores=False)
    assert torch.equal(tilt.rows(), torch.zeros(9, 8))


def test_tilt_counts_a_ruled_out_token_as_bias_zero() -> None:
    """A -inf bias (a sampler's mask) rules a token out: the tilt's covariance of c and bias
    counts it as bias 0 instead of turning dE's put-back non-finite."""
    g = torch.Generator().manual_seed(4)
    c, bias = torch.randn(64, 6, generator=g), torch.randn(64, generator=g)
    ruled_out = bias.clone()
    ruled_out[::5] = float("-inf")
    zeroed = torch.where(torch.isfinite(ruled_out), ruled_out, 0.0)
    args = (torch.arange(64), torch.ones(4), 16, 64)
    tilt = Tilt.estimate(c, ruled_out, *args, tensor_cores=False)
    assert torch.isfinite(tilt.rows()).all()
    torch.testing.assert_close(tilt.rows(), Tilt.estimate(c, zeroed, *args, tensor_cores=False).rows())
