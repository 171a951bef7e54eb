"""scripts/job_state.py's arithmetic: a job's transfer cost and the split of jobs into two
states, which the model cannot take from another job's calibration. The measurement itself
runs MPI jobs and is not run here."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def script():
    from conftest import load_file

    return load_file("scripts/job_state.py", "job_state")


def _job(*pairs):
    return {"blocks": [{"peer": peer, "private": private} for peer, private in pairs]}


def test_transfer_is_the_least_block_of_peer_less_private(script):
    job = _job((0.10e-9, 0.05e-9), (0.07e-9, 0.05e-9), (0.09e-9, 0.04e-9))
    assert script.transfer(job) == pytest.approx(0.02e-9)


def test_split_cuts_at_the_widest_ratio_and_the_summary_names_both_states(script):
    assert script.split([0.058, 0.016, 0.06, 0.013, 0.055]) == ([0.013, 0.016],
                                                               [0.055, 0.058, 0.06])
    assert script.split([1.0]) == ([1.0], [])
    jobs = [_job((p * 1e-9 + 0.05e-9, 0.05e-9)) for p in (0.016, 0.058, 0.06, 0.055)]
    lines = script.summary(jobs)
    assert lines[0].startswith("# fast state: 1 jobs, transfer 0.016-0.016 ns/B")
    assert lines[1].startswith("# slow state: 3 jobs, transfer 0.055-0.060 ns/B, median 0.058")
    assert lines[2] == "# slow / fast (medians): 3.6x"
