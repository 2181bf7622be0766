"""The op layer: the torch.library ops (library.py) and their runners, one file per path:
forward.py, backward_dense.py, backward_filtered.py, cpu_path.py."""

from .library import linear_cross_entropy_backward, linear_cross_entropy_forward, linear_cross_entropy_fused

__all__ = ["linear_cross_entropy_forward", "linear_cross_entropy_backward", "linear_cross_entropy_fused"]
