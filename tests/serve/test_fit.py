"""serve fit: the workload and quality parsers, the shape counts and KV sizes the prediction uses, and one real
search on a tiny model (its verification runs are real serve processes)."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main as memfit_main
from memfit.errors import UserError
from serve import fit, fit_predict
from serve.cli import build_parser as serve_parser
from serve.cli import validate
from tests.serve.conftest import TEXT


def test_workload_and_quality_parsers():
    assert fit.parse_workload("concurrency=4, prompt=64") == fit.Workload(4, 64, 256)
    with pytest.raises(UserError, match="unknown key 'batch'"):
        fit.parse_workload("batch=4")
    with pytest.raises(UserError, match="positive integer"):
        fit.parse_workload("prompt=0")
    q = fit.parse_quality("kl<=0.02,top1>=0.9")
    assert (q.kl, q.top1) == (0.02, 0.9)
    assert q.misses({"kl": 0.03, "top1": 0.95}) == "kl 0.0300 > 0.02"
    assert q.misses({"kl": 0.01, "top1": 0.8}) == "top1 0.800 < 0.9"
    assert q.misses({"kl": 0.01, "top1": 0.95}) is None
    with pytest.raises(UserError, match="unknown bound"):
        fit.parse_quality("ppl<=3")


def test_memfit_fit_needs_for(capsys):
    assert memfit_main(["fit", "x", "--memory", "1GiB"]) == 2
    assert "--for serve or --for train" in capsys.readouterr().err
    assert memfit_main(["fit", "x", "--for", "deploy"]) == 2


def test_shapes_count_every_parameter_once(model_dir):
    from memfit.hf import load_pretrained

    s = fit_predict.shapes(model_dir)
    model = load_pretrained(model_dir)  # its own copy: the session's `loaded` model gets packed by other tests
    assert s.tied and s.linear + s.tables + s.other == sum(p.numel() for p in model.parameters())
    assert s.vocab == model.get_input_embeddings().weight.numel()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_kv_plan_is_the_cache_serve_makes(model_dir, kv_dtype):
    from serve.api import ServeConfig, State
    from serve.loader import load

    config = fit_predict.read_model_config(model_dir)
    fmt = fit_predict.dense_formats(model_dir, fit_predict.shapes(model_dir), kernels=True)[0]
    kv = fit_predict.kv_plan(config, fmt, kv_dtype, running=3, seq_len=40, block_size=16, chunk=32)
    c = fit_predict.Candidate(fmt, kv_dtype, 3, 32, kv, 40)
    args = serve_parser().parse_args(c.serve_args())
    validate(args)  # the command line fit prints is one serve accepts
    cfg = ServeConfig(model_path=model_dir, dtype=args.dtype, max_batch=3, max_seq_len=40,
                      kv_cache_memory=args.kv_budget, kv_cache_dtype=kv_dtype, prefill_chunk=args.prefill_chunk)
    state = State(cfg, lambda: load(model_dir, args.dtype, cpu_kernels="auto"))
    state.load()
    assert state.status == "ready", state.error
    assert state.engine.model.cache_bytes == kv
    assert state.engine.model.num_blocks == 3 * 3  # three sequences of 40 tokens: 3 blocks of 16 each
    state.engine.stop()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("fit-text") / "held_out.txt"
    p.write_text(TEXT * 20)
    return str(p)


def test_fit_chooses_a_verified_plan_within_the_budget(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "fit"
    rc = memfit_main(["fit", model_dir, "--for", "serve", "--memory", "4GiB", "--workload",
                      "concurrency=2,prompt=16,output=8", "--formats", "fp32,int8", "--max-verify", "1",
                      "--decode-steps", "4", "--quality-text", text_file, "--min-quality", "kl<=0.05",
                      "--out", str(out), "--json"])
    assert rc == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert 0 < result["measured_peak"] <= 4 * 2**30
    assert result["kl"] is not None and result["kl"] <= 0.05 and result["tok_s"] > 0
    chosen = [c for c in result["candidates"] if c["status"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["measured"]["kv_cache_bytes"] == chosen[0]["predicted"]["kv"]
    for name in ("candidates.json", "candidates.md", "frontier.png", "command.txt"):
        assert (out / name).stat().st_size > 0
    command = (out / "command.txt").read_text().split()
    assert command[0] == "serve"
    validate(serve_parser().parse_args(command[1:]))
    assert "--max-batch 2 " in " ".join(command)  # the whole concurrency fits in 4 GiB


def test_a_budget_below_the_python_process_exits_2_with_the_smallest_feasible(model_dir, tmp_path, capsys):
    rc = memfit_main(["fit", model_dir, "--for", "serve", "--memory", "64MiB", "--min-quality", "none",
                      "--out", str(tmp_path / "fit")])
    err = capsys.readouterr().err
    assert rc == 2 and "fits no candidate" in err and "smallest feasible budget" in err


def test_a_quality_bound_nothing_meets_exits_2_naming_the_closest(model_dir, text_file, tmp_path, capsys):
    rc = memfit_main(["fit", model_dir, "--for", "serve", "--memory", "4GiB", "--workload",
                      "concurrency=1,prompt=8,output=4", "--formats", "fp32", "--quality-text", text_file,
                      "--min-quality", "top1>=1.5", "--decode-steps", "2", "--out", str(tmp_path / "fit")])
    err = capsys.readouterr().err
    assert rc == 2 and "no candidate passed" in err and "below quality: top1" in err


def test_unknown_format_exits_2(model_dir, tmp_path, capsys):
    rc = memfit_main(["fit", model_dir, "--for", "serve", "--memory", "4GiB", "--formats", "fp8",
                      "--min-quality", "none", "--out", str(tmp_path / "fit")])
    assert rc == 2 and "--formats: unknown fp8" in capsys.readouterr().err


def test_near_ties_run_again_and_the_median_chooses(model_dir, tmp_path, monkeypatch):
    """Every verified candidate is within 10% of the fastest first run, so each runs once more; the one fastest at
    first is slow the second time and loses on the median."""
    calls: dict[str, int] = {}

    def fake_probe(args, probe_args):
        if "--base-only" in probe_args:
            return {"rss_base": 200 * 2**20, "rss_tokenizer": 210 * 2**20}
        key = " ".join(args)
        calls[key] = calls.get(key, 0) + 1
        first = "--quantize" not in args and "--kv-cache-dtype" not in args
        step = [0.010, 0.030][calls[key] - 1] if first else [0.0105, 0.0100][calls[key] - 1]
        return {"peak": 300 * 2**20, "prefill_s": 0.0, "decode_step_s": step}

    monkeypatch.setattr(fit, "probe", fake_probe)
    args = fit.build_parser().parse_args([model_dir, "--memory", "4GiB", "--workload", "concurrency=2,prompt=16,"
                                          "output=8", "--formats", "fp32,int8", "--min-quality", "none",
                                          "--out", str(tmp_path)])
    result = fit.fit(args)
    passed = [c for c in result["candidates"] if c["status"] in ("fits", "chosen")]
    assert len(passed) >= 2 and all(len(c["measured"]["runs_tok_s"]) == 2 for c in passed)
    assert set(calls.values()) == {2}
    chosen = next(c for c in passed if c["status"] == "chosen")
    assert "--quantize" in result["command"] or "--kv-cache-dtype" in result["command"]
    assert chosen["measured"]["tok_s"] == max(c["measured"]["tok_s"] for c in passed)


def test_disk_offload_keeps_what_the_budget_leaves_in_ram_and_serve_runs_it(model_dir):
    """fp32+disk: serve's planner keeps what --max-memory cpu=X allows (KV and one streamed layer included) and
    reads the rest from the checkpoint; the command line fit would print runs in serve's own engine."""
    s, config = fit_predict.shapes(model_dir), fit_predict.read_model_config(model_dir)
    weights = 4 * (s.linear + s.tables + s.other)
    ws = fit_predict.workspace(s, config, 2, 16, 24)
    fmt, kv = fit_predict.disk_offload(model_dir, s, config, 2, 16, 24, base=0, budget=ws + 3 * weights // 4)
    assert fmt.placed and fmt.held > 0 and fmt.stream > 0 and fmt.held + kv + fmt.stream <= 3 * weights // 4
    assert fit_predict.disk_offload(model_dir, s, config, 2, 16, 24, base=0, budget=ws + 2 * weights) is None
    c = fit_predict.Candidate(fmt, "auto", 2, 16, kv, 24)
    assert "--kv-cache-memory" not in c.serve_args()
    validate(serve_parser().parse_args(c.serve_args()))
    m = fit.probe(c.serve_args(), ["--running", "2", "--prompt", "8", "--decode-steps", "2"])
    assert "error" not in m, m
    assert m["decode_step_s"] > 0 and m["kv_cache_bytes"] == kv
    assert m["repeats"] > 1  # a workload this short runs again until MIN_TIMED_S of timings (medians reported)
