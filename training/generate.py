"""Generate text from a checkpoint dir: `python -m training.generate --model DIR --prompt TEXT`.

Plain transformers loading (safetensors only), so this is also the check that a trained model is a
normal Hugging Face checkpoint.
"""

from __future__ import annotations

import argparse
import sys

import torch

from memfit.errors import UserError
from memfit.hf import load_pretrained, load_tokenizer


def generate(model_dir: str, prompt: str, max_new_tokens: int = 80, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0) -> str:
    model = load_pretrained(model_dir).eval()
    tok = load_tokenizer(model_dir)
    ids = tok(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_k=top_k,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.generate", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        print(generate(args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    except UserError as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
