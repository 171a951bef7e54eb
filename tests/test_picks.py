"""The kept picks file (:mod:`mpiallreduce.picks`) on one rank: its format, age, fingerprint."""

from __future__ import annotations

import datetime
import json
import math

import pytest
from mpi4py import MPI

from mpiallreduce import __main__ as main_module
from mpiallreduce import decide, picks

KEY = (8388608, False, True, False, "<f8", None)  # learn.case: 8 MiB out of place, float64 SUM


@pytest.fixture
def file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "learned.json"
    monkeypatch.setenv(picks.PATH_ENV, str(path))
    monkeypatch.delenv(picks.DAYS_ENV, raising=False)
    return path


def _verdict(pick="recursive_doubling", incumbent="shm", decided=True):
    return decide.Verdict(pick=pick, incumbent=incumbent, margin=0.5 if decided else math.nan,
                          noise=0.1, decided=decided, reason=decide.WIN if decided else
                          decide.TOO_NOISY, challenger=pick, rounds=5)


def _keep(nranks=2, key=KEY, verdict=None, sizes=(2,)):
    memory = picks.load(MPI.COMM_SELF, sizes)
    memory.put(nranks, key, verdict or _verdict(), {"shm": 3e-3, "recursive_doubling": 2e-3})
    return memory


def test_a_kept_decision_is_read_back_whole(file):
    _keep()
    data = json.loads(file.read_text())
    assert data["format"] == picks.FORMAT
    (machine,) = data["machines"].values()
    assert machine["fingerprint"]["ranks_per_node"] == "2"
    entry = picks.load(MPI.COMM_SELF, (2,)).get(2, KEY, "shm")
    assert entry["pick"] == "recursive_doubling"
    assert picks.verdict_of(entry) == _verdict()
    assert entry["agreed_us"] == {"shm": 3000.0, "recursive_doubling": 2000.0}
    assert not list(file.parent.glob(".learned-*"))  # the temporary file was renamed


def test_an_undecided_verdict_keeps_its_nan_margin(file):
    _keep(verdict=_verdict(pick="shm", decided=False))
    verdict = picks.verdict_of(picks.load(MPI.COMM_SELF, (2,)).get(2, KEY, "shm"))
    assert verdict.decided is False and math.isnan(verdict.margin)


@pytest.mark.parametrize("nranks, key, ruled, sizes", [
    (3, KEY, "shm", (2,)),  # another communicator size
    (2, (8388608, True, True, False, "<f8", None), "shm", (2,)),  # in place
    (2, (8388608, False, True, False, "<f4", None), "shm", (2,)),  # another dtype
    (2, KEY, "native", (2,)),  # the rules now choose another incumbent
    (2, KEY, "shm", (1, 1)),  # two nodes of one rank: another layout
])
def test_only_the_same_case_on_the_same_layout_is_remembered(file, nranks, key, ruled, sizes):
    _keep()
    assert picks.load(MPI.COMM_SELF, sizes).get(nranks, key, ruled) is None


def test_a_stale_pick_is_dropped(file, monkeypatch):
    _keep()
    data = json.loads(file.read_text())
    (machine,) = data["machines"].values()
    (entry,) = machine["cases"].values()
    entry["learned"] = (datetime.datetime.now(datetime.timezone.utc)
                        - datetime.timedelta(days=8)).isoformat()
    file.write_text(json.dumps(data))
    assert picks.load(MPI.COMM_SELF, (2,)).get(2, KEY, "shm") is None
    monkeypatch.setenv(picks.DAYS_ENV, "30")
    assert picks.load(MPI.COMM_SELF, (2,)).get(2, KEY, "shm") is not None
    monkeypatch.setenv(picks.DAYS_ENV, "0")
    assert picks.load(MPI.COMM_SELF, (2,)).get(2, KEY, "shm") is None


def test_a_bad_days_setting_is_a_clear_error(file, monkeypatch):
    monkeypatch.setenv(picks.DAYS_ENV, "soon")
    with pytest.raises(ValueError, match=picks.DAYS_ENV):
        picks.load(MPI.COMM_SELF, (2,))


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "other/9", "machines": {}})])
def test_a_bad_file_warns_is_ignored_and_is_replaced(file, text):
    file.parent.mkdir(parents=True)
    file.write_text(text)
    with pytest.warns(RuntimeWarning, match="ignoring mpiallreduce's learned picks"):
        memory = picks.load(MPI.COMM_SELF, (2,))
    assert memory.cases == {}
    with pytest.warns(RuntimeWarning):
        memory.put(2, KEY, _verdict(), {})
    assert json.loads(file.read_text())["format"] == picks.FORMAT


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(picks.PATH_ENV, "off")
    memory = picks.load(MPI.COMM_SELF, (2,))
    memory.put(2, KEY, _verdict(), {})  # remembered for this communicator only
    assert picks.load(MPI.COMM_SELF, (2,)).get(2, KEY, "shm") is None
    assert picks.path() is None and picks.forget() is None


def test_an_unwritable_cache_warns_and_learning_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(picks.PATH_ENV, str(blocker / "learned.json"))
    with pytest.warns(RuntimeWarning, match="ignoring"):
        memory = picks.load(MPI.COMM_SELF, (2,))
    with pytest.warns(RuntimeWarning) as caught:  # (the read before the write warns too)
        memory.put(2, KEY, _verdict(), {})
    assert any("could not keep" in str(warning.message) for warning in caught)
    assert memory.get(2, KEY, "shm")["pick"] == "recursive_doubling"


def test_the_report_shows_the_picks_and_forget_deletes_them(file, capsys):
    _keep()
    lines = picks.describe((2,))
    assert str(file) in lines[0] and "--forget" in lines[0]
    assert any("p2 8388608 out commutative float64: recursive_doubling" in line for line in lines)
    assert main_module.main(["--forget"]) == 0
    assert "deleted the learned picks" in capsys.readouterr().out and not file.exists()
    assert main_module.main(["--forget"]) == 0
    assert "no learned picks to delete" in capsys.readouterr().out
    assert main_module.main(["--bogus"]) == 2
