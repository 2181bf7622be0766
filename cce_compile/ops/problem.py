"""What an op call's tensors say about how it can run: the Problem that plan_launch takes,
the key its config is resolved for, the settings (config and Policy) it launches with, and
the device facts the runners size launches by."""

from __future__ import annotations

import base64
import json
import operator
from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..config.kernel_config import KernelConfig, TileConfig
from ..config.keys import ProblemKey
from ..plan.launch import Options, Problem
from ..plan.policy import Policy, active_policy, policy_from_json, policy_to_json
from ..plan.tokens import traced_n_bucket
from ..resolve.ladder import launch_failed, resolve_config
from ..resolve.platform import package_source_version

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
T = TypeVar("T")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def descriptor_rows_fit(element_bytes: int, row_stride: int) -> bool:
    """Whether rows of 16-bit elements this far apart suit the copy engine (16-byte aligned)."""
    return element_bytes == 2 and row_stride * element_bytes % 16 == 0


def tensor_descriptors_fit(*tensors: Tensor) -> bool:
    """Whether the tensor-descriptor kernels can take these 2-D tensors: real ones (a fake
    tensor's address is 0), no empty dimension (descriptors cannot describe one), a
    contiguous last dimension, 16-bit elements, 16-byte aligned bases and row strides."""
    return all(
        not is_fake(t) and t.numel() > 0 and t.stride(-1) == 1
        and descriptor_rows_fit(t.element_size(), t.stride(0)) and t.data_ptr() % 16 == 0
        for t in tensors
    )


@lru_cache(maxsize=None)
def runs_wgmma(device: torch.device) -> bool:
    """Whether the GPU is a Hopper (sm_90), whose wgmma the Gluon kernels are written in."""
    return torch.cuda.get_device_capability(device)[0] == 9


@lru_cache(maxsize=None)
def device_limits(device: torch.device) -> tuple[int, int]:
    """(programs a persistent kernel launches, shared memory one program may opt into): one
    program per SM on a GPU; under the interpreter a few, so the loop over tiles runs more
    than once, and no memory limit."""
    if device.type != "cuda":
        return 3, 1 << 30
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.shared_memory_per_block_optin


def problem_of(e: Tensor, c: Tensor) -> Problem:
    on_cuda = e.is_cuda
    return Problem(
        n=e.shape[0], v=c.shape[0], d=c.shape[1], dtype=dtype_name(e.dtype), on_cuda=on_cuda,
        hopper=on_cuda and runs_wgmma(e.device),
        descriptors_fit=tensor_descriptors_fit(e, c),
        capturing=on_cuda and torch.cuda.is_current_stream_capturing(),
    )


def options_of(bias: Tensor | None, weight: Tensor | None, softcap: float, label_smoothing: float,
               filter_eps: float, logit_scale: float) -> Options:
    return Options(has_bias=bias is not None, has_weight=weight is not None, has_softcap=softcap > 0.0,
                   has_smoothing=label_smoothing > 0.0, filtered=filter_eps > 0.0, logit_scale=logit_scale)


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd will want gradients of a call's operands."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def key_of(on_cuda: bool, v: int, d: int, dtype: str, bucket: int, filtered: bool, policy: Policy) -> ProblemKey:
    device = "cuda" if on_cuda else ("interpreter" if policy.triton_on_cpu else "cpu")
    return ProblemKey(device=device, v=v, d=d, dtype=dtype, n_bucket=bucket, mode="filtered" if filtered else "exact")


def problem_key(e: Tensor, c: Tensor, filtered: bool, policy: Policy, key_v: int | None = None) -> ProblemKey:
    """`key_v` names the config by another vocabulary size than c's (one every shard of a
    vocabulary-parallel call names alike, so that one rank's resolution serves all). N's
    bucket as plan.tokens.traced_n_bucket chooses it, for a call traced without settings."""
    return key_of(e.is_cuda, int(c.shape[0] if key_v is None else key_v), int(c.shape[1]), dtype_name(e.dtype),
                  traced_n_bucket(e.shape[0]), filtered, policy)


def gpu_of(e: Tensor) -> int | None:
    """The CUDA device a call's config is resolved for: its operands', which on a host of
    several GPUs need not be the current one (torch.compile traces outside the op's device
    guard, ops/launch.on_device_of); None off CUDA."""
    return e.device.index if e.is_cuda else None


def config_for(e: Tensor, c: Tensor, filtered: bool, policy: Policy, key_v: int | None = None) -> KernelConfig:
    return resolve_config(problem_key(e, c, filtered, policy, key_v), gpu_of(e))


@lru_cache(maxsize=64)
def encode_settings(config: KernelConfig, policy: Policy) -> str:
    """A call's config and Policy as one string argument of the ops (the forward's traced
    settings, the backward's): base64 of their JSON, since Inductor's C++ wrapper writes a
    string argument into its source unescaped. Cached: every call encodes one."""
    text = json.dumps(config.to_dict(), sort_keys=True) + "\n" + policy_to_json(policy)
    return base64.urlsafe_b64encode(text.encode()).decode()


def _encoded_part(settings: str) -> str:
    """The encoded config and Policy of a settings argument, "" where it has none. A traced
    call's settings begin with the package's source version and a "." (traced_settings),
    which base64 never holds."""
    return settings.rpartition(".")[2]


@lru_cache(maxsize=64)
def decode_settings(settings: str) -> tuple[KernelConfig, Policy]:
    config, policy = base64.urlsafe_b64decode(_encoded_part(settings)).decode().split("\n")
    return KernelConfig.from_dict(json.loads(config)), policy_from_json(policy)


def launch_settings(settings: str, e: Tensor, c: Tensor, filtered: bool,
                    key_v: int | None = None) -> tuple[KernelConfig, Policy]:
    """(config, policy) a forward op's call launches with: its `settings` decoded where they
    hold them (traced_settings), else the active Policy and the config resolved for it now."""
    if _encoded_part(settings):
        return decode_settings(settings)
    policy = active_policy()
    return config_for(e, c, filtered, policy, key_v), policy


def backward_settings(settings: str, e: Tensor, c: Tensor, filtered: bool, key_v: int | None = None) -> str:
    """The settings a call's backward op launches with: the traced ones, or those the forward
    resolved as it ran (launch_settings) encoded."""
    return settings if _encoded_part(settings) else encode_settings(*launch_settings(settings, e, c, filtered, key_v))


def traced_settings(e: Tensor, c: Tensor, filtered: bool, key_v: int | None = None, *,
                    config_in_backward: bool) -> str:
    """The settings argument of a forward op's call: "" for an eager call (the op resolves
    its config as it runs). Under torch.compile, the package's source version, a ".", and,
    where the outputs' sizes or the backward depend on the config, the config and Policy
    resolved now, where the call is traced (filtered mode's tile statistics are sized by the
    config; `config_in_backward`: autograd will run an op's backward that launches with the
    forward's config, not the fused loss's, which only scales). The graph holds them as a constant, so the op runs, its fake function sizes
    and its backward launches with the config it was traced for, and torch.compile's caches,
    which key on the graph, never hand a later process a graph traced for another config,
    Policy or version of this package's code. Inside one process a graph keeps what it was
    traced with (Dynamo does not guard on them): torch._dynamo.reset() retraces. V and D are
    read as constants (operator.index, which Dynamo specializes: a dynamic V or D,
    dynamic=True, recompiles per value, as the config's key needs); N counts by its bucket
    (plan.tokens.traced_n_bucket): one range guard (and compile) per power of two where guards
    are allowed, one graph for a mark_dynamic range or dimension that refuses them."""
    if not torch.compiler.is_compiling():
        return ""
    version = _traced_source_version() + "."
    # A branch, not bool(): a filter_eps Dynamo made a SymFloat (a second value, dynamic=True)
    # gives `eps > 0` as a SymBool, which the branch guards on and _settings_for_key takes.
    filtered = True if filtered else False  # noqa: SIM210
    if not (filtered or config_in_backward):
        return version
    v = operator.index(c.shape[0] if key_v is None else key_v)
    return version + _settings_for_key(e.is_cuda, v, operator.index(c.shape[1]), dtype_name(e.dtype),
                                       traced_n_bucket(e.shape[0]), filtered, gpu_of(e))


@torch.compiler.assume_constant_result
def _traced_source_version() -> str:
    return package_source_version()


@torch.compiler.assume_constant_result
def _settings_for_key(on_cuda: bool, v: int, d: int, dtype: str, bucket: int, filtered: bool, gpu: int | None) -> str:
    policy = active_policy()
    return encode_settings(resolve_config(key_of(on_cuda, v, d, dtype, bucket, filtered, policy), gpu), policy)


TRACED_CONFIG_FAILED = ("the kernel config this call was traced with failed to launch ({error}); "
                        "torch._dynamo.reset() (or a new process) traces again with the next one")
FILTERED_CONFIG_FAILED = ("the kernel config this call's forward ran with failed to launch in its backward ({error}); "
                          "filtered mode's backward reads the forward's tiles, laid out for that config, so it cannot "
                          "take another: the next call runs with the next one")


def launch_with_config(e: Tensor, c: Tensor, filtered: bool, settings: str,
                       launch: Callable[[KernelConfig, Policy], T], key_v: int | None = None) -> T:
    """`launch(config, policy)` with the call's settings: `settings` where they hold a config
    (traced_settings), else the active Policy and the config resolved now (for `key_v` as
    problem_key takes it). Every forward op launches through here. A resolved config
    from outside the process that fails to launch costs this call one failed launch per
    source: the ladder drops that source for the key and the next rung's config launches
    instead. Any error counts: Triton refuses a config in many ways (its compiler's and ptxas's
    errors, out of resources, a RuntimeError from an MLIR pass), and an error that is not the
    config's (a bug) is raised anyway from the last rung, the heuristic. A traced call cannot
    take another (the graph's sizes and its backward were made for its config): its failure is
    raised, with its source dropped for the next trace where that config is still the one the
    ladder gives for the key. Running out of memory says nothing about the config and is
    raised as it is."""
    config, policy = launch_settings(settings, e, c, filtered, key_v)
    fixed = TRACED_CONFIG_FAILED if _encoded_part(settings) else None
    return _launch_falling_back(e, c, filtered, config, policy, launch, key_v, fixed)


def launch_backward_with_config(e: Tensor, c: Tensor, filtered: bool, settings: str,
                                launch: Callable[[KernelConfig, Policy], T]) -> T:
    """`launch(config, policy)` with the forward's config and Policy (`settings`,
    backward_settings): the backward ops of the loss and the log-probs launch through here.
    Where that config fails to launch (the forward's kernels launched, the backward's did not),
    an eager call in exact mode falls back as the forward does: the recompute reads only the
    forward's log-sum-exps, which every config computes alike. A traced call cannot take
    another config (as its forward), nor filtered mode, whose kept tiles and tile statistics
    the forward laid out by its config's tiles: their failure is raised, naming the way out,
    with the config's source dropped for the next call or trace."""
    config, policy = decode_settings(settings)
    fixed = TRACED_CONFIG_FAILED if _traced(settings) else FILTERED_CONFIG_FAILED if filtered else None
    return _launch_falling_back(e, c, filtered, config, policy, launch, None, fixed)


def _traced(settings: str) -> bool:
    """Whether a backward op's `settings` are a traced call's: traced_settings' version and "."
    before the encoded config, where an eager call's are the encoded config alone."""
    return _encoded_part(settings) != settings


def _launch_falling_back(e: Tensor, c: Tensor, filtered: bool, config: KernelConfig, policy: Policy,
                         launch: Callable[[KernelConfig, Policy], T], key_v: int | None, fixed: str | None) -> T:
    """`launch(config, policy)`, and where the config fails to launch, the ladder's next for the
    call's key (launch_failed) until one launches or no rung is left. `fixed`: for a call that
    cannot take another config, the message (formatted with the error) of the RuntimeError its
    failure is raised as where later calls take another (the config's source is dropped now, or
    was already); None for a call that can. The key is made only once a launch fails: every
    backward call comes through here."""
    while True:
        try:
            return launch(config, policy)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            key, gpu = problem_key(e, c, filtered, policy, key_v), gpu_of(e)
            if fixed is not None:
                if resolve_config(key, gpu) != config or launch_failed(key, error, config, gpu):
                    raise RuntimeError("cce_compile: " + fixed.format(error=error)) from error
                raise
            if not launch_failed(key, error, config, gpu):
                raise
        config = resolve_config(key, gpu)


def kernel_flags(e: Tensor) -> dict[str, bool]:
    """UPCAST: the interpreter multiplies bf16 bit patterns in tl.dot (triton#11584), so
    operands go to fp32 there. IEEE: fp32 inputs get fp32 dots, not TF32."""
    upcast = not e.is_cuda and e.dtype == torch.bfloat16
    return {"UPCAST": upcast, "IEEE": upcast or e.dtype == torch.float32}


def stages_beside_output(tile: TileConfig, element_bytes: int, shared_memory: int) -> int:
    """The tile's pipeline stages, as many as fit in `shared_memory` beside the output tile
    that a tensor-descriptor store stages there (1 KiB left for barriers)."""
    per_stage = (tile.block_m + tile.block_n) * tile.block_k * element_bytes
    room = shared_memory - tile.block_m * tile.block_n * element_bytes - 1024
    return max(1, min(tile.num_stages, room // per_stage))


def cdiv(a, b):
    """Ceil division that works on ints and SymInts alike."""
    return (a + b - 1) // b
