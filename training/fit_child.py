"""The two child processes of `memfit fit --for train`, each a fresh interpreter so its memory is its own.

`probe RECIPE --batches 1,2,4 --plain-cap BYTES`: load the recipe's model and data once, as `train --plan`
does, then for each loss kind at the largest and the smallest micro-batch (the plain loss only where its logits,
by training.plan.loss_bytes, fit in the cap: a probe forward materialises them) run the plan's probe forward
(training.setup.plan_checkpointing, the recipe's checkpointing off) and record the MemoryPlan with the per-layer
costs the probe measured (training.budget.probe_layers), the trainable tensors' sizes, the vocabulary and the
process's peak while loading: what training.fit_candidates derives every candidate's plan from. `base` is
honest for the first point only (later ones share the process). With --check-adamw8bit, also whether
bitsandbytes' AdamW8bit works on the device and what importing it costs.

`run RECIPE --steps N`: the real training loop (training.loop.train) for N optimizer steps, then stop before any
eval or checkpoint. Prints the process's peak (VmHWM on CPU: the whole process, loading included, as it is never
reset here; max_memory_allocated on CUDA) and the tokens/s of steps 2..N (step 1 pays the warm-up).

Each prints one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UserError


@contextlib.contextmanager
def _recording_probe(into: dict[str, Any]) -> Iterator[None]:
    """Wrap training.setup.probe_layers so the plan's own probe hands us its per-layer costs too."""
    import training.setup as setup

    original = setup.probe_layers

    def probe(model, run_forward):
        costs, other = original(model, run_forward)
        into["costs"], into["other"] = [dataclasses.asdict(c) for c in costs], other
        return costs, other

    setup.probe_layers = probe
    try:
        yield
    finally:
        setup.probe_layers = original


def probe(recipe: str, batches: list[int], plain_cap: int, check_8bit: bool) -> dict[str, Any]:
    from accelerate import Accelerator

    from memfit.heap import map_large_allocations
    from memfit.modeldir import check_model_dir
    from training import precision as amp
    from training.config import load_config
    from training.freeze import apply_stage, stage_at, stage_label
    from training.loop import DataOrder
    from training.losses import chunked_causal_lm_loss, plain_causal_lm_loss
    from training.plan import loss_bytes, peak_bytes
    from training.setup import get_model, get_tokenizer, load_data, plan_checkpointing, read_split

    cfg = load_config(recipe)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    if acc.device.type == "cpu":
        map_large_allocations()
    if cfg.model_path:
        check_model_dir(cfg.model_path, "model_path", cfg.allow_pickle)
    # What train() does before its plan (training.loop.train), minus the output dir: a from-scratch tokenizer
    # goes to a temp dir, as with --plan.
    train_docs, val_docs = read_split(cfg)
    with tempfile.TemporaryDirectory(prefix="memfit-fit-probe-") as tmp:
        tokenizer = get_tokenizer(cfg, Path(tmp), train_docs, acc)
        data = load_data(cfg, tokenizer, train_docs, val_docs)
        model = get_model(cfg, tokenizer, None, acc.device).to(acc.device)
        model.train()
        base_trainable = {n: p.requires_grad for n, p in model.named_parameters()}
        stage = stage_at(cfg, 0)
        apply_stage(model, stage, base_trainable, stage_label(cfg, stage))
        load_peak = peak_bytes(acc.device)  # loading's own peak: tokenizing a large corpus can top training's
        prec = amp.resolve(cfg.precision, acc.device)
        order = DataOrder(len(data.train_x), cfg.seed)
        vocab = int(model.get_output_embeddings().weight.shape[0])
        plain = [b for b in batches if loss_bytes(dataclasses.replace(cfg, loss="plain"), b * cfg.block_size, vocab,
                                                   prec.dtype is not None) <= plain_cap]
        points = [("chunked", b) for b in sorted({max(batches), min(batches)}, reverse=True)]
        points += [("plain", b) for b in sorted({max(plain), min(plain)}, reverse=True)] if plain else []
        out: list[dict[str, Any]] = []
        for loss, batch in points:
            point = dataclasses.replace(cfg, batch_size=batch, loss=loss, checkpointing="none",
                                        activation_budget=None, offload_activations="none")
            idx = [order(i) for i in range(batch)]  # the first micro-batch of step 0, as train() takes it
            x, y = data.train_x[idx].to(acc.device), data.train_y[idx].to(acc.device)
            loss_fn = (plain_causal_lm_loss if loss == "plain"
                       else partial(chunked_causal_lm_loss, chunk_tokens=cfg.loss_chunk_tokens))
            seen: dict[str, Any] = {}
            with _recording_probe(seen):
                plan = plan_checkpointing(model, point, lambda f=loss_fn, x=x, y=y: f(model, x, y), prec, acc.device)
            out.append({"loss": loss, "batch_size": batch, "plan": plan.as_dict(), **seen})
            del x, y
        trainable = [[p.numel(), str(p.dtype).removeprefix("torch.")] for p in model.parameters() if p.requires_grad]
    hidden = int(model.get_output_embeddings().weight.shape[1])
    return {"device": acc.device.type, "precision": prec.name, "vocab": vocab, "hidden": hidden, "trainable": trainable,
            "points": out, "load_peak": load_peak, **_adamw8bit_usable(acc.device, check_8bit)}


def _adamw8bit_usable(device: torch.device, check: bool) -> dict[str, Any]:
    """Whether bitsandbytes' AdamW8bit imports and steps on this device, the bytes that costs the process
    (importing bitsandbytes pulls in torch's compiler stack: ~50 MiB of RSS that the plan's base, taken without
    it, does not hold) and the step's temporaries per element of the tensor it steps (the peak of a second step
    on a 4M-element tensor over the settled process: no state is allocated then). Run after the probe, so no
    point's base includes it."""
    from training.plan import peak_bytes, reset_peak, settled_bytes

    none = {"adamw8bit": False, "adamw8bit_bytes": 0, "adamw8bit_temp": 0.0}
    if not check:
        return none
    before = settled_bytes(device)
    n = 1 << 22
    try:
        import bitsandbytes as bnb

        p = torch.nn.Parameter(torch.zeros(n, device=device))
        opt = bnb.optim.AdamW8bit([p])
        p.grad = torch.ones_like(p)
        opt.step()
        imported = settled_bytes(device) - before
        reset_peak(device)
        opt.step()
        temp = (peak_bytes(device) - settled_bytes(device)) / n
        del p, opt
    except Exception:  # noqa: BLE001 - any failure (missing library, no kernel for the device) means "not here"
        return none
    # the probe's own tensors (its state, ~2 bytes per element, the 16 MiB parameter and its gradient) are not
    # part of what importing costs a real run
    imported -= n * (4 + 4 + 2)
    return {"adamw8bit": True, "adamw8bit_bytes": max(imported, 0), "adamw8bit_temp": max(temp, 0.0)}


class _Done(Exception):
    """Raised from on_step after the last measured step: stops train() before its final eval and save."""


def run(recipe: str, steps: int) -> dict[str, Any]:
    from training.config import load_config
    from training.loop import train
    from training.plan import peak_bytes

    cfg = load_config(recipe)
    marks: list[tuple[int, float, int]] = []

    def on_step(step: int, row: dict) -> None:
        marks.append((step, time.perf_counter(), int(row["tokens"])))
        if step >= steps:
            raise _Done

    try:
        train(cfg, on_step=on_step)
    except _Done:
        pass
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    (_, t1, tok1), (_, tn, tokn) = marks[0], marks[-1]
    tok_s = (tokn - tok1) / (tn - t1) if len(marks) > 1 and tn > t1 else None
    return {"peak": peak_bytes(device), "tok_s": tok_s, "steps": len(marks), "tokens_per_step": tok1,
            "device": device.type}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.fit_child")
    p.add_argument("mode", choices=("probe", "run"))
    p.add_argument("recipe")
    p.add_argument("--batches", default="1", help="probe: the micro-batches the candidates use, comma-separated")
    p.add_argument("--plain-cap", type=int, default=2**62, help="probe: skip plain-loss points above these bytes")
    p.add_argument("--check-adamw8bit", action="store_true", help="probe: also try bitsandbytes' AdamW8bit")
    p.add_argument("--steps", type=int, default=3, help="run: optimizer steps to measure")
    args = p.parse_args(argv)
    try:
        if args.mode == "probe":
            result = probe(args.recipe, [int(b) for b in args.batches.split(",")], args.plain_cap, args.check_adamw8bit)
        else:
            result = run(args.recipe, args.steps)
    except UserError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
