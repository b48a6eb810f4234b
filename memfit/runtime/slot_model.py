"""A packed forward pass over a Hugging Face decoder's modules (Llama family, Qwen, Gemma 3, Phi-3; GPT-2 and
GPT-NeoX renamed to Llama's layout by archs.py) on a paged KV cache.

One call runs any mix of decode tokens and prefill chunks of different sequences, packed into one [T, hidden]
matrix so every Linear runs once per layer. Each layer's cache is [num_blocks, kv_heads, block_size, head_dim];
``block_tables[group, slot]`` lists the blocks of the sequence in that slot for the layers of one KV group (serve's
scheduler fills it; kv_cache.py); without ``block_size`` a slot owns one block of ``max_seq_len`` positions (the
static cache). Only the HF *modules* are called, so compress's quantized Linears work unchanged; RoPE is the
model's own rotary_emb (rope.py), attention attention.py. Where every layer runs on memfit's CPU kernels the
layers are one C++ call (fast_stack); this Python loop is its reference and runs everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memfit.errors import UserError
from memfit.runtime import archs, kernels
from memfit.runtime.archs import UnsupportedModel
from memfit.runtime.attention import StepLayout, attend, quantize_rows, smooth_key_norms
from memfit.runtime.dense import pack_linears
from memfit.runtime.embeddings import pack_tied_vocab
from memfit.runtime.fast_stack import build
from memfit.runtime.fuse import fuse
from memfit.runtime.int4 import int4_on_kernels
from memfit.runtime.kv_cache import assign_blocks, bytes_per_device, make_kv_cache
from memfit.runtime.kv_groups import layer_windows
from memfit.runtime.linear import activation
from memfit.runtime.modules import (
    exec_device,
    float_rest,
    plain_forward,
    rms_norm_weight,
    split_fused_projections,
    tp_shards,
)
from memfit.runtime.offload import LayerPrefetcher
from memfit.runtime.rope import Rope

SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"} | archs.ADAPTED_TYPES


@dataclass
class Segment:
    """``length`` tokens of one sequence in slot ``slot`` starting at absolute position ``start``."""

    slot: int
    start: int
    length: int
    want_logits: bool = True  # logits of the segment's last token are returned


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_NO_ROWS = torch.empty(0, dtype=torch.long)  # `keep` meaning every row (SlotModel._forward)


class SlotModel:
    """Wraps an HF ``*ForCausalLM`` (``SUPPORTED_TYPES``) with a static slot KV cache."""

    def __init__(self, hf_model: torch.nn.Module, max_batch: int, max_seq_len: int,
                 cache_dtype: torch.dtype | None = None, prefetch: bool = False, dense_kernel: str = "off",
                 cpu_kernels: str = "off", bf16_weights: bool = False, num_blocks: int | None = None,
                 block_size: int | None = None):
        """``bf16_weights``: the Linears' weights (lm_head included) in bf16 on memfit's panel kernel, from an fp32
        or a bf16 model; activations, norms and the KV cache stay fp32 (dense.PanelLinear says why).
        ``block_size`` and ``num_blocks``: a paged KV cache of that many blocks of that many positions (both or
        neither; neither: the static slot cache)."""
        cfg = hf_model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_TYPES:
            raise UnsupportedModel(f"model: architecture {model_type!r} is not supported by the serve engine "
                                   f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})")
        if getattr(cfg, "attn_logit_softcapping", None):
            raise UnsupportedModel(f"model: {model_type} with attention logit soft-capping is not supported by the "
                                   "packed engine")
        archs.check(hf_model)  # GPT-2 / GPT-NeoX: refused (to the generic engine) before anything changes
        archs.adapt(hf_model)  # ... then given Llama's names and layouts
        self.hf = hf_model.eval()
        self.inner = hf_model.model
        self.layers = list(self.inner.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.split_mlp = model_type == "phi3"
        if self.split_mlp:  # fused qkv_proj / gate_up_proj: split into Llama's projections (views)
            fused = getattr(self.layers[0].self_attn, "qkv_proj", None)
            if fused is not None and tp_shards(fused) != 1:
                raise UnsupportedModel("model: phi3 with a tensor-parallel fused qkv_proj is not supported by the "
                                       "packed engine")
            # quantized (a compress output) or biased fused projections are not split: they run as they are
            split_fused_projections(self.layers, self.num_heads * self.head_dim, self.num_kv * self.head_dim)
            archs.permute_partial_rope(hf_model, self.layers, self.num_heads, self.num_kv, self.head_dim)
            for ly in self.layers:  # split or not, the MLP's activation under Llama's name
                ly.mlp.act_fn = ly.mlp.activation_fn
        # tensor parallel (transformers tp_plan): q/k/v are column-sharded, so each rank holds a slice of heads
        tp = tp_shards(getattr(self.layers[0].self_attn, "q_proj", None) or self.layers[0].self_attn.qkv_proj)
        if self.num_heads % tp or self.num_kv % tp:
            raise UserError(f"--tp {tp} must divide the attention heads ({self.num_heads}) and KV heads "
                            f"({self.num_kv})")
        self.num_heads //= tp
        self.num_kv //= tp
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.vocab_size = cfg.vocab_size
        # fused CPU kernels (memfit.runtime.kernels): fp32 and int4 Linears, norms, RoPE + KV write, decode attention;
        # None where not built (torch ops then)
        self.ops = kernels.load(cpu_kernels)
        bf16 = bf16_weights and self.ops is not None and dense_kernel != "off"
        if bf16_weights and not bf16:
            raise UserError("bf16 weights run on memfit's CPU kernels: drop --cpu-kernels off / --dense-kernel off, "
                            "or use --dtype fp32")
        # fp32 CPU Linears on packed weights (memfit.runtime.dense; replaces modules of the HF model)
        # a tied lm_head on the panel kernel too, the embedding's rows read from its packed table (embeddings.py);
        # first, so that pack_linears does not pack int8 rows' head alone
        self.tied_vocab_packed = dense_kernel != "off" and pack_tied_vocab(hf_model, self.ops, bf16)
        self.dense_packed = pack_linears(hf_model, dense_kernel, self.ops, bf16)
        if bf16:
            float_rest(hf_model)
        self.dtype = torch.float32 if bf16 else self._param_dtype()
        cdt = cache_dtype or self.dtype
        # each layer's KV cache lives where that layer executes (device maps split layers over devices)
        self.layer_devices = [exec_device(layer) for layer in self.layers]
        self.embed_device = exec_device(hf_model.get_input_embeddings())
        self.wpe = archs.position_embedding(hf_model)  # GPT-2's learned positions, added to the embedding
        if (block_size is None) != (num_blocks is None):
            raise UserError("a paged KV cache needs both num_blocks and block_size")
        self.paged = block_size is not None
        self.block_size = int(block_size) if self.paged else max_seq_len
        self.num_blocks = int(num_blocks) if self.paged else max_batch
        if self.block_size < 1 or self.num_blocks < 1:
            raise UserError(f"KV cache: block_size ({self.block_size}) and num_blocks ({self.num_blocks}) must be >= 1")
        self.max_blocks_per_seq = -(-max_seq_len // self.block_size)
        self.windows = layer_windows(cfg, max_seq_len)
        # a paged cache on one device groups the layers by window (kv_groups.py): sliding groups drop the blocks
        # behind their window; otherwise one group of every layer
        kv = make_kv_cache(self.layer_devices, self.windows, self.paged, self.num_blocks, self.block_size, max_batch,
                           max_seq_len, self.num_kv, self.head_dim, cdt)
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = kv.k, kv.v, kv.k_scale, kv.v_scale
        self.kv_groups, self.layer_group, self.block_tables = kv.groups, kv.layer_group, kv.tables
        self.block_table = self.block_tables[0]  # the static cache's (and a one-group cache's) table
        self.kv_int8 = cdt == torch.int8  # int8 KV: attention.quantize_rows says how
        self.scale = getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5)

        # q/k/v and gate/up as one call each; a checkpoint's own fused projection (Phi-3's, where it was not split:
        # split_fused_projections) is used as it is, its outputs already [q; k; v] / [gate; up]
        self.qkv = [getattr(ly.self_attn, "qkv_proj", None) or
                    fuse([ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj], self.ops)
                    for ly in self.layers]
        self.gate_up = [getattr(ly.mlp, "gate_up_proj", None) or (fuse([ly.mlp.gate_proj, ly.mlp.up_proj], self.ops)
                        if all(hasattr(ly.mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) else None)
                        for ly in self.layers]
        self.int4_kernel = int4_on_kernels(hf_model, self.ops)  # the other int4 projections (memfit.runtime.int4)
        # ... a checkpoint's own fused ones (GPT-2's c_attn, Phi-3's) among them: read again
        self.qkv = [getattr(ly.self_attn, "qkv_proj", None) or q for ly, q in zip(self.layers, self.qkv, strict=True)]
        self.gate_up = [getattr(ly.mlp, "gate_up_proj", None) or g
                        for ly, g in zip(self.layers, self.gate_up, strict=True)]
        # after packing and int4_on_kernels, which may replace it (GPT-NeoX's is embed_out)
        self.lm_head = hf_model.get_output_embeddings()
        # embedding and lm_head, once a step: their forward straight, without nn.Module.__call__'s hook bookkeeping
        self._embed = plain_forward(hf_model.get_input_embeddings())
        self._lm_head = plain_forward(self.lm_head)
        self.bf16_dot = bf16  # bf16 mode: int4 prefill rows on vdpbf16ps too (x and dequantized weights in bf16)
        for m in [*hf_model.modules(), *self.qkv, *self.gate_up]:
            if hasattr(m, "bf16_dot"):
                m.bf16_dot = bf16
        # per layer: the MLP's activation where its gate/up projection computes act(gate) * up in its epilogue
        # (linear.ACTS: SiLU, GELU-tanh), else None
        self.act_pairs = [activation(ly.mlp.act_fn) if getattr(g, "pairs", False) else None
                          for g, ly in zip(self.gate_up, self.layers, strict=True)]
        self.prefetch = LayerPrefetcher(self.layers, enabled=prefetch)
        self.rope = Rope(self.inner.rotary_emb, list(getattr(cfg, "layer_types", None) or [None] * len(self.layers)),
                         max_seq_len, self.head_dim)
        # every RMSNorm as (weight, eps) for one fused op (Gemma's (1 + w) folded in); other norms run as modules
        self._norms = {id(m): spec for m in hf_model.modules() if (spec := rms_norm_weight(m)) is not None}
        if self.kv_int8:  # int8 keys: outlier channels moved into the queries (attention.smooth_key_norms)
            smooth_key_norms(self._norms, self.layers, self.head_dim)
        # Gemma 2/3: norms after attention and after the MLP too (post_attention_layernorm then is not the MLP's)
        self.sandwich = [hasattr(ly, "pre_feedforward_layernorm") for ly in self.layers]
        # GPT-NeoX: attention and MLP both read the layer's input, h + attn(ln1(h)) + mlp(ln2(h))
        self.parallel = [bool(getattr(ly, "use_parallel_residual", False)) for ly in self.layers]
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.stack = build(self)  # the layers as one C++ call where all of them allow it, else None

    def _rms_norm(self, norm: torch.nn.Module, x: torch.Tensor, ops=None) -> torch.Tensor:
        """An RMSNorm as one fused op: memfit's kernel on CPU, else torch's (equal in fp32 to the module's six-op
        form, half its CPU time at decode sizes); other dtypes and norm types run the module."""
        spec = self._norms.get(id(norm))
        if spec is None or x.dtype != torch.float32:
            return norm(x)
        w, eps = spec
        if ops is not None and x.device.type == "cpu" and w.device.type == "cpu":
            return ops.rms_norm(x, w, eps)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def _param_dtype(self) -> torch.dtype:
        emb = self.hf.get_input_embeddings()
        w = getattr(emb, "weight", None)
        if w is not None and w.dtype.is_floating_point:
            return w.dtype
        for p in self.hf.parameters():
            if p.dtype.is_floating_point:
                return p.dtype
        return torch.float32

    @property
    def cache_bytes(self) -> int:
        return sum(self.cache_bytes_per_device().values())

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes (int8's scales too) of one block in one KV group's layers (all of them, unless sliding)."""
        return sum(self.cache_bytes_per_device().values()) // self.num_blocks

    def cache_bytes_per_device(self) -> dict[str, int]:
        return bytes_per_device(self.k_cache, self.k_scale)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Run ``input_ids`` (1-D, the segments' tokens concatenated in order) and return the logits
        (float32 on CPU, ``[num segments with want_logits, vocab]``) of each wanting segment's last token."""
        try:
            return self._forward(input_ids, segments)
        except BaseException:
            self.prefetch.reset()
            raise

    def _forward(self, input_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        T = int(input_ids.shape[0])
        assert T == sum(s.length for s in segments)
        # the step's index tensors, each built from a Python list in one call: a tensor op per segment
        # (arange/full, then cat) cost more than the decode step's other bookkeeping together
        pos_list: list[int] = []
        slot_list: list[int] = []
        for s in segments:
            pos_list.extend(range(s.start, s.start + s.length))
            slot_list.extend([s.slot] * s.length)
        if max(pos_list) >= self.max_seq_len:
            raise ValueError("position beyond max_seq_len")

        # Decodes (length-1 segments) are attended as one padded batch; prefill chunks one by one.
        offsets, o = [], 0
        for s in segments:
            offsets.append(o)
            o += s.length
        dec_idx = [i for i, s in enumerate(segments) if s.length == 1]
        dec_slot_list = [segments[i].slot for i in dec_idx]
        dec_len_list = [segments[i].start + 1 for i in dec_idx]
        # the five index vectors as views of one tensor: one list-to-tensor conversion a step instead of five
        nd = len(dec_idx)
        flat = torch.tensor(pos_list + slot_list + [offsets[i] for i in dec_idx] + dec_slot_list + dec_len_list,
                            dtype=torch.long)
        positions, slots = flat[:T], flat[T:2 * T]
        dec_tok, dec_slots, dec_len = flat[2 * T:2 * T + nd], flat[2 * T + nd:2 * T + 2 * nd], flat[2 * T + 2 * nd:]
        dec_max = max(dec_len_list) if dec_idx else 0
        h = self._embed(input_ids[None].to(self.embed_device))  # [1, T, hidden]
        if self.wpe is not None:
            h = h + self.wpe(positions.to(h.device))[None]
        if h.dtype != self.dtype:  # a bf16 embedding under bf16 weights: activations are fp32
            h = h.to(self.dtype)
        ropes = {kind: self.rope(h, positions, kind) for kind in self.rope.kinds}
        dec_mask = None  # no mask needed when every decode attends to the same number of positions
        if dec_idx and min(dec_len_list) != dec_max and self.stack is None:
            dec_mask = (torch.arange(dec_max)[None, :] < dec_len[:, None])[:, None, None, :]
        all_dec = len(dec_idx) == len(segments)  # pure decode step: token order == decode order
        contiguous = bool(dec_idx) and dec_slot_list == list(range(dec_slot_list[0], dec_slot_list[0] + len(dec_idx)))
        pre = [(i, s) for i, s in enumerate(segments) if s.length > 1]
        lay = StepLayout(offsets, pre, dec_idx, dec_slot_list, dec_len_list, all_dec, contiguous, dec_max,
                         self.paged)
        index = {"positions": positions, "slots": slots, "dec_tok": dec_tok, "dec_slots": dec_slots,
                 "dec_len": dec_len, "dec_mask": dec_mask, "tables": self.block_tables}
        for kind, (cos, sin) in ropes.items():
            index[f"cos:{kind}"], index[f"sin:{kind}"] = cos, sin
        # The rows whose logits the step returns: the last layer runs its o_proj and MLP on these rows only
        # (every token's K/V is cached by then). A prefill chunk saves ~8% of its FLOPs (10 layers here).
        # With no logits wanted (a prompt's earlier chunk) one row goes on, to keep the kernels' shapes non-empty.
        want = [offsets[i] + s.length - 1 for i, s in enumerate(segments) if s.want_logits]
        keep = want if want else [T - 1]
        keep_t = _NO_ROWS if len(keep) == T else torch.tensor(keep, dtype=torch.long)  # empty: every row
        if self.stack is not None:  # every layer on memfit.runtime.kernels: the C++ loop (fast_stack.py)
            prefill = [x for i, s in pre for x in (offsets[i], s.length, s.slot, s.start)]
            tables = [ropes[k] for k in self.rope.kinds]  # fast_stack numbers each layer's table in this order
            h = self.stack.forward(h[0], [c for c, _ in tables], [s_ for _, s_ in tables], self.block_tables, slots,
                                   positions, dec_tok, dec_slots, dec_len, all_dec, prefill, keep_t)[None]
        else:
            # where each token's K/V go: its block (through its group's table) and the row in it
            index["blk"] = self.block_tables[:, slots, positions // self.block_size]
            index["off"] = positions % self.block_size
            h = self._python_layers(h, index, lay, keep_t)
        if not want:
            return torch.empty(0, self.vocab_size)
        hl = self._rms_norm(self.inner.norm, h[0], self.ops if h.device.type == "cpu" else None)
        logits = self._lm_head(hl).float().cpu()
        if self.softcap:  # Gemma 2 style final soft-capping, as HF's *ForCausalLM.forward
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _python_layers(self, h: torch.Tensor, index: dict, lay: StepLayout, keep: torch.Tensor) -> torch.Tensor:
        """The decoder layers, one Python iteration each (any placement, dtype and module type); returns the last
        layer's rows ``keep`` (every row where ``keep`` is empty), as LayerStack.forward does."""
        T = int(h.shape[1])
        on_device: dict[torch.device, list[dict]] = {}  # the step's index tensors per KV group, once per device

        H, KV, D = self.num_heads, self.num_kv, self.head_dim
        prefetch = self.prefetch.enabled
        for li, layer in enumerate(self.layers):
            dev = self.layer_devices[li]
            if dev not in on_device:
                ix = {k: (v.to(dev) if v is not None else None) for k, v in index.items()}
                on_device[dev] = [{**ix, "table": ix["tables"][g], "blk": ix["blk"][g]}
                                  for g in range(len(self.kv_groups))]
            ix = on_device[dev][self.layer_group[li]]
            if h.device != dev:
                h = h.to(dev)
            if prefetch:
                self.prefetch.begin(li)
            attn = layer.self_attn
            kc, vc, ks, vs = self.k_cache[li], self.v_cache[li], self.k_scale[li], self.v_scale[li]
            cos, sin = ix[f"cos:{self.rope.layer_kinds[li]}"], ix[f"sin:{self.rope.layer_kinds[li]}"]
            ops = self.ops if dev.type == "cpu" and h.dtype == torch.float32 and \
                kc.dtype in (torch.float32, torch.int8) else None
            x = self._rms_norm(layer.input_layernorm, h, ops)
            qk_norm = hasattr(attn, "q_norm")  # qwen3, gemma3
            fused = self.qkv[li] is not None
            if fused:
                qkv = self.qkv[li](x)[0]  # [T, (H + 2 KV) D]
                q = qkv[:, :H * D].view(T, H, D)
                k = qkv[:, H * D:(H + KV) * D].view(T, KV, D)
                v = qkv[:, (H + KV) * D:].view(T, KV, D)
            else:
                q = attn.q_proj(x).view(T, H, D)
                k = attn.k_proj(x).view(T, KV, D)
                v = attn.v_proj(x).view(T, KV, D)
            if qk_norm:
                q = self._rms_norm(attn.q_norm, q, ops)
                k = self._rms_norm(attn.k_norm, k, ops)
            if ops is not None:
                # one kernel: RoPE in place on the q and k heads of [T, H + 2 KV, D], then k and v into the cache
                heads = qkv.view(T, H + 2 * KV, D) if fused and not qk_norm else torch.cat((q, k, v), dim=1)
                ops.rope_store(heads, cos, sin, H + KV, H, H + KV, kc, vc, ix["table"], ix["slots"], ix["positions"],
                               k_scale=ks, v_scale=vs)
                q = heads[:, :H]
            else:
                # RoPE once over query and key heads: in the fused output they are adjacent columns (one view,
                # no copy), otherwise concatenated
                qk = qkv[:, :(H + KV) * D].view(T, H + KV, D) if fused and not qk_norm else torch.cat((q, k), dim=1)
                qk = qk * cos + _rotate_half(qk) * sin
                q, k = qk[:, :H], qk[:, H:]
                for c, sc, x in ((kc, ks, k), (vc, vs, v)):
                    if sc is not None:
                        x, sc[ix["blk"], :, ix["off"]] = quantize_rows(x)
                    c[ix["blk"], :, ix["off"]] = x if x.dtype == c.dtype else x.to(c.dtype)
            out = attend(q, kc, vc, ix, lay, ops, self.scale, self.windows[li], ks, vs).reshape(1, T, H * D)
            if li == len(self.layers) - 1 and keep.numel():  # the last layer: only the wanted rows go on
                kd = keep.to(dev)
                out, h = out[:, kd], h[:, kd]
            h = self._mlp_block(li, layer, h, attn.o_proj(out), ops)
            if prefetch:
                self.prefetch.end(li)
        return h

    def _mlp_block(self, li: int, layer: torch.nn.Module, h: torch.Tensor, attn_out: torch.Tensor,
                   ops) -> torch.Tensor:
        """The layer after attention: residual add, the MLP's norm, the MLP, residual add (Gemma: normed too)."""
        if self.parallel[li]:
            return h + attn_out + layer.mlp(self._rms_norm(layer.post_attention_layernorm, h, ops))
        if self.sandwich[li]:
            h = h + self._rms_norm(layer.post_attention_layernorm, attn_out, ops)
            x = self._rms_norm(layer.pre_feedforward_layernorm, h, ops)
        else:
            h = h + attn_out
            x = self._rms_norm(layer.post_attention_layernorm, h, ops)
        if self.act_pairs[li]:
            y = layer.mlp.down_proj(self.gate_up[li].act_mul(x, self.act_pairs[li]))  # activation in the GEMM
        elif self.gate_up[li] is not None:
            gu = self.gate_up[li](x)
            n = gu.shape[-1] // 2
            y = layer.mlp.down_proj(layer.mlp.act_fn(gu[..., :n]) * gu[..., n:])
        elif self.split_mlp:  # Phi-3 after split_fused_projections: its own forward reads gate_up_proj
            y = layer.mlp.down_proj(layer.mlp.act_fn(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
        else:
            y = layer.mlp(x)
        if self.sandwich[li]:
            y = self._rms_norm(layer.post_feedforward_layernorm, y, ops)
        return h + y

    def assign_blocks(self, rows: int, per_row: int, wrap: bool = False) -> None:
        """kv_cache.assign_blocks on this model's tables: slots 0..rows-1 each on their own blocks."""
        assign_blocks(self.block_tables, self.num_blocks, rows, per_row, wrap)

    def clear_slot(self, slot: int) -> None:
        """Nothing to do: a slot's stale entries are never read (masks stop at each sequence's length)."""
