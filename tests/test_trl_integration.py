"""cce_compile.integrations.trl: the fused LM head TRL's RL trainers call, on real tiny
transformers models, against the model's own logits in float64."""

from __future__ import annotations

import copy
import inspect
import io
import math
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, VaultGemmaConfig,
                          VaultGemmaForCausalLM)

from cce_compile import linear_log_probs
from cce_compile.integrations import trl as trl_integration
from cce_compile.integrations.transformers import patch, unpatch
from cce_compile.integrations.trl import add_fused_lm_head

from .op_cases import relative_error
from .test_transformers import partition_as_zero3


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=211, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def tiny_gemma2() -> Gemma2ForCausalLM:
    config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=211, max_position_embeddings=64,
                          final_logit_softcapping=5.0)
    return Gemma2ForCausalLM(config)


def tiny_mixtral():
    """An MoE model of no family cce_compile's patch knows."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=211,
                           max_position_embeddings=64)
    return MixtralForCausalLM(config)


def reference(model, input_ids, attention_mask, labels, temperature: float):
    """Per-token log-probs and entropies of the next-token labels from the model's own (soft-capped)
    logits, in float64, 0 where the label is -100."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].double() / temperature
    labels = labels[:, 1:]
    log_softmax = torch.log_softmax(logits, dim=-1)
    mask = labels != -100
    log_probs = log_softmax.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) * mask
    return log_probs, entropy


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma2], ids=["llama", "gemma2-softcap"])
def test_fused_head_matches_the_models_own_logits(build) -> None:
    """Log-probs, entropy, loss and every parameter's gradient under random upstream gradients,
    the prompt's positions and the padding masked out as TRL's trainers mask them."""
    torch.manual_seed(0)
    model = build().float()
    ref_model = copy.deepcopy(model).double()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    input_ids = torch.randint(0, 211, (3, 20))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 15:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :8] = -100  # the prompt: only the completion is scored
    g = torch.Generator().manual_seed(1)
    up_lp, up_h = torch.randn(3, 19, generator=g, dtype=torch.float64), torch.randn(3, 19, generator=g, dtype=torch.float64)

    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    ((out.log_probs.double() * up_lp).sum() + (out.entropy.double() * up_h).sum()).backward()
    ref_lp, ref_h = reference(ref_model, input_ids, attention_mask, labels, 0.7)
    ((ref_lp * up_lp).sum() + (ref_h * up_h).sum()).backward()

    mask = labels[:, 1:] != -100
    assert torch.equal(out.label_mask, mask)
    assert relative_error(out.log_probs, ref_lp) < 2e-5 and relative_error(out.entropy, ref_h) < 2e-5
    assert torch.all(out.log_probs[~mask] == 0) and torch.all(out.entropy[~mask] == 0)
    torch.testing.assert_close(out.loss.double(), -ref_lp.sum() / mask.sum(), rtol=2e-5, atol=1e-6)
    for (name, param), ref_param in zip(model.named_parameters(), ref_model.parameters()):
        if ref_param.grad is not None and ref_param.grad.abs().max() > 0:
            assert relative_error(param.grad, ref_param.grad) < 1e-4, name


def test_the_flag_survives_a_later_patch() -> None:
    """add_fused_lm_head, then patch(): the patched forward once passed fused_lm_head=True down
    to the decoder, which dropped it, and returned the loss without log_probs."""
    torch.manual_seed(0)
    model = tiny_llama()
    input_ids = torch.randint(0, 211, (2, 12))
    add_fused_lm_head(model)
    patch(model)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs.shape == (2, 11)  # shifted


def test_without_the_flag_the_forward_is_the_models() -> None:
    """fused_lm_head=False (generation, evaluation) runs the original forward: logits and HF's loss."""
    torch.manual_seed(0)
    model = tiny_llama()
    input_ids = torch.randint(0, 211, (2, 12))
    expected = model(input_ids=input_ids, labels=input_ids)
    add_fused_lm_head(model)
    got = model(input_ids=input_ids, labels=input_ids)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)
    assert model.generate(input_ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_shift_labels_count_and_fp32_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-shifted labels (context or sequence parallelism) are scored as they are, the loss is
    summed over num_items_in_batch, and cast_lm_head_to_fp32 hands the op fp32 operands for a
    bf16 model under autocast (bf16 ones without it)."""
    torch.manual_seed(0)
    model = tiny_llama()
    ref_model = copy.deepcopy(model).double()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    input_ids = torch.randint(0, 211, (2, 12))
    labels = input_ids.clone()
    labels[:, :3] = -100
    shifted = torch.cat([labels[:, 1:], labels.new_full((2, 1), -100)], dim=1)
    out = model(input_ids=input_ids, shift_labels=shifted, num_items_in_batch=40, fused_lm_head=True)
    ref_lp, ref_h = reference(ref_model, input_ids, None, labels, 1.0)
    assert out.log_probs.shape == (2, 12) and relative_error(out.log_probs[:, :-1], ref_lp) < 2e-5
    torch.testing.assert_close(out.loss.double(), -ref_lp.sum() / 40, rtol=2e-5, atol=1e-6)

    operand_dtypes = []

    def recording(hidden, weight, *args, **kwargs):
        operand_dtypes.append((hidden.dtype, weight.dtype))
        return linear_log_probs(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(trl_integration, "linear_log_probs", recording)
    for cast in (True, False):
        bf16 = copy.deepcopy(ref_model).float().bfloat16()
        add_fused_lm_head(bf16, cast_lm_head_to_fp32=cast)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = bf16(input_ids=input_ids, labels=labels, fused_lm_head=True)
        assert out.log_probs.dtype == torch.float32
        assert relative_error(out.log_probs, ref_lp) < 5e-2  # the decoder in bf16
    assert operand_dtypes == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


def test_an_all_masked_batch_is_a_differentiable_zero() -> None:
    model = tiny_llama()
    add_fused_lm_head(model)
    input_ids = torch.randint(0, 211, (2, 10))
    out = model(input_ids=input_ids, labels=torch.full_like(input_ids, -100), fused_lm_head=True)
    assert out.loss == 0 and torch.all(out.log_probs == 0)
    out.loss.backward()  # reaches the model, as a zero
    assert model.lm_head.weight.grad is not None and torch.all(model.lm_head.weight.grad == 0)


@pytest.mark.parametrize(("change", "match"), [
    ({"outputs": ("log_probs", "is_top1")}, r"outputs: .*not \['is_top1'\]"),
    ({"config": {"logits_scaling": 8.0}}, "scales the logits"),
    ({"config": {"output_router_logits": True}}, "asks for an MoE router loss"),
])
def test_what_it_does_not_compute_is_refused(change: dict, match: str) -> None:
    model = tiny_llama()
    for field, value in change.get("config", {}).items():
        setattr(model.config, field, value)
    with pytest.raises(ValueError, match=match):
        add_fused_lm_head(model, outputs=change.get("outputs", ("log_probs",)))


def tiny_text_model(family: str, config_name: str, model_name: str, **config: object) -> nn.Module:
    """A two-layer random model of a transformers family, by class names (the module is imported here)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    model_class = getattr(module, model_name)
    config = getattr(importlib.import_module("transformers"), config_name)(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=211, **config)
    return model_class(config)


@pytest.mark.parametrize(("build", "match"), [
    pytest.param(lambda: tiny_text_model("recurrent_gemma", "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
                                         num_key_value_heads=2, head_dim=8, intermediate_size=64, lru_width=32),
                 r"soft-caps the logits \(logits_soft_cap\)", id="recurrent-gemma"),
    pytest.param(lambda: tiny_text_model("xlstm", "xLSTMConfig", "xLSTMForCausalLM", num_heads=4),
                 r"soft-caps the logits \(output_logit_soft_cap\)", id="xlstm"),
    pytest.param(lambda: tiny_text_model("inkling", "InklingTextConfig", "InklingForCausalLM", num_key_value_heads=2,
                                         head_dim=8, intermediate_size=64),
                 r"scales the logits \(logits_mup_width_multiplier\)", id="inkling"),
])
def test_a_head_the_model_transforms_by_another_config_field_is_refused(build, match: str) -> None:
    """RecurrentGemma and xLSTM soft-cap the logits by fields of their own (logits_soft_cap,
    output_logit_soft_cap: 30 by default), Inkling divides the hidden states by
    logits_mup_width_multiplier (24) before the head: the head was taken and scored the plain
    logits, log-probs off by 3-25% of the model's own on a tiny random model."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=match):
        add_fused_lm_head(build())


@pytest.mark.parametrize(("build", "match"), [
    pytest.param(lambda: tiny_text_model("bert", "BertConfig", "BertLMHeadModel", intermediate_size=64, is_decoder=True),
                 "cls", id="bert-mlm-head"),
    pytest.param(lambda: tiny_text_model("modernbert_decoder", "ModernBertDecoderConfig", "ModernBertDecoderForCausalLM",
                                         intermediate_size=64, pad_token_id=0),
                 "lm_head", id="modernbert-decoder-prediction-head"),
    pytest.param(lambda: tiny_text_model("llama4", "Llama4TextConfig", "Llama4ForCausalLM", num_key_value_heads=2,
                                         head_dim=8, intermediate_size=64, intermediate_size_mlp=64, num_local_experts=2),
                 "base_model", id="llama4-base-model-is-itself"),
])
def test_a_head_that_is_more_than_the_output_layer_is_refused(build, match: str) -> None:
    """The head multiplies base_model's last hidden state by get_output_embeddings(). BERT-style
    causal LMs (BertLMHeadModel, RoBERTa, ...) and ModernBertDecoder pass that hidden state
    through a dense layer and a norm first, in a module beside the output layer: their log-probs
    were 25-36% off the model's own, silently. Where base_model is the causal LM itself (its
    prefix names no submodule: Llama4ForCausalLM, Mllama's), the decoder call reached the
    model's own forward and died on 'last_hidden_state'."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=match):
        add_fused_lm_head(build())


@pytest.mark.parametrize(("temperature", "error"), [(0.0, ValueError), (float("nan"), ValueError), ("hot", TypeError)])
def test_a_bad_temperature_is_refused_when_the_head_is_added(temperature: object, error: type) -> None:
    """Not at the first fused call, after a rollout; the model keeps its own forward."""
    model = tiny_llama()
    with pytest.raises(error, match="temperature"):
        add_fused_lm_head(model, temperature=temperature)
    assert "forward" not in vars(model)


def test_a_default_moe_model_is_taken() -> None:
    """Mixtral's config sets a router loss coefficient but leaves output_router_logits off (TRL's
    GRPO and RLOO trainers turn it on per call unless their router_aux_loss_coef is 0.0): its head is taken and scores as the model's own logits do."""
    torch.manual_seed(0)
    model = tiny_mixtral()
    assert model.config.router_aux_loss_coef > 0 and not model.config.output_router_logits
    ref_model = copy.deepcopy(model)  # fp32: the experts' grouped GEMM takes no float64
    add_fused_lm_head(model)
    input_ids = torch.randint(0, 211, (2, 10))
    out = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    ref_lp, _ = reference(ref_model, input_ids, None, input_ids, 1.0)
    assert relative_error(out.log_probs, ref_lp) < 2e-5


def test_a_call_asking_for_router_logits_is_refused() -> None:
    """TRL's trainers ask for router logits per call on MoE models: refused, not a missing loss."""
    model = tiny_llama()
    add_fused_lm_head(model)
    input_ids = torch.randint(0, 211, (1, 6))
    with pytest.raises(ValueError, match="output_router_logits"):
        model(input_ids=input_ids, labels=input_ids, fused_lm_head=True, output_router_logits=True)


def test_a_deepcopy_runs_its_own_weights_on_both_paths() -> None:
    """A reference model deepcopied from the patched policy (as trainers build one) computes
    with its own weights with and without the flag: generation and logits too."""
    torch.manual_seed(0)
    model = tiny_llama()
    add_fused_lm_head(model)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.lm_head.weight.zero_()
    input_ids = torch.randint(0, 211, (2, 12))
    assert bool((copied(input_ids=input_ids).logits == 0).all())
    assert not bool((model(input_ids=input_ids).logits == 0).all())
    log_probs = copied(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs
    torch.testing.assert_close(log_probs, torch.full_like(log_probs, -math.log(211)))
    assert model(input_ids=input_ids).logits.shape == (2, 12, 211)



def pickle_round_trips(model: nn.Module) -> list[nn.Module]:
    """The model through pickle and through torch.save / torch.load (a whole module saved, as
    multiprocessing spawn and launchers pickle it)."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return [pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]


def fused_outputs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    return [out.log_probs, out.entropy, out.loss, out.label_mask]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma2], ids=["llama", "gemma2-softcap"])
def test_a_model_with_the_head_pickles_into_one_with_a_head_of_its_own(build) -> None:
    """pickle.dumps(model) failed ("Can't pickle <function LlamaForCausalLM.forward>: it's not
    the same object"): the head's forward was a function local to add_fused_lm_head. The copy
    unpickles with the head and its settings (temperature, entropy, the soft-cap), on its own
    weights (a zeroed head changes its log-probs alone), showing the original's signature
    (generate reads it). On the copy the head added again replaces the first (which it takes
    back), and patch() then unpatch() over it leave it in place, as on the original."""
    torch.manual_seed(0)
    model = build()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    input_ids = torch.randint(0, 211, (2, 12))
    labels = input_ids.clone()
    labels[:, :4] = -100
    expected = fused_outputs(model, input_ids, labels)
    expected_logits = model(input_ids=input_ids).logits
    for restored in pickle_round_trips(model):
        for got, want in zip(fused_outputs(restored, input_ids, labels), expected):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(restored(input_ids=input_ids).logits, expected_logits)
        assert inspect.signature(restored.forward) == inspect.signature(model.forward)
        with torch.no_grad():
            restored.lm_head.weight.zero_()
        log_probs = restored(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs
        torch.testing.assert_close(log_probs[:, 3:], torch.full_like(log_probs[:, 3:], -math.log(211)))
        torch.testing.assert_close(fused_outputs(model, input_ids, labels)[0], expected[0])

        add_fused_lm_head(restored, outputs=("log_probs",))
        out = restored(input_ids=input_ids, labels=labels, fused_lm_head=True)
        assert out.entropy is None and out.log_probs.shape == (2, 11)
        patch(restored)
        assert restored(input_ids=input_ids, labels=labels).logits is None  # the patched loss
        assert restored(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs.shape == (2, 11)
        unpatch(restored)
        assert restored(input_ids=input_ids, labels=labels).logits is not None
        assert restored(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs.shape == (2, 11)


def test_an_unpickled_head_compiles_fullgraph() -> None:
    """The unpickled copy's head, and its forward without the flag, trace as the original's do:
    no graph break."""
    torch.manual_seed(0)
    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    restored = pickle.loads(pickle.dumps(model))
    input_ids = torch.randint(0, 211, (2, 12))
    labels = input_ids.clone()
    labels[:, :4] = -100
    torch._dynamo.reset()
    compiled_head = torch.compile(lambda ids, target: restored(input_ids=ids, labels=target, fused_lm_head=True).entropy,
                                  fullgraph=True, backend="eager")
    compiled_logits = torch.compile(lambda ids: restored(input_ids=ids).logits, fullgraph=True, backend="eager")
    expected = model(input_ids=input_ids, labels=labels, fused_lm_head=True).entropy
    torch.testing.assert_close(compiled_head(input_ids, labels), expected)
    torch.testing.assert_close(compiled_logits(input_ids), model(input_ids=input_ids).logits)

def test_adding_the_head_again_takes_the_new_settings() -> None:
    """A second trainer on the same model (a notebook's re-run) adds the head again: it raised,
    so the model had to be loaded anew; TRL's own head wraps again and the new temperature wins,
    as it does here (no wrapper around the first head, which would call it without the flag)."""
    torch.manual_seed(0)
    model = tiny_llama()
    input_ids = torch.randint(0, 211, (2, 12))
    add_fused_lm_head(model)
    add_fused_lm_head(model, temperature=2.0)
    log_probs = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs
    logits = model(input_ids=input_ids).logits[:, :-1].double() / 2.0
    expected = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(log_probs.double(), expected, rtol=1e-5, atol=1e-5)


def counting_hook() -> tuple[Any, Any]:
    """accelerate.hooks and a ModelHook that counts the calls it runs around (skips without accelerate)."""
    hooks = pytest.importorskip("accelerate.hooks")

    class CountingHook(hooks.ModelHook):
        calls = 0

        def pre_forward(self, module: nn.Module, *args, **kwargs) -> tuple:
            self.calls += 1
            return args, kwargs

    return hooks, CountingHook()


def test_adding_the_head_again_after_an_accelerate_hook_keeps_the_hook() -> None:
    """Head added, then an accelerate hook (which keeps the head in `_old_forward`), then the head
    again: the first head's removal deleted `_old_forward`, so the hook called a forward that was
    no longer there (AttributeError) and the new head went around the hook, not beneath it."""
    hooks, hook = counting_hook()
    torch.manual_seed(0)
    model = tiny_llama()
    input_ids = torch.randint(0, 211, (2, 12))
    expected = model(input_ids=input_ids).logits.detach()
    add_fused_lm_head(model)
    hooks.add_hook_to_module(model, hook)
    add_fused_lm_head(model, temperature=2.0)
    torch.testing.assert_close(model(input_ids=input_ids).logits, expected)
    assert hook.calls == 1
    log_probs = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs
    assert hook.calls == 2
    logits = expected[:, :-1].double() / 2.0
    reference = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(log_probs.double(), reference, rtol=1e-5, atol=1e-5)


def test_an_adapter_on_the_head_is_refused() -> None:
    """LoRA on lm_head: the fused head reads lm_head.weight, the base layer's, so it refuses
    rather than score without the adapter; without the flag the model runs as PEFT's."""
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    add_fused_lm_head(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    input_ids = torch.randint(0, 211, (2, 12))
    with pytest.raises(TypeError, match="lm_head: a peft.tuners.lora.layer.Linear adapter layer"):
        model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert model(input_ids=input_ids).logits.shape == (2, 12, 211)


def test_a_zero3_partitioned_head_is_refused_by_name() -> None:
    """The same refusal as the patched forward's (one check, in linear_head)."""
    model = tiny_llama()
    add_fused_lm_head(model)
    partition_as_zero3(model.lm_head.weight)
    input_ids = torch.randint(0, 211, (2, 12))
    with pytest.raises(ValueError, match="lm_head: its weight is partitioned by DeepSpeed ZeRO-3"):
        model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)


def test_the_head_goes_beneath_the_models_accelerate_hook() -> None:
    """A device_map model's root hook moves the outputs back to the inputs' device: the head once
    replaced the hooked forward, so its log-probs skipped the hook (and stayed on the head's GPU),
    as patch()'s loss once did. Installed beneath it, the hook runs around both kinds of call."""
    hooks, hook = counting_hook()
    torch.manual_seed(0)
    model = tiny_llama()
    ref_model = copy.deepcopy(model).double()
    add_fused_lm_head(hooks.add_hook_to_module(model, hook))
    input_ids = torch.randint(0, 211, (2, 12))
    ref_lp, _ = reference(ref_model, input_ids, None, input_ids, 1.0)
    assert relative_error(model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs, ref_lp) < 2e-5
    assert hook.calls == 1
    model(input_ids=input_ids)
    assert hook.calls == 2


def test_a_head_offloaded_by_accelerate_is_loaded_by_its_hook(tmp_path) -> None:
    """lm_head on disk: its weight is on meta until its accelerate hook loads it (once a meta
    tensor reached the op); the log-probs are the model's own."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = tiny_llama()
    ref_model = copy.deepcopy(model).double()
    model = accelerate.dispatch_model(model, device_map={"model": "cpu", "lm_head": "disk"}, offload_dir=str(tmp_path))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    assert model.lm_head.weight.device.type == "meta"
    input_ids = torch.randint(0, 211, (2, 12))
    out = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    ref_lp, ref_h = reference(ref_model, input_ids, None, input_ids, 1.0)
    assert relative_error(out.log_probs, ref_lp) < 2e-5 and relative_error(out.entropy, ref_h) < 2e-5


def test_the_softcap_is_the_one_the_models_forward_applies() -> None:
    """A Llama or Mixtral config carrying final_logit_softcapping (from a config.json): their
    forwards ignore it, and so do the log-probs (they once applied it). VaultGemma, outside the
    families patch() knows, declares it in its config and its forward applies it: so do they."""
    torch.manual_seed(0)
    for model in (tiny_llama(), tiny_mixtral()):
        model.config.final_logit_softcapping = 0.5
        ref_model = copy.deepcopy(model)  # float32: Mixtral's experts' grouped GEMM refuses float64
        add_fused_lm_head(model)
        input_ids = torch.randint(0, 211, (2, 12))
        ref_lp, _ = reference(ref_model, input_ids, None, input_ids, 1.0)
        got = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs
        assert relative_error(got, ref_lp) < 2e-5, type(model).__name__
    config = VaultGemmaConfig(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5)
    model = VaultGemmaForCausalLM(config)
    ref_model = copy.deepcopy(model)
    add_fused_lm_head(model)
    input_ids = torch.randint(0, 211, (2, 12))
    ref_lp, _ = reference(ref_model, input_ids, None, input_ids, 1.0)
    assert relative_error(model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs, ref_lp) < 2e-5


def test_a_softcap_declared_as_a_class_attribute_counts() -> None:
    """DiffusionGemma's text config sets final_logit_softcapping as a class attribute, not an
    __init__ parameter, and its forward applies it: the config class declares it all the same."""
    from cce_compile.integrations.transformers import declares_softcap

    config_class = getattr(pytest.importorskip("transformers"), "DiffusionGemmaTextConfig", None)
    if config_class is None:
        pytest.skip("this transformers has no DiffusionGemma")
    assert declares_softcap(config_class) and not declares_softcap(LlamaConfig)


def test_a_head_added_after_patch_keeps_unpatch_from_dropping_it() -> None:
    """patch(), then the fused head: unpatch() once wrote back the forward from before patch(),
    dropping the head with it (fused_lm_head=True was then silently ignored). Refused."""
    model = patch(tiny_llama())
    add_fused_lm_head(model)
    with pytest.raises(ValueError, match=r"its forward was replaced after patch\(\)"):
        unpatch(model)
    input_ids = torch.randint(0, 211, (2, 12))
    assert model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs.shape == (2, 11)


def test_a_peft_model_gets_the_head_on_the_causal_lm_it_wraps() -> None:
    """add_fused_lm_head(peft_model), the order of a trainer that wraps with PEFT first: the head
    once took the PEFT model's base_model (the LoRA model, whose forward returns logits) for the
    decoder and failed on 'last_hidden_state'. Log-probs and the LoRA weights' gradients are the
    PEFT model's own."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                               init_lora_weights=False))
    ref_model = copy.deepcopy(model).double()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    input_ids = torch.randint(0, 211, (2, 12))
    labels = input_ids.clone()
    labels[:, :4] = -100
    upstream = torch.randn(2, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    (out.log_probs.double() * upstream).sum().backward()
    ref_lp, ref_h = reference(ref_model, input_ids, None, labels, 1.0)
    (ref_lp * upstream).sum().backward()
    assert relative_error(out.log_probs, ref_lp) < 2e-5 and relative_error(out.entropy, ref_h) < 2e-5
    lora = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    assert lora and all("lora_" in name for name, _ in lora)
    for (name, param), ref_param in zip(lora, (p for p in ref_model.parameters() if p.requires_grad)):
        assert relative_error(param.grad, ref_param.grad) < 1e-4, name
    with pytest.raises(TypeError, match="model: expected a transformers PreTrainedModel or a PEFT model of one, got Linear"):
        add_fused_lm_head(nn.Linear(4, 4))


def _separately_sharded_head_worker(rank: int, store: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cce_compile.plan.policy import Policy, override_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        with override_policy(Policy(triton_on_cpu=False)):
            torch.manual_seed(0)
            model = tiny_llama()
            ref_model = copy.deepcopy(model)
            add_fused_lm_head(ref_model, temperature=0.7, outputs=("log_probs", "entropy"))
            input_ids = torch.randint(0, 211, (4, 12), generator=torch.Generator().manual_seed(1))
            labels = input_ids.clone()
            labels[:, :5] = -100
            labels[3, :9] = -100  # the ranks score different numbers of tokens
            out = ref_model(input_ids=input_ids, labels=labels, fused_lm_head=True)
            (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()

            mesh = init_device_mesh("cpu", (2,))
            fully_shard(model.lm_head, mesh=mesh)  # its own group: a DTensor the head gathers
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
            mine = slice(2 * rank, 2 * rank + 2)
            out_rank = model(input_ids=input_ids[mine], labels=labels[mine], fused_lm_head=True)
            (out_rank.log_probs.sum() + 0.1 * out_rank.entropy.sum()).backward()
            torch.testing.assert_close(out_rank.log_probs, out.log_probs[mine].detach())
            for (name, param), ref_param in zip(model.named_parameters(), ref_model.parameters()):
                grad = param.grad.full_tensor() * 2  # FSDP averages the ranks' gradients
                if ref_param.grad.abs().max() > 0:
                    assert relative_error(grad, ref_param.grad) < 1e-4, name
    finally:
        dist.destroy_process_group()


def test_a_separately_sharded_fsdp2_head_gets_every_ranks_gradient(tmp_path) -> None:
    """fully_shard(lm_head) in a group of its own: its forward never runs, so the head gathers the
    DTensor weight itself. full_tensor()'s default backward (Replicate) kept on each rank its own
    tokens' gradient for its shard, unreduced: lm_head's gradient was 99% off that of one process
    on the whole batch (as TRL's head's is), silently. Two gloo ranks on CPU."""
    import torch.multiprocessing as mp

    mp.spawn(_separately_sharded_head_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
