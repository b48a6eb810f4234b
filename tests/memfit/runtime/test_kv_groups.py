"""KV groups: each layer's window from its config, layers grouped by window (gcd-sized groups), and the most
blocks a sequence holds when its sliding groups drop the blocks behind their window."""

from __future__ import annotations

from types import SimpleNamespace

from memfit.runtime.kv_groups import blocks_for, first_live_block, group_layers, layer_windows

GEMMA3_270M = {"num_hidden_layers": 18, "sliding_window": 512,
               "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3}


def test_layer_windows_from_the_config_kinds():
    assert layer_windows(GEMMA3_270M, 2048) == ([512] * 5 + [None]) * 3
    assert layer_windows({"text_config": GEMMA3_270M}, 2048) == ([512] * 5 + [None]) * 3  # multimodal config.json
    assert layer_windows(GEMMA3_270M, 512) == [None] * 18  # the window never limits a 512-position sequence
    assert layer_windows({"num_hidden_layers": 3, "sliding_window": 64}, 128) == [64] * 3  # Mistral, Phi-3
    assert layer_windows({"num_hidden_layers": 3, "sliding_window": None}, 128) == [None] * 3  # Llama
    assert layer_windows({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": False,
                          "max_window_layers": 2}, 128) == [None] * 4  # Qwen2 as shipped
    assert layer_windows({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": True,
                          "max_window_layers": 2}, 128) == [None, None, 64, 64]
    assert layer_windows({"n_layer": 2, "n_head": 2, "n_embd": 32}, 64) == [None] * 2  # GPT-2's config.json
    assert layer_windows(SimpleNamespace(num_hidden_layers=2, sliding_window=8,
                                         layer_types=["full_attention", "sliding_attention"]), 64) == [None, 8]


def test_groups_are_equal_sized_one_window_each():
    g = group_layers(([512] * 5 + [None]) * 3)  # Gemma 3 270M: 15 sliding layers and 3 full ones
    assert len(g) == 6 and g.size == 3
    assert g.windows == (512,) * 5 + (None,)
    assert g.layers[0] == (0, 1, 2) and g.layers[1] == (3, 4, 6) and g.layers[4] == (14, 15, 16)
    assert g.layers[5] == (5, 11, 17)
    where = g.of_layer(18)
    assert where[5] == (5, 0) and where[17] == (5, 2) and where[14] == (4, 0) and where[6] == (1, 2)
    assert sorted(li for layers in g.layers for li in layers) == list(range(18))
    one = group_layers([None] * 4)  # no sliding layers: one group, the cache as before
    assert len(one) == 1 and one.size == 4 and not one.sliding
    odd = group_layers([8, 8, None])  # coprime counts: groups of one layer
    assert len(odd) == 3 and odd.size == 1 and odd.sliding


def test_blocks_held_counts_a_sliding_group_up_to_its_window_and_one_chunk():
    g = group_layers(([512] * 5 + [None]) * 3)
    # decode (chunk 1) of a 2048-token sequence, blocks of 16: the full group 128, each sliding one 33 (512 + 1
    # positions may straddle 33 blocks)
    assert g.blocks_held(2048, 16, 1) == 128 + 5 * 33
    assert g.blocks_held(2048, 16, 256) == 128 + 5 * (blocks_for(511 + 256, 16) + 1)
    assert g.blocks_held(100, 16, 256) == 6 * 7  # shorter than the window: every group holds all of it
    assert group_layers([None] * 4).blocks_held(2048, 16, 256) == 128
    # first_live_block: HF's rule, a query at p sees keys p - window < j
    assert first_live_block(10, 8, 4) == 0 and first_live_block(11, 8, 4) == 1 and first_live_block(100, None, 4) == 0


def test_the_bound_holds_for_every_position_and_chunk():
    # what a sliding group really holds over [first_live_block(c), blocks_for(c + n)) never exceeds the bound
    for w in (1, 5, 8, 16, 33):
        for bs in (1, 4, 16):
            for n in (1, 3, 7, 16):
                bound = group_layers([w]).blocks_held(10_000, bs, n)
                worst = max(blocks_for(c + n, bs) - first_live_block(c, w, bs) for c in range(200))
                assert worst <= bound, (w, bs, n)
