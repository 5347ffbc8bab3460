"""benchmarks/vs_trl.py's pieces that decide its verdict (the runs themselves need TRL: `.[bench]`)."""

from __future__ import annotations

import pytest
from benchmark_module import load_benchmark


def _vs_trl():
    return load_benchmark("vs_trl")


def test_trl_is_scored_as_often_as_agentrls_checkpoints_were():
    spacing = _vs_trl().checkpoint_spacing
    # the warm start at 0 s, then three checkpoints over 30 s: one every 10 s
    assert spacing([(0.0, 0.4), (9.0, 0.5), (21.0, 0.6), (30.0, 0.7)]) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="no scored checkpoint"):
        spacing([(0.0, 0.4)])


def test_an_explicit_scoring_interval_wins_over_agentrls_spacing():
    every = _vs_trl().trl_scoring_every
    curve = [(0.0, 0.4), (11.0, 0.5), (22.0, 0.6)]
    assert every(0.0, curve) == pytest.approx(11.0)  # 0: match agentrl
    assert every(20.0, curve) == 20.0


def test_a_side_that_never_gets_there_stands_in_with_its_budget_as_a_bound():
    ratio = _vs_trl().ratio
    assert ratio(40.0, 20.0, 240.0, 236.0) == (2.0, None)
    assert ratio(None, 20.0, 240.0, 236.0) == (12.0, "lower")  # TRL never: at least 240 / 20
    assert ratio(40.0, None, 240.0, 236.0) == (pytest.approx(40.0 / 236.0), "upper")
    assert ratio(None, None, 240.0, 236.0) == (None, None)
    assert ratio(0.0, 0.0, 240.0, 236.0) == (None, None)  # the shared warm start was already there


def test_the_ladder_races_to_each_target_and_to_trls_best():
    ladder = _vs_trl().ladder
    ours = {"curve": [(0.0, 0.4), (10.0, 0.65), (20.0, 0.75), (30.0, 0.9)], "wall_s": 236.0}
    trl = {"curve": [(0.0, 0.4), (10.0, 0.5), (20.0, 0.62), (40.0, 0.71), (60.0, 0.78), (80.0, 0.7)],
           "wall_s": 240.0}
    rungs = ladder(ours, trl, [0.6, 0.7, 0.8])
    assert rungs["0.6"]["speedup"] == pytest.approx(2.0)  # 20 s / 10 s
    assert rungs["0.7"]["speedup"] == pytest.approx(2.0)  # 40 / 20
    assert rungs["0.8"] == {"target": 0.8, "agentrl_s": 30.0, "trl_s": None, "speedup": pytest.approx(8.0),
                            "bound": "lower"}  # TRL never: its 240 s stand in
    # TRL's best (0.78, at 60 s) was first matched by agentrl at 30 s: not at 20 s (0.75 < 0.78)
    assert rungs["trl_best"]["target"] == 0.78
    assert rungs["trl_best"]["speedup"] == pytest.approx(2.0)
