"""`python -m server_app.traffic` (issue 38): Flower's count is recorded only beside a count of
ours to compare it with, and the comparison fails past the tolerance either way. The agreement
itself, in a real deployment: tests/e2e/test_deployment.py."""

from __future__ import annotations

import json
import sys

import pytest

from fl_app.rundir import RunDir
from server_app.traffic import UNREADABLE, agrees, compare, main


@pytest.mark.parametrize(
    ("summary", "why"),
    [
        (None, "no readable summary.json"),
        ({"status": "running", "run_id": 5}, "status 'running'"),
        ({"status": "complete", "run_id": 5}, "has no message_bytes"),  # written before the count
    ],
    ids=["none", "running", "old"],
)
def test_a_run_dir_without_our_count_is_refused_in_one_line_and_left_alone(tmp_path, capsys, summary, why):
    rd = RunDir(tmp_path / "r")
    if summary is not None:
        rd.write_summary(summary)
    before = rd.summary_path.read_bytes() if summary is not None else None
    assert main([str(rd.path)]) == UNREADABLE
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert (rd.summary_path.read_bytes() if summary is not None else None) == before


def test_without_flower_s_command_a_run_s_count_is_unreadable_in_one_line_and_left_alone(tmp_path, monkeypatch, capsys):
    """As in a `pip install --target` dir without console scripts: no `flwr` beside this Python or on PATH."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rd = RunDir(tmp_path / "r")
    rd.write_summary({"status": "complete", "run_id": 5, "message_bytes": {"down": 10, "up": 5}})
    before = rd.summary_path.read_bytes()
    assert main([str(rd.path)]) == UNREADABLE
    err = capsys.readouterr().err
    assert "no `flwr` command beside this Python" in err and err.count("\n") == 1, err
    assert "pip install 'flwr[simulation]==1.42.0'" in err, err
    assert rd.summary_path.read_bytes() == before


def test_the_counts_agree_only_within_the_tolerance_each_way():
    ours = {"down": 1000, "up": 500}
    assert agrees(compare(ours, {"outbound_bytes": 1050, "inbound_bytes": 480}))  # +4.8%, -4.2%
    assert not agrees(compare(ours, {"outbound_bytes": 1060, "inbound_bytes": 500}))  # down 5.7% short
    assert not agrees(compare(ours, {"outbound_bytes": 1000, "inbound_bytes": 470}))  # up 6.4% over
    c = compare(ours, {"outbound_bytes": 1100, "inbound_bytes": 500})
    assert c["down"] == {"ours": 1000, "flower": 1100, "diff": 100, "rel": pytest.approx(100 / 1100)}
    assert json.dumps(c)  # what --json prints
