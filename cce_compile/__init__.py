"""cce_compile: cross_entropy(e @ c.T, targets) and its gradients without the logits.

Imports torch and triton only; the tuning service and database load on demand.
"""

from .api import LinearCrossEntropyLoss, linear_cross_entropy
from .config.kernel_config import ConfigError, KernelConfig, TileConfig
from .config.resolve import override_config

__version__ = "0.1.0"
__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropyLoss",
    "KernelConfig",
    "TileConfig",
    "ConfigError",
    "override_config",
]
