"""Hugging Face causal LMs whose training loss goes through linear_cross_entropy.

`patch(model_or_class)` replaces `*ForCausalLM.forward` with one generic forward that, when
labels are given, takes the loss from the final hidden states and `lm_head.weight` without the
(tokens, vocab) logits, with the patch's options (training and evaluation alike). With
autograd recording that is where HF's loss costs the most memory: the float32 logits and their
softmax stay alive for backward; under `torch.no_grad()` (Trainer's evaluation and prediction
loops) the logits come back too, for metrics. Without labels (`generate`) the original
forward runs.

Runs on 4.5x and 5.x releases: the KV cache argument is `cache` where the release renamed it
(late 5.x, which still takes `past_key_values` with a FutureWarning) and `past_key_values`
before; 4.5x forwards also take `cache_position` (some `output_attentions`,
`output_hidden_states`), which the generic forward passes on by keyword. Import this module
only where transformers is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from transformers.cache_utils import Cache
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from ..api import check_flags, check_loss_options, check_target_dtype, linear_cross_entropy, shift_targets
from ..ops.problem import SUPPORTED_DTYPES
from ..plan.launch import Memory

Function = TypeVar("Function", bound=Callable[..., Any])


def _unchanged(func: Function) -> Function:
    """The decorator a release lacks: its forward as written."""
    return func


def _tuple_unless_return_dict(forward: Function) -> Function:
    """can_return_tuple's tuple (for return_dict=False, passed or in the config), in HF's
    positions: callers unpack (loss, logits, cache, ...; an MoE's loss, aux_loss, logits, ...),
    and ModelOutput.to_tuple would drop the None logits of a loss computed without them, so None
    holds their slot."""

    @functools.wraps(forward)
    def wrapper(self: PreTrainedModel, *args: Any, return_dict: bool | None = None, **kwargs: Any) -> Any:
        output = forward(self, *args, **kwargs)
        if self.config.return_dict if return_dict is None else return_dict:
            return output
        values = output.to_tuple()
        if isinstance(output, (CausalLMOutputWithPast, MoeCausalLMOutputWithPast)) and output.logits is None:
            names = [field.name for field in dataclasses.fields(output)]
            before = sum(getattr(output, name) is not None for name in names[: names.index("logits")])
            return (*values[:before], None, *values[before:])
        return values

    return wrapper  # type: ignore[return-value]

# The installed release's name for the KV cache, in its forwards and model outputs alike.
_CACHE = "cache" if any(field.name == "cache" for field in dataclasses.fields(CausalLMOutputWithPast)) else "past_key_values"

if _CACHE == "cache":  # the renaming releases still take the old name, as their own forward does
    from transformers.utils.deprecation import deprecate_kwarg

    _accept_old_cache_name: Callable[[Function], Function] = deprecate_kwarg(
        "past_key_values", "5.40.0", new_name="cache"
    )
else:
    _accept_old_cache_name = _unchanged

# Parameters of older releases' forwards (between use_cache and logits_to_keep) that only go on
# to self.model; the generic forward passes them on by keyword, through **kwargs.
_PASSED_THROUGH = ("output_attentions", "output_hidden_states", "cache_position")

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # releases without the helper (4.5x, early 5.x): a copy of its slicing

    def slice_logits_to_keep(tensor: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """causal_lm_loss takes the same logits_to_keep on every release: the last n positions
        (0: all), a 1D tensor of positions, (batch, n) positions per sample, or a (batch, seq)
        boolean mask (flattened to the kept rows)."""
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return tensor[logits_to_keep]
            return torch.take_along_dim(tensor, logits_to_keep[..., None], dim=1)
        positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return tensor[:, positions, ...]

# The supported causal-LM classes, by family (the transformers.models subpackage), each taken
# where the installed transformers has it. Their forwards compute what the generic forward does:
# outputs = self.model(...), logits = self.lm_head(last hidden state at logits_to_keep), soft-capped
# by config.final_logit_softcapping where the config class declares it (declares_softcap), scaled
# as LOGIT_SCALES says where it lists the family, then self.loss_function(logits, labels,
# vocab_size, **kwargs) and nothing more (no head but lm_head), outputs CausalLMOutputWithPast;
# or, for ROUTER_AUX_LOSS's families, that and the router's load-balancing loss as Mixtral's
# forward adds it, outputs MoeCausalLMOutputWithPast. Read from each forward's source in
# transformers 5.25.0;
# tests/test_transformers.py checks every one against HF's loss and gradients. A family left out
# is refused by patch().
FAMILIES = {
    "apertus": "ApertusForCausalLM",
    "apertus1p5": "Apertus1p5TextForCausalLM",
    "arcee": "ArceeForCausalLM",
    "bitnet": "BitNetForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "cwm": "CwmForCausalLM",
    "diffllama": "DiffLlamaForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "flex_olmo": "FlexOlmoForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "granite": "GraniteForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "helium": "HeliumForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "jais2": "Jais2ForCausalLM",
    "jamba": "JambaForCausalLM",
    "laguna": "LagunaForCausalLM",
    "lara_mini": "LaraMiniForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mellum": "MellumForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "minimax_m3_vl": "MiniMaxM3VLForCausalLM",
    "ministral": "MinistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "nanochat": "NanoChatForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "olmo": "OlmoForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "persimmon": "PersimmonForCausalLM",
    "phi": "PhiForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen4_exp": "Qwen4ExpForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "vaultgemma": "VaultGemmaForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class LogitScale:
    """How a family's forward scales lm_head's logits before its loss: by the number at
    `attribute` (a dotted path from the model, read where and when the forward reads it),
    multiplying or, with `divides`, dividing. The loss takes the scale as the op's temperature:
    loss(logits * a / T) = loss(logits / (T / a))."""

    attribute: str
    divides: bool = False

    def value(self, model: nn.Module) -> object:
        """The scale at `attribute`, read from the model as its forward reads it."""
        return functools.reduce(getattr, self.attribute.split("."), model)

    def loss_temperature(self, model: nn.Module, temperature: float) -> float:
        """The op's temperature for the scaled logits divided by `temperature` (the patch's),
        refused by the attribute's name where the loss cannot take it: a scale that is no
        finite number > 0, or a result outside the temperatures the op takes."""
        value = self.value(model)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < float("inf"):
            raise ValueError(f"{type(model).__name__}.{self.attribute}: expected a finite number > 0 (the scale "
                             f"its forward applies to the logits), got {value!r}")
        scaled = temperature * value if self.divides else temperature / value
        try:
            check_loss_options(temperature=scaled)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{type(model).__name__}.{self.attribute} = {value!r} with the patch's temperature "
                              f"{temperature!r}: {error}") from None
        return scaled

    def apply(self, model: nn.Module, logits: Tensor) -> Tensor:
        """The logits as the family's forward scales them (for the logits returned)."""
        value = self.value(model)
        return logits / value if self.divides else logits * value


# families (of FAMILIES) whose forward, as Mixtral's, also takes output_router_logits (the
# config's by default) and, where true, adds router_aux_loss_coef * load_balancing_loss_func(
# outputs.router_logits, num_experts, num_experts_per_tok, attention_mask) to the loss, each with
# its own module's load_balancing_loss_func; none scales or soft-caps the logits
ROUTER_AUX_LOSS = frozenset({
    "ernie4_5_moe", "flex_olmo", "gpt_oss", "jamba", "laguna", "lara_mini", "mellum", "minimax", "minimax_m2",
    "minimax_m3_vl", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen4_exp",
})

# families (of FAMILIES) whose forward scales the logits, and how; none of them soft-caps
LOGIT_SCALES = {
    "cohere": LogitScale("logit_scale"),  # logits * self.logit_scale
    "cohere2": LogitScale("logit_scale"),
    "falcon_h1": LogitScale("model.lm_head_multiplier"),  # logits * self.model.lm_head_multiplier
    "granite": LogitScale("config.logits_scaling", divides=True),  # logits / self.config.logits_scaling
    "granite_swa": LogitScale("config.logits_scaling", divides=True),
}

# where patch() keeps what unpatch() restores, in the patched class's or instance's __dict__
_REPLACED_FORWARD = "_cce_replaced_forward"
# and the forward it installed, which unpatch() expects to find there still
_PATCHED_FORWARD = "_cce_patched_forward"
# the forward the TRL head (integrations/trl.add_fused_lm_head) installed on an instance, which patch() wraps
FUSED_HEAD_FORWARD = "_cce_trl_fused_forward"

Patchable = TypeVar("Patchable", PreTrainedModel, type)


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """What patch() passes on to linear_cross_entropy; the softcap is the one the model's own
    forward applies (declares_softcap).

    return_logits also returns detached logits (for metrics logged during training); they cost
    the (tokens, vocab) memory the op saves, though not the float32 copy HF's loss keeps.
    temperature divides the (soft-capped) logits in the loss, not the returned logits.
    Every option is checked here: a bad one fails at patch(), not at the first training step.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    filter_eps: float | str | None = None
    memory: Memory = "workspace"
    return_logits: bool = False
    temperature: float = 1.0

    def __post_init__(self) -> None:
        check_loss_options(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                           filter_eps=self.filter_eps, memory=self.memory, temperature=self.temperature)
        check_flags(return_logits=self.return_logits)


_LOSS_OPTION_NAMES = tuple(field.name for field in dataclasses.fields(LossOptions))


def available_families() -> dict[str, type[PreTrainedModel]]:
    """The causal-LM classes of FAMILIES that the installed transformers has."""
    found = {}
    for family, class_name in FAMILIES.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        model_class = getattr(module, class_name, None)
        if model_class is not None:
            found[family] = model_class
    return found


def declares_softcap(config_class: type) -> bool:
    """Whether a config class has a final_logit_softcapping field: the models whose configs
    declare it (Gemma 2, 3, 3n, 4, VaultGemma, ...) are those whose forwards soft-cap the logits
    by it; any other config carries the key only as one kept from a config.json, which the
    model's forward ignores, and so must the loss."""
    field = "final_logit_softcapping"  # an __init__ parameter, or a class attribute (DiffusionGemma's)
    return hasattr(config_class, field) or field in inspect.signature(config_class.__init__).parameters


def _soft_capped(logits: Tensor, softcap: float | None) -> Tensor:
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def linear_head(head: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The weight and bias of a head that computes x @ weight.T + bias, which the fused loss
    multiplies by instead of calling the head. A head that computes more is refused, since
    reading its `.weight` would train without the rest: a PEFT adapter layer over it (LoRA in
    target_modules: `.weight` is the base layer's), an nn.Linear with its own forward (a
    quantized layer), a module that is no nn.Linear (a head of one's own, torch.ao's dynamic
    quantized Linear), or forward hooks on it (pruning's mask, the legacy weight_norm; FSDP2's
    own, which gather a weight the loss takes sharded, pass). Disabled adapters, or active ones
    all merged into the weight or absent from the head (another adapter's, which PEFT's layer
    skips), pass. A DeepSpeed ZeRO-3 partitioned weight is refused too: ZeRO-3 gathers it only
    when the head runs. PEFT's trainable tokens on the head itself pass: the weight is then the
    merged one its forward multiplies by."""
    tokens_weight = _trainable_tokens_weight(head)
    if tokens_weight is None and _adapter_layers_in_use(head):
        raise TypeError(
            f"lm_head: a {type(head).__module__}.{type(head).__qualname__} adapter layer, whose output the fused loss cannot compute from "
            "lm_head.weight; leave lm_head out of the adapter's target_modules (PEFT's modules_to_save=['lm_head'] "
            "trains it whole) or merge the adapter"
        )
    layer = _computing_layer(head)
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"lm_head: a {type(layer).__module__}.{type(layer).__qualname__}, not an nn.Linear, whose output "
                        "the fused loss cannot compute as x @ lm_head.weight.T + bias; unpatch() the model, or compute "
                        "the loss with cce_compile.linear_cross_entropy in a forward of your own")
    if type(layer).forward is not nn.Linear.forward:
        raise TypeError(f"lm_head: a {type(layer).__name__} with its own forward (a quantized layer?), which the "
                        "fused loss, reading lm_head.weight, would bypass")
    if (head._forward_pre_hooks or head._forward_hooks) and not _fsdp_sharded(head):
        raise TypeError("lm_head has forward hooks (pruning, weight_norm or spectral_norm, a hook of yours), which "
                        "the fused loss, reading lm_head.weight without calling lm_head, would skip; remove them "
                        "(torch.nn.utils.parametrize's weights are read through)")
    weight = head.weight  # read once: a parametrization recomputes it on every read (spectral_norm's power iteration)
    if hasattr(weight, "ds_id"):  # the mark ZeRO-3 puts on the parameters it partitions
        raise ValueError("lm_head: its weight is partitioned by DeepSpeed ZeRO-3, which gathers it only when lm_head "
                         "itself runs, and cce_compile reads lm_head.weight without calling it; use ZeRO stage 1 or 2, "
                         "or leave this model to its own forward")
    if tokens_weight is not None:
        return tokens_weight, layer.bias
    bias = getattr(head, "bias", None)
    if bias is None:  # PEFT's TrainableTokensWrapper: .weight is its merged weight, the bias its base layer's
        bias = getattr(getattr(head, "original_module", None), "bias", None)
    return weight, bias


def _trainable_tokens_weight(head: nn.Module) -> Tensor | None:
    """The weight of a PEFT TrainableTokensLayer that is the head, directly over an nn.Linear
    (TrainableTokensConfig on lm_head, or on a tied embedding, which PEFT ties the head's layer
    to): the base weight with the active adapters' rows put in, as that layer's forward computes
    it; None for any other head."""
    if not (hasattr(head, "trainable_tokens_delta") and hasattr(head, "get_merged_weights")):
        return None
    base = getattr(head, "base_layer", None)
    if not isinstance(base, nn.Linear) or getattr(base, "base_layer", None) is not None:
        return None
    active = [name for name in head.active_adapters if name in head.trainable_tokens_delta]
    if head.disable_adapters or head.merged or not active:
        return base.weight
    head._check_overlapping_tokens(active)  # as its forward does: two adapters may not train one row
    return head.get_merged_weights(active)


def _computing_layer(head: nn.Module) -> nn.Module:
    """The layer whose x @ weight.T + bias a head computes once its adapters pass
    (_adapter_layers_in_use): beneath PEFT's adapter layers their base layer, and the module a
    PEFT ModulesToSaveWrapper or TrainableTokensWrapper wraps (its trained copies are of that type)."""
    layer = head
    while True:
        inner = getattr(layer, "base_layer", None)
        if inner is None:
            inner = getattr(layer, "original_module", None)
        if not isinstance(inner, nn.Module):
            return layer
        layer = inner


def _fsdp_sharded(head: nn.Module) -> bool:
    """Whether FSDP2's fully_shard manages `head`: its hooks gather the weight, which the loss,
    given the DTensor, handles itself (docs/integrations.md, FSDP2)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(head, FSDPModule)


def _adapter_layers_in_use(head: nn.Module) -> bool:
    """Whether a PEFT adapter layer in `head`'s chain of base layers computes an adapter of its
    own: one active, enabled, unmerged and held by that layer (another adapter's, which PEFT's
    layer skips, is not). Every layer of the chain, not the outermost alone: a PeftMixedModel
    with adapters of two types on the head nests one type's layer around the other's (a LoHa
    layer around a LoRA layer), each holding only its own type's adapters."""
    layer = head
    while getattr(layer, "base_layer", None) is not None:
        if not getattr(layer, "disable_adapters", False):
            merged = getattr(layer, "merged_adapters", ())
            # the layer's own adapters, by name, in the dicts its adapter_layer_names lists (LoRA's lora_A, ...)
            held = [getattr(layer, name, {}) for name in getattr(layer, "adapter_layer_names", ())]
            if any(name not in merged and (not held or any(name in adapters for adapters in held))
                   for name in getattr(layer, "active_adapters", ())):
                return True
        layer = layer.base_layer
    return False


Computed = TypeVar("Computed")


def through_head(
    head: nn.Module, hidden: Tensor, compute: Callable[[Tensor, Tensor, Tensor | None], Computed]
) -> Computed:
    """compute(hidden, weight, bias) in place of head(hidden), inside the head's accelerate hook
    where it has one, as calling the head would run it: an offloaded head's weight is on meta
    until its hook loads it (and put back after), and the hook moves hidden to the head's device."""
    hook = getattr(head, "_hf_hook", None)
    if hook is None:
        return compute(hidden, *linear_head(head))
    (hidden,), _ = hook.pre_forward(head, hidden)
    return hook.post_forward(head, compute(hidden, *linear_head(head)))


def _hf_loss_function(model: PreTrainedModel) -> Callable[..., Any]:
    """What HF's forward calls as self.loss_function: one set on the model, a subclass's, or
    loss_type's in LOSS_MAPPING. Where none is set and loss_type names none (None for a subclass
    of the user's naming), HF's getter gives ForCausalLMLoss after a warning_once, which Dynamo
    cannot trace (torch.compile's fullgraph fails, the graph breaks in two without it): that
    case is answered here without the getter."""
    if (not hasattr(model, "_loss_function") and type(model).loss_function is PreTrainedModel.loss_function
            and getattr(model, "loss_type", None) not in LOSS_MAPPING):
        return ForCausalLMLoss
    return model.loss_function


def _config_softcap(config: Any, temperature: float) -> float | None:
    """The config's final_logit_softcapping, refused by that name where the loss cannot take it
    (HF's forward divides by it: 0 gave a NaN loss), not as the op's `softcap`, which the user
    never passed."""
    softcap = config.final_logit_softcapping
    try:
        check_loss_options(softcap=softcap, temperature=temperature)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{type(config).__name__}.final_logit_softcapping: {error}") from None
    return softcap


def causal_lm_loss(
    hidden_states: Tensor,
    lm_head: nn.Module,
    labels: Tensor,
    *,
    logits_to_keep: int | Tensor = 0,
    shift_labels: Tensor | None = None,
    num_items_in_batch: Tensor | int | None = None,
    softcap: float | None = None,
    options: LossOptions = LossOptions(),
) -> Tensor:
    """HF's ForCausalLMLoss on soft-capped lm_head(hidden_states), without the logits.

    Position t is scored against labels[t + 1] (or shift_labels[t] when the caller shifted).
    The shift is made here on the full sequence, before logits_to_keep selects positions as the
    model's forward does, so that a kept position keeps its own next token even when the kept
    positions are not contiguous. With num_items_in_batch the summed loss is divided by it, as
    HF does for gradient accumulation; otherwise it is the mean over non-ignored tokens.
    """
    kept = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else None
    if shift_labels is None:
        check_target_dtype(labels, "labels")  # before the shift, which casts them to int64
        shift_labels = shift_targets(batched("labels", labels, hidden_states, False, kept), options.ignore_index)
    else:
        check_target_dtype(shift_labels, "shift_labels")
        shift_labels = batched("shift_labels", shift_labels, hidden_states, True, kept)
    kept_hidden = slice_logits_to_keep(hidden_states, logits_to_keep)
    kept_targets = slice_logits_to_keep(shift_labels.unsqueeze(-1), logits_to_keep).squeeze(-1)

    def head_loss(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not torch.is_autocast_enabled(hidden.device.type):
            if weight.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"a model patched by cce_compile computes its loss in float32, float16 or bfloat16; "
                                f"this one's lm_head is {weight.dtype} (cast the model, or unpatch() it)")
            # Outside autocast the op needs one dtype: the head's (under autocast it casts both).
            hidden = hidden.to(weight.dtype)
        return linear_cross_entropy(
            hidden,
            weight,
            kept_targets.to(hidden.device),
            bias=bias,
            ignore_index=options.ignore_index,
            reduction="mean" if num_items_in_batch is None else "sum",
            label_smoothing=options.label_smoothing,
            z_loss=options.z_loss,
            softcap=softcap,
            filter_eps=options.filter_eps,
            memory=options.memory,
            temperature=options.temperature,
        )

    loss = through_head(lm_head, kept_hidden, head_loss)
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def batched(name: str, labels: Tensor, hidden_states: Tensor, shifted: bool, kept: int | None) -> Tensor:
    """Labels as (batch, length): the hidden states' sequence, or with an int logits_to_keep
    `kept` that many (HF's own loss takes the kept positions' labels alone). HF's loss flattens
    them, so it takes one sample's labels 1-D and `shifted` ones (shift_labels: nothing crosses a
    sample's end) flat at any batch; other shapes are refused by `name` rather than scored
    against the wrong positions or failing in an index deep below."""
    batch, sequence = hidden_states.shape[:-1]
    lengths = [sequence] if kept is None or kept == sequence else [sequence, kept]
    if labels.ndim == 1 and (batch == 1 or shifted):
        for length in lengths:
            if labels.shape[0] == batch * length:
                return labels.reshape(batch, length)
    if labels.ndim != 2 or labels.shape[0] != batch or labels.shape[1] not in lengths:
        expected = " or ".join(str((batch, length)) for length in lengths)
        raise ValueError(f"{name}: expected (batch, sequence) = {expected} (the hidden states' sequence"
                         f"{', or logits_to_keep' if len(lengths) > 1 else ''}), got shape {tuple(labels.shape)}")
    return labels


@dataclasses.dataclass(frozen=True)
class _Patch:
    """What one patch() call gives the generic forward: fallback(model, ...), the forward it
    replaced; the loss options; softcapped, whether the patched class's config declares the
    soft-cap (declares_softcap; decided at patch time: inspecting in the forward would break
    torch.compile's graph); the family's logit scale (LOGIT_SCALES), if any; and, for the
    families of ROUTER_AUX_LOSS, their module's load_balancing_loss_func. Module-level and
    frozen, so that an instance's forward holding it pickles."""

    fallback: Callable[..., CausalLMOutputWithPast | tuple]
    options: LossOptions
    softcapped: bool
    logit_scale: LogitScale | None = None
    load_balancing_loss: Callable[..., Tensor] | None = None


@_accept_old_cache_name
@_tuple_unless_return_dict
def _generic_forward(
    self: PreTrainedModel,
    input_ids: torch.LongTensor | None = None,
    attention_mask: Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache: Cache | None = None,
    inputs_embeds: Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    *,
    logits_to_keep: int | Tensor = 0,
    _cce_patch: _Patch,
    **kwargs: Any,
) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
    """The one forward for every family and release, with what patch() decided in `_cce_patch`.

    `cache` is the installed release's cache argument, whatever its name there (`past_key_values`
    given by keyword arrives in kwargs on releases that call it so). logits_to_keep is
    keyword-only because 4.5x forwards put cache_position in that position. A module-level
    function (the instance's forward is a functools.partial of it), so a patched instance
    pickles: torch.save(model), multiprocessing spawn.
    """
    options = _cce_patch.options
    cache = kwargs.pop(_CACHE, cache)
    model_inputs = {
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        _CACHE: cache, "inputs_embeds": inputs_embeds, "use_cache": use_cache,
    }
    if labels is None or kwargs.get("fused_lm_head"):  # generation, or TRL's fused head added before
        return _cce_patch.fallback(self, **model_inputs, labels=labels, logits_to_keep=logits_to_keep, return_dict=True,
                                   **kwargs)
    loss_function = _hf_loss_function(self)
    if loss_function is not ForCausalLMLoss:
        raise TypeError(
            f"{type(self).__name__}: its loss_function is {getattr(loss_function, '__qualname__', loss_function)}, "
            "not transformers' ForCausalLMLoss (model.loss_function = ..., a subclass's loss_function, or "
            "model.loss_type), a loss the patched forward would replace by linear_cross_entropy's; unpatch() the "
            "model, or give it HF's back (`del model._loss_function`, model.loss_type = 'ForCausalLM') to train "
            "with the patched loss")
    load_balancing_loss = _cce_patch.load_balancing_loss
    if load_balancing_loss is not None:  # as an MoE forward passes it on: the config's unless given
        output_router_logits = kwargs.pop("output_router_logits", None)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        model_inputs["output_router_logits"] = output_router_logits
    outputs = self.model(**model_inputs, **kwargs)
    softcap = _config_softcap(self.config, options.temperature) if _cce_patch.softcapped else None
    # HF's loss takes the call's ignore_index (ForCausalLMLoss's keyword) over its default
    ignore_index = kwargs.get("ignore_index")
    call_options = options if ignore_index is None else dataclasses.replace(options, ignore_index=ignore_index)
    scale = _cce_patch.logit_scale
    if scale is not None:  # the scaled logits' loss, at the temperature that scales them
        call_options = dataclasses.replace(call_options, temperature=scale.loss_temperature(self, options.temperature))
    # a parametrized head's weight computed once for the loss and the logits, as HF's one call computes it
    with parametrize.cached():
        loss = causal_lm_loss(
            outputs.last_hidden_state, self.lm_head, labels,
            logits_to_keep=logits_to_keep, shift_labels=kwargs.get("shift_labels"),
            num_items_in_batch=kwargs.get("num_items_in_batch"), softcap=softcap, options=call_options,
        )
        logits = None
        if options.return_logits or not torch.is_grad_enabled():  # evaluation's metrics and predictions read them
            with torch.no_grad():
                hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
                logits = _soft_capped(self.lm_head(hidden), softcap)
                if scale is not None:
                    logits = scale.apply(self, logits)
    if load_balancing_loss is None:
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            **{_CACHE: getattr(outputs, _CACHE)},
        )
    aux_loss = None
    if output_router_logits:
        aux_loss = load_balancing_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(
        loss=loss, aux_loss=aux_loss, logits=logits, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions, router_logits=outputs.router_logits, **{_CACHE: getattr(outputs, _CACHE)},
    )


def _class_forward(patched: _Patch, signature: inspect.Signature) -> Callable[..., CausalLMOutputWithPast | tuple]:
    """The generic forward as a function for a class to bind. `signature` (the replaced
    forward's) is what inspection then sees: generate, Trainer and PEFT (whose prefix tuning
    looks for `past_key_values`) read parameter names from it. A class pickles by name, so this
    closure is never pickled: its instances unpickle with the loading process's class forward."""

    def forward(self: PreTrainedModel, *args: Any, **kwargs: Any) -> CausalLMOutputWithPast | tuple:
        return _generic_forward(self, *args, _cce_patch=patched, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward


def instance_forward(function: Callable[..., Any], model: PreTrainedModel, **bound: Any) -> functools.partial:
    """`function(model, *args, **bound, **kwargs)` as `model`'s own forward: a functools.partial,
    which pickles (where `function` is module-level and `bound` pickles), deepcopies onto the copy,
    and torch.compile(fullgraph=True) traces. It shows the class forward's signature without
    self, as a bound method would (generate, Trainer and PEFT read parameter names from it)."""
    forward = functools.partial(function, model, **bound)
    signature = inspect.signature(type(model).forward)
    forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=list(signature.parameters.values())[1:])
    return forward


def _instance_forward(model: PreTrainedModel, patched: _Patch) -> functools.partial:
    """The generic forward bound to `model`, with what patch() decided (instance_forward)."""
    return instance_forward(_generic_forward, model, _cce_patch=patched)


def replaced_forward(model: PreTrainedModel, attribute: str) -> Callable[..., Any]:
    """The forward a patch replaced on this instance, kept under `attribute` (its own, e.g. the
    one beneath an accelerate hook, or None for the class's): looked up on the model at call
    time, not captured, so a deepcopy calls its own forward. The class's is bound with
    functools.partial, which torch.compile(fullgraph=True) traces (it refuses types.MethodType
    there)."""
    replaced = vars(model)[attribute]
    return replaced if replaced is not None else functools.partial(type(model).forward, model)


def _forward_replaced_on_instance(model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    return replaced_forward(model, _REPLACED_FORWARD)(*args, **kwargs)


# the parameters the generic forward is written for, under the installed cache name, checked
# against the class being patched; a positional argument must bind to the same name in both
_GENERIC_PARAMETERS = {name: parameter for name, parameter in inspect.signature(_generic_forward).parameters.items()
                       if name != "_cce_patch"}
_FORWARD_PARAMETERS = [_CACHE if name == "cache" else name for name in _GENERIC_PARAMETERS]
_POSITIONAL = [
    name for name, parameter in zip(_FORWARD_PARAMETERS, _GENERIC_PARAMETERS.values())
    if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
]


def _name(model_or_class: object) -> str:
    return getattr(model_or_class, "__name__", f"a {type(model_or_class).__name__} instance")


def _check_patchable(model_class: type, target: object) -> str:
    """The family (of FAMILIES) whose class `model_class` is or subclasses; TypeError where none
    is or the class is one patch() cannot take, ValueError where `target` is patched already."""
    found_families = available_families()
    families = tuple(found_families.values())
    if not issubclass(model_class, families):
        names = ", ".join(cls.__name__ for cls in families)
        hint = ""
        if callable(getattr(target, "get_base_model", None)):  # a PEFT wrapper around the model
            hint = "; patch the model it wraps: patch(model.get_base_model())"
        elif isinstance(getattr(target, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            hint = ("; patch the model torch.compile wraps, before the compiled one's first call: "
                    "patch(model._orig_mod) (or patch, then compile)")
        raise TypeError(f"{model_class.__name__} is not a supported causal LM (the installed transformers "
                        f"has: {names}){hint}")
    family = next(cls for cls in model_class.__mro__ if cls in families)
    for cls in model_class.__mro__[: model_class.__mro__.index(family)]:
        if vars(cls).get("forward") not in (None, vars(cls).get(_PATCHED_FORWARD)):  # not one patch() installed
            raise TypeError(  # the patched forward would run in its place: whatever it adds (an auxiliary loss) lost
                f"{cls.__name__} defines its own forward, which patch() would replace; patch({family.__name__}), "
                "whose forward its super().forward() calls, or compute the loss in it with "
                "cce_compile.integrations.transformers.causal_lm_loss(hidden_states, self.lm_head, labels)")
    found = list(inspect.signature(model_class.forward).parameters)
    family_name = next(name for name, cls in found_families.items() if cls is family)
    passed_through = (*_PASSED_THROUGH, "output_router_logits") if family_name in ROUTER_AUX_LOSS else _PASSED_THROUGH
    others = [name for name in found if name not in passed_through]
    if found[: len(_POSITIONAL)] != _POSITIONAL or others != _FORWARD_PARAMETERS:
        raise TypeError(
            f"{model_class.__name__}.forward takes {found}, the patch is written for {_FORWARD_PARAMETERS} "
            f"(and any of {list(passed_through)} after use_cache)"
        )
    if _REPLACED_FORWARD in vars(target):
        raise ValueError(f"{_name(target)} is already patched; unpatch it first")
    return family_name


def forward_slot(target: object) -> str:
    """Where the target's forward is to be replaced: beneath its accelerate hook where it has one
    (add_hook_to_module keeps the forward it wraps in `_old_forward`), so that the hook runs
    around the patched forward as around the original: that of a model loaded with device_map
    moves the outputs back to the inputs' device."""
    return "_old_forward" if "_old_forward" in vars(target) else "forward"


def patch(model_or_class: Patchable, **loss_options: Any) -> Patchable:
    """Route the training loss of a supported causal LM through linear_cross_entropy.

    A model instance gets its own forward (other instances keep theirs); a class is patched
    for all its instances. loss_options are LossOptions' fields. Returns its argument.
    """
    unknown = [name for name in loss_options if name not in _LOSS_OPTION_NAMES]
    if unknown:
        raise TypeError(f"patch() got unknown loss options {unknown}; it takes {list(_LOSS_OPTION_NAMES)} "
                        "(the soft-cap comes from the model's config, the reduction from num_items_in_batch)")
    options = LossOptions(**loss_options)
    model_class = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    family = _check_patchable(model_class, model_or_class)
    softcapped = declares_softcap(model_class.config_class)
    logit_scale = LOGIT_SCALES.get(family)
    # the function the family's forward calls, from its module (not a subclass's)
    load_balancing_loss = (importlib.import_module(available_families()[family].__module__).load_balancing_loss_func
                           if family in ROUTER_AUX_LOSS else None)
    slot = forward_slot(model_or_class)
    own = vars(model_or_class).get(slot)
    fused_head = None if isinstance(model_or_class, type) else vars(model_or_class).get(FUSED_HEAD_FORWARD)
    if (not isinstance(model_or_class, type) and own is not None and own is not fused_head
            and getattr(own, "__func__", None) not in (model_class.forward, fused_head)):
        raise ValueError(
            f"{_name(model_or_class)}: its forward is wrapped on the instance ({getattr(own, '__qualname__', own)}: "
            "accelerate.prepare's mixed-precision wrapper?), which the patched forward would call only without "
            "labels, so training would run outside it; patch() the model before wrapping it")
    # for unpatch(); an instance's own forward (e.g. the one beneath a hook) is also called on fallback
    setattr(model_or_class, _REPLACED_FORWARD, own)
    if isinstance(model_or_class, type):
        original = model_or_class.forward
        forward = _class_forward(_Patch(original, options, softcapped, logit_scale, load_balancing_loss), inspect.signature(original))
        model_or_class.forward = forward
    else:
        forward = _instance_forward(model_or_class, _Patch(_forward_replaced_on_instance, options, softcapped, logit_scale, load_balancing_loss))
        setattr(model_or_class, slot, forward)
    setattr(model_or_class, _PATCHED_FORWARD, forward)
    return model_or_class


def unpatch(model_or_class: Patchable) -> Patchable:
    """Give back the forward that patch() replaced on this class or instance, where the patched
    one is now (beneath an accelerate hook added since, too). Refused where another forward has
    replaced the patch's since (accelerate's autocast wrapper, a fused LM head): giving back the
    one from before patch() would silently drop it too."""
    if not isinstance(model_or_class, (type, nn.Module)):
        raise TypeError(f"unpatch() takes a model or model class that patch() patched, got {_name(model_or_class)}")
    if _REPLACED_FORWARD not in vars(model_or_class):
        raise ValueError(f"{_name(model_or_class)} is not patched")
    take_back_forward(
        model_or_class, _REPLACED_FORWARD, _PATCHED_FORWARD,
        f"{_name(model_or_class)}: its forward was replaced after patch() (by accelerate's autocast wrapper, a "
        "fused LM head?), which unpatch() would drop along with the patch; undo that first",
    )
    return model_or_class


def take_back_forward(target: object, replaced_attribute: str, installed_attribute: str, wrapped_since: str) -> None:
    """Put back the forward a patch replaced on `target` (kept under `replaced_attribute`) where the
    one it installed (under `installed_attribute`) still is, and forget both; ValueError(`wrapped_since`)
    where another forward has replaced it since (giving back the older one would drop that too)."""
    slot = forward_slot(target)
    current = vars(target).get(slot)
    if getattr(current, "__func__", current) is not vars(target)[installed_attribute]:
        raise ValueError(wrapped_since)
    replaced = vars(target)[replaced_attribute]
    delattr(target, replaced_attribute)
    delattr(target, installed_attribute)
    # None: none of the target's own, so the class's shows again; beneath an accelerate hook
    # added since, the hook is to call the class's forward.
    if replaced is None and slot == "_old_forward":
        setattr(target, slot, types.MethodType(type(target).forward, target))
    elif replaced is None:
        delattr(target, slot)
    else:
        setattr(target, slot, replaced)
