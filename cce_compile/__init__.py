"""cce_compile: cross_entropy(e @ c.T, targets) and its gradients without the logits.

The names below load on first use, so the torch-free layers (`cce_compile.config`,
`cce_compile.plan`) and the `cce` command's help import neither torch nor triton.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "linear_cross_entropy": "cce_compile.api",
    "LinearCrossEntropyLoss": "cce_compile.api",
    "linear_log_probs": "cce_compile.api",
    "VocabParallel": "cce_compile.parallel.vocab_parallel",
    "KernelConfig": "cce_compile.config.kernel_config",
    "TileConfig": "cce_compile.config.kernel_config",
    "ConfigError": "cce_compile.config.kernel_config",
    "override_config": "cce_compile.resolve.ladder",
    "Policy": "cce_compile.plan.policy",
    "override_policy": "cce_compile.plan.policy",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cce_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
