"""Error measures shared by the benchmark harness and the tuner (torch only, so the tuner
loads none of the harness's display code)."""

from __future__ import annotations

from torch import Tensor


def relative_error(value: Tensor, ref: Tensor, floor: float | None = None) -> float:
    """Norm-wise relative error ||value - ref|| / ||ref||, in float32; with `floor`, the
    denominator is clamped below at it (a zero reference then gives no inf or NaN)."""
    ref32 = ref.float()
    denominator = ref32.norm()
    if floor is not None:
        denominator = denominator.clamp_min(floor)
    return ((value.float() - ref32).norm() / denominator).item()
