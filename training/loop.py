"""The training loop, top to bottom: one optimizer step = grad_accum micro-batches on every process."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DistributedType
from tqdm import tqdm

from memfit.errors import UserError
from memfit.heap import map_large_allocations, release_free_memory
from memfit.modeldir import atomic_dir, check_model_dir
from training import checkpoint as ckpt
from training import precision as amp
from training.config import TrainConfig
from training.freeze import apply_stage, stage_at, stage_label
from training.losses import chunked_causal_lm_loss, plain_causal_lm_loss
from training.memory import MemoryReport, fill_static
from training.offload import offload_activations
from training.plan import (
    MemoryPlan,
    peak_bytes,
    process_bytes,
    reset_peak,
)
from training.setup import (
    get_model,
    get_tokenizer,
    load_data,
    lr_factor,
    make_optimizer,
    plan_checkpointing,
    prepare_output_dir,
    read_split,
)

LossFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]


class DataOrder:
    """Global sample k -> block index: a fresh seeded permutation per epoch.

    The order depends only on (seed, k), so resuming at step s continues at sample s * global_batch,
    and N processes see exactly the samples one process would, in the same order.
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self._perms = n, seed, {}

    def __call__(self, k: int) -> int:
        epoch, pos = divmod(k, self.n)
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}
        return int(self._perms[epoch][pos])


@torch.no_grad()
def evaluate(model, data, cfg: TrainConfig, prec: amp.Precision, acc: Accelerator, loss_fn: LossFn) -> float | None:
    n = len(data.val_x)
    if n == 0:
        return None
    model.eval()
    starts = list(range(acc.process_index * cfg.batch_size, n, cfg.batch_size * acc.num_processes))
    if cfg.eval_batches:
        starts = starts[: cfg.eval_batches]
    total = torch.zeros(2, dtype=torch.float64, device=acc.device)
    for s in starts:
        x = data.val_x[s : s + cfg.batch_size].to(acc.device)
        y = data.val_y[s : s + cfg.batch_size].to(acc.device)
        with prec.autocast():
            total[0] += loss_fn(model, x, y).double()
        total[1] += (y != -100).sum()
    total = acc.reduce(total, reduction="sum") if acc.num_processes > 1 else total
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def save(dest: Path, model, tokenizer, optimizer, state: dict[str, Any], acc: Accelerator,
         with_state: bool = True) -> None:
    unwrapped = acc.unwrap_model(model)
    weights = acc.get_state_dict(model) if acc.distributed_type.value == "FSDP" else None
    if not acc.is_main_process:
        return

    def write(tmp: Path) -> None:
        unwrapped.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        if with_state:
            ckpt.write_training_state(tmp, state, optimizer)
        else:
            (tmp / "best.json").write_text(json.dumps({k: state[k] for k in ("step", "val_loss")}))

    atomic_dir(dest, write)


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, memory_report: bool = False,
          on_step: Callable[[int, dict], None] | None = None, plan_only: bool = False) -> dict[str, Any]:
    """Run training; returns the final metrics. `on_step(step, row)` is called after every step.
    plan_only: load and probe, print the predicted memory, train nothing (`train --plan`)."""
    acc = Accelerator(cpu=not torch.cuda.is_available())
    if acc.device.type == "cpu":
        map_large_allocations()  # before loading: freed activations leave RSS at once (see its docstring)
    if acc.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed owns backward/step through its engine; this loop drives them itself (scaler, clipping).
        raise UserError("DeepSpeed launch configs are not supported: use configs/accelerate/fsdp.yaml (ZeRO-3 "
                        "style) or configs/accelerate/fsdp_zero2.yaml (ZeRO-2 style)")
    out = Path(cfg.output_dir)
    # Validate every input before the output dir is touched (--overwrite deletes only after this).
    if cfg.model_path:
        check_model_dir(cfg.model_path, "model_path", cfg.allow_pickle)
    train_docs, val_docs = read_split(cfg)
    if plan_only:  # touch nothing in output_dir: a from-scratch tokenizer goes to a temp dir
        out, resume, overwrite = Path(tempfile.mkdtemp(prefix="memfit-plan-")), False, True
    resume_from = prepare_output_dir(out, resume, overwrite) if acc.is_main_process else None
    acc.wait_for_everyone()
    if resume and resume_from is None:
        resume_from = ckpt.find_checkpoint(out / "last")
    tokenizer = get_tokenizer(cfg, out, train_docs, acc)
    data = load_data(cfg, tokenizer, train_docs, val_docs)
    model = get_model(cfg, tokenizer, resume_from, acc.device).to(acc.device)
    model.train()
    world, rank = acc.num_processes, acc.process_index
    global_batch = cfg.batch_size * cfg.grad_accum * world
    step, best_val, tokens_seen = 0, math.inf, 0
    state = tensors = None
    if resume_from is not None:
        state, tensors = ckpt.read_training_state(resume_from)
        if state["global_batch"] != global_batch:
            raise UserError(f"--resume: global batch {global_batch} != checkpoint's {state['global_batch']} "
                            "(batch_size x grad_accum x processes must match to continue the data order)")
        step, best_val, tokens_seen = state["step"], state["best_val"], state["tokens_seen"]
    if len(cfg.stages) > 1 and world > 1:
        raise UserError("stages: switching the trainable set mid-run needs a single process (DDP fixes its "
                        "gradient buckets at start); run the stages as separate runs")
    # What trains: the model's own choice (all weights, or LoRA's adapters) narrowed by trainable/freeze.
    # A checkpoint is written by the optimizer of the step before it, so resume rebuilds that stage's.
    base_trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    stage = stage_at(cfg, max(step - 1, 0))
    apply_stage(model, stage, base_trainable, stage_label(cfg, stage))
    if cfg.loss == "chunked" and acc.distributed_type == DistributedType.FSDP:
        print("loss: chunked reads lm_head's weight outside the FSDP forward; using loss=plain", flush=True)
        cfg.loss = "plain"
    loss_fn: LossFn = (plain_causal_lm_loss if cfg.loss == "plain"
                       else partial(chunked_causal_lm_loss, chunk_tokens=cfg.loss_chunk_tokens))
    prec = amp.resolve(cfg.precision, acc.device)
    order = DataOrder(len(data.train_x), cfg.seed)

    def first_micro_batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = [order(step * global_batch + rank * cfg.batch_size * cfg.grad_accum + i) for i in range(cfg.batch_size)]
        return data.train_x[idx].to(acc.device), data.train_y[idx].to(acc.device)

    # Which decoder layers recompute in backward; checkpointing=auto (and --plan) probe one forward for it.
    plan: MemoryPlan | None = None
    if cfg.checkpointing == "auto" or memory_report or plan_only:
        x0, y0 = first_micro_batch()
        plan = plan_checkpointing(model, cfg, lambda: loss_fn(model, x0, y0), prec, acc.device,
                                  verbose=acc.is_main_process)
    else:
        plan_checkpointing(model, cfg, None, prec, acc.device)
    if plan_only:
        shutil.rmtree(out, ignore_errors=True)
        return {"plan": plan.as_dict()}
    model = acc.prepare(model)
    optimizer = make_optimizer(model, cfg, acc.device)
    scaler = prec.scaler()
    if state is not None:
        optimizer.load_state_dict(ckpt.unflatten_optimizer(state["optimizer"], tensors))
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        ckpt.restore_rng(tensors)
    else:
        torch.manual_seed(cfg.seed + rank)

    metrics = (out / "metrics.jsonl").open("a") if acc.is_main_process else None
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if acc.is_main_process:
        print(f"model: {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable); precision {prec.name}; "
              f"checkpointing {cfg.checkpointing}; {len(data.train_x)} train / {len(data.val_x)} val blocks of "
              f"{cfg.block_size} ({data.n_train_docs} / {data.n_val_docs} documents); world {world}", flush=True)

    stop = {"signal": None}  # SIGTERM (preemption): finish the step, save `last`, exit cleanly
    if acc.is_main_process and world == 1:
        signal.signal(signal.SIGTERM, lambda s, f: stop.update(signal=s))

    def state_dict() -> dict[str, Any]:
        return {"step": step, "best_val": best_val, "tokens_seen": tokens_seen, "global_batch": global_batch,
                "scaler": scaler.state_dict() if scaler else None,
                "config": dataclasses.asdict(cfg)}

    report = MemoryReport(plan=plan) if memory_report else None
    if report is not None:
        reset_peak(acc.device)  # the peak is process-wide: this run's steps', not loading or an earlier run's
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not acc.is_main_process, dynamic_ncols=True)
    last: dict[str, Any] = {}
    start_val = None
    if cfg.eval_at_start and step == 0:  # the base model's loss: what a fine-tune is measured against
        start_val = evaluate(model, data, cfg, prec, acc, loss_fn)
        if start_val is not None:
            bar.write(f"step 0: val loss {start_val:.4f} ppl {math.exp(min(start_val, 50)):.2f}")
            if metrics:
                metrics.write(json.dumps({"step": 0, "tokens": 0, "val_loss": round(start_val, 6),
                                          "val_ppl": round(math.exp(min(start_val, 50)), 4)}) + "\n")
                metrics.flush()
    t0, tokens_at_t0 = time.perf_counter(), tokens_seen
    offload = offload_activations(cfg.offload_activations, acc.device, model)
    trim = acc.device.type == "cpu"  # glibc keeps freed sub-32 MiB blocks as heap fragments in RSS
    while step < cfg.max_steps:
        if stage_at(cfg, step) != stage:  # a new stage: new trainable set, optimizer state kept where it still trains
            stage = stage_at(cfg, step)
            names = apply_stage(acc.unwrap_model(model), stage, base_trainable, stage_label(cfg, stage))
            optimizer = make_optimizer(model, cfg, acc.device, carry_from=optimizer)
            bar.write(f"step {step}: stage {stage.index} trains {len(names)} tensors")
        lr = cfg.lr * lr_factor(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # The global batch of this step, then this process's contiguous share of it.
        idx = [order(step * global_batch + i) for i in range(global_batch)]
        y_all = data.train_y[idx]
        n_tokens = int((y_all != -100).sum())  # the whole window, all processes: loss normaliser
        mine = idx[rank * cfg.batch_size * cfg.grad_accum : (rank + 1) * cfg.batch_size * cfg.grad_accum]
        loss_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        for micro in range(cfg.grad_accum):
            chunk = mine[micro * cfg.batch_size : (micro + 1) * cfg.batch_size]
            x, y = data.train_x[chunk].to(acc.device), data.train_y[chunk].to(acc.device)
            sync = micro == cfg.grad_accum - 1  # all-reduce gradients only once per step
            with acc.no_sync(model) if not sync else nullcontext():
                with offload, prec.autocast():  # offload hooks see what the forward saves for backward
                    s = loss_fn(model, x, y)
                if trim:
                    release_free_memory()  # the forward's temporaries, before backward allocates gradients
                # DDP averages gradients over processes, so scale by world to get sum / n_tokens.
                loss = s * world / max(n_tokens, 1)
                (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += s.detach().double()
        if world > 1:
            loss_sum = acc.reduce(loss_sum, reduction="sum")
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg.grad_clip > 0:
            gnorm = float(acc.clip_grad_norm_(params, cfg.grad_clip))
        else:
            gnorm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if report is not None and report.parameters == 0:
            fill_static(report, model, optimizer)
            report.peak = peak_bytes(acc.device)
            _write_report(report, out, acc)
        optimizer.zero_grad(set_to_none=True)
        if trim:
            release_free_memory()  # the backward's and the step's freed blocks, before the next forward
        step += 1
        tokens_seen += n_tokens

        train_loss = float(loss_sum) / max(n_tokens, 1)
        elapsed = time.perf_counter() - t0
        row = {"step": step, "loss": round(train_loss, 6), "lr": lr, "grad_norm": round(gnorm, 4),
               "tokens": tokens_seen, "tokens_per_s": round((tokens_seen - tokens_at_t0) / max(elapsed, 1e-9), 1),
               "mem_mib": round(process_bytes(acc.device) / 2**20, 1)}
        if scaler is not None:
            row["loss_scale"] = scaler.get_scale()
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", mem=f"{row['mem_mib']:.0f}M")
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            val = evaluate(model, data, cfg, prec, acc, loss_fn)
            if val is not None:
                row.update(val_loss=round(val, 6), val_ppl=round(math.exp(min(val, 50)), 4))
                if val < best_val:
                    best_val = val
                    save(out / "best", model, tokenizer, optimizer, {"step": step, "val_loss": val}, acc,
                         with_state=False)
                bar.write(f"step {step}: val loss {val:.4f} ppl {math.exp(min(val, 50)):.2f}")
        if metrics and (step % cfg.log_every == 0 or "val_loss" in row or step == cfg.max_steps):
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        if step % cfg.save_every == 0 or step == cfg.max_steps or stop["signal"]:
            save(out / "last", model, tokenizer, optimizer, state_dict(), acc)
        last = row
        if on_step is not None:
            on_step(step, row)
        if stop["signal"]:
            bar.write(f"signal {stop['signal']}: saved {out / 'last'} at step {step}; resume with --resume")
            break
    bar.close()
    if report is not None:
        report.peak_final = peak_bytes(acc.device)
        _write_report(report, out, acc)
    if metrics:
        metrics.close()
    if cfg.lora and not cfg.qlora and acc.is_main_process and step == cfg.max_steps:  # 4-bit bases don't merge
        merged = acc.unwrap_model(model).merge_and_unload()
        atomic_dir(out / "merged", lambda d: (merged.save_pretrained(d), tokenizer.save_pretrained(d)))
    acc.wait_for_everyone()
    return {**last, "best_val_loss": best_val if best_val < math.inf else None, "start_val_loss": start_val,
            "memory_report": report.as_dict() if report else None}


def _write_report(report: MemoryReport, out: Path, acc: Accelerator) -> None:
    if acc.is_main_process:
        (out / "memory_report.json").write_text(json.dumps(report.as_dict(), indent=1))
        print("memory report:\n" + report.table(), flush=True)
