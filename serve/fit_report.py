"""What ``serve fit`` leaves in ``--out``: the candidates (predicted vs measured) as JSON and Markdown, the frontier
as a PNG (peak memory vs workload throughput, the budget as a line), and the chosen command line. Every file
is written to a temporary name and renamed, so an interrupted run never leaves a half-written one."""

from __future__ import annotations

import json
from pathlib import Path

from memfit.modeldir import atomic_file
from memfit.sizes import format_bytes


def _write(path: Path, text: str) -> None:
    atomic_file(path, lambda tmp: tmp.write_text(text))


def tok_s_cell(m: dict) -> str:
    if "tok_s" not in m:
        return ""
    runs = len(m.get("runs_tok_s", ()))
    return f"{m['tok_s']:.1f}" + (f" (median of {runs})" if runs > 1 else "")


def table(cands, budget: int) -> str:
    rows = ["| candidate | predicted peak | measured peak | error | tok/s (workload) | KL | top-1 | status |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cands:
        m, p = c.measured, c.predicted
        peak = m.get("peak")
        cells = [c.name, format_bytes(p["peak"]), format_bytes(peak) if peak else "",
                 f"{(p['peak'] - peak) / peak:+.1%}" if peak else "", tok_s_cell(m),
                 f"{m['kl']:.4f}" if "kl" in m else "", f"{m['top1']:.3f}" if "top1" in m else "", c.status]
        rows.append("| " + " | ".join(cells) + " |")
    return f"budget {format_bytes(budget)}\n\n" + "\n".join(rows) + "\n"


def plot(path: Path, cands, best, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in cands:
        if "tok_s" not in c.measured and "peak" not in c.measured:
            continue
        x = c.measured.get("peak", c.predicted["peak"]) / 2**20
        y = c.measured.get("tok_s", 0.0)
        color = "tab:green" if c is best else ("tab:blue" if "tok_s" in c.measured else "tab:gray")
        ax.scatter([x], [y], color=color, s=60 if c is best else 25, zorder=3)
        ax.annotate(c.name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.plot([c.predicted["peak"] / 2**20, x], [y, y], color="tab:orange", lw=0.8)  # predicted -> measured
    ax.axvline(budget / 2**20, color="tab:red", ls="--", label="budget")
    ax.set_xlabel("peak RSS, MiB (measured; orange: from the prediction)")
    ax.set_ylabel("workload output tok/s (0: rejected)")
    ax.set_title("serve fit: candidates verified")
    ax.legend(loc="lower right")
    fig.tight_layout()
    atomic_file(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)


def write_outputs(out: Path, cands, best, budget: int, workload, command: str | None = None) -> None:
    records = [{"name": c.name, "serve_args": c.serve_args(), "status": c.status, "predicted": c.predicted,
                "measured": c.measured} for c in cands]
    _write(out / "candidates.json", json.dumps({"budget": budget, "workload": vars(workload),
                                                        "chosen": best.name if best else None,
                                                        "candidates": records}, indent=1))
    _write(out / "candidates.md", table(cands, budget))
    if command:
        _write(out / "command.txt", command + "\n")
    plot(out / "frontier.png", cands, best, budget)
