"""TRL's RL trainers (GRPO, RLOO; TRL 1.x) with linear_log_probs behind their fused LM head.

Those trainers score completions through a head they add to the policy and reference models,
`trl.trainer.utils.add_fused_lm_head`: `model(..., labels=labels, fused_lm_head=True)` runs the
decoder and returns per-token log-probs (and entropy) without the (tokens, vocab) logits.
`add_fused_lm_head` here adds a head with the same call and output fields, computed by
linear_log_probs. The trainers look the function up in their own modules, so

    import trl.trainer.grpo_trainer
    from cce_compile.integrations.trl import add_fused_lm_head
    trl.trainer.grpo_trainer.add_fused_lm_head = add_fused_lm_head  # before GRPOTrainer(...)

makes a GRPOTrainer use it (`trl.trainer.rloo_trainer` likewise). Of TRL's optional outputs
only the entropy is computed, where `outputs` names it (else the output's entropy is None);
log_sum_sq_probs, mean_logits and is_top1, which TRL's SFT, DPO and KTO trainers ask for, are
refused. A model whose config scales its logits, or soft-caps them by a field other than
final_logit_softcapping, an MoE router loss asked for (by the config or the call) and a
DeepSpeed ZeRO-3 partitioned head are refused, as is a head that is more than one output layer
beside the base model (BERT-style heads), each with a clear error: nothing
is silently computed differently. The soft-cap is the config's final_logit_softcapping where
its class declares that field (the Gemma family's, whose forwards apply it), as patch() does. An FSDP2-sharded head is gathered, as
TRL's is, its gradient averaged over the ranks (TRL's is not reduced); a head offloaded by accelerate is loaded by its hook, as a call would load it.
cast_lm_head_to_fp32 casts the whole head for the call (TRL casts tile by tile).
TRL itself is never imported here; import this module only where transformers is installed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput

from ..api import check_loss_options, linear_log_probs
from .transformers import (
    FUSED_HEAD_FORWARD, declares_softcap, forward_slot, instance_forward, replaced_forward, take_back_forward,
    through_head,
)

SUPPORTED_OUTPUTS = ("log_probs", "entropy")
LOGIT_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling",
                      "logits_mup_width_multiplier")
"""Config fields by which some families scale their logits (or the hidden states the head takes,
Inkling's) before the softmax: refused."""
OTHER_SOFTCAP_FIELDS = ("logits_soft_cap", "output_logit_soft_cap")
"""Soft-caps some forwards apply by a field other than final_logit_softcapping (RecurrentGemma's,
xLSTM's), which declares_softcap does not read: refused."""
_REPLACED_FORWARD = "_cce_trl_replaced_forward"


@dataclass
class FusedLogProbsOutput(ModelOutput):
    """What `model(..., labels=labels, fused_lm_head=True)` returns, with the fields TRL's
    trainers read: per-token fields (batch, seq_len - 1), or (batch, seq_len) with
    shift_labels, 0 where the label is -100; loss the mean negative log-likelihood over the
    labeled tokens (or their sum over num_items_in_batch)."""

    loss: Tensor | None = None
    log_probs: Tensor | None = None
    entropy: Tensor | None = None
    log_sum_sq_probs: Tensor | None = None
    mean_logits: Tensor | None = None
    is_top1: Tensor | None = None
    label_mask: Tensor | None = None
    aux_loss: Tensor | None = None


@dataclass(frozen=True)
class _FusedHead:
    """What one add_fused_lm_head call gives the head's forward: the temperature, whether it casts
    the head to float32, whether it computes the entropy, and the final soft-cap (the config's
    where its class declares it, else None; decided when the head is added). Module-level and
    frozen, so that an instance's forward holding it pickles."""

    temperature: float
    cast_lm_head_to_fp32: bool
    entropy: bool
    softcap: float | None


def _check_supported(model: PreTrainedModel, outputs: tuple[str, ...]) -> None:
    unsupported = [name for name in outputs if name not in SUPPORTED_OUTPUTS]
    if unsupported:
        raise ValueError(f"outputs: cce_compile's fused LM head computes {SUPPORTED_OUTPUTS}, not {unsupported}")
    config = model.config.get_text_config()
    scaled = [name for name in LOGIT_SCALE_FIELDS if getattr(config, name, None) not in (None, 1.0)]
    if scaled:
        raise ValueError(f"model: its config scales the logits ({', '.join(scaled)}), which linear_log_probs does not")
    capped = [name for name in OTHER_SOFTCAP_FIELDS if getattr(config, name, None) is not None]
    if capped:
        raise ValueError(f"model: its config soft-caps the logits ({', '.join(capped)}), which cce_compile's fused LM "
                         "head applies only from final_logit_softcapping")
    if getattr(config, "output_router_logits", False):  # as TRL's head: the router loss only where asked for
        raise ValueError("model: its config asks for an MoE router loss, which cce_compile's fused LM head does not add")


def _check_plain_head(model: PreTrainedModel) -> None:
    """The head computes get_output_embeddings()(base_model(...).last_hidden_state), which is the
    model's logits only where the causal LM is its base model and that output layer, side by side.
    Refused: a base_model that is the model itself (its prefix names no submodule, e.g.
    Llama4ForCausalLM's), an output layer nested in a larger head, or another module with weights
    beside the two (the dense layer and norm BERT-style and ModernBertDecoder heads apply first)."""
    base, head = model.base_model, model.get_output_embeddings()
    if base is model:
        raise ValueError(f"model: {type(model).__name__}.base_model is the model itself, not its decoder, which "
                         "cce_compile's fused LM head calls")
    name = type(model).__name__
    if head is None or not any(child is head for child in model.children()):
        path = next((path for path, module in model.named_modules() if module is head), None)
        raise ValueError(f"model: {name}'s output layer ({path}) is not a direct submodule but sits in a larger head, "
                         "whose other layers cce_compile's fused LM head would skip")
    others = [child_name for child_name, child in model.named_children()
              if child is not base and child is not head and next(child.parameters(), None) is not None]
    if others:
        raise ValueError(f"model: {name} has modules beside its decoder and output layer ({', '.join(others)}), which "
                         "its logits may pass through and cce_compile's fused LM head would skip")
    unpadded = getattr(model.config.get_text_config(), "unpadded_vocab_size", None)
    if unpadded is not None and unpadded < head.weight.shape[0]:  # Inkling's forward slices; Inkling2's head is that wide
        raise ValueError(f"model: its forward drops the logits past unpadded_vocab_size ({unpadded}) of the output "
                         f"layer's {head.weight.shape[0]}, which cce_compile's fused LM head would score")


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    """The model whose forward gets the head: a PEFT model's wrapped causal LM (its adapter
    layers in place), which the PEFT model's forward calls with the same arguments. On the PEFT
    model itself the head would take the whole causal LM (its base_model) for the decoder."""
    if not isinstance(model, PreTrainedModel) and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model: expected a transformers PreTrainedModel or a PEFT model of one, got {type(model).__name__}")
    return model


def _fused_forward(
    self: PreTrainedModel, *args: Any, _cce_head: _FusedHead, fused_lm_head: bool = False, labels: Tensor | None = None,
    shift_labels: Tensor | None = None, num_items_in_batch: Tensor | int | None = None, **kwargs: Any,
) -> Any:
    """The forward add_fused_lm_head installs, with what it decided in `_cce_head`: with
    fused_lm_head=True, FusedLogProbsOutput; without it, the forward it replaced. Module-level
    (the instance's forward is a functools.partial of it), so a model with the head pickles:
    torch.save(model), multiprocessing spawn."""
    if not fused_lm_head:
        passed = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
        return replaced_forward(self, _REPLACED_FORWARD)(
            *args, **{name: value for name, value in passed.items() if value is not None}, **kwargs)
    if kwargs.get("output_router_logits"):
        raise ValueError("output_router_logits: cce_compile's fused LM head adds no MoE router loss")
    kwargs["use_cache"] = False
    hidden = self.base_model(*args, **kwargs).last_hidden_state
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels

    def score(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
        """Per-token log-probs, entropies (None unless asked for) and the label mask."""
        if isinstance(weight, DTensor):  # FSDP2's sharded head (its own group, never unsharded): gathered
            # Each rank scores its own tokens, so the gathered head's gradient is a partial one: averaged over
            # the mesh (a reduce-scatter back to the shards), as FSDP averages the other gradients. The default
            # (Replicate) kept each rank's slice of its own tokens' gradient, unreduced (TRL's head does so too).
            grads = [Partial("avg")] * weight.device_mesh.ndim
            weight = weight.full_tensor(grad_placements=grads)
            bias = None if bias is None else bias.full_tensor(grad_placements=grads)
        # With the model split across devices the decoder may end on another device than the head.
        hidden, targets = hidden.to(weight.device), labels.to(weight.device)
        mask = targets != -100
        rows = mask.nonzero(as_tuple=True)  # one host sync for both selections
        hidden = hidden[rows]
        cast = contextlib.nullcontext()
        if _cce_head.cast_lm_head_to_fp32:
            hidden, weight, bias = hidden.float(), weight.float(), None if bias is None else bias.float()
            cast = torch.autocast(hidden.device.type, enabled=False)
        with cast:
            scored = linear_log_probs(hidden, weight, targets[rows], bias=bias,
                                      temperature=_cce_head.temperature, softcap=_cce_head.softcap,
                                      entropy=_cce_head.entropy)
        log_probs, entropies = scored if _cce_head.entropy else (scored, None)
        # masked_scatter keeps an all-masked batch connected to the model: a differentiable zero
        log_probs, entropies = (None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)
                                for x in (log_probs, entropies))
        return log_probs, entropies, mask

    log_probs, entropies, mask = through_head(self.get_output_embeddings(), hidden, score)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedLogProbsOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropies,
                               label_mask=mask)


def add_fused_lm_head(
    model: PreTrainedModel | nn.Module, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """Patch `model.forward` (this instance) as TRL's add_fused_lm_head does: with
    fused_lm_head=True it runs the decoder and returns FusedLogProbsOutput from
    linear_log_probs over the labeled positions only (logits / temperature, the final soft-cap
    of the families whose forward applies it included); without it, the original forward
    (generation unchanged). A PEFT model gets it on the causal LM it wraps, before or after
    wrapping alike. The model pickles with its head (torch.save(model), multiprocessing spawn)
    and unpickles with it, its settings and its own weights."""
    check_loss_options(temperature=temperature)
    model = _causal_lm(model)
    _check_supported(model, outputs)
    _check_plain_head(model)
    if _REPLACED_FORWARD in vars(model):  # a second trainer on the same model (a notebook's re-run): the new
        take_back_forward(                # settings replace the first's, as TRL's own head, wrapped again, does
            model, _REPLACED_FORWARD, FUSED_HEAD_FORWARD,
            "model already has cce_compile's fused LM head, and its forward was wrapped since: "
            "load the model again to add the head with other settings")
    slot = forward_slot(model)  # beneath an accelerate hook, which then runs around the head too
    setattr(model, _REPLACED_FORWARD, vars(model).get(slot))  # for the flag-less calls: replaced_forward
    text_config = model.config.get_text_config()
    softcap = text_config.final_logit_softcapping if declares_softcap(type(text_config)) else None
    head = _FusedHead(temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                      entropy="entropy" in outputs, softcap=softcap)
    forward = instance_forward(_fused_forward, model, _cce_head=head)
    setattr(model, slot, forward)
    setattr(model, FUSED_HEAD_FORWARD, forward)
