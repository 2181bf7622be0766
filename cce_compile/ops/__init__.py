"""The op layer: the torch.library ops (library.py) and their runners, one file per path:
forward.py, forward_fused.py, backward_dense.py, backward_filtered.py, cpu_path.py;
linear_log_probs' ops in log_probs.py, the vocabulary-parallel loss's in vocab_parallel.py."""

from .library import linear_cross_entropy_backward, linear_cross_entropy_forward, linear_cross_entropy_fused
from .log_probs import linear_log_probs_backward, linear_log_probs_forward

__all__ = ["linear_cross_entropy_forward", "linear_cross_entropy_backward", "linear_cross_entropy_fused",
           "linear_log_probs_forward", "linear_log_probs_backward"]
