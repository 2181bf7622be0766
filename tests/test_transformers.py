"""The transformers integration against the unpatched model it replaces, for every family the
installed transformers has: tiny random-init fp32 models on CPU, deepcopied twins.

Release-agnostic: run it under a release that names the cache `cache` (5.24.0) and under ones
that name it `past_key_values` (4.57.1 and 5.0.0, whose forwards also take cache_position and,
in 4.57.1's Gemma2/3, output_attentions and output_hidden_states; 5.10.4, which does not)."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import pathlib
import pickle
import re
import types

import pytest
import torch
import torch.nn.utils.prune
import torch._dynamo.testing
from torch import Tensor, nn

pytest.importorskip("transformers")

from transformers import PreTrainedModel  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from cce_compile.integrations.transformers import FAMILIES as LISTED_FAMILIES  # noqa: E402
from cce_compile.integrations.transformers import (  # noqa: E402
    LOGIT_SCALES,
    ROUTER_AUX_LOSS,
    LossOptions,
    available_families,
    causal_lm_loss,
    declares_softcap,
    patch,
    unpatch,
)

FAMILIES = available_families()
# the installed release's cache argument: its forwards' fourth parameter, after self
CACHE = list(inspect.signature(next(iter(FAMILIES.values())).forward).parameters)[4]
VOCAB = 500
SOFTCAP = 0.5  # small, so that tanh bends the random-init logits and a wrong softcap shows
# config fields of some families whose defaults are a real model's sizes (linear attention's, Mamba's)
TINY_SIZES = {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
              "mamba_d_state": 16, "mamba_chunk_size": 16}
# an MoE's config fields, where a config has them: a few small experts, the router's logits
# output and its load-balancing loss weighed enough to show, no router jitter (random in training)
TINY_MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "output_router_logits": True, "router_aux_loss_coef": 0.1,
            "router_jitter_noise": 0.0}
# the logit scales some families' forwards apply (LOGIT_SCALES), away from their defaults (1 for
# Granite and Falcon-H1) so that one lost or inverted shows
LOGIT_SCALING = {"logit_scale": 0.25, "logits_scaling": 4.0, "lm_head_multiplier": 0.5}


def tiny_model(family: str, model_class: type[PreTrainedModel] | None = None,
               config_class: type | None = None) -> PreTrainedModel:
    """Two layers, random init (initializer_range raised so the logits spread), training mode;
    model_class: a subclass of the family's class to build instead; config_class: a config class
    other than the model class's own to build it from."""
    model_class = model_class or FAMILIES[family]
    config = (config_class or model_class.config_class)(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=128, initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False, attn_implementation="eager",
    )
    if hasattr(config, "final_logit_softcapping"):
        config.final_logit_softcapping = SOFTCAP
    for name, value in {**TINY_SIZES, **TINY_MOE, **LOGIT_SCALING}.items():
        if hasattr(config, name):
            setattr(config, name, value)
    for name, value in config.to_dict().items():  # a twin's dropout would draw other random numbers
        if "dropout" in name and isinstance(value, float):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    return model_class(config).train()


def batch(seed: int = 0, shape: tuple[int, int] = (2, 24)) -> tuple[Tensor, Tensor]:
    """input_ids and labels = input_ids with about a quarter of the labels -100."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, shape, generator=generator)
    ignored = torch.rand(shape, generator=generator) < 0.25
    return input_ids, torch.where(ignored, -100, input_ids)


def twins(family: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    reference = tiny_model(family)
    return reference, patch(copy.deepcopy(reference))


def hf_shifted_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """What position t of `logits` should score: labels[t + 1] of the full sequence."""
    shifted = nn.functional.pad(labels[..., 1:], (0, 1), value=-100)
    return nn.functional.cross_entropy(logits.flatten(0, -2).float(), shifted.flatten(), ignore_index=-100)


def assert_close(actual: Tensor, expected: Tensor, rtol: float = 1e-4) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


# The families the behaviour tests run over: the first seven supported, which take the generic
# forward's paths (soft-capped or not) as every other family does; test_loss_and_gradients_match_hf
# checks each supported family against HF.
BEHAVIOUR_FAMILIES = sorted(set(FAMILIES) & {"gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3"})
parametrize_families = pytest.mark.parametrize("family", BEHAVIOUR_FAMILIES)

# model types that AutoModelForCausalLM builds as a supported class from a config class of their
# own (in 5.25.0 EXAONE 3, InternLM3 and IQuest-Coder, as LlamaForCausalLM): model type -> class.
# Not a composite config holding the class's own as its text_config (Qwen3.5's), which
# AutoModelForCausalLM builds the class from.
BORROWING = {
    model_type: model_class
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
    for model_class in FAMILIES.values()
    if model_class.__name__ == class_name and CONFIG_MAPPING[model_type] is not model_class.config_class
    and CONFIG_MAPPING[model_type].sub_configs.get("text_config") is not model_class.config_class
}


def test_patching_a_peft_wrapper_names_the_model_to_patch() -> None:
    """patch(peft_model) said 'PeftModelForCausalLM is not a supported causal LM' of a wrapped
    Llama; the error now says to patch the model it wraps, which then computes PEFT's loss."""
    peft = pytest.importorskip("peft")
    input_ids, labels = batch(seed=11)
    reference = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    wrapped = copy.deepcopy(reference)
    with pytest.raises(TypeError, match=r"is not a supported causal LM .*patch\(model\.get_base_model\(\)\)"):
        patch(wrapped)
    patch(wrapped.get_base_model())
    output = wrapped(input_ids, labels=labels)
    assert output.logits is None  # the loss went through the op
    assert_close(output.loss, reference(input_ids, labels=labels).loss, rtol=1e-5)


def test_patching_a_compiled_model_names_the_model_to_patch() -> None:
    """patch(torch.compile(model)) said 'OptimizedModule is not a supported causal LM' and no
    more; the error names the module it wraps, which patched before the first call is what the
    compiled model runs."""
    input_ids, labels = batch(seed=12)
    reference = tiny_model("llama")
    compiled = torch.compile(copy.deepcopy(reference), backend="aot_eager")
    with pytest.raises(TypeError, match=r"OptimizedModule is not a supported causal LM .*patch\(model\._orig_mod\)"):
        patch(compiled)
    patch(compiled._orig_mod)
    output = compiled(input_ids, labels=labels)
    assert output.logits is None  # the loss went through the op
    assert_close(output.loss, reference(input_ids, labels=labels).loss, rtol=1e-5)


def assert_every_gradient_close(patched: PreTrainedModel, reference: PreTrainedModel, rtol: float = 1e-4) -> None:
    for name, parameter in reference.named_parameters():
        if parameter.grad is None:
            assert patched.get_parameter(name).grad is None, name
        else:
            assert_close(patched.get_parameter(name).grad, parameter.grad, rtol=rtol)


# Gradients that float32 rounding in the loss moves further: Qwen3.5-MoE's gated delta rule
# (linear attention) A_log and dt_bias, 1e-4 of their largest off when HF's own loss is taken in
# float64 instead of float32, as far as the op's loss moves them
GRADIENT_RTOL = {"qwen3_5_moe": 5e-4}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_gradients_match_hf(family: str) -> None:
    """Every supported family: the loss through the op (no logits) and every parameter's gradient
    are HF's, with a quarter of the labels -100 (and the soft-cap where the config declares one,
    a logit scale away from 1, an MoE's router loss)."""
    reference, patched = twins(family)
    input_ids, labels = batch()
    expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
    assert actual.logits is None
    assert_close(actual.loss, expected.loss, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    assert_every_gradient_close(patched, reference, GRADIENT_RTOL.get(family, 1e-4))


@pytest.mark.parametrize("model_type", sorted(BORROWING))
def test_a_model_type_built_as_a_supported_class_from_its_own_config_matches_hf(model_type: str) -> None:
    """Such a model runs the supported class's forward whatever config it holds, and patch()
    decides from the class (its forward, the soft-cap its config class declares): loss and every
    parameter's gradient as unpatched."""
    model_class = BORROWING[model_type]
    reference = tiny_model(model_type, model_class, config_class=CONFIG_MAPPING[model_type])
    assert type(reference.config) is not model_class.config_class
    patched = patch(copy.deepcopy(reference))
    input_ids, labels = batch(seed=3)
    expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
    assert actual.logits is None  # the loss went through the op
    assert_close(actual.loss, expected.loss, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    assert_every_gradient_close(patched, reference)


def test_one_samples_labels_may_come_one_dimensional_as_hfs_loss_flattens_them() -> None:
    """model(ids[None], labels=ids) trains in HF; the patched forward indexed the 1-D labels as
    (batch, sequence) and raised IndexError. Other shapes are refused naming the argument."""
    reference, patched = twins("llama")
    input_ids, labels = batch(shape=(1, 24))
    expected = reference(input_ids, labels=labels[0])
    actual = patched(input_ids, labels=labels[0])
    assert actual.logits is None
    assert_close(actual.loss, expected.loss, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    assert_close(patched.lm_head.weight.grad, reference.lm_head.weight.grad)
    with pytest.raises(ValueError, match=r"labels: expected \(batch, sequence\) = \(1, 24\) .* got shape \(1, 1, 24\)"):
        patched(input_ids, labels=labels[None])


def test_shift_labels_may_come_flat_at_any_batch_as_hfs_loss_flattens_them() -> None:
    reference, patched = twins("llama")
    input_ids, labels = batch(seed=3)
    shifted = nn.functional.pad(labels[:, 1:], (0, 1), value=-100).flatten()
    expected = reference(input_ids, labels=labels, shift_labels=shifted).loss
    assert_close(patched(input_ids, labels=labels, shift_labels=shifted).loss, expected, rtol=1e-5)
    with pytest.raises(ValueError, match=r"shift_labels: expected \(batch, sequence\) = \(2, 24\) .* got shape \(47,\)"):
        patched(input_ids, labels=labels, shift_labels=shifted[1:])
    with pytest.raises(ValueError, match=r"labels: expected .* got shape \(48,\)"):
        patched(input_ids, labels=labels.flatten())  # flat labels would shift across the samples' ends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
@pytest.mark.parametrize("keyword", ["labels", "shift_labels"])
def test_labels_that_are_no_integers_are_refused_by_name_as_hfs_loss_refuses_them(dtype: torch.dtype,
                                                                                    keyword: str) -> None:
    """HF's cross-entropy refuses float or bool labels; the label shift cast them to int64 first,
    so float labels were truncated (3.7 scored as token 3) and bool ones scored as tokens 0 and 1,
    silently; float shift_labels were refused as the op's `targets`, which the caller never passed."""
    _, patched = twins("llama")
    input_ids, labels = batch(seed=4)
    wrong = (labels.float() + 0.7) if dtype == torch.float32 else labels > 200
    with pytest.raises(TypeError, match=rf"^{keyword} must be an integer tensor .* got {dtype}"):
        patched(input_ids, **{"labels": labels, keyword: wrong})


@parametrize_families
def test_frozen_head_matches_hf_without_computing_its_gradient(family: str, fused_outputs: list) -> None:
    """A LoRA-style step (lm_head frozen): the patched model's loss and the trained layers'
    gradients are HF's, and the op is never asked for the head's gradient."""
    reference, patched = twins(family)
    for model in (reference, patched):
        model.lm_head.weight.requires_grad_(False)
    input_ids, labels = batch(seed=5)
    expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
    assert_close(actual.loss, expected.loss, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    assert patched.lm_head.weight.grad is None
    assert_close(patched.get_parameter("model.layers.1.mlp.down_proj.weight").grad,
                 reference.get_parameter("model.layers.1.mlp.down_proj.weight").grad)
    assert fused_outputs and all(grad_c == 0 < grad_e for grad_e, grad_c in fused_outputs)


@pytest.mark.parametrize("options", [{}, {"return_logits": True}])
def test_a_parametrized_heads_weight_is_computed_once_a_step_as_hfs_one_call_does(options: dict) -> None:
    """A parametrization recomputes lm_head.weight on every read, and spectral_norm's, in training,
    advances its power iteration each time. The patched forward read it twice for the loss (three
    times with return_logits, whose logits call the head), so its spectral norm estimate ran
    ahead of HF's: gradients 1e-3 off at the first step, 1e-2 at the third, silently. Over three
    steps, with grad and without (evaluation in training mode), loss, logits and gradients are HF's."""
    reference = tiny_model("llama")
    torch.nn.utils.parametrizations.spectral_norm(reference.lm_head)
    patched = patch(copy.deepcopy(reference), **options)
    for seed in range(3):
        input_ids, labels = batch(seed=seed)
        for model in (reference, patched):
            model.zero_grad()
        expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
        assert_close(actual.loss, expected.loss, rtol=1e-5)
        if options:
            assert_close(actual.logits, expected.logits.detach(), rtol=1e-5)
        expected.loss.backward()
        actual.loss.backward()
        for name, parameter in reference.named_parameters():
            assert_close(patched.get_parameter(name).grad, parameter.grad)
        with torch.no_grad():
            expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
        assert_close(actual.logits, expected.logits, rtol=1e-5)


@pytest.mark.parametrize("hooked", ["pre-hook", "prune", "weight_norm"])
def test_a_head_with_forward_hooks_is_refused(hooked: str) -> None:
    """The loss reads lm_head.weight without calling lm_head, so its forward hooks would never run:
    a pre-hook's change to the input was silently lost, and pruning's or the legacy weight_norm's
    weight, computed once when the hook was registered, failed the second step's backward. Refused
    by name; the no-labels path (which calls lm_head) still runs them."""
    _, patched = twins("llama")
    head = patched.lm_head
    if hooked == "pre-hook":
        head.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    elif hooked == "prune":
        torch.nn.utils.prune.l1_unstructured(head, "weight", amount=0.5)
    else:
        torch.nn.utils.weight_norm(head)
    input_ids, labels = batch()
    with pytest.raises(TypeError, match="lm_head has forward hooks"):
        patched(input_ids, labels=labels)
    with torch.no_grad():
        assert patched(input_ids).logits.shape == (*input_ids.shape, VOCAB)


@parametrize_families
def test_num_items_in_batch_matches_hf(family: str) -> None:
    reference, patched = twins(family)
    input_ids, labels = batch(seed=1)
    num_items = torch.tensor(37)  # a whole accumulation window's count, not this batch's
    expected = reference(input_ids, labels=labels, num_items_in_batch=num_items).loss
    assert_close(patched(input_ids, labels=labels, num_items_in_batch=num_items).loss, expected, rtol=1e-5)


@parametrize_families
def test_logits_to_keep_scores_each_kept_position_against_its_next_label(family: str) -> None:
    reference, patched = twins(family)
    input_ids, labels = batch(seed=2)
    with torch.no_grad():
        logits = reference(input_ids).logits
    keep_mask = torch.rand(labels.shape, generator=torch.Generator().manual_seed(3)) < 0.5
    shifted = nn.functional.pad(labels[..., 1:], (0, 1), value=-100)
    expected_mask_loss = nn.functional.cross_entropy(logits[keep_mask], shifted[keep_mask], ignore_index=-100)
    assert_close(patched(input_ids, labels=labels, logits_to_keep=keep_mask).loss, expected_mask_loss, rtol=1e-5)
    expected_last_loss = hf_shifted_loss(logits[:, -9:], labels[:, -9:])
    assert_close(patched(input_ids, labels=labels, logits_to_keep=9).loss, expected_last_loss, rtol=1e-5)
    # HF's own loss takes the kept positions' labels alone; any other length was scored misaligned, silently
    assert_close(patched(input_ids, labels=labels[:, -9:], logits_to_keep=9).loss,
                 reference(input_ids, labels=labels[:, -9:], logits_to_keep=9).loss, rtol=1e-5)
    for wrong in (labels[:, 1:], torch.cat([labels, labels[:, :3]], dim=1)):
        for keyword in ("labels", "shift_labels"):
            with pytest.raises(ValueError, match=rf"{keyword}: expected .* = \(2, 24\) or \(2, 9\) .* got shape"):
                patched(input_ids, logits_to_keep=9, **{"labels": labels, keyword: wrong})


@parametrize_families
def test_adamw_training_tracks_hf(family: str) -> None:
    reference, patched = twins(family)
    input_ids, labels = batch(seed=4)
    curves = []
    for model in (reference, patched):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for _ in range(10):
            loss = model(input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    expected, actual = curves
    assert expected[-1] < expected[0] - 0.1, "the fixed batch should be learned"
    assert_close(actual, expected, rtol=1e-3)


@pytest.mark.parametrize("family", sorted(set(BEHAVIOUR_FAMILIES) | (set(FAMILIES) & {
    "cohere", "granite", "mixtral", "olmo2", "phi", "qwen3_moe", "vaultgemma"})))
def test_patched_model_compiles_fullgraph(family: str) -> None:
    """fullgraph=True fails on any graph break; the cheap eager backend suffices for that, the
    helper test below runs AOT autograd through the op's backward. An MoE without its router
    logits: HF's MoE models capture them under a lock that fullgraph refuses, unpatched too."""
    model = patch(tiny_model(family))
    if family in ROUTER_AUX_LOSS:
        model.config.output_router_logits = False
    input_ids, labels = batch(seed=5)
    torch._dynamo.reset()
    compiled_loss = torch.compile(lambda ids, target: model(ids, labels=target).loss, fullgraph=True, backend="eager")
    loss = compiled_loss(input_ids, labels)
    loss.backward()
    eager_model = copy.deepcopy(model)
    eager_model.zero_grad()
    eager_loss = eager_model(input_ids, labels=labels).loss
    eager_loss.backward()
    assert_close(loss, eager_loss, rtol=1e-5)
    assert_close(model.lm_head.weight.grad, eager_model.lm_head.weight.grad)


@parametrize_families
def test_patched_model_compiles_fullgraph_where_it_falls_back_to_hf(family: str) -> None:
    """Without labels (generation) the patched instance calls the class's own forward, which
    fullgraph=True traces too (a types.MethodType bound there was refused); under no_grad with
    labels (evaluation) the op's no-grad pass and the head's logits. HF's logits come back."""
    reference, patched = twins(family)
    input_ids, labels = batch(seed=8)
    for kwargs, grad in (({}, True), ({"labels": labels}, False)):
        torch._dynamo.reset()
        with torch.set_grad_enabled(grad):
            compiled = torch.compile(lambda ids: patched(ids, **kwargs).logits, fullgraph=True, backend="eager")
            assert_close(compiled(input_ids), reference(input_ids, **kwargs).logits.detach(), rtol=1e-5)


@pytest.mark.parametrize(("options", "new_buckets"), [({}, 0), ({"memory": "low"}, 1)])
def test_a_compiled_training_step_over_varying_lengths_compiles_as_the_unpatched_model(
        options: dict, new_buckets: int) -> None:
    """Forward and backward() in one fullgraph compile (Dynamo traces the backward), SGD
    after it, over batches of 2 x 20, 24, 30, then 40 tokens (N = 40 to 60 in the bucket
    (32, 64], then 80), with automatic dynamic shapes (a static first graph, then a dynamic
    one). The patched twin compiles what the unpatched one does, step by step: on the default
    path (no traced config) nothing more; with memory="low" (a config per N bucket) one graph
    more, at the step that leaves the bucket. Losses and parameters stay the unpatched's.
    Dynamo's eager backend: the guards counted are Dynamo's (AOT is test_op_compile's)."""
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip("this torch's Dynamo cannot trace Tensor.backward()")
    reference = tiny_model("llama")
    patched = patch(copy.deepcopy(reference), **options)
    runs = []
    for model in (reference, patched):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

        def forward_backward(input_ids: Tensor, labels: Tensor, model: PreTrainedModel = model) -> Tensor:
            loss = model(input_ids, labels=labels).loss
            loss.backward()
            return loss.detach()

        losses, frames = [], []
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            compiled = torch.compile(forward_backward, backend=counter, fullgraph=True)
            for seed, length in enumerate((20, 24, 30, 40)):
                losses.append(compiled(*batch(seed, (2, length))))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                frames.append(counter.frame_count)
        runs.append((torch.stack(losses), frames, [p.detach() for p in model.parameters()]))
    (want, want_frames, want_params), (got, got_frames, got_params) = runs
    assert want_frames == [1, 2, 2, 2], f"the unpatched model's frames after each step: {want_frames}"
    assert got_frames == [1, 2, 2, 2 + new_buckets], f"frames after each step: {got_frames}, unpatched {want_frames}"
    assert_close(got, want, rtol=1e-5)
    for p, q in zip(got_params, want_params):
        assert_close(p, q, rtol=1e-4)


def test_loss_helper_compiles_fullgraph_with_every_option() -> None:
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 24, 64, generator=generator, requires_grad=True)
    lm_head = nn.Linear(64, VOCAB, bias=True)
    _, labels = batch(seed=6)
    options = LossOptions(label_smoothing=0.1, z_loss=1e-3)
    compiled = torch.compile(
        lambda h, target: causal_lm_loss(h, lm_head, target, softcap=SOFTCAP, num_items_in_batch=torch.tensor(30), options=options),
        fullgraph=True, backend="aot_eager",
    )
    compiled(hidden, labels).backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_evaluation_computes_the_training_loss_with_the_patch_options() -> None:
    """Under no_grad (the Trainer's evaluation loop) the loss once came from HF's own loss: the
    options were dropped (temperature, smoothing, z-loss: 5.70 against 6.05 in training) and an
    ignore_index other than -100 raised IndexError."""
    input_ids, labels = batch(seed=9)
    labels = torch.where(labels == -100, -1, labels)
    model = patch(tiny_model("llama"), ignore_index=-1, temperature=0.5, label_smoothing=0.2, z_loss=1e-2)
    trained = model(input_ids, labels=labels)
    with torch.no_grad():
        evaluated = model(input_ids, labels=labels)
    assert_close(evaluated.loss, trained.loss.detach(), rtol=1e-5)
    assert trained.logits is None and evaluated.logits.shape == (*input_ids.shape, VOCAB)
    unpatch(model)
    with torch.no_grad():
        assert_close(evaluated.logits, model(input_ids).logits, rtol=1e-5)


def test_peft_trainable_tokens_on_the_head_train_as_hf_does() -> None:
    """PEFT's trainable_token_indices wraps a tied lm_head in a TrainableTokensWrapper whose
    .weight is the merged weight and which has no .bias of its own (once AttributeError)."""
    peft = pytest.importorskip("peft")
    input_ids, labels = batch(seed=10)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 4, 5])
    base = tiny_model("llama")
    base.config.tie_word_embeddings = True
    base.tie_weights()
    reference = peft.get_peft_model(base, config)
    patched = peft.get_peft_model(patch(copy.deepcopy(base)), copy.deepcopy(config))
    patched.load_state_dict(reference.state_dict())
    expected, actual = reference(input_ids, labels=labels).loss, patched(input_ids, labels=labels).loss
    assert_close(actual, expected, rtol=1e-5)
    expected.backward()
    actual.backward()
    for name, parameter in reference.named_parameters():
        if parameter.requires_grad and "trainable_tokens" in name:
            assert_close(patched.get_parameter(name).grad, parameter.grad)


@pytest.mark.parametrize(("target", "tied"), [("lm_head", False), ("embed_tokens", True)])
def test_peft_trainable_tokens_layer_as_the_head_trains_as_hf_does(target: str, tied: bool) -> None:
    """PEFT's TrainableTokensConfig puts a TrainableTokensLayer on the head itself (targeted, or
    tied to a targeted embedding): the loss multiplies by its merged weight (it was refused,
    with a hint to take lm_head out of target_modules, where a tied model never put it)."""
    peft = pytest.importorskip("peft")
    input_ids, labels = batch(seed=11)
    config = peft.TrainableTokensConfig(target_modules=[target], token_indices=[3, 4, 5])
    base = tiny_model("llama")
    if tied:
        base.config.tie_word_embeddings = True
        base.tie_weights()
    reference = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "trainable_tokens_delta" in name:
                parameter.normal_(std=0.5)
    patched = copy.deepcopy(reference)
    patch(patched.get_base_model())
    assert type(patched.get_base_model().lm_head).__name__ == "TrainableTokensLayer"
    expected, actual = reference(input_ids, labels=labels).loss, patched(input_ids, labels=labels).loss
    assert_close(actual, expected, rtol=1e-5)
    expected.backward()
    actual.backward()
    trained = [name for name, parameter in reference.named_parameters() if parameter.requires_grad]
    assert trained and all("trainable_tokens" in name for name in trained)
    for name in trained:
        assert_close(patched.get_parameter(name).grad, reference.get_parameter(name).grad)
    with reference.disable_adapter(), patched.disable_adapter():
        assert_close(patched(input_ids, labels=labels).loss, reference(input_ids, labels=labels).loss, rtol=1e-5)


@parametrize_families
def test_no_grad_and_unpatch_give_hf_logits_back(family: str) -> None:
    reference, patched = twins(family)
    input_ids, labels = batch(seed=7)
    expected = reference(input_ids, labels=labels)
    with torch.no_grad():
        evaluated = patched(input_ids, labels=labels)
    assert_close(evaluated.logits, expected.logits.detach(), rtol=1e-5)
    assert patched(input_ids, labels=labels, return_dict=False)[0].dim() == 0
    assert unpatch(patched) is patched and "forward" not in vars(patched)
    restored = patched(input_ids, labels=labels)
    assert_close(restored.logits, expected.logits, rtol=1e-5)
    assert_close(restored.loss, expected.loss, rtol=1e-5)


def pickle_round_trips(model: PreTrainedModel) -> list[PreTrainedModel]:
    """The model through pickle and through torch.save / torch.load (a whole module saved, as
    multiprocessing spawn and launchers pickle it)."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return [pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]


@parametrize_families
def test_a_patched_instance_pickles_into_a_patched_model_of_its_own(family: str) -> None:
    """pickle.dumps(patched) failed: the instance's forward was a function local to patch(),
    which pickle cannot name. The copy unpickles patched, with the patch's options (label
    smoothing makes its loss differ from HF's), on its own weights (a zeroed head changes its
    loss alone), showing the original's signature (generate reads it), and unpatches to HF's."""
    reference = tiny_model(family)
    smoothed = patch(copy.deepcopy(reference), label_smoothing=0.1)
    patched = patch(copy.deepcopy(reference))
    input_ids, labels = batch(seed=16)
    expected = reference(input_ids, labels=labels)
    smoothed_loss = smoothed(input_ids, labels=labels).loss
    for restored, restored_smoothed in zip(pickle_round_trips(patched), pickle_round_trips(smoothed)):
        output = restored(input_ids, labels=labels)
        assert output.logits is None  # the op's loss: HF's forward returns the logits
        assert_close(output.loss, expected.loss, rtol=1e-5)
        assert_close(restored_smoothed(input_ids, labels=labels).loss, smoothed_loss, rtol=1e-5)
        assert (smoothed_loss - expected.loss).abs() > 1e-3, "label smoothing should change the loss"
        assert inspect.signature(restored.forward) == inspect.signature(patched.forward)
        with torch.no_grad():
            restored.lm_head.weight.zero_()
        assert_close(restored(input_ids, labels=labels).loss, torch.tensor(float(VOCAB)).log(), rtol=1e-5)
        assert_close(patched(input_ids, labels=labels).loss, expected.loss, rtol=1e-5)
        assert unpatch(restored) is restored and "forward" not in vars(restored)
        assert restored(input_ids, labels=labels).logits is not None


def test_an_unpickled_patched_instance_compiles_fullgraph() -> None:
    """The unpickled copy's forward traces as the patched original's does: no graph break."""
    reference = tiny_model("llama")
    restored = pickle.loads(pickle.dumps(patch(copy.deepcopy(reference))))
    input_ids, labels = batch(seed=17)
    torch._dynamo.reset()
    compiled_loss = torch.compile(lambda ids, target: restored(ids, labels=target).loss, fullgraph=True, backend="eager")
    assert_close(compiled_loss(input_ids, labels), reference(input_ids, labels=labels).loss, rtol=1e-5)


def test_class_patch_covers_new_instances_and_instance_patch_only_its_own() -> None:
    family = BEHAVIOUR_FAMILIES[0]
    model_class = FAMILIES[family]
    input_ids, labels = batch(seed=8)
    bystander = tiny_model(family)
    patch(model_class, return_logits=True)
    try:
        with pytest.raises(ValueError, match="already patched"):
            patch(model_class)
        output = tiny_model(family)(input_ids, labels=labels)
        assert output.logits is not None and not output.logits.requires_grad and output.loss.requires_grad
    finally:
        unpatch(model_class)
    assert tiny_model(family)(input_ids, labels=labels).logits.requires_grad
    patch(tiny_model(family))
    assert bystander(input_ids, labels=labels).logits is not None


def test_patch_rejects_what_it_cannot_handle() -> None:
    with pytest.raises(TypeError, match="not a supported causal LM"):
        patch(nn.Linear)
    with pytest.raises(TypeError):
        patch(tiny_model(BEHAVIOUR_FAMILIES[0]), reduction="sum")
    with pytest.raises(ValueError, match="not patched"):
        unpatch(tiny_model(BEHAVIOUR_FAMILIES[0]))


# causal LMs that patch() refuses, with what their forward computes that the generic one would not
REFUSED = {
    "GPT2LMHeadModel": "no self.model (its decoder is self.transformer)",
    "JetMoeForCausalLM": "adds its router's loss weighed by aux_loss_coef",
    "GraniteMoeForCausalLM": "scales the logits and adds the router's loss",
    "BambaForCausalLM": "adds a z-loss of its own",
    "Dots1ForCausalLM": "returns the router logits too",
    "OPTForCausalLM": "its decoder is self.model.decoder",
}


@pytest.mark.parametrize("class_name", sorted(REFUSED))
def test_a_causal_lm_outside_the_supported_families_is_refused(class_name: str) -> None:
    """patch() on a class whose forward computes more than the generic forward (REFUSED says what)
    would train it on another loss, silently; it is refused by name, as are its instances."""
    transformers = pytest.importorskip("transformers")
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        pytest.skip(f"the installed transformers has no {class_name}")
    with pytest.raises(TypeError, match=rf"^{class_name} is not a supported causal LM"):
        patch(model_class)
    assert "_cce_replaced_forward" not in vars(model_class)  # nothing was patched


SCALED_FAMILIES = sorted(set(LOGIT_SCALES) & set(FAMILIES))
MOE_FAMILIES = sorted(set(ROUTER_AUX_LOSS) & set(FAMILIES))


def test_the_router_loss_families_are_supported_ones_that_neither_scale_nor_soft_cap() -> None:
    assert set(ROUTER_AUX_LOSS) <= set(LISTED_FAMILIES) and not set(ROUTER_AUX_LOSS) & set(LOGIT_SCALES)
    assert not [family for family in MOE_FAMILIES if declares_softcap(FAMILIES[family].config_class)]


@pytest.mark.parametrize("family", [family for family in MOE_FAMILIES if family in {"mixtral", "qwen3_moe", "gpt_oss"}])
def test_an_moes_router_loss_and_outputs_are_hfs(family: str) -> None:
    """Mixtral-style forwards add router_aux_loss_coef * load_balancing_loss_func(...) to the loss
    when output_router_logits (the config's, or the call's): the patched forward adds the same,
    with the family's own function, and returns HF's aux_loss and router_logits; without the
    router logits the loss is the cross-entropy alone, as HF's. The tuple of return_dict=False
    keeps HF's positions (loss, aux_loss, logits, ...), None in the logits' slot."""
    reference, patched = twins(family)
    input_ids, labels = batch(seed=19)
    expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
    assert actual.logits is None
    assert expected.aux_loss > 0
    assert_close(actual.aux_loss, expected.aux_loss, rtol=1e-6)
    assert len(actual.router_logits) == len(expected.router_logits)
    for got, want in zip(actual.router_logits, expected.router_logits):
        assert_close(got, want, rtol=1e-6)
    without = reference(input_ids, labels=labels, output_router_logits=False)
    assert without.aux_loss is None and (expected.loss - without.loss).abs() > 1e-3
    patched_without = patched(input_ids, labels=labels, output_router_logits=False)
    assert patched_without.aux_loss is None
    assert_close(patched_without.loss, without.loss, rtol=1e-5)
    values = patched(input_ids, labels=labels, return_dict=False)
    hf_values = reference(input_ids, labels=labels, return_dict=False)
    assert len(values) == len(hf_values) and values[2] is None
    assert_close(values[1], hf_values[1], rtol=1e-6)
    with torch.no_grad():
        assert_close(patched(input_ids, labels=labels).logits, expected.logits.detach(), rtol=1e-5)


def test_the_logit_scales_are_of_supported_families_that_do_not_soft_cap() -> None:
    """The op takes a family's logit scale as its temperature, soft-cap applied first; a family
    that soft-capped too would need the order its forward applies them in. None does."""
    assert set(LOGIT_SCALES) <= set(LISTED_FAMILIES)
    assert not [family for family in SCALED_FAMILIES if declares_softcap(FAMILIES[family].config_class)]


@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_a_scaled_familys_temperature_divides_hfs_scaled_logits(family: str) -> None:
    """Cohere's logit_scale, Granite's logits_scaling and Falcon-H1's lm_head_multiplier scale the
    logits in HF's forward; the patched loss takes the scale into the op's temperature. With the
    patch's temperature T the loss is cross-entropy(HF's logits / T), its gradients those of that
    loss, and the logits returned (return_logits, no_grad) are HF's, scaled."""
    reference = tiny_model(family)
    patched = patch(copy.deepcopy(reference), temperature=0.5, return_logits=True)
    input_ids, labels = batch(seed=17)
    hf_logits = reference(input_ids).logits
    expected = hf_shifted_loss(hf_logits / 0.5, labels)
    actual = patched(input_ids, labels=labels)
    assert_close(actual.loss, expected, rtol=1e-5)
    assert_close(actual.logits, hf_logits.detach(), rtol=1e-5)
    expected.backward()
    actual.loss.backward()
    assert_every_gradient_close(patched, reference)
    with torch.no_grad():
        assert_close(patched(input_ids, labels=labels).logits, hf_logits.detach(), rtol=1e-5)


@pytest.mark.parametrize(("family", "value"), [("cohere", 0.0), ("cohere", -0.25), ("granite", 0.0),
                                               ("granite", float("nan")), ("falcon_h1", float("inf"))])
def test_a_logit_scale_the_loss_cannot_take_is_refused_by_its_name(family: str, value: float) -> None:
    """A scale of 0, below 0, NaN or inf (HF's loss is NaN or its logits inf) is refused naming the
    attribute the family's forward reads, not as the op's temperature, which the user never set."""
    if family not in FAMILIES:
        pytest.skip(f"the installed transformers has no {family}")
    model = patch(tiny_model(family))
    attribute = LOGIT_SCALES[family].attribute
    *owners, name = attribute.split(".")
    setattr(functools.reduce(getattr, owners, model), name, value)
    input_ids, labels = batch(seed=18)
    with pytest.raises(ValueError, match=rf"^{type(model).__name__}\.{re.escape(attribute)}: expected a finite"):
        model(input_ids, labels=labels)


class WithAuxLoss(FAMILIES["llama"]):  # type: ignore[misc, valid-type]
    """A user's subclass whose forward adds to the loss (an auxiliary loss), its signature copied
    from the class it extends."""

    @functools.wraps(FAMILIES["llama"].forward)
    def forward(self, *args: object, **kwargs: object) -> object:
        output = super().forward(*args, **kwargs)
        if output.loss is not None:
            output.loss = output.loss + 10.0
        return output


def test_a_subclass_with_its_own_forward_is_refused_and_its_parent_patched_instead() -> None:
    """patch() replaced such a forward whole: the training loss lost what it added, silently.
    Refused, naming the class; patching the class it extends keeps it (its super().forward())."""
    input_ids, labels = batch(seed=15)
    expected = tiny_model("llama", WithAuxLoss)(input_ids, labels=labels).loss
    unchanged = type("Unchanged", (WithAuxLoss,), {})  # a forward inherited from the user's class
    for target in (tiny_model("llama", WithAuxLoss), WithAuxLoss, unchanged):
        with pytest.raises(TypeError, match=r"^WithAuxLoss defines its own forward, which patch\(\) would replace; "
                                            r"patch\(LlamaForCausalLM\)"):
            patch(target)
        with pytest.raises(ValueError, match="not patched"):
            unpatch(target)
    model = tiny_model("llama", WithAuxLoss)
    patch(FAMILIES["llama"])
    try:
        actual = model(input_ids, labels=labels)
    finally:
        unpatch(FAMILIES["llama"])
    assert actual.logits is None  # the loss came from the patched parent, the aux loss still in it
    assert_close(actual.loss, expected, rtol=1e-5)


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"temperature": 0}, ValueError, "temperature must be a finite number >= 1e-20"),
    ({"label_smoothing": 2.0}, ValueError, "label_smoothing"),
    ({"memory": "bogus"}, ValueError, "memory must be one of"),
    ({"filter_eps": "fast"}, ValueError, "filter_eps"),
    ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
    ({"return_logits": "yes"}, TypeError, "return_logits must be a bool"),
])
def test_patch_checks_its_options_before_any_step(options: dict, error: type, match: str) -> None:
    """A bad option fails at patch(), naming itself, not at the first training step; the model
    is left unpatched."""
    model = tiny_model(BEHAVIOUR_FAMILIES[0])
    with pytest.raises(error, match=match):
        patch(model, **options)
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)


def test_patch_names_an_unknown_option_and_the_ones_it_takes() -> None:
    """An unknown option (one linear_cross_entropy takes but the patch does not, say) once
    failed in LossOptions.__init__, which the caller never called, without the options patch()
    takes; unpatch() of something that is no model failed in vars()."""
    model = tiny_model(BEHAVIOUR_FAMILIES[0])
    for options in ({"softcap": 30.0}, {"reduction": "sum"}, {"z_los": 1e-4}):
        with pytest.raises(TypeError, match=rf"^patch\(\) got unknown loss options \['{next(iter(options))}'\]; "
                                            r"it takes \['ignore_index', 'label_smoothing', 'z_loss'"):
            patch(model, **options)
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)
    for target in (None, 42):
        with pytest.raises(TypeError, match=r"^unpatch\(\) takes a model or model class that patch\(\) patched"):
            unpatch(target)


@pytest.mark.parametrize("patch_ignore_index", [-100, -1])
def test_an_ignore_index_passed_to_the_call_is_used_as_hfs_loss_uses_it(patch_ignore_index: int) -> None:
    """HF's ForCausalLMLoss takes ignore_index from the forward's kwargs; the patched forward
    once kept the patch's, so labels padded with the call's ignore_index raised as out of range
    (on the GPU: a NaN loss)."""
    reference = tiny_model("llama")
    patched = patch(copy.deepcopy(reference), ignore_index=patch_ignore_index)
    input_ids, labels = batch(seed=16)
    labels = torch.where(labels == -100, -7, labels)
    for kwargs in ({}, {"num_items_in_batch": 19}):
        expected = reference(input_ids, labels=labels, ignore_index=-7, **kwargs).loss
        actual = patched(input_ids, labels=labels, ignore_index=-7, **kwargs).loss
        assert_close(actual, expected, rtol=1e-5)
        reference.zero_grad()
        patched.zero_grad()
        expected.backward()
        actual.backward()
        assert_close(patched.lm_head.weight.grad, reference.lm_head.weight.grad)
        assert_close(patched.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad)


@parametrize_families
def test_cache_goes_in_and_out_of_the_training_forward_as_hf(family: str) -> None:
    """A training step on a continuation of a cached prefix: the cache, given under the installed
    name or as `past_key_values` (deprecated where renamed), is the one HF's forward would use."""
    reference, patched = twins(family)
    input_ids, labels = batch(seed=9)
    caches = []
    for model in (reference, patched):
        with torch.no_grad():  # in eval mode: 4.57's Gemma2/3 make no cache in training mode
            caches.append(getattr(model.eval()(input_ids[:, :10], use_cache=True), CACHE))
        model.train()
    expected = reference(input_ids[:, 10:], labels=labels[:, 10:], use_cache=True, **{CACHE: caches[0]})
    renamed = pytest.warns(FutureWarning, match="past_key_values") if CACHE != "past_key_values" else contextlib.nullcontext()
    with renamed:
        actual = patched(input_ids[:, 10:], labels=labels[:, 10:], use_cache=True, past_key_values=caches[1])
    assert_close(actual.loss, expected.loss, rtol=1e-5)
    assert getattr(actual, CACHE) is caches[1] and caches[1].get_seq_length() == input_ids.shape[1]
    # what generate, Trainer and PEFT inspect: the replaced forward's parameters, under their names
    assert inspect.signature(patched.forward) == inspect.signature(reference.forward)


def claiming_forward(
    monkeypatch: pytest.MonkeyPatch, model_class: type[PreTrainedModel], names: list[str]
) -> type[PreTrainedModel]:
    """The family's class, its own forward claiming these parameters as another release's would
    (patch() reads the signature; the calls below pass nothing those parameters would need); a
    subclass with a forward of its own would be refused as one."""
    kind = {"self": inspect.Parameter.POSITIONAL_OR_KEYWORD, "kwargs": inspect.Parameter.VAR_KEYWORD}
    monkeypatch.setattr(model_class.forward, "__signature__", inspect.Signature([
        inspect.Parameter(name, kind.get(name, inspect.Parameter.POSITIONAL_OR_KEYWORD),
                          default=inspect.Parameter.empty if name in kind else None)
        for name in names
    ]), raising=False)
    return model_class


def installed_forward_with(extra: list[str], before: str = "logits_to_keep") -> list[str]:
    """The installed family forward's parameter names, with `extra` moved or added before `before`."""
    names = [name for name in inspect.signature(FAMILIES[BEHAVIOUR_FAMILIES[0]].forward).parameters if name not in extra]
    at = names.index(before)
    return names[:at] + extra + names[at:]


def test_patch_takes_the_4_5x_forward_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """4.5x forwards take output_attentions, output_hidden_states and cache_position between
    use_cache and logits_to_keep: accepted (passed on by keyword), the loss still HF's."""
    family = BEHAVIOUR_FAMILIES[0]
    names = installed_forward_with(["output_attentions", "output_hidden_states", "cache_position"])
    patched = patch(tiny_model(family, claiming_forward(monkeypatch, FAMILIES[family], names)))
    input_ids, labels = batch(seed=10)
    assert_close(patched(input_ids, labels=labels).loss, tiny_model(family)(input_ids, labels=labels).loss, rtol=1e-5)


OTHER_CACHE = "past_key_values" if CACHE == "cache" else "cache"


@pytest.mark.parametrize("names", [
    pytest.param([OTHER_CACHE if name == CACHE else name for name in installed_forward_with([])], id="other-release-cache-name"),
    pytest.param(installed_forward_with(["token_type_ids"]), id="unknown-parameter"),
    pytest.param(installed_forward_with(["return_dict"]), id="return-dict-of-4.50"),
    pytest.param(installed_forward_with(["cache_position"], before="inputs_embeds"), id="passed-through-before-use-cache"),
])
def test_patch_rejects_other_forward_signatures(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    model_class = claiming_forward(monkeypatch, FAMILIES[BEHAVIOUR_FAMILIES[0]], names)
    with pytest.raises(TypeError, match="the patch is written for"):
        patch(model_class)


def test_loss_helper_passes_the_temperature() -> None:
    """LossOptions(temperature=T): the loss of the soft-capped logits divided by T."""
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 24, 64, generator=generator)
    lm_head = nn.Linear(64, VOCAB, bias=False)
    _, labels = batch(seed=8)
    loss = causal_lm_loss(hidden, lm_head, labels, softcap=SOFTCAP, options=LossOptions(temperature=0.5))
    logits = SOFTCAP * torch.tanh(lm_head(hidden) / SOFTCAP) / 0.5
    assert_close(loss, hf_shifted_loss(logits, labels), rtol=1e-5)


def test_lm_head_adapters_are_refused_or_trained_as_hf_does() -> None:
    """PEFT's LoRA on lm_head (target_modules) computes more than lm_head.weight, which the
    loss reads: refused with a clear error, not trained without the adapter. Merged or disabled,
    and modules_to_save (a trainable copy of the head), the loss and gradients are HF's."""
    peft = pytest.importorskip("peft")
    input_ids, labels = batch()

    def adapted(**lora: object) -> nn.Module:
        model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, init_lora_weights=False, **lora))
        return model, patch(copy.deepcopy(model).base_model.model)

    reference, patched = adapted(target_modules=["q_proj", "lm_head"])
    with pytest.raises(TypeError, match="lm_head: a peft.tuners.lora.layer.Linear adapter layer"):
        patched(input_ids, labels=labels)
    for model in (reference.base_model.model, patched):
        model.lm_head.merge()
    assert_close(patched(input_ids, labels=labels).loss, reference(input_ids, labels=labels).loss, rtol=1e-5)
    for model in (reference.base_model.model, patched):
        model.lm_head.unmerge()
        model.lm_head.enable_adapters(False)
    assert_close(patched(input_ids, labels=labels).loss, reference(input_ids, labels=labels).loss, rtol=1e-5)

    reference, patched = adapted(target_modules=["q_proj"], modules_to_save=["lm_head"])
    with torch.no_grad():
        for model in (reference.base_model.model, patched):
            model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # the trainable copy differs from the base
    expected, actual = reference(input_ids, labels=labels).loss, patched(input_ids, labels=labels).loss
    assert_close(actual, expected, rtol=1e-5)
    expected.backward()
    actual.backward()
    head_weight = "lm_head.modules_to_save.default.weight"
    assert_close(patched.get_parameter(head_weight).grad, reference.base_model.model.get_parameter(head_weight).grad)

    two = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    two.add_adapter("second", peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    two.base_model.set_adapter(["default", "second"])
    patched = patch(two.base_model.model)
    patched.lm_head.merge(adapter_names=["default"])  # one of two active adapters merged: still refused
    with pytest.raises(TypeError, match="adapter layer"):
        patched(input_ids, labels=labels)


def test_an_lm_head_adapter_of_an_inactive_adapter_trains_as_hf_does() -> None:
    """With two adapters, one on lm_head and the active one not, PEFT's head layer skips the
    adapter it holds and computes the base layer: the patched forward once refused it (the
    active adapter counted as one on the head). Loss and gradients are HF's; with the head's
    adapter active too, it is refused still."""
    peft = pytest.importorskip("peft")
    input_ids, labels = batch(seed=16)
    reference = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                                          init_lora_weights=False))
    reference.add_adapter("second", peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    reference.set_adapter("second")
    patched = copy.deepcopy(reference)
    patch(patched.get_base_model())
    expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
    assert actual.logits is None  # the op's loss, not HF's
    assert_close(actual.loss, expected.loss, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    for name, parameter in reference.named_parameters():
        if parameter.requires_grad:
            assert_close(patched.get_parameter(name).grad, parameter.grad)
    patched.base_model.set_adapter(["default", "second"])
    with pytest.raises(TypeError, match="adapter layer"):
        patched(input_ids, labels=labels)


def test_an_lm_head_adapter_nested_in_a_mixed_models_head_is_refused_as_the_outer_ones() -> None:
    """A PeftMixedModel with a LoRA and a LoHa adapter on lm_head nests the LoHa layer around
    the LoRA layer, each holding its own type's adapters. With the LoRA adapter alone active,
    the outer LoHa layer holds none of the active ones: the check read that layer alone, passed
    the head, and the loss was the base weight's, without the LoRA adapter's delta HF adds
    (6.77 against 7.07), silently. Refused as a LoRA layer on the head is; with the inner
    adapter inactive too (neither layer computes one), it trains as HF does."""
    peft = pytest.importorskip("peft")
    input_ids, labels = batch(seed=17)
    reference = peft.PeftMixedModel(
        tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False), "a")
    reference.add_adapter("b", peft.LoHaConfig(r=4, target_modules=["q_proj", "lm_head"], init_weights=False))
    reference.add_adapter("c", peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    head = reference.base_model.model.lm_head
    assert isinstance(head.base_layer, peft.tuners.lora.LoraLayer), "PEFT no longer nests a mixed model's layers"
    patched = copy.deepcopy(reference)
    patch(patched.base_model.model)
    for active in (["a"], ["b"], ["a", "b"]):
        patched.set_adapter(active)
        with pytest.raises(TypeError, match="adapter layer"):
            patched(input_ids, labels=labels)
    reference.set_adapter(["c"])
    patched.set_adapter(["c"])
    expected, actual = reference(input_ids, labels=labels), patched(input_ids, labels=labels)
    assert actual.logits is None  # the op's loss, not HF's
    assert_close(actual.loss, expected.loss, rtol=1e-5)


class DoubledHead(nn.Module):
    """A head of one's own: it holds a .weight but computes 2 x @ weight.T."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.weight = head.weight

    def forward(self, x: Tensor) -> Tensor:
        return 2 * nn.functional.linear(x, self.weight)


@pytest.mark.parametrize("replace", [
    pytest.param(lambda model: setattr(model, "lm_head", DoubledHead(model.lm_head)), id="own-module"),
    pytest.param(lambda model: setattr(model, "lm_head", nn.Sequential(model.lm_head)), id="sequential"),
    pytest.param(lambda model: torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, inplace=True), id="dynamic-quantized"),
])
def test_a_head_that_is_no_linear_layer_is_refused(replace) -> None:
    """Only an nn.Linear subclass with a forward of its own was refused: a head of one's own
    holding a .weight was read as a plain linear layer, its loss silently not HF's (6.36 where
    HF's is 7.09 for the doubled head), and an nn.Sequential or torch.ao dynamic quantized head
    failed in an AttributeError ('function' object has no attribute 'dtype'). Refused by name,
    in training and evaluation; without labels the model's own forward runs."""
    _, patched = twins("llama")
    replace(patched)
    input_ids, labels = batch()
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match="lm_head: a .*, not an nn.Linear"):
            patched(input_ids, labels=labels)
    with torch.no_grad():
        assert patched(input_ids).logits.shape == (*input_ids.shape, VOCAB)


def partition_as_zero3(parameter: nn.Parameter) -> None:
    """What DeepSpeed ZeRO-3 (not installed here) leaves of a parameter it partitions, outside
    its module's forward: an empty placeholder, marked with ds_id."""
    parameter.ds_id, parameter.ds_shape = 0, parameter.shape
    parameter.data = torch.empty(0)


def test_a_zero3_partitioned_head_is_refused_by_name() -> None:
    """The loss reads lm_head.weight without calling lm_head, so ZeRO-3 never gathers it: this
    once failed inside the op, as 'c must be 2-D (V, D), got shape (0,)'."""
    model = patch(tiny_model("llama"))
    partition_as_zero3(model.lm_head.weight)
    input_ids, labels = batch()
    with pytest.raises(ValueError, match="lm_head: its weight is partitioned by DeepSpeed ZeRO-3"):
        model(input_ids, labels=labels)


@pytest.mark.parametrize("patch_first", [True, False], ids=["patch-then-dispatch", "dispatch-then-patch"])
def test_a_head_offloaded_by_accelerate_is_loaded_by_its_hook(patch_first: bool, tmp_path: pathlib.Path) -> None:
    """lm_head on disk (device_map="auto" when memory runs out): its weight is on meta until the
    head's accelerate hook loads it, which the loss, reading the weight without calling the
    head, once skipped ('c is on meta but e is on cpu'). The op computes HF's loss and gradients."""
    accelerate = pytest.importorskip("accelerate")
    reference = tiny_model("llama")
    dispatch = functools.partial(accelerate.dispatch_model, device_map={"model": "cpu", "lm_head": "disk"},
                                 offload_dir=str(tmp_path))
    model = copy.deepcopy(reference)
    model = dispatch(patch(model)) if patch_first else patch(dispatch(model))
    assert model.lm_head.weight.device.type == "meta"
    input_ids, labels = batch(seed=11)
    expected, actual = reference(input_ids, labels=labels), model(input_ids, labels=labels)
    assert actual.logits is None  # the op's loss, not HF's
    assert_close(actual.loss, expected.loss, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    name = "model.layers.1.mlp.down_proj.weight"
    assert_close(model.get_parameter(name).grad, reference.get_parameter(name).grad)


@pytest.mark.parametrize("family", sorted(f for f, cls in FAMILIES.items() if not declares_softcap(cls.config_class)))
def test_a_softcap_in_another_familys_config_is_ignored_as_its_forward_does(family: str) -> None:
    """Only the forwards of families whose config class declares the soft-cap apply it; another
    family's config may carry final_logit_softcapping (from a config.json), which the loss once
    applied: a loss HF does not compute, silently. Training loss and evaluation logits are HF's."""
    reference = tiny_model(family)
    reference.config.final_logit_softcapping = SOFTCAP
    patched = patch(copy.deepcopy(reference))
    input_ids, labels = batch(seed=12)
    assert_close(patched(input_ids, labels=labels).loss, reference(input_ids, labels=labels).loss, rtol=1e-5)
    with torch.no_grad():
        assert_close(patched(input_ids, labels=labels).logits, reference(input_ids).logits, rtol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf")])
def test_a_softcap_the_loss_cannot_take_is_refused_by_its_config_field(softcap: float) -> None:
    """A softcapping family's final_logit_softcapping that no loss can take (HF's forward divides by
    it: 0 gives a NaN loss) was refused as "softcap", an argument the user never passed."""
    family = next(f for f, cls in sorted(FAMILIES.items()) if declares_softcap(cls.config_class))
    model = patch(tiny_model(family))
    model.config.final_logit_softcapping = softcap
    input_ids, labels = batch(seed=14)
    with pytest.raises(ValueError, match=rf"{type(model.config).__name__}\.final_logit_softcapping: softcap must be"):
        model(input_ids, labels=labels)


def test_return_dict_false_keeps_hfs_positions() -> None:
    """HF returns (loss, logits, cache); the patched model once returned (loss, cache), since
    to_tuple drops the logits it does not compute: `loss, logits = model(...)` failed and
    outputs[1] was the cache. None holds the logits' slot."""
    reference, patched = twins("llama")
    input_ids, labels = batch(seed=13)
    expected = reference(input_ids, labels=labels, use_cache=True, return_dict=False)
    actual = patched(input_ids, labels=labels, use_cache=True, return_dict=False)
    assert len(actual) == len(expected) == 3 and actual[1] is None and type(actual[2]) is type(expected[2])
    assert_close(actual[0], expected[0], rtol=1e-5)
    loss, logits = patched(input_ids, labels=labels, return_dict=False)
    assert logits is None and loss.requires_grad
    with torch.no_grad():
        loss, logits = patched(input_ids, labels=labels, return_dict=False)
    assert_close(logits, expected[1].detach(), rtol=1e-5)


def test_unpatch_refuses_to_drop_a_forward_installed_after_patch() -> None:
    """unpatch() once wrote back the forward from before patch(), silently dropping any forward
    installed over the patch since (accelerate's autocast wrapper, a fused LM head). Refused
    while one is there, for an instance and a class; once undone, unpatch() gives back the
    original."""
    accelerate_utils = pytest.importorskip("accelerate.utils")
    input_ids, labels = batch(seed=14)
    model = patch(tiny_model("llama"))
    patched_forward = model.forward
    # what Accelerator.prepare installs under mixed precision over a forward that is no bound method
    assert not hasattr(patched_forward, "__func__")
    model.forward = accelerate_utils.convert_outputs_to_fp32(torch.autocast("cpu", enabled=False)(patched_forward))
    with pytest.raises(ValueError, match=r"a LlamaForCausalLM instance: its forward was replaced after patch\(\)"):
        unpatch(model)
    assert model(input_ids, labels=labels).logits is None  # still patched, behind the wrapper
    model.forward = patched_forward
    unpatch(model)
    assert "forward" not in vars(model)

    model_class = type("Wrapped", (FAMILIES["llama"],), {})
    patch(model_class)
    patched_forward = model_class.forward

    @functools.wraps(patched_forward)
    def wrapping(self: PreTrainedModel, *args: object, **kwargs: object) -> object:
        return patched_forward(self, *args, **kwargs)

    model_class.forward = wrapping
    with pytest.raises(ValueError, match=r"Wrapped: its forward was replaced after patch\(\)"):
        unpatch(model_class)
    model_class.forward = patched_forward
    unpatch(model_class)
    assert "forward" not in vars(model_class)


def test_patch_refuses_an_instance_whose_forward_is_wrapped() -> None:
    """Accelerator.prepare(mixed_precision="bf16") puts an autocast wrapper on the instance's
    forward; patch() kept it for the no-labels fallback alone, so the training forward ran the
    whole model outside autocast, silently. Refused, naming the way round (patch first)."""
    accelerate_utils = pytest.importorskip("accelerate.utils")
    model = tiny_model("llama")
    model.forward = types.MethodType(accelerate_utils.convert_outputs_to_fp32(type(model).forward), model)
    with pytest.raises(ValueError, match=r"its forward is wrapped on the instance .* patch\(\) the model before"):
        patch(model)
    assert "_cce_replaced_forward" not in vars(model)
    model.forward = types.MethodType(type(model).forward, model)  # its own forward, bound: nothing to lose
    input_ids, labels = batch(seed=15)
    assert patch(model)(input_ids, labels=labels).logits is None


def test_an_accelerate_hooked_instance_is_patched_beneath_its_hook() -> None:
    """A model loaded with device_map carries accelerate's hook on its forward, which moves the
    outputs back to the inputs' device. patch(instance) once replaced the hooked forward, so the
    training loss skipped the hook (on several GPUs the loss stayed on the head's device, which
    the Trainer refuses). Patched beneath the hook, hooked before or after patch(), the hook runs
    on every call, and unpatch() leaves it calling the original."""
    hooks = pytest.importorskip("accelerate.hooks")

    class CountingHook(hooks.ModelHook):
        def __init__(self) -> None:
            self.calls = 0

        def pre_forward(self, module: nn.Module, *args: object, **kwargs: object) -> tuple:
            self.calls += 1
            return args, kwargs

    reference = tiny_model("llama")
    input_ids, labels = batch(seed=15)
    expected = reference(input_ids, labels=labels)
    for hook_first in (True, False):
        model, hook = copy.deepcopy(reference), CountingHook()
        if hook_first:
            patch(hooks.add_hook_to_module(model, hook))
        else:
            hooks.add_hook_to_module(patch(model), hook)
        actual = model(input_ids, labels=labels)
        assert actual.logits is None and hook.calls == 1
        assert_close(actual.loss, expected.loss, rtol=1e-5)
        assert_close(model(input_ids).logits, expected.logits, rtol=1e-5)
        assert hook.calls == 2
        unpatch(model)
        assert_close(model(input_ids, labels=labels).logits, expected.logits, rtol=1e-5)
        assert hook.calls == 3


def test_a_float64_model_is_refused_naming_its_dtype() -> None:
    """The op runs in float32, float16 or bfloat16; a patched float64 model once failed naming
    the op's internal argument `e`, which its user never passed."""
    model = patch(tiny_model("llama").double())
    input_ids, labels = batch(seed=17)
    with pytest.raises(TypeError, match=r"computes its loss in float32, float16 or bfloat16; this one's lm_head is "
                                        r"torch\.float64 \(cast the model, or unpatch\(\) it\)"):
        model(input_ids, labels=labels)
    assert model(input_ids).logits.dtype == torch.float64  # without labels the model runs as HF's


def test_a_loss_function_set_on_the_model_is_refused_not_replaced() -> None:
    """transformers' `model.loss_function = f` makes HF's forward compute f(logits, labels, ...);
    the patched forward computed the plain cross-entropy in its place, silently (5.86 against
    the custom loss's 11.72 here). Refused, naming the function, with labels; without them the
    model generates as HF's."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def doubled(logits: Tensor, labels: Tensor, vocab_size: int, **kwargs: object) -> Tensor:
        return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs)

    reference = tiny_model("llama")
    reference.loss_function = doubled
    patched = patch(copy.deepcopy(reference))
    input_ids, labels = batch(seed=18)
    with pytest.raises(TypeError, match=r"^LlamaForCausalLM: its loss_function is .*doubled, not transformers' ForCausalLMLoss \(model\.loss_function = \.\.\."):
        patched(input_ids, labels=labels)
    assert_close(patched(input_ids).logits, reference(input_ids).logits, rtol=1e-5)
    del patched._loss_function
    assert_close(patched(input_ids, labels=labels).loss, reference(input_ids, labels=labels).loss / 2, rtol=1e-5)


class WithOwnLoss(FAMILIES["llama"]):  # type: ignore[misc, valid-type]
    """A user's subclass that changes the loss through HF's loss_function, not its forward."""

    @property
    def loss_function(self) -> object:
        from transformers.loss.loss_utils import ForCausalLMLoss

        return lambda *args, **kwargs: 2 * ForCausalLMLoss(*args, **kwargs)


@pytest.mark.parametrize("change", ["subclass", "loss_type"])
def test_a_loss_function_other_than_hfs_causal_lm_loss_is_refused_not_replaced(change: str) -> None:
    """HF's forward computes self.loss_function, which a subclass may override and which
    model.loss_type picks from transformers' LOSS_MAPPING; only one set on the instance was
    refused, so the patched forward replaced a subclass's loss (12.72 here) or the masked-LM
    loss of loss_type "ForMaskedLM" (6.43, no shift) by the causal cross-entropy (6.36), silently.
    Refused by what it is; HF's own again (loss_type "ForCausalLM"), it trains as HF's."""
    reference = tiny_model("llama", WithOwnLoss if change == "subclass" else None)
    if change == "loss_type":
        reference.loss_type = "ForMaskedLM"
    patched = patch(copy.deepcopy(reference))
    input_ids, labels = batch(seed=19)
    with pytest.raises(TypeError, match=r"its loss_function is .*, not transformers' ForCausalLMLoss"):
        patched(input_ids, labels=labels)
    assert_close(patched(input_ids).logits, reference(input_ids).logits, rtol=1e-5)
    if change == "loss_type":
        patched.loss_type = reference.loss_type = "ForCausalLM"
        assert_close(patched(input_ids, labels=labels).loss, reference(input_ids, labels=labels).loss, rtol=1e-5)


class MyLlama(FAMILIES["llama"]):  # type: ignore[misc, valid-type]
    """A user's subclass whose name holds no LOSS_MAPPING key: HF leaves its loss_type None."""


def test_a_subclass_without_a_loss_type_compiles_fullgraph() -> None:
    """HF's loss_function getter warns (warning_once, which Dynamo cannot trace) where loss_type is
    None, as for a subclass named by its user, before it gives ForCausalLMLoss: the patched
    forward's check of the loss read that getter, so such a model no longer compiled with
    fullgraph=True (and broke the graph in two without it). Its loss is HF's causal one, as
    HF's getter gives it, so it is read without the warning."""
    model = patch(tiny_model("llama", MyLlama))
    assert model.loss_type is None
    input_ids, labels = batch(seed=5)
    torch._dynamo.reset()
    compiled_loss = torch.compile(lambda ids, target: model(ids, labels=target).loss, fullgraph=True, backend="eager")
    assert_close(compiled_loss(input_ids, labels), model(input_ids, labels=labels).loss, rtol=1e-5)
