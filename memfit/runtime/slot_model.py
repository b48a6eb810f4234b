"""A packed, slot-cache forward pass over the weights of a Hugging Face Llama-style model.

One call runs any mix of decode tokens and prefill chunks from different sequences ("segments"):
all tokens of the step are packed into one ``[T, hidden]`` matrix so every Linear runs once per
layer; attention reads a preallocated KV cache ``[layers, max_batch, kv_heads, max_seq, head_dim]``
(one static slot per running sequence, never reallocated) with per-token positions.

Only the *modules* of the HF model are called (``layer.self_attn.q_proj(x)``, ``layer.mlp(x)``,
``layer.input_layernorm(x)``), never their ``.weight``, so quantized Linear replacements from
``compress`` work unchanged. Rotary embeddings come from the model's own ``rotary_emb`` module, so
every RoPE scaling variant that transformers implements is matched exactly. Where every layer runs on
memfit's CPU kernels (memfit.runtime.kernels), the layers run as one C++ call over those kernels' packed weights
(memfit.runtime.fast_stack); the Python loop here is its reference and runs everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memfit.errors import UserError
from memfit.runtime import kernels
from memfit.runtime.dense import pack_linears
from memfit.runtime.fast_stack import build
from memfit.runtime.fuse import fuse
from memfit.runtime.int4 import int4_on_kernels
from memfit.runtime.offload import LayerPrefetcher

SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class Segment:
    """``length`` tokens of one sequence in slot ``slot`` starting at absolute position ``start``."""

    slot: int
    start: int
    length: int
    want_logits: bool = True  # logits of the segment's last token are returned


def _shards(linear: torch.nn.Module) -> int:
    """How many tensor-parallel ranks share this (column-sharded) Linear: 1 unless its weight is a DTensor."""
    w = getattr(linear, "weight", None)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return 1
    if isinstance(w, DTensor):
        return w.shape[0] // w.to_local().shape[0]
    return 1


def _exec_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: its accelerate hook's execution device (offloaded weights are on meta until
    the hook loads them), else the device of its first real parameter, else CPU."""
    for m in module.modules():
        hook = getattr(m, "_hf_hook", None)
        dev = getattr(hook, "execution_device", None)
        if dev is not None:
            return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    for p in module.parameters():
        if not p.is_meta:
            return p.device if not hasattr(p, "to_local") else p.to_local().device
    return torch.device("cpu")


def _plain_forward(module: torch.nn.Module):
    """``module.forward`` where calling it is the same as calling the module (no forward hooks of its own or
    global ones, checked once at load; accelerate's hooks wrap ``forward`` itself and so still run), else the
    module."""
    from torch.nn.modules import module as nn_module

    if not isinstance(module, torch.nn.Module):
        return module
    hooks = (module._forward_hooks, module._forward_pre_hooks, nn_module._global_forward_hooks,
             nn_module._global_forward_pre_hooks)
    return module if any(hooks) else module.forward


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor, ops=None) -> torch.Tensor:
    """HF's Llama-family RMSNorm as one fused op: ours (memfit.runtime.kernels) on CPU, else torch's (exactly equal in
    fp32, half the CPU time of its six-op form at decode sizes); anything else (other dtypes, hooked or other
    norm types) runs the module."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or w is None or x.dtype != torch.float32 or w.dtype != torch.float32 or \
            getattr(norm, "_hf_hook", None) is not None or not type(norm).__name__.endswith("RMSNorm"):
        return norm(x)
    if ops is not None and x.device.type == "cpu" and w.device.type == "cpu":
        return ops.rms_norm(x, w, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _prefix_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                          scale: float) -> torch.Tensor:
    """Attention of a later prefill chunk q [1, H, n, D] over its slot's keys [0, start + n): the cached prefix
    unmasked, the chunk itself causally. Two flash calls merged by their logsumexp (as vLLM's merge_attn_states)
    rather than one SDPA call with an [n, end] mask, because the mask and SDPA's float copy of it are a chunk's
    largest allocation (2.5 MB per layer at n=256, end=2048); the same as memfit/runtime/csrc/stack.cpp. GQA needs no
    repeat: the CPU flash kernel takes fewer key heads."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_a, lse_a = flash(q, k[:, :, :start], v[:, :, :start], scale=scale)
    o_b, lse_b = flash(q, k[:, :, start:], v[:, :, start:], is_causal=True, scale=scale)
    # softmax over both parts = the parts' outputs weighted by sigmoid(lse_a - lse_b) and its complement
    w = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    if q.dtype == torch.float32:
        return torch.lerp(o_b, o_a, w)
    return torch.lerp(o_b.float(), o_a.float(), w).to(q.dtype)


_NO_ROWS = torch.empty(0, dtype=torch.long)  # `keep` meaning every row (SlotModel._forward)


class SlotModel:
    """Wraps an HF ``*ForCausalLM`` (Llama family) with a static slot KV cache."""

    def __init__(self, hf_model: torch.nn.Module, max_batch: int, max_seq_len: int,
                 cache_dtype: torch.dtype | None = None, prefetch: bool = False, dense_kernel: str = "off",
                 cpu_kernels: str = "off"):
        cfg = hf_model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_TYPES:
            raise UserError(f"model: architecture {model_type!r} is not supported by the serve engine "
                            f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})")
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
                and model_type == "mistral":
            raise UserError("model: sliding-window attention is not supported by the serve engine")
        self.hf = hf_model.eval()
        self.inner = hf_model.model
        self.layers = list(self.inner.layers)
        self.rotary = self.inner.rotary_emb
        self.num_heads = cfg.num_attention_heads
        self.num_kv = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        # tensor parallel (transformers tp_plan): q/k/v are column-sharded, so each rank holds a slice of heads
        tp = _shards(self.layers[0].self_attn.q_proj)
        if self.num_heads % tp or self.num_kv % tp:
            raise UserError(f"--tp {tp} must divide the attention heads ({self.num_heads}) and KV heads "
                            f"({self.num_kv})")
        self.num_heads //= tp
        self.num_kv //= tp
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.vocab_size = cfg.vocab_size
        self.dtype = self._param_dtype()
        cdt = cache_dtype or self.dtype
        # each layer's KV cache lives where that layer executes (device maps split layers over devices)
        self.layer_devices = [_exec_device(layer) for layer in self.layers]
        self.embed_device = _exec_device(self.inner.embed_tokens)
        shape = (max_batch, self.num_kv, max_seq_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=cdt, device=d) for d in self.layer_devices]
        self.v_cache = [torch.zeros(shape, dtype=cdt, device=d) for d in self.layer_devices]
        self.scale = self.layers[0].self_attn.scaling if hasattr(self.layers[0].self_attn, "scaling") \
            else self.head_dim ** -0.5
        # fused CPU kernels (memfit.runtime.kernels): fp32 and int4 Linears, norms, RoPE + KV write, decode attention;
        # None where not built (torch ops then)
        self.ops = kernels.load(cpu_kernels)
        # fp32 CPU Linears on packed weights (memfit.runtime.dense; replaces modules of the HF model)
        self.dense_packed = pack_linears(hf_model, dense_kernel, self.ops)
        self.lm_head = hf_model.lm_head  # after packing, which may replace it
        # embedding and lm_head, called once a step: their forward straight, without nn.Module.__call__'s hook
        # bookkeeping, where no hooks are registered (with the other changes to _forward's bookkeeping, the
        # time of a batch-16 decode step outside the layers and lm_head went from 0.64-0.69 to 0.54 ms)
        self._embed = _plain_forward(self.inner.embed_tokens)
        self._lm_head = _plain_forward(self.lm_head)

        self.qkv = [fuse([ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj], self.ops)
                    for ly in self.layers]
        self.gate_up = [fuse([ly.mlp.gate_proj, ly.mlp.up_proj], self.ops) if all(
            hasattr(ly.mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) else None
            for ly in self.layers]
        self.int4_kernel = int4_on_kernels(hf_model, self.ops)  # the other int4 projections (memfit.runtime.int4)
        self.silu_pairs = [getattr(g, "pairs", False) and type(ly.mlp.act_fn).__name__ in ("SiLU", "SiLUActivation")
                           for g, ly in zip(self.gate_up, self.layers, strict=True)]
        self.prefetch = LayerPrefetcher(self.layers, enabled=prefetch)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        rope_type = str(getattr(self.rotary, "rope_type", "default"))
        # static RoPE variants: cos/sin depend on the position only, so they are computed once per position
        self._rope_static = "dynamic" not in rope_type and rope_type != "longrope" and \
            max_seq_len * self.head_dim <= 2 ** 22
        self.stack = build(self)  # the layers as one C++ call where all of them allow it, else None

    def _rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` from the model's own rotary module: looked up in a table of every
        position when the RoPE type is static (a gather instead of the module's ~8 ops per step)."""
        if not self._rope_static:
            cos, sin = self.rotary(h, positions[None].to(h.device))
            return cos[0][:, None, :], sin[0][:, None, :]
        t = self._rope_table
        if t is None or t[0].dtype != h.dtype or t[0].device != h.device:
            every = torch.arange(self.max_seq_len, device=h.device)[None]
            cos, sin = self.rotary(h, every)
            t = self._rope_table = (cos[0][:, None, :].contiguous(), sin[0][:, None, :].contiguous())
        ix = positions.to(h.device)
        return t[0][ix], t[1][ix]

    def _param_dtype(self) -> torch.dtype:
        emb = self.inner.embed_tokens
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

    def cache_bytes_per_device(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.k_cache:
            out[str(k.device)] = out.get(str(k.device), 0) + 2 * k.numel() * k.element_size()
        return out

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
        cos, sin = self._rope(h, positions)
        dec_mask = None  # no mask needed when every decode attends to the same number of positions
        if dec_idx and min(dec_len_list) != dec_max and self.stack is None:
            dec_mask = (torch.arange(dec_max)[None, :] < dec_len[:, None])[:, None, None, :]
        all_dec = len(dec_idx) == len(segments)  # pure decode step: token order == decode order
        contiguous = bool(dec_idx) and dec_slot_list == list(range(dec_slot_list[0], dec_slot_list[0] + len(dec_idx)))
        pre = [(i, s) for i, s in enumerate(segments) if s.length > 1]
        index = {"positions": positions, "slots": slots, "cos": cos, "sin": sin, "dec_tok": dec_tok,
                 "dec_slots": dec_slots, "dec_len": dec_len, "dec_mask": dec_mask}
        # The rows whose logits the step returns: the last layer runs its o_proj and MLP on these rows only
        # (every token's K/V is cached by then). A prefill chunk saves ~8% of its FLOPs (10 layers here).
        # With no logits wanted (a prompt's earlier chunk) one row goes on, to keep the kernels' shapes non-empty.
        want = [offsets[i] + s.length - 1 for i, s in enumerate(segments) if s.want_logits]
        keep = want if want else [T - 1]
        keep_t = _NO_ROWS if len(keep) == T else torch.tensor(keep, dtype=torch.long)  # empty: every row
        if self.stack is not None:  # every layer on memfit.runtime.kernels: the C++ loop (memfit.runtime.fast_stack)
            prefill = [x for i, s in pre for x in (offsets[i], s.length, s.slot, s.start)]
            h = self.stack.forward(h[0], cos, sin, slots, positions, dec_tok, dec_slots, dec_len, all_dec,
                                   prefill, keep_t)[None]
        else:
            h = self._python_layers(h, index, offsets, pre, dec_idx, dec_slot_list, dec_max, all_dec, contiguous,
                                    keep_t)
        if not want:
            return torch.empty(0, self.vocab_size)
        hl = _rms_norm(self.inner.norm, h[0], self.ops if h.device.type == "cpu" else None)
        return self._lm_head(hl).float().cpu()

    def _python_layers(self, h: torch.Tensor, index: dict, offsets: list[int], pre: list, dec_idx: list[int],
                       dec_slot_list: list[int], dec_max: int, all_dec: bool, contiguous: bool,
                       keep: torch.Tensor) -> torch.Tensor:
        """The decoder layers, one Python iteration each (any placement, dtype and module type); returns the last
        layer's rows ``keep`` (every row where ``keep`` is empty), as LayerStack.forward does."""
        T = int(h.shape[1])
        on_device: dict[torch.device, dict] = {}  # the step's index tensors, copied once per device

        H, KV, D = self.num_heads, self.num_kv, self.head_dim
        prefetch = self.prefetch.enabled
        for li, layer in enumerate(self.layers):
            dev = self.layer_devices[li]
            if dev not in on_device:
                on_device[dev] = {k: (v.to(dev) if v is not None else None) for k, v in index.items()}
            ix = on_device[dev]
            if h.device != dev:
                h = h.to(dev)
            if prefetch:
                self.prefetch.begin(li)
            attn = layer.self_attn
            kc, vc = self.k_cache[li], self.v_cache[li]
            ops = self.ops if dev.type == "cpu" and kc.dtype == h.dtype == torch.float32 else None
            x = _rms_norm(layer.input_layernorm, h, ops)
            qk_norm = hasattr(attn, "q_norm")  # qwen3
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
                q = attn.q_norm(q)
                k = attn.k_norm(k)
            if ops is not None:
                # one kernel: RoPE in place on the q and k heads of [T, H + 2 KV, D], then k and v into the cache
                heads = qkv.view(T, H + 2 * KV, D) if fused and not qk_norm else torch.cat((q, k, v), dim=1)
                ops.rope_store(heads, ix["cos"], ix["sin"], H + KV, H, H + KV, kc, vc, ix["slots"], ix["positions"])
                q = heads[:, :H]
            else:
                # RoPE once over query and key heads: in the fused output they are adjacent columns (one view,
                # no copy), otherwise concatenated
                qk = qkv[:, :(H + KV) * D].view(T, H + KV, D) if fused and not qk_norm else torch.cat((q, k), dim=1)
                qk = qk * ix["cos"] + _rotate_half(qk) * ix["sin"]
                q, k = qk[:, :H], qk[:, H:]
                kc[ix["slots"], :, ix["positions"]] = k if k.dtype == kc.dtype else k.to(kc.dtype)
                vc[ix["slots"], :, ix["positions"]] = v if v.dtype == vc.dtype else v.to(vc.dtype)

            out = None if all_dec else torch.empty(T, H, D, dtype=q.dtype, device=dev)
            if dec_idx and ops is not None:
                od = ops.decode_attention(q if all_dec else q[ix["dec_tok"]], kc, vc, ix["dec_slots"], ix["dec_len"],
                                          self.scale)
                if all_dec:
                    out = od
                else:
                    out[ix["dec_tok"]] = od
            elif dec_idx:
                qd = (q if all_dec else q[ix["dec_tok"]])[:, :, None, :]  # [n, H, 1, D]
                if contiguous:
                    a, b = dec_slot_list[0], dec_slot_list[0] + len(dec_idx)
                    kd, vd = kc[a:b, :, :dec_max], vc[a:b, :, :dec_max]
                else:
                    kd, vd = kc[ix["dec_slots"], :, :dec_max], vc[ix["dec_slots"], :, :dec_max]
                od = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=ix["dec_mask"],
                                                    scale=self.scale, enable_gqa=KV != H)
                if all_dec:
                    out = od[:, :, 0, :]
                else:
                    out[ix["dec_tok"]] = od[:, :, 0, :]
            ours: list[int] = []  # chunks for the kernels' prefill attention (as csrc/stack.cpp does)
            for i, s in pre:
                a, n = offsets[i], s.length
                end = s.start + n
                if ops is not None and ops.prefill_attention_fits(D, end):
                    ours += [a, n, s.slot, s.start]
                    continue
                qp = q[a:a + n].transpose(0, 1)[None]  # [1, H, n, D]
                kp = kc[s.slot:s.slot + 1, :, :end].to(q.dtype)
                vp = vc[s.slot:s.slot + 1, :, :end].to(q.dtype)
                if s.start == 0:
                    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                        enable_gqa=KV != H)
                elif dev.type == "cpu":
                    op = _prefix_attention_cpu(qp, kp, vp, s.start, self.scale)
                else:
                    mask = torch.ones(n, end, dtype=torch.bool, device=dev).tril(diagonal=s.start)
                    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale,
                                                        enable_gqa=KV != H)
                out[a:a + n] = op[0].transpose(0, 1)
            if ours:
                ops.prefill_attention(q, kc, vc, out, ours, self.scale)
            out = out.reshape(1, T, H * D)
            if li == len(self.layers) - 1 and keep.numel():  # the last layer: only the wanted rows go on
                kd = keep.to(dev)
                out, h = out[:, kd], h[:, kd]
            h = h + attn.o_proj(out)
            x = _rms_norm(layer.post_attention_layernorm, h, ops)
            if self.silu_pairs[li]:
                h = h + layer.mlp.down_proj(self.gate_up[li].silu_mul(x))  # activation in the GEMM (dense.py)
            elif self.gate_up[li] is not None:
                gu = self.gate_up[li](x)
                n = gu.shape[-1] // 2
                h = h + layer.mlp.down_proj(layer.mlp.act_fn(gu[..., :n]) * gu[..., n:])
            else:
                h = h + layer.mlp(x)
            if prefetch:
                self.prefetch.end(li)
        return h

    def clear_slot(self, slot: int) -> None:
        """Nothing to do: a slot's stale entries are never read (masks stop at each sequence's length)."""
