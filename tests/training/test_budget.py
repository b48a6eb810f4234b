"""checkpointing: auto: per-layer probe, the cheapest layer set under a budget, and the plan holding on a real model."""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from memfit.errors import UserError
from training.budget import (
    LayerCost,
    apply_checkpointing,
    choose_checkpointing,
    find_decoder_layers,
    probe_layers,
)
from training.memory import ActivationMeter


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model.train()


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 320, (2, 64), generator=g), torch.randint(0, 320, (2, 64), generator=g)


def forward(model, batch):
    x, y = batch
    return lambda: F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten(), reduction="sum")


def measured(model, batch) -> int:
    with ActivationMeter(model) as meter:
        forward(model, batch)()
    return meter.bytes


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


def test_find_decoder_layers_on_llama_peft_and_gemma3():
    llama = tiny_llama()
    assert find_decoder_layers(llama) is llama.model.layers
    peft = lora(tiny_llama())
    assert type(peft).__name__ == "PeftModelForCausalLM"
    assert find_decoder_layers(peft) is peft.get_base_model().model.layers
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128))
    assert find_decoder_layers(gemma) is gemma.model.layers

    odd = torch.nn.Module()
    odd.config = SimpleNamespace(num_hidden_layers=3)
    odd.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 2)
    with pytest.raises(UserError, match="num_hidden_layers=3"):
        find_decoder_layers(odd)


def test_probe_accounts_for_every_saved_byte(batch):
    model = tiny_llama()
    model.model.layers[1].gradient_checkpointing = True  # the probe measures un-checkpointed, then restores this
    costs, other = probe_layers(model, forward(model, batch))
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [False, True, False, False]
    assert all(p.grad is None for p in model.parameters())

    hidden = 2 * 64 * 64 * 4  # the fp32 input hidden state is what a checkpointed layer keeps
    assert [c.boundary_bytes for c in costs] == [hidden] * 4
    saved = [c.saved_bytes for c in costs]
    assert min(saved) > 4 * hidden and max(saved) <= 1.1 * min(saved)
    assert all(c.forward_s > 0 for c in costs) and other > 0
    # The same distinct storages as the meter sees: the probe only splits them by layer.
    model.model.layers[1].gradient_checkpointing = False
    assert sum(saved) + other == measured(model, batch)


def brute_force(costs: list[LayerCost], other: int, budget: int) -> float:
    best = None
    for n in range(len(costs) + 1):
        for chosen in itertools.combinations(costs, n):
            ids = {c.index for c in chosen}
            size = other + sum(c.boundary_bytes if c.index in ids else c.saved_bytes for c in costs)
            if size <= budget:
                t = sum(c.forward_s for c in chosen)
                best = t if best is None else min(best, t)
    assert best is not None
    return best


def test_choose_is_the_cheapest_set_under_the_budget():
    MiB = 2**20
    costs = [LayerCost(i, s * MiB, MiB, t) for i, (s, t) in
             enumerate([(40, 0.9), (25, 0.3), (60, 1.5), (33, 0.35), (18, 0.5), (51, 0.8)])]
    other = 100 * MiB
    plan = choose_checkpointing(costs, other, other + 227 * MiB)
    assert plan.layers == [] and plan.recompute_s == 0 and plan.predicted_bytes == plan.max_bytes == other + 227 * MiB
    assert plan.min_bytes == other + 6 * MiB
    for budget in range(plan.min_bytes, plan.max_bytes, 7 * MiB // 3):
        plan = choose_checkpointing(costs, other, budget)
        predicted = other + sum(c.boundary_bytes if c.index in plan.layers else c.saved_bytes for c in costs)
        assert plan.predicted_bytes == predicted <= budget
        assert plan.recompute_s == pytest.approx(brute_force(costs, other, budget))
    assert "layer" in plan.table() and "budget" in plan.table()

    with pytest.raises(UserError, match=f"is {plan.min_bytes} .*at least 106MiB") as err:
        choose_checkpointing(costs, other, plan.min_bytes - 1)
    assert "activation_budget" in str(err.value)


def predicted(costs: list[LayerCost], other: int, full, mlp) -> int:
    return other + sum(c.boundary_bytes if c.index in full else
                       c.saved_bytes - c.mlp_saved_bytes + c.mlp_boundary_bytes if c.index in mlp else
                       c.saved_bytes for c in costs)


def brute_force3(costs: list[LayerCost], other: int, budget: int) -> float:
    """The least recompute over every none / MLP only / whole choice per layer (3^n plans)."""
    best = None
    for kinds in itertools.product(("none", "mlp", "full"), repeat=len(costs)):
        if any(k == "mlp" and c.mlp_forward_s is None for c, k in zip(costs, kinds, strict=True)):
            continue
        full = {c.index for c, k in zip(costs, kinds, strict=True) if k == "full"}
        mlp = {c.index for c, k in zip(costs, kinds, strict=True) if k == "mlp"}
        if predicted(costs, other, full, mlp) <= budget:
            t = sum(c.forward_s if k == "full" else c.mlp_forward_s if k == "mlp" else 0.0
                    for c, k in zip(costs, kinds, strict=True))
            best = t if best is None else min(best, t)
    assert best is not None
    return best


def test_choose_mixes_mlp_only_and_whole_layers_optimally():
    MiB = 2**20
    # (saved, kept if whole, time, mlp saved, mlp input kept, mlp time): layer 2 has no MLP option, layer 4's MLP
    # keeps more than it frees (useless), layer 5 is not worth checkpointing whole (its input outweighs it).
    rows = [(40, 1, 0.9, 22, 1, 0.4), (25, 1, 0.3, 14, 1, 0.1), (60, 1, 1.5, 0, 0, None),
            (33, 1, 0.35, 20, 1, 0.2), (18, 1, 0.5, 2, 3, 0.2), (3, 4, 0.8, 2, 1, 0.3)]
    costs = [LayerCost(i, s * MiB, b * MiB, t, ms * MiB, mb * MiB, mt) for i, (s, b, t, ms, mb, mt) in enumerate(rows)]
    other = 100 * MiB
    top = choose_checkpointing(costs, other, 10**12)
    assert top.max_bytes == other + 179 * MiB and top.min_bytes == other + 7 * MiB
    for budget in range(top.min_bytes, top.max_bytes + MiB, 5 * MiB // 3):
        plan = choose_checkpointing(costs, other, budget)
        assert not set(plan.layers) & set(plan.mlp_layers) and 2 not in plan.mlp_layers
        assert plan.predicted_bytes == predicted(costs, other, plan.layers, plan.mlp_layers) <= budget
        assert plan.recompute_s == pytest.approx(
            sum(costs[i].forward_s for i in plan.layers) + sum(costs[i].mlp_forward_s for i in plan.mlp_layers))
        assert plan.recompute_s == pytest.approx(brute_force3(costs, other, budget))
    plan = choose_checkpointing(costs, other, other + 140 * MiB)
    assert plan.mlp_layers and plan.layers
    table = plan.table()
    assert all(kind in table for kind in ("none", "mlp", "full")) and "MLPs only" in table


def gemma3() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=128))
    model.config.use_cache = False
    return model.train()


def wrapped(model) -> list[int]:
    return [i for i, layer in enumerate(find_decoder_layers(model)) if "forward" in layer.mlp.__dict__]


@pytest.mark.parametrize("make", [tiny_llama, gemma3])
def test_mlp_only_checkpointing_frees_what_the_probe_predicts(make, batch):
    model = make()
    reference = copy.deepcopy(model)
    costs, other = probe_layers(model, forward(model, batch))
    for c in costs:
        # The MLP's saved bytes are part of its layer's; its input is saved by its first projections only, so a
        # checkpointed MLP frees them and saves the input again.
        assert 0 < c.mlp_boundary_bytes == c.boundary_bytes < c.mlp_saved_bytes < c.saved_bytes
        assert 0 < c.mlp_forward_s < c.forward_s

    # Mixed plans: the meter sees the prediction, exactly but for one case: the RoPE cos/sin every layer of a kind
    # saves are SHARED (in other_bytes); once all the layers that save one table are checkpointed whole, the table
    # rides in their recompute closures instead of being saved (Gemma 3's full-attention table in the last plan).
    rope = 2 * 2 * 64 * 16 * 4  # at most two tables (Gemma 3: local and global), cos and sin, 64 x head_dim 16 fp32
    for full, mlp in [([0], [1, 2]), ([], [0, 1, 2, 3]), ([1, 2, 3], [0])]:
        apply_checkpointing(model, full, mlp)
        assert wrapped(model) == mlp
        assert [i for i, layer in enumerate(model.model.layers) if layer.gradient_checkpointing] == full
        expected = predicted(costs, other, full, mlp)
        assert expected - rope <= measured(model, batch) <= expected

    # The probe measures un-checkpointed (same costs as before) and puts the plan back afterwards.
    again, other_again = probe_layers(model, forward(model, batch))
    assert [(c.saved_bytes, c.mlp_saved_bytes, c.mlp_boundary_bytes) for c in again] == \
        [(c.saved_bytes, c.mlp_saved_bytes, c.mlp_boundary_bytes) for c in costs] and other_again == other
    assert wrapped(model) == [0]

    apply_checkpointing(model, [0], [1, 2])
    apply_checkpointing(model, [0], [1, 2])  # idempotent: one wrap, not two
    assert [layer.mlp._memfit_inner_forward for layer in model.model.layers[1:3]] == [None, None]
    twin = copy.deepcopy(model)  # the wrap goes with the copy, bound to the copy's MLP
    assert wrapped(twin) == [1, 2] and twin.model.layers[1].mlp.forward.__self__ is twin.model.layers[1].mlp
    forward(model, batch)().backward()
    forward(reference, batch)().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with torch.no_grad():  # no checkpointing (and no warning) outside training
        model.eval()
        torch.testing.assert_close(model(input_ids=batch[0]).logits, reference.eval()(input_ids=batch[0]).logits)

    apply_checkpointing(model, [])
    assert wrapped(model) == [] and not any(layer.gradient_checkpointing for layer in model.model.layers)
    with pytest.raises(ValueError, match="both"):
        apply_checkpointing(model, [1], [1])


def test_mlp_only_lands_a_budget_whole_layers_cannot(batch):
    model = tiny_llama()
    costs, other = probe_layers(model, forward(model, batch))
    # Every layer whole but one MLP-only: whole-layer steps are too coarse to land within 10% under this budget.
    budget = predicted(costs, other, [0, 1, 2], [3]) + 1024
    layers_only = choose_checkpointing([LayerCost(c.index, c.saved_bytes, c.boundary_bytes, c.forward_s)
                                        for c in costs], other, budget)
    assert layers_only.predicted_bytes < 0.9 * budget

    plan = choose_checkpointing(costs, other, budget)
    assert len(plan.mlp_layers) == 1 and len(plan.layers) == 3
    assert 0.9 * budget <= plan.predicted_bytes <= budget
    assert plan.recompute_s < layers_only.recompute_s
    apply_checkpointing(model, plan.layers, plan.mlp_layers)
    assert measured(model, batch) == plan.predicted_bytes


def test_the_plan_holds_on_a_real_model(batch):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    costs, other = probe_layers(model, forward(model, batch))
    plan0 = choose_checkpointing(costs, other, 10**12)
    budget = (plan0.min_bytes + plan0.max_bytes) // 2
    plan = choose_checkpointing(costs, other, budget)
    assert 0 < len(plan.layers) + len(plan.mlp_layers) and len(plan.layers) < 4

    apply_checkpointing(model, plan.layers, plan.mlp_layers)
    assert [i for i, layer in enumerate(model.model.layers) if layer.gradient_checkpointing] == plan.layers
    assert wrapped(model) == plan.mlp_layers
    got = measured(model, batch)
    assert got <= budget and abs(got - plan.predicted_bytes) <= 0.1 * plan.predicted_bytes

    forward(model, batch)().backward()
    forward(reference, batch)().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_per_layer_checkpointing_under_peft(batch):
    model, reference = lora(tiny_llama()), lora(tiny_llama())
    costs, other = probe_layers(reference, forward(reference, batch))
    assert sum(c.saved_bytes for c in costs) + other == measured(reference, batch)
    apply_checkpointing(model, [0, 2])
    assert [layer.gradient_checkpointing for layer in find_decoder_layers(model)] == [True, False, True, False]
    assert measured(model, batch) < measured(reference, batch)
    forward(model, batch)().backward()
    forward(reference, batch)().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())  # the frozen base still passes gradients through
    for n, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, msg=n)
    apply_checkpointing(model, [])
    assert not any(layer.gradient_checkpointing for layer in find_decoder_layers(model))
