"""The one decision procedure (:mod:`mpiallreduce.decide`): synthetic rounds, no MPI, no clock."""

from __future__ import annotations

import math

import pytest

from mpiallreduce import decide as rule
from mpiallreduce.decide import decide

STEADY = [100.0, 101.0, 99.0, 100.0, 102.0]  # median 100, spread 2%


def test_a_clear_win_replaces_the_incumbent():
    verdict = decide({"native": STEADY, "ring": [80.0, 82.0, 78.0, 80.0, 84.0]}, "native",
                     one_node=False)
    assert (verdict.pick, verdict.decided, verdict.reason) == ("ring", True, rule.WIN)
    assert verdict.margin == pytest.approx(100 / 80 - 1)
    assert verdict.noise == pytest.approx(2 / 80)  # ring's spread, the larger of the two
    assert verdict.text == "ring beats native by 25% (noise 2.5%)"


def test_a_lead_within_the_noise_keeps_the_incumbent_and_says_so():
    # ring's median is 5% faster, but either code moves by about 15% between rounds
    native = [90.0, 100.0, 110.0, 95.0, 105.0]
    ring = [85.0, 95.2, 105.0, 80.0, 110.0]
    verdict = decide({"native": native, "ring": ring}, "native", one_node=False)
    assert (verdict.pick, verdict.decided, verdict.reason) == ("native", False, rule.WITHIN_NOISE)
    assert 0 < verdict.margin < verdict.noise
    assert verdict.challenger == "ring"
    assert verdict.text.startswith("within noise: keeping native (ring leads by 5.0%, noise ")


def test_an_incumbent_too_noisy_to_judge_is_kept_whatever_the_lead():
    busy = [100.0, 40.0, 300.0, 60.0, 250.0]  # spread far over MAX_NOISE
    verdict = decide({"native": busy, "ring": [10.0, 10.0, 10.0, 10.0, 10.0]}, "native",
                     one_node=False)
    assert (verdict.pick, verdict.decided, verdict.reason) == ("native", False, rule.TOO_NOISY)
    assert verdict.noise > rule.MAX_NOISE
    assert "within noise: keeping native" in verdict.text and "too busy to decide" in verdict.text


def test_the_margin_must_exceed_the_challengers_spread_too():
    # the incumbent is steady, the challenger's median is 20% faster but its rounds spread 40%
    verdict = decide({"native": STEADY, "ring": [60.0, 70.0, 83.3, 100.0, 101.0]}, "native",
                     one_node=False)
    assert verdict.reason == rule.WITHIN_NOISE and verdict.pick == "native"


@pytest.mark.parametrize("name", ["hierarchical", "cascade", "hierarchical-shm", "cascade-p2p"])
def test_one_node_leaves_the_multi_node_algorithms_out(name):
    samples = {"native": STEADY, name: [50.0] * 5, "ring": [90.0, 90.5, 89.5, 90.0, 91.0]}
    assert decide(samples, "native", one_node=True).pick == "ring"
    assert decide(samples, "native", one_node=False).pick == name  # across nodes it competes
    assert rule.eligible(samples, one_node=True) == ["native", "ring"]


def test_on_one_node_an_explicit_multi_node_algorithm_must_beat_the_rest_beyond_noise():
    ring = [60.0, 60.5, 59.5, 60.0, 61.0]
    close = {"native": STEADY, "ring": ring, "cascade": [59.8, 59.9, 59.5, 60.0, 60.5]}
    # it beats native beyond the noise, but ring only within it: ring
    assert decide(close, "native", one_node=True, explicit=["cascade"]).pick == "ring"
    far = {**close, "cascade": [30.0, 30.2, 29.8, 30.0, 30.5]}
    assert decide(far, "native", one_node=True, explicit=["cascade"]).pick == "cascade"
    assert decide(far, "native", one_node=True).pick == "ring"  # not named: no candidate


def test_an_exact_tie_keeps_the_incumbent():
    verdict = decide({"shm": STEADY, "ring": list(STEADY)}, "shm", one_node=True)
    assert (verdict.pick, verdict.decided, verdict.reason) == ("shm", True, rule.FASTEST)
    assert verdict.margin == 0
    assert verdict.text.startswith("keeping shm: nothing measured faster")


def test_a_single_sample_decides_nothing():
    verdict = decide({"native": [100.0], "ring": [10.0]}, "native", one_node=False)
    assert (verdict.pick, verdict.decided, verdict.reason) == ("native", False, rule.TOO_FEW)
    assert verdict.rounds == 1 and math.isnan(verdict.noise)
    assert verdict.text == ("within noise: keeping native (1 round(s): no spread measured, "
                            f"{rule.MIN_ROUNDS} needed)")


def test_a_challenger_with_too_few_rounds_cannot_win():
    verdict = decide({"native": STEADY, "ring": [10.0, 10.0]}, "native", one_node=False)
    assert verdict.pick == "native" and not verdict.decided


def test_the_incumbent_alone_is_decided():
    verdict = decide({"native": [1.0]}, "native", one_node=False)
    assert (verdict.pick, verdict.decided, verdict.reason) == ("native", True, rule.ONLY)


def test_the_fastest_of_several_winners_is_picked_and_ties_go_to_the_earlier_name():
    samples = {"native": STEADY, "tree": [70.0, 70.1, 69.9, 70.0, 70.2],
               "ring": [50.0, 50.1, 49.9, 50.0, 50.2], "knomial": [50.0, 50.1, 49.9, 50.0, 50.2]}
    assert decide(samples, "native", one_node=False).pick == "ring"


def test_samples_that_never_ran_are_left_out_and_a_missing_incumbent_is_an_error():
    verdict = decide({"native": STEADY, "ring": [math.inf] * 5}, "native", one_node=False)
    assert verdict.reason == rule.ONLY
    with pytest.raises(ValueError, match="incumbent 'auto'"):
        decide({"native": STEADY}, "auto", one_node=False)


def test_the_verdict_is_a_pure_function_of_the_samples():
    samples = {"native": [3.0, 1.0, 2.0, 5.0], "ring": [1.0, 1.1, 0.9, 1.0]}
    first = decide(samples, "native", one_node=True)
    assert all(decide(dict(samples), "native", one_node=True) == first for _ in range(3))


def test_spread_is_the_interquartile_range_over_the_median():
    assert rule.spread([90.0, 100.0, 110.0]) == pytest.approx(0.1)  # quartiles 95 and 105
    assert math.isnan(rule.spread([1.0, 2.0]))
    assert rule.percent(0.234) == "23%" and rule.percent(0.034) == "3.4%"
