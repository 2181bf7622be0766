"""The op layer: triton_op registrations (forward, backward), their autograd, the CPU path."""

from . import autograd  # noqa: F401  (registers the backward)
from .backward import linear_cross_entropy_backward
from .forward import linear_cross_entropy_forward

__all__ = ["linear_cross_entropy_forward", "linear_cross_entropy_backward"]
