"""`memfit fit --for train` (training.fit) on the tiny recipe: probes, derived plans, verification runs, outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import load_config
from training.fit import main, round_up
from training.fit_candidates import MARGIN

from .conftest import write_corpus

RECIPE = "configs/train/tiny.yaml"
# block 256 x micro-batch 8: activations and the plain loss's logits grow the peak by ~10% from the smallest
# candidate to the largest, enough to put a budget between them that the process's RSS noise cannot cross.
SHAPE = ["block_size=256", "batch_size=8", "val_files=[doc0.txt]"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("fit") / "corpus", n_docs=6, words_per_doc=2000)


def _fit(out: Path, memory: str, data: Path, *extra: str) -> int:
    return main(["-", "--memory", memory, "--recipe", RECIPE, "--out", str(out), "--verify-steps", "2",
                 "--max-verify", "1", f"data=[{data}]", *SHAPE, *extra])


def _summary(out: Path) -> dict:
    return json.loads((out / "candidates.json").read_text())


@pytest.fixture(scope="module")
def generous(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("fit") / "generous"
    assert _fit(out, "4GiB", data) == 0
    return out


def test_a_generous_budget_chooses_a_verified_plan_under_it(generous, capsys):
    s = _summary(generous)
    chosen = s["candidates"][s["chosen"]]
    assert chosen["status"] == "chosen" and chosen["measured_tok_s"] > 0
    assert 0 < chosen["measured_peak"] <= s["budget"] == 4 * 2**30
    assert chosen["predicted_peak"] <= s["limit"] == int(s["budget"] * (1 - MARGIN))
    # nothing had to give: the recipe's own method, micro-batch and plainest knobs rank first
    knobs = ("method", "batch_size", "grad_accum", "checkpointing", "offload_activations")
    assert tuple(chosen[k] for k in knobs) == ("full", 8, 1, "none", "none")
    cfg = load_config(str(generous / "recipe.yaml"))
    assert cfg.batch_size * cfg.grad_accum == 8 and cfg.block_size == 256 and not cfg.lora
    assert (cfg.batch_size, cfg.checkpointing, cfg.loss, cfg.optimizer) == (8, "none", chosen["loss"], "adamw")
    assert (generous / "frontier.png").stat().st_size > 1000
    assert "| chosen |" in (generous / "candidates.md").read_text()
    assert len({c["batch_size"] for c in s["candidates"]}) == 4  # every divisor of the global batch 8


def test_predictions_are_the_probes_own_plans_where_probed(generous):
    """At a probed point the derived plan is the probe's MemoryPlan byte for byte; elsewhere activations are
    affine in the micro-batch and checkpointing full keeps less than none."""
    log = (generous / "probes" / "full-fp32.log").read_text().split("\n--- stderr ---")[0]
    probe = json.loads(log.strip().splitlines()[-1])
    point = probe["points"][0]
    assert (point["loss"], point["batch_size"]) == ("chunked", 8)
    cands = _summary(generous)["candidates"]

    def find(**knobs) -> dict:
        base = dict(loss="chunked", optimizer="adamw", offload_activations="none", optimizer_offload="none")
        return next(c for c in cands if all(c[k] == v for k, v in {**base, **knobs}.items()))

    assert find(batch_size=8, checkpointing="none")["plan"] == point["plan"]
    acts = {b: find(batch_size=b, checkpointing="none")["plan"]["activations"] for b in (1, 2, 4, 8)}
    assert acts[4] - acts[2] == pytest.approx(2 * (acts[2] - acts[1]), abs=2)
    assert find(batch_size=8, checkpointing="full")["plan"]["activations"] < acts[8]
    assert find(batch_size=8, checkpointing="none", offload_activations="disk")["plan"]["activations"] == 0


def test_a_budget_between_the_peaks_excludes_the_big_candidates(generous, data, tmp_path):
    peaks = sorted(c["predicted_peak"] for c in _summary(generous)["candidates"])
    limit = peaks[len(peaks) // 3]  # a third of the candidates predicted to fit, the largest not
    assert peaks[-1] - limit > 4 * 2**20  # well clear of the run-to-run RSS noise (a few MiB)
    out = tmp_path / "tight"
    budget = int(limit / (1 - MARGIN))
    assert _fit(out, str(budget), data) == 0
    s = _summary(out)
    chosen = s["candidates"][s["chosen"]]
    assert chosen["predicted_peak"] <= s["limit"] and chosen["measured_peak"] <= budget
    over = [c for c in s["candidates"] if c["status"] == "predicted over budget"]
    assert over and all(c["predicted_peak"] > s["limit"] for c in over)
    biggest = max(s["candidates"], key=lambda c: c["predicted_peak"])
    assert biggest["status"] == "predicted over budget" and biggest["batch_size"] == 8
    cfg = load_config(str(out / "recipe.yaml"))
    assert cfg.batch_size * cfg.grad_accum == 8


def test_a_budget_that_fits_nothing_names_the_smallest_feasible_one(data, tmp_path, capsys):
    out = tmp_path / "nothing"
    assert _fit(out, "1MiB", data) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress lines
    least = min(c["predicted_peak"] for c in _summary(out)["candidates"])
    assert err.startswith("train fit: error: --memory 1.0 MiB: nothing fits")
    assert f"smallest predicted peak is {least / 2**20:.1f} MiB" in err
    assert f"smallest feasible budget is about {round_up(least / (1 - MARGIN))}" in err
    assert not (out / "recipe.yaml").exists()


@pytest.mark.parametrize("args, message", [
    (["-", "--memory", "1GiB", "--recipe", RECIPE, "bogus=1"], "unknown config key 'bogus'"),
    (["-", "--memory", "1GiB", "--recipe", "configs/train/no.yaml"], "--recipe: configs/train/no.yaml does not exist"),
    (["-", "--memory", "2GB", "--recipe", RECIPE], "--memory: '2GB' is not a size"),
    (["models/nope", "--memory", "1GiB", "--recipe", RECIPE], "MODEL: models/nope is not a directory"),
    (["-", "--memory", "1GiB", "--recipe", RECIPE, "--verify-steps", "1"], "--verify-steps must be >= 2"),
])
def test_bad_input_exits_2(args, message, tmp_path, capsys):
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train fit: error: ") and message in err


def _cand(ckpt: str, batch: int, offload: str = "none"):
    from training.fit_candidates import Candidate

    return Candidate("full", "fp32", batch, 8 // batch, ckpt, 64 * 2**20 if ckpt == "auto" else None, "chunked",
                     offload, "adamw", "none")


def test_each_checkpointing_kind_is_verified_before_a_second_plan_of_any_kind():
    from training.fit import verification_order

    ranked = [_cand("none", 8), _cand("none", 4), _cand("none", 8, "disk"), _cand("auto", 8), _cand("none", 2),
              _cand("full", 8)]
    ranked[4].status = "predicted over budget"
    order = verification_order(ranked)
    assert order == [ranked[0], ranked[3], ranked[5], ranked[1], ranked[2]]


def test_near_ties_run_again_and_the_median_chooses(monkeypatch, tmp_path):
    """A (100 tok/s) and B (95) are within 10%: both run again, B's second run (130) beats A's (90) and B is
    chosen on the median; C (50) runs once; D goes over the budget on its run."""
    import training.fit as tf

    runs = {8: [100.0, 90.0], 4: [95.0, 130.0], 2: [50.0], 1: [99.0]}
    peaks = {8: 100, 4: 100, 2: 100, 1: 10**9}

    def child(args, log):
        batch = load_config(args[1]).batch_size
        return {"peak": peaks[batch], "tok_s": runs[batch].pop(0)}, ""

    monkeypatch.setattr(tf, "_child", child)
    a, b, c, d = ranked = [_cand("none", 8), _cand("auto", 4), _cand("full", 2), _cand("none", 1)]
    chosen = tf.verify(ranked, load_config(RECIPE), tmp_path, steps=2, max_verify=4, budget=1000, start=0)
    assert chosen is b and b.status == "chosen" and b.runs_tok_s == [95.0, 130.0] and b.measured_tok_s == 112.5
    assert a.runs_tok_s == [100.0, 90.0] and a.measured_tok_s == 95.0 and a.status == "fits"
    assert c.runs_tok_s == [50.0] and d.status == "over budget"
    assert all(not v for v in runs.values())  # every planned run happened, no more
