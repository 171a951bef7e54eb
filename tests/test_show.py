"""python -m mpiallreduce.show: diagrams and tables of the schedules the package runs (no MPI)."""

from __future__ import annotations

import ast
import pathlib
import re
import shlex
import sys

import pytest

from mpiallreduce import show
from mpiallreduce.algorithms import REGISTRY
from mpiallreduce.verify import verify

pytest.importorskip("matplotlib")

#: two node shapes: nodes of 2 (and a last node of 1 at odd p) and nodes of 4 (last one smaller)
SHAPES = (2, 4)


def _schedule_messages(schedule) -> int:
    """Non-empty sends of the schedule, counted from the Schedule itself."""
    return sum(1 for _, _, send in schedule.messages() if send.size)


def _arrows(fig) -> int:
    return sum(1 for ax in fig.axes for patch in ax.patches
               if (patch.get_gid() or "").startswith("message"))


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("ranks_per_node", SHAPES)
def test_one_arrow_per_message_for_every_algorithm_at_p_1_to_9(name, ranks_per_node):
    import matplotlib.pyplot as plt

    for p in range(1, 10):
        count = 2 * p + 1  # not divisible by p, every block non-empty
        schedule, topology = show.build(name, p, count, ranks_per_node)
        verify(schedule)
        fig = show.draw(schedule, topology)
        try:
            assert _arrows(fig) == _schedule_messages(schedule) == len(show.messages(schedule))
            if p > 1:
                assert _arrows(fig) > 0
        finally:
            plt.close(fig)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_svg_file_holds_every_arrow(name, tmp_path):
    schedule, topology = show.build(name, 6, 13, 4)
    path = tmp_path / f"{name}.svg"
    assert show.main([name, "--ranks", "6", "--count", "13", "--ranks-per-node", "4",
                      "-o", str(path)]) == 0
    text = path.read_text()
    assert len(re.findall(r'id="message-\d+"', text)) == _schedule_messages(schedule)
    assert "T = " in text and "reduce" in text


def test_ring_cost_terms_are_thakur_rabenseifner_gropp():
    for p in (2, 4, 8):
        schedule, topology = show.build("ring", p, 8 * p, None)
        a, b, c = show.cost_terms(schedule, topology)
        assert a == pytest.approx(2 * (p - 1))
        assert b == pytest.approx(2 * (p - 1) / p)
        assert c == pytest.approx((p - 1) / p)
    schedule, topology = show.build("recursive_doubling", 8, 64, None)
    assert show.cost_terms(schedule, topology) == pytest.approx((3, 3, 3))


def _per_element(segments, count) -> list:
    out = [None] * count
    for lo, hi, contents in segments:
        for i in range(lo, hi):
            out[i] = None if contents is None else tuple(contents)
    return out


def _parse(text: str, count: int) -> dict[int, list]:
    """``after step k`` blocks of the table: step -> per rank, the contents of every element."""
    steps, current = {}, None
    for line in text.splitlines():
        found = re.match(r"\s+after step (\d+):", line)
        if found:
            current = steps.setdefault(int(found.group(1)), [])
            continue
        found = re.match(r"\s+rank (\d+): (.*)$", line)
        if found and current is not None:
            segments = []
            for lo, hi, held in re.findall(r"\[(\d+), (\d+)\) (\([^)]*\)|-)", found.group(2)):
                segments.append((int(lo), int(hi), None if held == "-" else ast.literal_eval(held)))
            current.append(_per_element(segments, count))
    return steps


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("p", [1, 3, 4, 7])
def test_text_matches_the_verifier(name, p):
    count = 2 * p + 1
    schedule, topology = show.build(name, p, count, 2)
    text = show.table(schedule, topology, contributions=True)
    states = {}
    final = verify(schedule, on_step=lambda index, segments: states.__setitem__(index, segments))
    parsed = _parse(text, count)
    assert sorted(parsed) == list(range(schedule.nsteps))
    for index, segments in states.items():
        assert parsed[index] == [_per_element(s, count) for s in segments]
    if schedule.nsteps:
        assert parsed[schedule.nsteps - 1] == [_per_element(s, count) for s in final]
        assert all(e == tuple(range(p)) for rank in parsed[schedule.nsteps - 1] for e in rank)
    lines = [line for line in text.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s+\[", line)]
    listed = sorted(tuple(map(int, re.findall(r"\d+", line)[:5])) for line in lines)
    sends = sorted((index, rank, send.peer, send.start, send.stop)
                   for rank, index, send in schedule.messages() if send.size)
    assert listed == sends


def test_text_through_the_command_line(capsys):
    assert show.main(["knomial", "--ranks", "9", "--param", "k=3", "--text"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# knomial allreduce: 9 ranks") and "k=3" in out
    # 2 rounds up and 2 down; a parent's 2 children share its port: 2(k-1)·2 α and nβ, 2(k-1) nγ
    assert "T = 8·α + 8·nβ + 4·nγ" in out


@pytest.mark.parametrize("argv, message", [
    (["ring", "--ranks", "4"], "give -o"),
    (["ring", "--ranks", "0", "--text"], "--ranks must be at least 1"),
    (["ring", "--ranks", "4", "-o", "x.jpg"], "must end in .svg"),
    (["ring", "--ranks", "4", "--contributions"], "--contributions goes with --text"),
])
def test_bad_usage_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        show.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_algorithm_lists_the_known_ones(capsys):
    assert show.main(["rign", "--ranks", "4", "--text"]) == 2
    err = capsys.readouterr().err
    assert "unknown allreduce algorithm 'rign'" in err and "ring" in err


def test_without_matplotlib_the_error_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert show.main(["ring", "--ranks", "4", "-o", str(tmp_path / "ring.svg")]) == 2
    assert "pip install 'mpiallreduce[plot]'" in capsys.readouterr().err


PAGE = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "algorithms.md").read_text()
DRAWN = re.findall(r"^python -m mpiallreduce\.show (.*) -o (docs/diagrams/\w+\.svg)$", PAGE, re.M)


def test_the_algorithms_page_shows_one_diagram_per_algorithm():
    shown = {pathlib.Path(path).stem for _, path in DRAWN}
    assert shown == set(REGISTRY)
    for _, path in DRAWN:
        assert f"]({path.removeprefix('docs/')})" in PAGE


@pytest.mark.parametrize("argv, path", DRAWN, ids=[pathlib.Path(p).stem for _, p in DRAWN])
def test_the_committed_diagrams_are_the_schedules_of_today(argv, path):
    """Each committed SVG has as many arrows as the schedule its README command builds now
    (rerun the command when a schedule changes)."""
    args = show.build_parser().parse_args([*shlex.split(argv), "-o", path])
    count = 2 * args.ranks if args.count is None else args.count
    schedule, _ = show.build(args.algorithm, args.ranks, count, args.ranks_per_node,
                             show._params(args.param), args.dtype, args.collective)
    text = (pathlib.Path(__file__).resolve().parent.parent / path).read_text()
    assert len(re.findall(r'id="message-\d+"', text)) == _schedule_messages(schedule)
