"""``memfit train|compress|serve|plan|eval ...``: one command in front of the stages' own commands.

``memfit train`` is ``train``, ``memfit compress`` is ``compress``, ``memfit serve`` is ``serve``,
``memfit plan MODEL`` is ``serve plan MODEL`` and ``memfit eval MODEL`` is ``compress eval MODEL``: the same
parsers, flags and exit codes (2 for bad input). This module is the front door above every stage; it names
them by module path and imports only the one asked for (the rest of memfit's core imports no stage).
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv) -> int, argv prefix, what it does)
COMMANDS: dict[str, tuple[str, list[str], str]] = {
    "train": ("training.cli", [], "fine-tune or pretrain (AMP, checkpointing, LoRA/QLoRA, DDP/FSDP)"),
    "compress": ("compress.cli", [], "quantize, prune or factorize a model dir (compress --help)"),
    "serve": ("serve.cli", [], "OpenAI-compatible server with continuous batching"),
    "plan": ("serve.cli", ["plan"], "dry run of serve's placement: memory per device, without loading"),
    "eval": ("compress.cli", ["eval"], "perplexity, size and decode speed against baselines"),
}


def usage() -> str:
    lines = ["usage: memfit {" + ",".join(COMMANDS) + "} ...", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, (_, _, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"{usage()}\nmemfit: error: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    module, prefix, _ = COMMANDS[argv[0]]
    try:
        return int(importlib.import_module(module).main(prefix + argv[1:]) or 0)
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def entry() -> None:
    sys.exit(main())
