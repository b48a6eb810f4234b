"""Where each module of a model runs: device maps over GPUs, CPU RAM and disk, with the KV cache counted.

accelerate does the placement (``infer_auto_device_map`` with the model's ``_no_split_modules``) and the
offload (transformers' ``from_pretrained(device_map=...)`` reads disk-offloaded tensors straight from the
checkpoint's memory-mapped safetensors). What we add: the KV cache of ``--max-batch x --max-seq-len`` is
reserved on each layer's execution device before accelerate places the weights (accelerate knows only
parameters), a clear error when not even one layer fits, and a dry-run ``plan`` on the meta device.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.errors import UserError
from serve.kv_config import format_bytes as _size

KEYWORDS = ("auto", "balanced", "balanced_low_0", "sequential", "cpu")
_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def parse_max_memory(text: str | None) -> dict[int | str, int] | None:
    """``cuda:0=20GiB,cpu=48GiB,disk=200GiB`` (also ``0=20GiB``; bare numbers are bytes) -> accelerate's dict."""
    if not text:
        return None
    from accelerate.utils import convert_file_size_to_int

    out: dict[int | str, int] = {}
    for part in text.split(","):
        if "=" not in part:
            raise UserError(f"--max-memory: {part!r} is not DEVICE=SIZE (e.g. cuda:0=20GiB,cpu=48GiB)")
        dev, size = (s.strip() for s in part.split("=", 1))
        m = re.fullmatch(r"(?:cuda:)?(\d+)", dev)
        key: int | str = int(m.group(1)) if m else dev
        if not m and dev not in ("cpu", "disk", "mps"):
            raise UserError(f"--max-memory: unknown device {dev!r} (cuda:N, N, cpu, mps or disk)")
        if isinstance(key, int) and key >= torch.cuda.device_count():
            raise UserError(f"--max-memory names cuda:{key} but {torch.cuda.device_count()} CUDA device(s) are visible")
        try:
            n = int(size) if size.isdigit() else convert_file_size_to_int(size)
        except ValueError:
            n = -1
        if n <= 0:
            raise UserError(f"--max-memory: {dev}={size!r} is not a size (e.g. 20GiB, 512MB, 1000000)")
        out[key] = n
    return out


def read_device_map_file(path: str) -> dict[str, int | str]:
    try:
        dm = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--device-map: cannot read {path} as JSON ({e})") from None
    if not isinstance(dm, dict) or not dm:
        raise UserError(f"--device-map: {path} must hold a JSON object {{module name: device}}")
    for k, v in dm.items():
        ok = v in ("cpu", "disk") or (isinstance(v, int) and v >= 0) or \
            (isinstance(v, str) and re.fullmatch(r"cuda:\d+", v) is not None)
        if not ok:
            raise UserError(f"--device-map: {path}: module {k!r} has device {v!r} (cpu, disk, N or cuda:N)")
    return {k: (int(v[5:]) if isinstance(v, str) and v.startswith("cuda:") else v) for k, v in dm.items()}


@dataclass
class ModulePlan:
    name: str
    device: int | str  # where the weights live: GPU index, "cpu" or "disk"
    param_bytes: int
    kv_bytes: int = 0  # KV cache of this decoder layer (on its execution device)


@dataclass
class Plan:
    device_map: dict[str, int | str]
    modules: list[ModulePlan]
    main_device: int | str  # where offloaded (cpu on a GPU box, or disk) layers execute
    resident: dict[str, int] = field(default_factory=dict)  # predicted bytes that stay on each device
    max_memory: dict[int | str, int] | None = None
    working: dict[str, int] = field(default_factory=dict)  # offloaded modules materialized while a step runs

    def summary(self) -> dict:
        """Compact, JSON-ready: devices -> module count and bytes (shown by /health and /v1/models)."""
        counts: dict[str, int] = {}
        for m in self.modules:
            counts[_dev_name(m.device)] = counts.get(_dev_name(m.device), 0) + 1
        return {"modules_per_device": counts, "resident_bytes": self.resident, "working_bytes": self.working,
                "device_map": {k: _dev_name(v) for k, v in self.device_map.items()}}


def _dev_name(d: int | str) -> str:
    return f"cuda:{d}" if isinstance(d, int) else str(d)


def meta_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model built from its config on the meta device: shapes, no weights, nothing read but config.json."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--model: cannot build {path} from its config.json ({e})") from None
    model.tie_weights()
    return model


def kv_bytes_per_layer(config, max_batch: int, max_seq_len: int, dtype: torch.dtype, tp: int = 1) -> int:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * max_batch * (kv // tp) * max_seq_len * head_dim * _DTYPE_BYTES.get(dtype, 4)


def _layer_names(model: torch.nn.Module) -> list[str]:
    n = model.config.num_hidden_layers
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
            return [f"{name}.{i}" for i in range(n)]
    raise UserError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def _owner(device_map: dict[str, int | str], name: str) -> int | str:
    """The device of module ``name`` under device_map (the longest key that is a prefix of it)."""
    best, dev = -1, None
    for k, v in device_map.items():
        if (k == "" or name == k or name.startswith(k + ".")) and len(k) > best:
            best, dev = len(k), v
    if dev is None:
        raise UserError(f"--device-map does not place module {name!r}")
    return dev


def _expand(model: torch.nn.Module, dm: dict[str, int | str], layers: list[str]) -> dict[str, int | str]:
    """Split keys that hold decoder layers (``""``, ``model``, ``model.layers``) into their children, so every
    layer has its own entry (accelerate's dispatch cannot offload a ``""`` key to disk, and the plan shows
    each layer)."""
    out: dict[str, int | str] = {}
    for k, d in dm.items():
        if any(n.startswith(k + ".") or not k for n in layers):
            mod = model.get_submodule(k) if k else model
            kids = {(f"{k}.{c}" if k else c): d for c, _ in mod.named_children()}
            direct = [n for n, _ in mod.named_parameters(recurse=False)] + \
                [n for n, _ in mod.named_buffers(recurse=False)]
            if direct:  # tensors held by the parent itself: keep the parent key for them
                return dm
            out.update(_expand(model, kids, layers))
        else:
            out[k] = d
    return out


def compute_plan(model: torch.nn.Module, device_map: str | dict, max_memory: dict | None, max_batch: int,
                 max_seq_len: int, dtype: torch.dtype, tp: int = 1, prefetch: bool = False) -> Plan:
    """Place ``model`` (meta or real) with accelerate, reserving each layer's KV cache on its execution device
    (and, with prefetch, room for one more offloaded layer: accelerate itself reserves the one it loads)."""
    from accelerate.utils import compute_module_sizes, get_balanced_memory, get_max_memory, infer_auto_device_map

    layers = _layer_names(model)
    kv = kv_bytes_per_layer(model.config, max_batch, max_seq_len, dtype, tp)
    sizes = compute_module_sizes(model, dtype=dtype)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    gpus = torch.cuda.device_count()
    main: int | str = 0 if gpus else "cpu"

    def executes_on(d):
        """Where a module placed on ``d`` runs: offloaded (cpu / disk) ones on the main GPU, disk on the CPU."""
        return main if d in ("cpu", "disk") and gpus else ("cpu" if d == "disk" else d)

    if isinstance(device_map, dict):
        dm = dict(device_map)
        budget = max_memory
    elif device_map == "cpu":
        dm, budget = {"": "cpu"}, max_memory
    else:
        budget = dict(max_memory) if max_memory else get_max_memory()
        budget = {k: v for k, v in budget.items() if k != "mps"}
        if gpus == 0 and any(isinstance(k, int) for k in budget):
            raise UserError("--max-memory names a CUDA device but none is visible")
        need_one = max(sizes[n] for n in layers) + kv * len(layers)
        if budget.get(main, 0) < need_one:
            raise UserError(f"--max-memory {_dev_name(main)}={_size(budget.get(main, 0))} is too small: running needs "
                            f"at least one decoder layer ({_size(max(sizes[n] for n in layers))}) plus the KV cache "
                            f"({_size(kv * len(layers))} for --max-batch {max_batch} x --max-seq-len {max_seq_len}) "
                            f"on {_dev_name(main)}")
        reserve: dict[int | str, int] = {}
        dm = {}
        for _ in range(6):  # reserve KV where the layers execute, re-place, until the reservation holds
            mm = {k: max(0, v - reserve.get(k, 0)) for k, v in budget.items()}
            if device_map in ("auto", "balanced", "balanced_low_0") and gpus > 1:
                mm = get_balanced_memory(model, max_memory=mm, no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=device_map == "balanced_low_0")
            dm = infer_auto_device_map(model, max_memory=mm, no_split_module_classes=no_split, dtype=dtype)
            need: dict[int | str, int] = {}
            if prefetch and any(_owner(dm, n) != main for n in layers):
                need[main] = max(sizes[n] for n in layers)
            for n in layers:
                d = _owner(dm, n)
                ex = executes_on(d)
                need[ex] = need.get(ex, 0) + kv
            if all(need.get(k, 0) <= reserve.get(k, 0) for k in need):
                break
            reserve = {k: max(need.get(k, 0), reserve.get(k, 0)) for k in set(need) | set(reserve)}
    if not (list(dm) == [""] and dm[""] != "disk"):
        dm = _expand(model, dm, layers)
    mods: list[ModulePlan] = []
    resident: dict[str, int] = {}
    other = 0  # the largest offloaded module outside the layers (Gemma 3's tied vocabulary: 640 MiB in fp32)
    for k, d in dm.items():
        size = sizes.get(k, 0) if k else sizes[""]
        if d != "disk":
            resident[_dev_name(d)] = resident.get(_dev_name(d), 0) + size
        if not k:
            mods.append(ModulePlan("(all but the decoder layers)", d, size - sum(sizes[n] for n in layers)))
        elif not any(n == k or n.startswith(k + ".") for n in layers):  # not a layer or their parent
            mods.append(ModulePlan(k, d, size))
            if _dev_name(d) != _dev_name(executes_on(d)):
                other = max(other, size)
    offloaded = 0
    for n in layers:
        d = _owner(dm, n)
        ex = executes_on(d)
        resident[_dev_name(ex)] = resident.get(_dev_name(ex), 0) + kv
        mods.append(ModulePlan(n, d, sizes[n], kv))
        if _dev_name(d) != _dev_name(ex):
            offloaded = max(offloaded, sizes[n])
    # while running, offloaded modules are materialized on the main device: one layer (accelerate), two with
    # prefetch, or an offloaded embedding / lm_head, whichever is larger
    need = max(offloaded * (2 if prefetch else 1), other)
    working = {_dev_name(main): need} if need else {}
    return Plan(dm, mods, main, resident, budget, working)


def format_plan(plan: Plan) -> str:
    rows = [f"{'module':<32} {'device':>8} {'params MiB':>11} {'KV MiB':>8}"]
    for m in plan.modules:
        rows.append(f"{m.name:<32} {_dev_name(m.device):>8} {m.param_bytes / 2**20:>11.2f} {m.kv_bytes / 2**20:>8.2f}")
    rows.append("resident per device (parameters kept there + KV cache of the layers executing there):")
    for d, b in plan.resident.items():
        cap = (plan.max_memory or {}).get(int(d[5:]) if d.startswith("cuda:") else d)
        rows.append(f"  {d:<8} {b / 2**20:>10.2f} MiB" + (f"  (budget {cap / 2**20:.2f} MiB)" if cap else ""))
    for d, b in plan.working.items():
        rows.append(f"  {d:<8} +{b / 2**20:>9.2f} MiB while a step runs (offloaded weights loaded: the current "
                    f"layer and, prefetching, the next; or an offloaded embedding / lm_head, if larger)")
    disk = sum(m.param_bytes for m in plan.modules if m.device == "disk")
    if disk:
        rows.append(f"  disk     {disk / 2**20:>10.2f} MiB  (read from the checkpoint's safetensors every step)")
    return "\n".join(rows)


@dataclass
class Placement:
    """What ``serve --device-map/--max-memory/--offload-folder`` asked for."""

    device_map: str | dict = "auto"  # a KEYWORDS entry or {module name: device}
    max_memory: dict | None = None  # accelerate's {0: bytes, "cpu": bytes}; None = what the machine has free
    offload_folder: str | None = None  # None: a temp dir, used only if something must be written
    prefetch: bool = False  # load the next offloaded layer while the current one runs (memfit.runtime.offload)


def _temp_folder() -> str:
    """A private offload dir, removed when the process exits (it only ever holds copies of weights)."""
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="memfit-offload-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def load_placed(path: str, dtype: torch.dtype, device_map: str | dict, max_memory: dict | None,
                offload_folder: str | None, max_batch: int, max_seq_len: int, compressed: bool,
                prefetch: bool = False) -> tuple[torch.nn.Module, Plan]:
    """Load ``path`` placed by ``device_map`` (a keyword or a dict); returns the model and the plan it followed."""
    from memfit.hf import load_pretrained

    if compressed:
        # compress outputs hold packed integer modules that only compress.load can build, so they are loaded
        # into CPU RAM first (they are small: that is their point), then placed by accelerate's dispatch_model
        from accelerate import dispatch_model

        import compress

        model = compress.load(path, device="cpu")
        plan = compute_plan(model, device_map, max_memory, max_batch, max_seq_len, dtype, prefetch=prefetch)
        devices = set(plan.device_map.values())
        gpus = sorted((d for d in devices if d not in ("cpu", "disk")), key=str)
        if gpus:
            # 4-bit layers are packed for the device's kernel at load (CPU and CUDA int4 packs differ), so a
            # compress output goes onto GPUs only: loaded on the first one, then spread over the others
            if devices - set(gpus):
                raise UserError("a compress output can be placed on GPUs or on CPU/disk, not split between them "
                                f"(plan: {sorted(map(_dev_name, devices))}); give the GPUs room for all of it "
                                "(--max-memory) or use --device-map cpu")
            first = gpus[0] if isinstance(gpus[0], str) else f"cuda:{gpus[0]}"
            model = compress.load(path, device=first)
            if len(gpus) > 1:
                model = dispatch_model(model, plan.device_map, main_device=plan.main_device)
            return model, plan
        if devices != {"cpu"}:
            folder = offload_folder or _temp_folder()
            model = dispatch_model(model, plan.device_map, main_device=plan.main_device, offload_dir=folder,
                                   offload_buffers=True)
        return model, plan
    plan = compute_plan(meta_model(path, dtype), device_map, max_memory, max_batch, max_seq_len, dtype,
                        prefetch=prefetch)
    kwargs: dict = {"dtype": dtype, "device_map": plan.device_map}
    if "disk" in plan.device_map.values():
        # transformers reads disk-offloaded tensors straight from the checkpoint's safetensors (nothing is
        # copied); the folder is only written for tensors it must convert
        kwargs["offload_folder"] = offload_folder or _temp_folder()
    return load_pretrained(path, **kwargs), plan


def measured_resident(model: torch.nn.Module, cache_bytes: dict[str, int]) -> dict[str, int]:
    """Bytes of the tensors actually materialized per device after loading (offloaded ones stay on meta)
    plus the KV cache: what ``plan`` predicts as resident."""
    seen: set[int] = set()
    out = dict(cache_bytes)
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta or id(t) in seen:
            continue
        seen.add(id(t))
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return out

DTYPES_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
