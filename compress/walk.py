"""The one layer walk: every method (quantize, prune, low-rank) and every pipeline step runs through it.

A model dir is built on the meta device with its outer modules (embeddings, final norm, lm_head) loaded;
then one decoder layer at a time is materialized (fp32, from the safetensors shards), handed to the method's
layer function (methods.Method.layer) as a LayerJob, stored, and sent back to meta. With calibration, the
inputs of layer 0 (and every layer's other arguments: masks and rotary embeddings can differ per layer) are
captured once and each layer's *compressed* outputs feed the next, so peak memory is about one decoder layer
plus the calibration activations. The output is written to a temp dir and renamed.

Targets are the nn.Linear modules of the decoder layers (any architecture: the layers are the model's
ModuleList of num_hidden_layers modules). transformers' Conv1D (gpt2's c_attn/c_proj/c_fc: a Linear with its
weight stored [in, out]) becomes an nn.Linear (skeleton.conv1d_as_linear), its weight read transposed: every
compress format and the loader's quantized Linears describe nn.Linear weights (out, in).
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from compress.calib import Calibration, calibration_tokens
from compress.layerjob import Batch, LayerJob
from compress.quant import QuantArgs
from compress.skeleton import (
    checkpoint_aliases,
    conv1d_as_linear,
    decoder_layers,
    fix_meta_buffers,
    hf_config,
    materialize,
    meta_model,
)
from compress.store import WeightSource
from memfit.errors import UserError
from memfit.hf import load_tokenizer
from memfit.modeldir import atomic_dir, copy_side_files, read_config

if TYPE_CHECKING:
    from compress.methods import Method

CALIB_BATCH = 8  # calibration sequences per forward pass
Store = Callable[[LayerJob, dict[str, Any]], None]  # (job, the method's results) -> stored form in walk.tensors


def skipped(name: str, patterns: list[str]) -> bool:
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatch(name, p) for p in patterns)


class _Stop(Exception):
    pass


class _Catch(nn.Module):
    """Stands in for a decoder layer while capturing: records its inputs and passes the hidden states on
    unchanged; the last one stops the forward pass. Every layer's own arguments are kept because they can
    differ per layer (Gemma 2/3, Qwen2 with layer_types: a sliding-window or a full mask, local or global
    rotary embeddings); where they are the same (Llama) they are the same tensors, so no memory is added."""

    def __init__(self, store: list[Batch], last: bool) -> None:
        super().__init__()
        self.store = store
        self.last = last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hs = args[0] if args else kwargs.pop("hidden_states")
        self.store.append(((hs, *args[1:]), kwargs))
        if self.last:
            raise _Stop
        return hs


def capture_layers(model: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor,
                   batch: int) -> list[list[Batch]]:
    """The inputs each decoder layer receives for `tokens` (per layer, one entry per batch of sequences); only
    layer 0's include the hidden states (None in the others: the walk feeds each layer its predecessor's)."""
    stores: list[list[Batch]] = [[] for _ in layers]
    real = list(layers)
    for i in range(len(layers)):
        layers[i] = _Catch(stores[i], i == len(real) - 1)
    try:
        with torch.no_grad():
            for i in range(0, tokens.shape[0], batch):
                try:
                    model(input_ids=tokens[i : i + batch], use_cache=False)
                except _Stop:
                    pass
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
    if any(len(s) != len(stores[0]) for s in stores):
        raise UserError(f"{type(model).__name__}: not every decoder layer was called during calibration")
    for s in stores[1:]:  # their hidden states come from the previous layer in the walk: drop the references
        s[:] = [((None, *a[1:]), kw) for a, kw in s]
    return stores


def capture_inputs(model: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor, batch: int) -> list[Batch]:
    """The inputs decoder layer 0 receives for `tokens`, one entry per batch of sequences."""
    return capture_layers(model, layers, tokens, batch)[0]


class LayerWalk:
    """A dense model dir on the meta device, its outer modules loaded; `run` walks the decoder layers.

    Targets: the decoder-layer Linears not matched by `skip`; with outer=True also the Linears outside the
    layers (lm_head), which the caller compresses itself after the walk (`outer`). A store function puts each
    layer's compressed form into `tensors` and names the parameters it handled in `handled`; every other
    parameter is stored as fp16.
    """

    def __init__(self, model_dir: str, skip: list[str], trust_remote_code: bool = False, outer: bool = False) -> None:
        self.model_dir = model_dir
        self.trust_remote_code = trust_remote_code
        self.src = WeightSource(model_dir)
        self.raw_cfg = read_config(Path(model_dir))
        if self.raw_cfg.get("quantization_config"):
            qc = self.raw_cfg["quantization_config"]
            raise UserError(f"{model_dir} is already compressed ({qc.get('quant_method')}): start from a dense model")
        self.config = hf_config(model_dir, trust_remote_code)
        self.model = meta_model(self.config, trust_remote_code)
        self.layers_name, self.layers = decoder_layers(self.model, self.config)
        self.inner = self.layers_name + "."
        self.transposed = conv1d_as_linear(self.model, self.config)  # gpt2: Conv1D weights as Linears
        self.linears = {n: m for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        wanted = {n: m for n, m in self.linears.items() if not skipped(n, skip)}
        self.targets = {n: m for n, m in wanted.items() if n.startswith(self.inner)}
        self.outer = {n: m for n, m in wanted.items() if outer and not n.startswith(self.inner)}
        self.skipped = sorted(n for n in self.linears if n not in self.targets and n not in self.outer)
        if not self.targets and not self.outer:
            what = "Linear" if outer else "decoder-layer Linear"
            raise UserError(f"nothing to compress: every {what} is in --skip")
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        emb_mod = self.model.get_input_embeddings()
        emb = next((f"{n}.weight" for n, m in self.model.named_modules() if m is emb_mod), None)
        self.alias = checkpoint_aliases(self.model, self.src)  # model name -> checkpoint key, where renamed
        for name, _p in [(n, p) for n, p in self.model.named_parameters() if not n.startswith(self.inner)]:
            key = name if name in self.src else self.alias.get(name, name)
            if key not in self.src and self.tied and name.startswith("lm_head") and emb is not None:
                key = emb if emb in self.src else self.alias.get(emb, emb)
            set_module_tensor_to_device(self.model, name, "cpu", value=self.src.get(key).float())
        if self.tied:
            self.model.tie_weights()
        fix_meta_buffers(self.model, self.config)
        self.inputs: list[list[Batch]] = []  # per decoder layer: its calibration inputs
        self.tensors: dict[str, torch.Tensor] = {}
        self.handled: set[str] = set()

    def calibrate(self, method: Method, calibration: Calibration | None) -> None:
        """Capture the layers' inputs when `method` needs calibration (tokenizer loaded only then)."""
        if not method.calibrated:
            return
        if calibration is None or not calibration.files:
            raise UserError(f"method {method.name} needs calibration text (--calib FILES)")
        tokenizer = load_tokenizer(self.model_dir, self.trust_remote_code)
        c = calibration
        tokens = calibration_tokens(tokenizer, list(c.files), c.samples, c.seqlen, c.seed)
        if int(tokens.max()) >= self.config.vocab_size:
            raise UserError(f"calibration tokens exceed the model's vocab_size {self.config.vocab_size}: "
                            "wrong tokenizer?")
        self.inputs = capture_layers(self.model, self.layers, tokens, CALIB_BATCH)

    def run(self, method: Method, store: Store, options: dict[str, Any] | None = None,
            args: dict[str, QuantArgs] | None = None, desc: str = "", progress: bool = True) -> None:
        """Each decoder layer in turn: materialize, method.layer(job), store(job, results), fp16 for the rest,
        feed the compressed outputs on. args: QuantArgs per full module name (quantize methods)."""
        if method.layer is None:
            raise UserError(f"method {method.name} does not run layer by layer")
        for i in tqdm(range(len(self.layers)), desc=desc or method.name, unit="layer", disable=not progress):
            prefix = f"{self.inner}{i}."
            layer = self.layers[i]
            materialize(layer, prefix, self.src, alias=self.alias, transposed=self.transposed)
            lin = {n: m for n, m in layer.named_modules() if prefix + n in self.targets}
            job = LayerJob(layer, prefix, lin, {n: args[prefix + n] for n in lin} if args else {}, self.config,
                           self.inputs[i] if self.inputs else [], dict(options or {}))
            store(job, method.layer(job))
            for pname, p in layer.named_parameters():
                if prefix + pname not in self.handled:
                    t = p.detach().to(torch.float16)  # a Conv1D left dense goes back to its [in, out] layout
                    self.tensors[prefix + pname] = (t.t() if prefix + pname in self.transposed else t).contiguous()
            if self.inputs and i < len(self.layers) - 1:
                outs = job.run()
                self.inputs[i] = []
                nxt = self.inputs[i + 1]
                self.inputs[i + 1] = [((o, *a[1:]), kw) for o, (a, kw) in zip(outs, nxt, strict=True)]
            self.layers[i] = layer.to("meta")
        self.inputs = []

    def write(self, out: Path, qc: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> None:
        """Outer parameters as fp16 (unless handled), config.json (extra keys, then qc), side files; atomic."""
        for name, p in self.model.named_parameters():
            if not name.startswith(self.inner) and name not in self.handled:
                self.tensors[name] = p.detach().to(torch.float16).contiguous()
        cfg = dict(self.raw_cfg)
        cfg.pop("torch_dtype", None)
        cfg["dtype"] = "float16"
        cfg.update(extra or {})
        if qc:
            cfg["quantization_config"] = qc
        if self.transposed:  # gpt2
            if qc:
                qc.setdefault("memfit", {})["conv1d_as_linear"] = True
            print("note: the model's Conv1D layers are stored as Linear weights [out, in]: load the output with "
                  "memfit (compress.load, serve); transformers' own loader would leave them uninitialized",
                  file=sys.stderr)

        def write(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            save_file(self.tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            copy_side_files(Path(self.model_dir), tmp)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

        atomic_dir(out, write)
