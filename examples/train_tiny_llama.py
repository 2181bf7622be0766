"""Train a tiny Llama for a few AdamW steps with its loss through cce_compile, under
torch.compile, on a CUDA GPU if there is one, else on the CPU.

    python examples/train_tiny_llama.py                  # 20 steps, inductor
    python examples/train_tiny_llama.py --steps 3 --backend aot_eager

The model is random-init from a config (nothing is downloaded); `patch` makes its forward
take the loss from the final hidden states and lm_head.weight, never the (tokens x vocab)
logits. Swap in `AutoModelForCausalLM.from_pretrained(...)` for a real model. Prints one line
per step and exits non-zero if the loss did not fall.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cce_compile.integrations.transformers import patch
from cce_compile.resolve.ladder import resolved


def tiny_llama(vocab: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def at_least(minimum: int):
    """An argparse type: an integer >= minimum (the loss needs 2 steps to fall, a vocabulary past
    the 3 special tokens, and at least 2 positions to shift labels against)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {minimum}")
        return value
    parse.__name__ = "integer"  # argparse names a value int() refuses by it
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=at_least(2), default=20)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, eager)")
    parser.add_argument("--vocab", type=at_least(4), default=4096)
    parser.add_argument("--batch", type=at_least(1), default=4)
    parser.add_argument("--seq", type=at_least(2), default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = patch(tiny_llama(args.vocab)).to(device=device, dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    compiled = torch.compile(model, backend=args.backend, fullgraph=True)

    # One fixed batch, so a few steps visibly lower its loss; labels are the inputs (HF shifts them).
    input_ids = torch.randint(3, args.vocab, (args.batch, args.seq), device=device)
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = compiled(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - start:.2f} s, {device}, {args.backend})")
    shapes = resolved()  # every (GPU model, problem shape) the op resolved a kernel config for
    print(f"cce_compile's op computed the loss for {len(shapes)} shape(s): "
          + ", ".join(f"V={key.v} D={key.d} {key.dtype} on {model}" for model, key in shapes))
    if not shapes:
        raise SystemExit("the loss did not go through cce_compile's op")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
