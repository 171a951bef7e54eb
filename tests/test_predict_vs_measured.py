"""scripts/predict_vs_measured.py: --max-size keeps the judged (and fitted) rows to a size, and
the per-job slope of shm's time per byte and the --fit run replayed as the model: the model is
judged as it is used, on ratios between algorithms and on its picks."""

from __future__ import annotations

import io
import json

import pytest

from mpiallreduce.model import DEFAULT_MACHINE, predict


@pytest.fixture(scope="module")
def script():
    from conftest import load_file

    return load_file("scripts/predict_vs_measured.py", "predict_vs_measured")


def _rows(sizes, shm_per_byte: float):
    """Measured rows at 2 ranks: the model's time for every algorithm but shm, whose time is
    its 8-byte prediction plus ``shm_per_byte`` seconds per byte."""
    base = predict("shm", 2, 8).time
    rows = []
    for size in sizes:
        for name in ("native", "recursive_doubling", "shm"):
            seconds = (base + shm_per_byte * size if name == "shm"
                       else predict(name, 2, size).time)
            rows.append({"size": size, "algorithm": name, "avg_us": seconds * 1e6})
    return rows


def test_max_size_leaves_larger_rows_out_and_the_shm_slope_is_printed(script, tmp_path):
    sizes = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 1 << 20]
    measured = tmp_path / "rows.json"
    measured.write_text(json.dumps({"cases": {"2": _rows(sizes, 0.7e-9)}}))
    out = io.StringIO()
    assert script.main(["--measured", str(measured), "--cores", "2", "--max-size", "64K"],
                       out=out) == 0
    text = out.getvalue()
    judged = [line for line in text.splitlines() if line.startswith("      2  out")]
    assert len(judged) == 3 * 4  # 1 MiB left out
    assert not any(" 1048576 " in line for line in judged)
    slope = [line for line in text.splitlines() if line.startswith("# shm per byte")]
    assert len(slope) == 1 and "measured 0.700 ns/B" in slope[0]
    # the model's own slope over the same sizes, as the script computes it
    predicted = [predict("shm", 2, size).time for size in sizes[:4]]
    expected = script._slope(sizes[:4], predicted) * 1e9
    assert f"predicted {expected:.3f} ns/B" in slope[0]

    out = io.StringIO()
    assert script.main(["--measured", str(measured), "--cores", "2"], out=out) == 0
    assert sum(line.startswith("      2  out") for line in out.getvalue().splitlines()) == 15


def test_keep_sizes_and_no_slope_without_two_shm_sizes(script):
    measured = {("2", "out"): [{"size": 8, "algorithm": "shm", "avg_us": 1.0},
                               {"size": 1 << 20, "algorithm": "shm", "avg_us": 9.0}]}
    assert script.keep_sizes(measured, None) is measured
    assert script.keep_sizes(measured, 64 << 10) == {("2", "out"): [measured[("2", "out")][0]]}
    records = [{"case": "2", "mode": "out", "algorithm": "shm", "size": 16 << 10,
                "measured_us": 5.0, "predicted_us": 4.0}]
    assert script.shm_slopes(records) == []


def test_the_fit_run_replayed_as_the_model(script, tmp_path):
    """With --fit, the fitted run's own measurements are judged as if they were the model (the
    agreement of two jobs, which held-out figures are read against); a row the other run
    lacks is not compared."""
    judged = {"cases": {"2": [{"size": 8, "algorithm": "native", "avg_us": 10.0},
                              {"size": 8, "algorithm": "ring", "avg_us": 20.0},
                              {"size": 8, "algorithm": "tree", "avg_us": 40.0},
                              {"size": 16, "algorithm": "native", "avg_us": 10.0},
                              {"size": 16, "algorithm": "ring", "avg_us": 30.0}]}}
    other = {"cases": {"2": [{"size": 8, "algorithm": "native", "avg_us": 1.0},
                             {"size": 8, "algorithm": "ring", "avg_us": 2.2},   # 2.2 vs 2: in
                             {"size": 8, "algorithm": "tree", "avg_us": 2.0},   # 2 vs 4: out
                             {"size": 16, "algorithm": "native", "avg_us": 5.0}]}}  # no ring
    records = script.compare(script.load_measured([_write(tmp_path / "j.json", judged)]),
                             DEFAULT_MACHINE, 2)
    replay = script.replayed(records, script.load_measured([_write(tmp_path / "o.json", other)]))
    assert [r["predicted_us"] for r in replay] == [1.0, 2.2, 2.0, 5.0, None]
    lines, figures = script.as_used(replay, script.REPLAY)
    assert figures == {"ratios": 1 / 2, "picks": 1.0}  # 16 B: one row compared, no group
    assert all(line.startswith(f"# {script.REPLAY}:") for line in lines)

    out = io.StringIO()
    assert script.main(["--measured", str(tmp_path / "j.json"), "--fit", str(tmp_path / "o.json"),
                        "--cores", "2"], out=out) == 0
    replay_lines = [line for line in out.getvalue().splitlines()
                    if line.startswith(f"# {script.REPLAY}:")]
    assert replay_lines[-1].split()[-4:] == ["1/2", "(50%)", "1/1", "(100%)"]


def _write(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_the_stored_in_job_run_is_ranked_as_it_measured(script):
    """On a stored job of this VM (docs/results/machine-injob.json and its two benches,
    calibrated and measured in one mpirun -n 2 job), the model refitted from the job's own
    measurements puts at least 85% of the ratios between algorithms within +-25% of the
    measured ones and picks within 10% of the measured best in at least 90% of the rows.
    Without the exchange's curve past 64 KiB, the reuse term and shm's rate at 4 KiB, the
    same measurements give 63% and 88%: the bounds hold those terms in the model."""
    from pathlib import Path

    from mpiallreduce.model import Machine
    from mpiallreduce.model.fit import machine_from

    root = Path(__file__).resolve().parent.parent / "docs" / "results"
    stored = Machine.load(str(root / "machine-injob.json"))
    machine = machine_from(stored.info["measurements"])  # refitted by this code, not stored
    rows = script.load_measured([str(root / f"bench-n2-injob-{mode}.json")
                                 for mode in ("out", "in")])
    _, figures = script.as_used(script.compare(rows, machine, None))
    assert figures["ratios"] >= 0.85 and figures["picks"] >= 0.90, figures
