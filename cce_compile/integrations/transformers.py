"""Hugging Face causal LMs whose training loss goes through linear_cross_entropy.

`patch(model_or_class)` replaces `*ForCausalLM.forward` with one generic forward that, when
labels are given and autograd records (`torch.is_grad_enabled()`), takes the loss from the
final hidden states and `lm_head.weight` without the (tokens, vocab) logits. That is when HF's
loss costs the most memory: the float32 logits and their softmax stay alive for backward.
Without labels, or under `torch.no_grad()` (Trainer's evaluation and prediction loops,
`generate`), the original forward runs, so logits are there for metrics and decoding.

Written against transformers 5.x (the `cache` argument and `slice_logits_to_keep`); import
this module only where transformers is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple

from ..api import linear_cross_entropy, shift_targets
from ..plan.launch import Memory

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # releases without the helper: the same slicing of the sequence dimension

    def slice_logits_to_keep(tensor: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The last `logits_to_keep` positions (0: all of them), or the positions a tensor names."""
        positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return tensor[:, positions, ...]

# family (the transformers.models subpackage) -> its causal-LM class
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# where patch() keeps what unpatch() restores, in the patched class's or instance's __dict__
_REPLACED_FORWARD = "_cce_replaced_forward"

Patchable = TypeVar("Patchable", PreTrainedModel, type)


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """What patch() passes on to linear_cross_entropy; the softcap comes from the model config.

    return_logits also returns detached logits (for metrics logged during training); they cost
    the (tokens, vocab) memory the op saves, though not the float32 copy HF's loss keeps.
    temperature divides the (soft-capped) logits in the loss, not the returned logits.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    filter_eps: float | str | None = None
    memory: Memory = "workspace"
    return_logits: bool = False
    temperature: float = 1.0


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


def _soft_capped(logits: Tensor, softcap: float | None) -> Tensor:
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def causal_lm_loss(
    hidden_states: Tensor,
    lm_head: nn.Linear,
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
    if shift_labels is None:
        shift_labels = shift_targets(labels, options.ignore_index)
    kept_hidden = slice_logits_to_keep(hidden_states, logits_to_keep)
    kept_targets = slice_logits_to_keep(shift_labels.unsqueeze(-1), logits_to_keep).squeeze(-1)
    weight = lm_head.weight
    if not torch.is_autocast_enabled(kept_hidden.device.type):
        # Outside autocast the op needs one dtype: the head's (under autocast it casts both).
        kept_hidden = kept_hidden.to(weight.dtype)
    loss = linear_cross_entropy(
        kept_hidden,
        weight,
        kept_targets.to(kept_hidden.device),
        bias=lm_head.bias,
        ignore_index=options.ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        label_smoothing=options.label_smoothing,
        z_loss=options.z_loss,
        softcap=softcap,
        filter_eps=options.filter_eps,
        memory=options.memory,
        temperature=options.temperature,
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _patched_forward(
    fallback: Callable[..., CausalLMOutputWithPast | tuple], options: LossOptions
) -> Callable[..., CausalLMOutputWithPast | tuple]:
    """The one forward for every family: its signature and decorators are those of the
    transformers 5.x `*ForCausalLM.forward`; fallback(model, ...) is the forward it replaced."""

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self: PreTrainedModel,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        model_inputs = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
        )
        if labels is None or not torch.is_grad_enabled():
            return fallback(self, **model_inputs, labels=labels, logits_to_keep=logits_to_keep, return_dict=True, **kwargs)
        outputs = self.model(**model_inputs, **kwargs)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        loss = causal_lm_loss(
            outputs.last_hidden_state, self.lm_head, labels,
            logits_to_keep=logits_to_keep, shift_labels=kwargs.get("shift_labels"),
            num_items_in_batch=kwargs.get("num_items_in_batch"), softcap=softcap, options=options,
        )
        logits = None
        if options.return_logits:
            with torch.no_grad():
                logits = _soft_capped(self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)), softcap)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=outputs.cache,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

    return forward


def _forward_replaced_on_instance(model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    """Looked up on the model at call time, not captured, so a deepcopy calls its own forward."""
    replaced = vars(model)[_REPLACED_FORWARD]
    if replaced is None:
        return type(model).forward(model, *args, **kwargs)
    return replaced(*args, **kwargs)


# the parameters the generic forward is written for, checked against the class being patched
_FORWARD_PARAMETERS = list(inspect.signature(_patched_forward(_forward_replaced_on_instance, LossOptions())).parameters)


def _name(model_or_class: object) -> str:
    return getattr(model_or_class, "__name__", f"a {type(model_or_class).__name__} instance")


def _check_patchable(model_class: type, target: object) -> None:
    families = tuple(available_families().values())
    if not issubclass(model_class, families):
        names = ", ".join(cls.__name__ for cls in families)
        raise TypeError(f"{model_class.__name__} is not a supported causal LM (the installed transformers has: {names})")
    found = list(inspect.signature(model_class.forward).parameters)
    if found != _FORWARD_PARAMETERS:
        raise TypeError(f"{model_class.__name__}.forward takes {found}, the patch is written for {_FORWARD_PARAMETERS}")
    if _REPLACED_FORWARD in vars(target):
        raise ValueError(f"{_name(target)} is already patched; unpatch it first")


def patch(model_or_class: Patchable, **loss_options: Any) -> Patchable:
    """Route the training loss of a supported causal LM through linear_cross_entropy.

    A model instance gets its own forward (other instances keep theirs); a class is patched
    for all its instances. loss_options are LossOptions' fields. Returns its argument.
    """
    options = LossOptions(**loss_options)
    if isinstance(model_or_class, type):
        _check_patchable(model_or_class, model_or_class)
        original = model_or_class.forward
        setattr(model_or_class, _REPLACED_FORWARD, vars(model_or_class).get("forward"))
        model_or_class.forward = _patched_forward(original, options)
    else:
        _check_patchable(type(model_or_class), model_or_class)
        # an instance-level forward (e.g. an accelerate hook) is kept and called on fallback
        setattr(model_or_class, _REPLACED_FORWARD, vars(model_or_class).get("forward"))
        model_or_class.forward = types.MethodType(_patched_forward(_forward_replaced_on_instance, options), model_or_class)
    return model_or_class


def unpatch(model_or_class: Patchable) -> Patchable:
    """Give back the forward that patch() replaced on this class or instance."""
    if _REPLACED_FORWARD not in vars(model_or_class):
        raise ValueError(f"{_name(model_or_class)} is not patched")
    replaced = vars(model_or_class)[_REPLACED_FORWARD]
    delattr(model_or_class, _REPLACED_FORWARD)
    if replaced is None:
        delattr(model_or_class, "forward")
    else:
        setattr(model_or_class, "forward", replaced)
    return model_or_class
