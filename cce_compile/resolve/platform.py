"""What a tuned config depends on besides the problem: the GPU, and the code it launches."""

from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..config.keys import normalize_gpu_name
from ..plan.policy import Policy

KERNELS_DIR = Path(__file__).parents[1] / "kernels"


@dataclass(frozen=True)
class Platform:
    """The GPU and the code versions a config is tuned for.

    `compute_capability`/`sm_count` let the service answer for a GPU it has not seen
    (same_arch); `shared_memory_bytes` is the per-block limit configs are checked against
    (None: not checked, e.g. on CPU or for a GPU named on the command line)."""

    gpu: str
    compute_capability: str | None
    sm_count: int | None
    shared_memory_bytes: int | None
    kernel_version: str
    triton_version: str


def launched_source(source: str) -> str:
    """Python source as the compiler sees it: its tokens with comments, docstrings and layout
    dropped, so that editing a note does not change what a kernel compiles to. Tokens, not
    ast.unparse, so every Python version gives the same text."""
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            docstring_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    words = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.INDENT, tokenize.DEDENT):
            words.append(tokenize.tok_name[token.type])
        elif token.type not in (tokenize.COMMENT, tokenize.NL) and token.start[0] not in docstring_lines:
            words.append(token.string.strip() or tokenize.tok_name[token.type])
    return " ".join(words)


@lru_cache(maxsize=1)
def kernel_version() -> str:
    """A short hash of what decides the launched code: the kernels' source (comments and
    docstrings stripped) and the default Policy, whose thresholds pick the kernels. Configs
    tuned for other code do not apply."""
    digest = hashlib.sha256()
    for path in sorted(KERNELS_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + launched_source(path.read_text(encoding="utf-8")).encode() + b"\0")
    digest.update(repr(Policy()).encode())
    return digest.hexdigest()[:12]


@lru_cache(maxsize=1)
def package_source_version() -> str:
    """A short hash of this package's Python source, every file as it is. torch.compile's
    on-disk caches key on the traced graph, not on the Python behind the ops' fake functions
    and autograd formulas: a traced call carries this in its settings (ops/problem.py), so
    that a graph traced by another version of the package is never handed back."""
    digest = hashlib.sha256()
    package = Path(__file__).parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@lru_cache(maxsize=1)
def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def local_platform(device: str, gpu: int | None = None) -> Platform:
    """This process's platform for a ProblemKey.device ("cuda", "cpu", "interpreter"): on CUDA,
    GPU `gpu`'s (the operands', which on a host of several GPUs need not be the current one),
    the current GPU's where None (the tuner and `cce lookup` run on it)."""
    if device != "cuda":
        return Platform(device, None, None, None, kernel_version(), triton_version())
    import torch

    return _cuda_platform(torch.cuda.current_device() if gpu is None else gpu)


def gpu_model(device: str, gpu: int | None = None) -> str:
    """The GPU model local_platform(device, gpu) names (its `gpu`), at the cost of a cached
    lookup: what the op's configs are remembered by, per call (resolve/ladder.py). Off CUDA,
    the device itself."""
    if device != "cuda":
        return device
    import torch

    return _cuda_gpu_name(torch.cuda.current_device() if gpu is None else gpu)


@lru_cache(maxsize=None)
def _cuda_gpu_name(index: int) -> str:
    import torch

    return normalize_gpu_name(torch.cuda.get_device_name(index))


@lru_cache(maxsize=None)
def _cuda_platform(index: int) -> Platform:
    import torch

    props = torch.cuda.get_device_properties(index)
    return Platform(
        gpu=_cuda_gpu_name(index),
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        shared_memory_bytes=props.shared_memory_per_block_optin,
        kernel_version=kernel_version(),
        triton_version=triton_version(),
    )
