"""fl_app.paths.confine: the one path-confinement rule (issue #18)."""

from __future__ import annotations

import os

import pytest

from fl_app.paths import PathEscapeError, confine, is_inside


def test_relative_and_absolute_paths_inside_the_root_are_accepted(tmp_path):
    (tmp_path / "rounds").mkdir()
    assert confine("rounds/round-0001/actor", tmp_path) == tmp_path.resolve() / "rounds/round-0001/actor"
    assert confine(tmp_path / "rounds", tmp_path) == tmp_path.resolve() / "rounds"
    assert confine(tmp_path, tmp_path) == tmp_path.resolve()


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside", "rounds/../../outside", "/"])
def test_paths_out_of_the_root_are_refused(tmp_path, bad):
    root = tmp_path / "run"
    root.mkdir()
    with pytest.raises(PathEscapeError, match="outside"):
        confine(bad, root, what="weights_out")
    assert not is_inside(bad, root)


def test_a_sibling_with_the_root_as_name_prefix_is_outside(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run-other").mkdir()
    with pytest.raises(PathEscapeError):
        confine(tmp_path / "run-other" / "x", tmp_path / "run")


def test_a_symlink_inside_the_root_that_points_out_is_refused_for_reads_and_writes(tmp_path):
    root, outside = tmp_path / "run", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "rounds").mkdir()
    os.symlink(outside, root / "rounds" / "round-0002")
    with pytest.raises(PathEscapeError, match="resolves to"):
        confine("rounds/round-0002/actor", root)  # written through: refused before any write
    with pytest.raises(PathEscapeError):
        confine(root / "rounds" / "round-0002", root)


def test_a_symlink_that_stays_inside_and_a_symlinked_root_are_fine(tmp_path):
    real_root = tmp_path / "real"
    (real_root / "a").mkdir(parents=True)
    os.symlink(real_root / "a", real_root / "alias")
    os.symlink(real_root, tmp_path / "link-to-root")
    assert confine("alias/x", real_root) == real_root.resolve() / "a" / "x"
    assert confine(tmp_path / "link-to-root" / "a", tmp_path / "link-to-root") == real_root.resolve() / "a"
