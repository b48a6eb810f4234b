"""serve on CUDA: the slot-cache forward, the engine and device-map placement against the HF model on the GPU.

Skipped without CUDA. ``MEMFIT_TEST_DEVICE=cpu`` runs the device-generic tests on CPU (a check of the test
bodies on a machine without a GPU); the tests marked ``cuda_only`` need a real GPU whatever that says.
Imports nothing that a bare GPU box lacks (fastapi, uvicorn, bitsandbytes): only memfit.runtime, serve.engine/loader/
placement, which import none of them.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from memfit.runtime.slot_model import Segment, SlotModel
from serve.engine import Engine, Event, Sequence
from serve.loader import load
from serve.placement import Placement, compute_plan, measured_resident, meta_model, parse_max_memory
from serve.sampling import SamplingParams

from .conftest import make_model_dir
from .conftest import slot_greedy as greedy

DEVICE = torch.device(os.environ.get("MEMFIT_TEST_DEVICE") or "cuda")
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real CUDA device")

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
PROMPT = [5, 17, 42, 99, 3, 250, 77, 12, 8, 160, 33]
# bf16 logits of two different op orders (ours vs HF's) differ by a few bf16 ulps of the logit scale; measured
# on CPU at <= 1.7% of max |logit|: 5% leaves room for the GPU's kernels, while a wrong mask, position or cache
# slot is off by O(1)
BF16_TOL = 0.05


@pytest.fixture(autouse=True, scope="session")
def _cpu_kernels_built():
    """Overrides conftest's fixture: nothing here needs serve's CPU kernels, and building them (~40 s, a C++
    compiler) would eat the GPU run's budget."""


def _model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3":  # q/k norms: the Python loop's other branch
        m = Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16))
    else:  # "dynamic" RoPE: cos/sin from the rotary module every step instead of the table
        rope = {"rope_type": kind, "rope_theta": 10000.0} | ({"factor": 2.0} if kind == "dynamic" else {})
        m = LlamaForCausalLM(LlamaConfig(**_COMMON, rope_parameters=rope))
    return m.to(DEVICE, dtype).eval()


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None].to(DEVICE)).logits[0].float().cpu()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    else:
        err = float((got - want).abs().max() / want.abs().max())
        assert err < BF16_TOL, f"max |diff| {err:.4f} of max |logit|"


@pytest.mark.parametrize("kind,dtype", [("default", torch.float32), ("dynamic", torch.float32),
                                        ("qwen3", torch.float32), ("default", torch.bfloat16)])
def test_slot_model_on_device_matches_hf_forward(kind, dtype):
    model = _model(kind, dtype)
    sm = SlotModel(model, 4, 64)
    assert all(k.device.type == DEVICE.type and k.dtype == dtype for k in sm.k_cache + sm.v_cache)
    assert sm.stack is None  # the C++ layer loop is CPU-only
    torch.manual_seed(1)
    a, b, c = torch.randint(3, 300, (30,)), torch.randint(3, 300, (9,)), torch.randint(3, 300, (21,))
    ref = {k: _hf_logits(model, x) for k, x in (("a", a), ("b", b), ("c", c))}
    # 1: two first prefill chunks (causal SDPA)
    out = sm.forward(torch.cat([a[:20], b[:8]]), [Segment(2, 0, 20), Segment(0, 0, 8)])
    assert out.device.type == "cpu" and out.dtype == torch.float32
    _close(out[0], ref["a"][19], dtype)
    _close(out[1], ref["b"][7], dtype)
    # 2: a decode, a *later* chunk of a (on CUDA: the explicit [n, end] mask branch, never run by the CPU
    # suite) and a new prompt
    out = sm.forward(torch.cat([b[8:9], a[20:], c]), [Segment(0, 8, 1), Segment(2, 20, 10), Segment(3, 0, 21)])
    _close(out[0], ref["b"][8], dtype)
    _close(out[1], ref["a"][29], dtype)
    _close(out[2], ref["c"][20], dtype)
    # 3: decodes in non-contiguous slots of different lengths (gathered cache rows, padding mask)
    out = sm.forward(torch.tensor([5, 6]), [Segment(3, 21, 1), Segment(0, 9, 1)])
    _close(out[0], _hf_logits(model, torch.cat([c, torch.tensor([5])]))[-1], dtype)
    _close(out[1], _hf_logits(model, torch.cat([b, torch.tensor([6])]))[-1], dtype)
    # 4: decodes in contiguous slots (the cache slice instead of the gather)
    out = sm.forward(torch.tensor([7, 8]), [Segment(2, 30, 1), Segment(3, 22, 1)])
    _close(out[0], _hf_logits(model, torch.cat([a, torch.tensor([7])]))[-1], dtype)
    _close(out[1], _hf_logits(model, torch.cat([c, torch.tensor([5, 8])]))[-1], dtype)


@cuda_only
def test_serve_default_kernel_modes_leave_cuda_layers_alone(monkeypatch):
    """serve's defaults are --dense-kernel auto --cpu-kernels auto: on a CUDA model neither may touch a module
    or call a CPU kernel. The kernels are replaced by a stand-in that fails on any call (no C++ build here)."""
    from memfit.runtime import kernels

    calls: list[str] = []

    class NoCalls:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                calls.append(name)
                raise AssertionError(f"CPU kernel {name} called on a CUDA model")
            return fail

    monkeypatch.setattr(kernels, "load", lambda mode: NoCalls())
    model = _model("default", torch.float32)
    ref = _hf_logits(model, torch.tensor(PROMPT))
    types_before = [type(m) for m in model.modules()]
    sm = SlotModel(model, 2, 64, dense_kernel="on", cpu_kernels="on")
    assert sm.dense_packed == 0 and sm.stack is None and [type(m) for m in model.modules()] == types_before
    out = sm.forward(torch.tensor(PROMPT), [Segment(0, 0, len(PROMPT))])
    _close(out[0], ref[-1], torch.float32)
    assert calls == []


class Collector:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()


def _run_engine(model: torch.nn.Module, tok, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of ``prompts`` through the engine: 5 prompts over 3 slots, 8-token prefill chunks, so
    sequences join and leave while others decode and long prompts span several steps."""
    sm = SlotModel(model, 3, 128)
    eng = Engine(sm, tok, set(), prefill_chunk=8)
    seqs = []
    for p in prompts:
        c = Collector()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seqs.append((Sequence(p, params, c, model.config.vocab_size), c))
    try:
        eng.submit([s for s, _ in seqs])
        for _, c in seqs:
            assert c.done.wait(120), "engine did not finish"
            assert c.events[-1].finish_reason == "length", c.events[-1]
        assert sorted(eng.free_slots) == [0, 1, 2]
    finally:
        eng.stop()
    return [s.out_ids for s, _ in seqs]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(7, vocab, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 25)]


def test_engine_greedy_equals_hf_generate_on_device(model_dir):
    loaded = load(model_dir)
    model = loaded.model.to(DEVICE)
    prompts = _prompts(model.config.vocab_size)
    got = _run_engine(model, loaded.tokenizer, prompts, 12)
    for p, out in zip(prompts, got, strict=True):
        ids = torch.tensor([p], device=DEVICE)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        assert out == ref[0, len(p):].tolist()


def test_engine_bf16_tokens_are_greedy_under_hf_bf16(model_dir):
    """bf16: exact token equality with HF's generate would hinge on near-ties that differ between two op orders.
    Instead teacher-force HF on the engine's own output: every token the engine picked must be HF's argmax up to
    bf16 noise (a wrong cache row or position picks tokens far below the max)."""
    loaded = load(model_dir, dtype="bf16")
    model = loaded.model.to(DEVICE)
    assert next(model.parameters()).dtype == torch.bfloat16
    prompts = _prompts(model.config.vocab_size)
    got = _run_engine(model, loaded.tokenizer, prompts, 12)
    for p, out in zip(prompts, got, strict=True):
        lg = _hf_logits(model, torch.tensor(p + out[:-1]))[len(p) - 1:]  # the logits each pick was made from
        picked = lg.gather(1, torch.tensor(out)[:, None])[:, 0]
        gap = lg.max(-1).values - picked
        assert float(gap.max()) <= BF16_TOL * float(lg.abs().max()), (gap, lg.abs().max())


# ---- placement on the GPU (device maps, CPU/disk offload executing on cuda:0) ------------------------------

@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory) -> str:
    """4 decoder layers, so maps can split them (as tests/serve/test_placement.py)."""
    return str(make_model_dir(tmp_path_factory.mktemp("tiny-llama-4l-cuda"), seed=3, layers=4, hidden=64))


@pytest.fixture(scope="module")
def reference(deep_dir) -> list[int]:
    """The all-in-RAM fp32 CPU model's greedy tokens (serve without any placement)."""
    return greedy(SlotModel(load(deep_dir).model, 2, 64), PROMPT, 16)


def _gpu_map(layers: list[int | str]) -> dict[str, int | str]:
    dm: dict[str, int | str] = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
    dm.update({f"model.layers.{i}": d for i, d in enumerate(layers)})
    return dm


@cuda_only
@pytest.mark.parametrize("device_map", [{"": 0}, "auto"])
def test_whole_model_on_gpu(deep_dir, reference, device_map):
    loaded = load(deep_dir, placement=Placement(device_map), max_batch=2, max_seq_len=64)
    plan = loaded.plan
    assert {str(d) for d in plan.device_map.values()} == {"0"}, plan.device_map
    sm = SlotModel(loaded.model, 2, 64)
    assert all(d == torch.device("cuda:0") for d in sm.layer_devices) and sm.embed_device.type == "cuda"
    assert set(sm.cache_bytes_per_device()) == {"cuda:0"}
    assert greedy(sm, PROMPT, 16) == reference
    measured = measured_resident(loaded.model, sm.cache_bytes_per_device())
    assert measured.get("cpu", 0) == 0, measured
    want = plan.resident["cuda:0"]
    assert abs(measured["cuda:0"] - want) <= 0.1 * want, (measured, plan.resident)


@cuda_only
@pytest.mark.parametrize("layers,prefetch", [([0, 0, "cpu", "cpu"], False), ([0, "cpu", "disk", 0], True),
                                             (["disk", "cpu", "disk", "cpu"], True)])
def test_offloaded_layers_execute_on_gpu(deep_dir, reference, layers, prefetch, tmp_path):
    loaded = load(deep_dir, placement=Placement(_gpu_map(layers), offload_folder=str(tmp_path), prefetch=prefetch),
                  max_batch=2, max_seq_len=64)
    sm = SlotModel(loaded.model, 2, 64, prefetch=prefetch)
    # offloaded layers run on the main device (their weights are brought over per step): KV cache there too
    assert all(d == torch.device("cuda:0") for d in sm.layer_devices), sm.layer_devices
    assert set(sm.cache_bytes_per_device()) == {"cuda:0"}
    assert sm.prefetch.offloaded == [i for i, d in enumerate(layers) if d in ("cpu", "disk")]
    assert greedy(sm, PROMPT, 16) == reference
    assert greedy(sm, PROMPT, 16) == reference  # a second pass over the (re)loaded weights


@cuda_only
def test_max_memory_budget_splits_layers_between_gpu_and_cpu(deep_dir, reference):
    assert parse_max_memory("cuda:0=1MiB,cpu=2GiB") == {0: 2**20, "cpu": 2 * 2**30}
    meta = meta_model(deep_dir, torch.float32)
    layer = sum(p.numel() * 4 for p in meta.model.layers[0].parameters())
    embed = meta.model.embed_tokens.weight.numel() * 4
    kv = 4 * 2 * 2 * 2 * 64 * 16 * 4  # 4 layers (offloaded ones execute on the GPU), k+v, batch 2, 2 KV heads...
    # accelerate's own reserve for offloaded layers makes the exact split hard to predict: take the first GPU
    # budget (in half layers) that leaves some layers on the GPU and some in RAM
    for halves in range(2, 12):
        mm = {0: embed + kv + halves * layer // 2, "cpu": 2**30}
        plan = compute_plan(meta, "auto", mm, 2, 64, torch.float32)
        on_gpu = [m.name for m in plan.modules if "layers" in m.name and m.device == 0]
        if 1 <= len(on_gpu) < 4:
            break
    else:
        pytest.fail(f"no GPU budget split the layers: last plan {plan.device_map}")
    assert "disk" not in plan.device_map.values()
    loaded = load(deep_dir, placement=Placement("auto", mm), max_batch=2, max_seq_len=64)
    sm = SlotModel(loaded.model, 2, 64)
    assert len(sm.prefetch.offloaded) == 4 - len(on_gpu)
    assert greedy(sm, PROMPT, 16) == reference
    got = measured_resident(loaded.model, sm.cache_bytes_per_device())
    assert got["cuda:0"] <= plan.resident["cuda:0"] + plan.working.get("cuda:0", 0) + layer, (got, plan)


def _compress_missing() -> str | None:
    """Why compress.load / the compress CLI cannot be imported here (a top-level import of an absent package such
    as compressed-tensors), or None."""
    try:
        import compress.loader  # noqa: F401
        from compress.cli import build_parser

        build_parser()
    except ModuleNotFoundError as e:
        return f"compress.load / the compress CLI need {e.name!r}, not installed here"
    return None


@cuda_only
@pytest.mark.skipif(_compress_missing() is not None, reason=str(_compress_missing()))
def test_compress_output_placed_on_gpu(deep_dir, tmp_path):
    # 4-bit layers are packed for the device's kernel at load: serve.placement loads a compress output on the
    # GPU it is placed on (it loaded it on CPU and moved the CPU pack to the GPU before, which has no kernel there)
    from compress.cli import main as compress_main
    from compress.loader import load as compress_load
    from memfit.errors import UserError
    from memfit.runtime.qlinear import QUANT_LINEARS

    out = tmp_path / "q4"
    assert compress_main(["quantize", deep_dir, "-o", str(out), "--bits", "4", "--method", "rtn",
                          "--group-size", "32"]) == 0
    ref = compress_load(str(out), backend="dequant")  # the exact dequantized weights, fp32, on CPU
    loaded = load(str(out), placement=Placement({"": 0}), max_batch=2, max_seq_len=64)
    qls = [m for m in loaded.model.modules() if isinstance(m, QUANT_LINEARS)]
    assert qls and all(m.device.type == "cuda" for m in _buffers_and_params(qls))
    sm = SlotModel(loaded.model, 2, 64)
    assert sm.k_cache[0].device.type == "cuda"
    got = sm.forward(torch.tensor(PROMPT), [Segment(0, 0, len(PROMPT))])[0]
    with torch.no_grad():
        want = ref(torch.tensor(PROMPT)[None]).logits[0, -1]
    # the CUDA backend (dequant at this width, or int4 with bf16 activations) against the exact weights
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    with pytest.raises(UserError, match="not split between them"):  # half on the GPU, half on CPU: refused
        load(str(out), placement=Placement(_gpu_map([0, 1, "cpu", "cpu"])), max_batch=2, max_seq_len=64)


def _buffers_and_params(mods: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [t for m in mods for t in [*m.parameters(), *m.buffers()]]
