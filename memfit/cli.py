"""``memfit train|compress|serve|plan|eval ...``: one command in front of the stages' own commands.

``memfit train`` is ``train``, ``memfit compress`` is ``compress``, ``memfit serve`` is ``serve``,
``memfit plan MODEL`` is ``serve plan MODEL``, ``memfit eval MODEL`` is ``compress eval MODEL`` and ``memfit fit
MODEL --for serve|train`` is serve.fit / training.fit: the same
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
    "fit": ("", [], "choose and verify the fastest serve/train setup within a memory budget (--for serve|train)"),
}
FIT_TARGETS = {"serve": "serve.fit", "train": "training.fit"}  # memfit fit --for X -> the module that plans X


def fit_module(argv: list[str]) -> tuple[str, list[str]]:
    """``--for serve|train`` (also ``--for=X``) taken out of ``memfit fit``'s arguments: (module, the rest)."""
    for i, a in enumerate(argv):
        if a == "--for" or a.startswith("--for="):
            target = a.partition("=")[2] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in a else 2):]
            if target not in FIT_TARGETS:
                raise ValueError(f"--for must be serve or train, got {target!r}")
            return FIT_TARGETS[target], rest
    raise ValueError("memfit fit needs --for serve or --for train")


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
    if argv[0] == "fit":
        if any(a in ("-h", "--help") for a in argv[1:]) and not any(a.startswith("--for") for a in argv):
            print("usage: memfit fit MODEL --memory SIZE --for {serve,train} ... (memfit fit --for serve --help)")
            return 0
        try:
            module, rest = fit_module(argv[1:])
        except ValueError as e:
            print(f"memfit fit: error: {e}", file=sys.stderr)
            return 2
        argv = ["fit", *rest]
    try:
        return int(importlib.import_module(module).main(prefix + argv[1:]) or 0)
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def entry() -> None:
    sys.exit(main())
