"""`train --config configs/train/<recipe>.yaml [key=value ...]` (also `python -m training`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from memfit.errors import UserError
from training.config import load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train", description=__doc__)
    p.add_argument("--config", help="YAML recipe (see configs/train/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override any config key")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir exactly")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in output_dir")
    p.add_argument("--allow-pickle", action="store_true", help="allow pickle .bin checkpoints (unsafe)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint")
    p.add_argument("--memory-report", action="store_true",
                   help="predict memory before step 1, then print it next to what was measured")
    p.add_argument("--plan", action="store_true",
                   help="print the memory the recipe will need (parameters, gradients, optimizer state, activations, "
                        "loss, peak) from one probe forward, and exit without training")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.allow_pickle:
            cfg.allow_pickle = True
        if args.trust_remote_code:
            cfg.trust_remote_code = True
        if args.resume and args.overwrite:
            raise UserError("--resume and --overwrite contradict each other; pick one")
        from training.loop import train  # heavy imports after the config is known to be good

        result = train(cfg, resume=args.resume, overwrite=args.overwrite, memory_report=args.memory_report,
                       plan_only=args.plan)
    except UserError as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # one summary line, not one per process
        print(json.dumps({k: v for k, v in result.items() if k != "memory_report"}))  # --plan: the plan's bytes
    return 0


def entry() -> None:
    sys.exit(main())
