"""The launch-balance model of python -m headwise.bench.launch_balance."""

import pytest

from headwise.bench import launch_balance as lb


def test_equal_ctas_that_fill_every_slot_take_the_balanced_time():
    works = [1.0] * (lb.SMS * 3)
    assert lb.makespan(works, slots=3, cap=1 / 3) == pytest.approx(3.0)


def test_a_lone_cta_runs_at_its_cap():
    assert lb.makespan([10.0], slots=3, cap=0.5) == pytest.approx(20.0)
    # Two waves of one CTA per SM: the second wave starts when the first ends.
    assert lb.makespan([1.0] * (2 * lb.SMS), slots=1, cap=1.0) == pytest.approx(2.0)


def test_the_statistics_layouts_do_the_same_work_in_bounded_ctas():
    cases = lb.stats_cases(batch=2, seq=1024, chunk=256)
    totals = {name: sum(sum(w) for w in launches) for name, launches in cases.items()}
    assert len(set(totals.values())) == 1, totals
    assert totals["unsplit"] == 2 * sum(2 * (i + 1) for i in range(16))
    assert max(cases["unsplit"][0]) == 32
    assert max(max(w) for w in cases["256-row chunks"]) == 8
    assert max(cases["one launch"][0]) == 8
    assert len(cases["256-row chunks"]) == 4


def test_the_partials_layouts_do_the_same_work_and_pairing_evens_the_launches():
    cases = lb.partials_cases(batch=1, seq=1024)
    totals = {name: sum(sum(w) for w in launches) for name, launches in cases.items()}
    assert len(set(totals.values())) == 1, totals
    assert [len(cases[name]) for name in ("256 rows", "512 rows", "1024 rows", "256 paired")] == [4, 2, 1, 4]
    per_launch = [sum(w) for w in cases["256 paired"]]
    assert len(set(per_launch)) == 1, per_launch
    assert len({sum(w) for w in cases["256 rows"]}) == 4
