"""What `memfit fit --for train` writes: the candidates table (markdown and JSON) and the frontier PNG."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit.modeldir import atomic_file
from training.fit_candidates import Candidate

HEAD = ("#", "method", "prec", "micro x accum", "checkpointing", "loss", "act offload", "optimizer", "opt offload",
        "pred peak MiB", "meas peak MiB", "tok/s", "status")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def row(i: int, c: Candidate) -> tuple[str, ...]:
    ckpt = c.checkpointing + (f" ({c.activation_budget // 2**20} MiB)" if c.activation_budget else "")
    status = c.status + (f" ({c.note})" if c.note else "")
    return (str(i), c.method, c.precision, f"{c.batch_size} x {c.grad_accum}", ckpt, c.loss, c.offload_activations,
            c.optimizer, c.optimizer_offload, _mib(c.predicted_peak), _mib(c.measured_peak),
            "-" if c.measured_tok_s is None else f"{c.measured_tok_s:.0f}" + (
                f" (median of {len(c.runs_tok_s)})" if len(c.runs_tok_s) > 1 else ""), status)


def markdown(cands: list[Candidate], only: list[int] | None = None) -> str:
    """The table, one row per candidate (`only`: these indices), in the order given (the verification order)."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for i, c in enumerate(cands):
        if only is None or i in only:
            lines.append("| " + " | ".join(row(i, c)) + " |")
    return "\n".join(lines)


def shown(cands: list[Candidate], extra: int = 8) -> list[int]:
    """Rows worth printing: every verified candidate, the next `extra` predicted to fit, the `extra` closest
    predicted over budget."""
    verified = [i for i, c in enumerate(cands) if c.measured_peak is not None or c.status == "failed"]
    waiting = [i for i, c in enumerate(cands) if c.status == "not verified"][:extra]
    over = sorted((i for i, c in enumerate(cands) if c.status == "predicted over budget"),
                  key=lambda i: cands[i].predicted_peak)[:extra]
    return sorted(set(verified + waiting + over))


def write_text(path: Path, text: str) -> None:
    """Write via a temp file and a rename, so a reader never sees half a file."""
    atomic_file(path, lambda tmp: tmp.write_text(text))


def write_tables(out: Path, summary: dict[str, Any], cands: list[Candidate]) -> None:
    write_text(out / "candidates.json", json.dumps({**summary, "candidates": [asdict(c) for c in cands]}, indent=1))
    head = [f"# memfit fit --for train: {summary['recipe']} in {summary['budget_text']}", "",
            f"Device {summary['device']}; predicted to fit: predicted peak <= {summary['limit'] / 2**20:.1f} MiB "
            f"({100 * (1 - summary['margin']):.0f}% of the budget); measured: a real run of {summary['verify_steps']} "
            "steps (peak of the whole process, the highest of its runs; tok/s over the steps after the first, the "
            "median of its runs where near ties ran again).", ""]
    if summary.get("fallback"):
        head += [f"**{summary['fallback']}**", ""]
    if summary.get("chosen") is not None:
        head += [f"Chosen: #{summary['chosen']}, `{summary['command']}`", ""]
    write_text(out / "candidates.md", "\n".join(head) + markdown(cands) + "\n")


def write_png(path: Path, cands: list[Candidate], budget: int, title: str) -> str | None:
    """Peak memory vs tok/s: verified candidates at their measured peak (hollow: where the prediction put them),
    the budget as a vertical line, the chosen one starred; the measured frontier as a step line. Returns why no
    PNG was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "frontier.png skipped: matplotlib is not installed (pip install matplotlib)"
    measured = [c for c in cands if c.measured_peak is not None and c.measured_tok_s]
    fig, ax = plt.subplots(figsize=(8, 5))
    if measured:
        ref = max(measured, key=lambda c: c.measured_tok_s)
        for status, color in (("not verified", "0.45"), ("predicted over budget", "lightcoral")):
            rest = [c for c in cands if c.status == status]
            ax.scatter([c.predicted_peak / 2**20 for c in rest],
                       [ref.measured_tok_s * ref.score / c.score for c in rest], marker="x", s=14, color=color,
                       label=f"{status}: predicted peak, speed estimated from the ranking")
        for c in measured:
            ax.plot([c.predicted_peak / 2**20, c.measured_peak / 2**20], [c.measured_tok_s] * 2, color="0.7", lw=0.8)
        ok = [c for c in measured if c.measured_peak <= budget]
        bad = [c for c in measured if c.measured_peak > budget]
        ax.scatter([c.predicted_peak / 2**20 for c in measured], [c.measured_tok_s for c in measured],
                   facecolors="none", edgecolors="tab:blue", label="predicted peak")
        ax.scatter([c.measured_peak / 2**20 for c in ok], [c.measured_tok_s for c in ok], color="tab:blue",
                   label="measured, under budget")
        ax.scatter([c.measured_peak / 2**20 for c in bad], [c.measured_tok_s for c in bad], color="tab:red",
                   label="measured, over budget")
        front, best = [], 0.0
        for c in sorted(measured, key=lambda c: c.measured_peak):
            if c.measured_tok_s > best:
                best = c.measured_tok_s
                front.append((c.measured_peak / 2**20, best))
        if front:
            xs, ys = zip(*front, strict=True)
            ax.step(xs, ys, where="post", color="tab:blue", lw=1, alpha=0.6, label="measured frontier")
        for c in measured:
            if c.status == "chosen":
                ax.scatter([c.measured_peak / 2**20], [c.measured_tok_s], marker="*", s=260, color="gold",
                           edgecolors="black", zorder=5, label="chosen")
    else:
        ax.scatter([c.predicted_peak / 2**20 for c in cands], [1.0 / c.score for c in cands], marker="x", s=14,
                   color="0.6", label="predicted peak (none verified; y: relative speed estimate)")
    ax.axvline(budget / 2**20, color="tab:red", ls="--", label=f"budget {budget / 2**20:.0f} MiB")
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    atomic_file(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return None
