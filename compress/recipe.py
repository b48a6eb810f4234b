"""`compress pipeline --config RECIPE.yaml`: steps in order (prune..., then lowrank or quantize), one output.

A recipe is read into typed configs (`Recipe` and one dataclass per step kind); an unknown key, a value of
the wrong type or out of range is a UserError naming the step and the key (exit 2), before any work.
Intermediate steps write dense fp16 dirs into a work dir next to the output; the last step's dir is moved
into place with the usual temp dir + rename. A quantize step after a prune step keeps the zeros: RTN and
AWQ map 0 to the zero point anyway, and `method: gptq` runs the registry's `after_prune` variant,
sparse-gptq (GPTQ with the pruning mask fixed). The output's config.json lists every step under
`memfit_steps`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from compress import lowrank, methods
from compress.calib import Calibration, check_sizes
from compress.prune import lowrank_model, prune_model, resolve_sparsity
from compress.quant import SUPPORTED_BITS
from compress.quantize import QuantizeOptions, quantize_model
from memfit.defaults import CALIB_SAMPLES, CALIB_SEQLEN, GROUP_SIZE
from memfit.errors import UserError
from memfit.modeldir import atomic_dir, check_model_dir, check_output_dir


@dataclass
class PruneStep:
    """`- prune: {...}`: any number of them, each followed by another step or last."""

    method: str = methods.DEFAULT["prune"]
    """magnitude, wanda or sparsegpt."""
    sparsity: float | None = None
    """Fraction of the weights removed, in (0, 1); default 0.5, N:M patterns imply 1 - N/M."""
    pattern: str = "unstructured"
    """unstructured, or N:M like '2:4' (quoted: YAML reads 2:4 as a number)."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """Module names/patterns left dense (a list or one comma-separated string)."""
    given: dict[str, Any] = field(default_factory=dict, repr=False)
    """The options as the recipe wrote them (not a recipe key)."""
    kind: ClassVar[str] = "prune"

    def check(self) -> None:
        methods.get(self.method, "prune", "method")
        resolve_sparsity(self.sparsity, self.pattern, ("sparsity", "pattern"))


@dataclass
class LowrankStep:
    """`- lowrank: {...}`: the last step."""

    method: str = methods.DEFAULT["lowrank"]
    """svd, svd-llm or asvd."""
    ratio: float = 0.8
    """Fraction of each factorized Linear's parameters kept, in (0, 1]."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """Module names/patterns left dense (a list or one comma-separated string)."""
    given: dict[str, Any] = field(default_factory=dict, repr=False)
    """The options as the recipe wrote them (not a recipe key)."""
    kind: ClassVar[str] = "lowrank"

    def check(self) -> None:
        methods.get(self.method, "lowrank", "method")
        lowrank.check_ratio(self.ratio, "ratio")


@dataclass
class QuantizeStep:
    """`- quantize: {...}`: the last step."""

    bits: int = 4
    """Bits per weight: 2, 3, 4 or 8."""
    method: str | None = None
    """rtn, gptq or awq; default: the best measured at that width (methods.DEFAULT_QUANTIZE)."""
    group_size: int = GROUP_SIZE
    """Input columns per scale (layers it does not divide get the largest divisor)."""
    sym: bool = False
    """Symmetric codes (no zero points)."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """Module names/patterns kept in fp16 (a list or one comma-separated string)."""
    given: dict[str, Any] = field(default_factory=dict, repr=False)
    """The options as the recipe wrote them (not a recipe key; recorded in `memfit_steps`)."""
    kind: ClassVar[str] = "quantize"

    def check(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise UserError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        self.method = self.method or methods.default("quantize", self.bits)
        if self.method not in methods.names("quantize", layerwise=True):
            raise UserError(f"method {self.method!r} is not supported here (one of "
                            f"{', '.join(methods.names('quantize', layerwise=True))})")
        if self.group_size <= 0:
            raise UserError(f"group_size must be positive, got {self.group_size}")


Step = PruneStep | LowrankStep | QuantizeStep
STEPS: dict[str, type[Step]] = {c.kind: c for c in (PruneStep, LowrankStep, QuantizeStep)}


@dataclass
class Recipe:
    """A `compress pipeline` recipe file."""

    steps: list[Step]
    """prune steps, then at most one lowrank or quantize step (the last)."""
    model: str | None = None
    """Input model dir (--model overrides it)."""
    output: str | None = None
    """Output dir (-o overrides it)."""
    calib: list[str] | None = None
    """Calibration text files or dirs; default: the Shakespeare training split."""
    calib_samples: int = CALIB_SAMPLES
    """Calibration windows, for every calibrated step."""
    calib_seqlen: int = CALIB_SEQLEN
    """Tokens per calibration window."""
    seed: int = 0
    """Seeds the calibration windows."""

    def calibration(self, method: methods.Method) -> Calibration | None:
        return method.calibration(self.calib, self.calib_samples, self.calib_seqlen, self.seed)


def _ok(hint: Any, value: Any) -> bool:
    """Whether a YAML value fits a field's type hint (int is no bool; an int is a fine float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_ok(a, value) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_ok(args[0], v) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             list[str]: "a list of strings", type(None): "null"}
    parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return " or ".join(names.get(p, str(p)) for p in parts)


def _build(cls: type, values: dict[str, Any], where: str, exclude: tuple[str, ...] = ("given",)) -> Any:
    """cls(**values), every key known and of its field's type; errors start with `where`."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.name not in exclude]
    bad = sorted(set(values) - set(known))
    if bad:
        raise UserError(f"{where}: unknown options {bad} (known: {', '.join(known)})")
    typed = {}
    for key, value in values.items():
        if key == "skip" and isinstance(value, str):
            value = [s.strip() for s in value.split(",")]
        if not _ok(hints[key], value):
            raise UserError(f"{where}: {key} must be {_type_name(hints[key])}, got {value!r}")
        typed[key] = [s.strip() for s in value if s.strip()] if key == "skip" else value
    return cls(**typed)


def load_recipe(path: str) -> Recipe:
    """Read and validate a recipe file; a UserError naming the step and key for anything wrong."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise UserError(f"--config: cannot read {p} ({e})") from None
    except yaml.YAMLError as e:
        raise UserError(f"--config {p}: not valid YAML ({e})") from None
    where = f"--config {p}"
    if not isinstance(raw, dict) or not isinstance(raw.get("steps"), list) or not raw["steps"]:
        raise UserError(f"{where}: needs a non-empty `steps:` list")
    steps: list[Step] = []
    for i, s in enumerate(raw["steps"]):
        if not isinstance(s, dict) or len(s) != 1 or next(iter(s)) not in STEPS:
            raise UserError(f"{where}: step {i + 1} must be one of {sorted(STEPS)} with its options")
        kind, opts = next(iter(s.items()))
        at = f"{where}: step {i + 1} ({kind})"
        opts = {} if opts is None else opts
        if not isinstance(opts, dict):
            raise UserError(f"{at}: options must be a mapping, got {opts!r}")
        if kind != "prune" and i != len(raw["steps"]) - 1:
            raise UserError(f"{at} must be the last step (only prune steps can be followed by others)")
        step = _build(STEPS[kind], opts, at)
        step.given = dict(opts)
        try:
            step.check()
        except UserError as e:
            raise UserError(f"{at}: {e}") from None
        steps.append(step)
    recipe = _build(Recipe, {**raw, "steps": []}, where, exclude=())
    recipe.steps = steps
    try:
        check_sizes(recipe.calib_samples, recipe.calib_seqlen, ("calib_samples", "calib_seqlen"))
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return recipe


def _method(step: Step, after_prune: bool) -> methods.Method:
    """The registry method a step runs: after a prune step, a method's `after_prune` variant if it has one."""
    m = methods.get(str(step.method), step.kind)  # type: ignore[arg-type]
    return methods.METHODS[m.after_prune] if after_prune and m.after_prune else m


def _run(step: Step, m: methods.Method, cur: str, dest: Path, cal: Calibration | None, last: bool) -> dict:
    """Run one step from cur into dest; returns its `memfit_steps` entry."""
    if isinstance(step, PruneStep):
        s = prune_model(cur, dest, m.name, step.sparsity, step.pattern, cal, step.skip, dense=not last)
        return {"prune": s["record"]}
    if isinstance(step, LowrankStep):
        lowrank_model(cur, dest, m.name, step.ratio, cal, step.skip)
        return {"lowrank": {"method": m.name, "ratio": float(step.ratio)}}
    opt = QuantizeOptions(bits=step.bits, method=m.name, group_size=step.group_size, sym=step.sym,
                          calibration=cal, skip=step.skip)
    s = quantize_model(cur, dest, opt)
    return {"quantize": dict(step.given) | {"fallbacks": s["fallbacks"]}}


def run_recipe(config: str, model: str | None, output: str | None, overwrite: bool) -> int:
    r = load_recipe(config)
    model = model or r.model
    output = output or r.output
    if not model or not output:
        raise UserError("pipeline: give the input and output dirs (recipe `model`/`output` or --model/-o)")
    out = Path(output)
    check_model_dir(model)
    check_output_dir(model, out, overwrite)
    runs = [_method(step, after_prune=i > 0) for i, step in enumerate(r.steps)]
    cals = [r.calibration(m) for m in runs]  # missing calibration text: refused before any step runs
    work = out.parent / f".{out.name}.steps-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    records: list[dict[str, Any]] = []
    try:
        cur = model
        for i, step in enumerate(r.steps):
            dest = work / f"step{i + 1}-{step.kind}"
            print(f"pipeline step {i + 1}/{len(r.steps)}: {step.kind} {step.given}", file=sys.stderr)
            try:
                records.append(_run(step, runs[i], cur, dest, cals[i], last=i == len(r.steps) - 1))
            except UserError as e:
                raise UserError(f"pipeline step {i + 1} ({step.kind}): {e}") from None
            cur = str(dest)
        cfg_path = Path(cur) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["memfit_steps"] = records
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        atomic_dir(out, lambda tmp: shutil.copytree(cur, tmp))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}: {' -> '.join(next(iter(x)) for x in records)}")
    return 0
