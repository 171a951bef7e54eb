"""scripts/predict_vs_measured.py: --max-size keeps the judged (and fitted) rows to a size, and
the per-job slope of shm's time per byte (issue 38, item 3)."""

from __future__ import annotations

import io
import json

import pytest

from mpiallreduce.model import predict


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
