"""Fault suite for weights, aggregation and resume (issue #18, items 3, 7 and 10).

Hypothesis corrupts manifests, shard bytes, client uploads and run dirs. Every fault must end in
the project's own error (WeightsError, RunDirError, PathEscapeError) or, where the data is still
consistent, in exactly the right tensors: never a raw exception, never a silently different
model, never a deleted round. The example counts are recorded in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fl_app.aggregate import NonFiniteWeightsError, fedavg_manifests, fedavg_states
from fl_app.paths import PathEscapeError
from fl_app.rundir import MARKER, RunDir, RunDirError
from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError, load_shards, save_shards, verify_shards

SHARD = 3000


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(24, 16, generator=g),
        "w": torch.randn(16, 16, generator=g),
        "b": torch.randn(16, generator=g),
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
    }


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().numpy().tobytes() for k, v in state.items()}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("faults") / "w"
    save_shards(_state(), d, SHARD)
    return d


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="weights-faults-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fresh(base: Path) -> Path:
    """A new empty dir per hypothesis example (function fixtures are shared by all examples)."""
    return Path(tempfile.mkdtemp(dir=base))


def _fresh_copy(original: Path, base: Path) -> tuple[Path, Path]:
    """A new scratch dir (`_fresh`) and a copy of the original weights in it, for an example to damage."""
    scratch = _fresh(base)
    return scratch, Path(shutil.copytree(original, scratch / "w"))


def _manifest_doc(d: Path) -> dict:
    return json.loads((d / MANIFEST_NAME).read_text())


def _mutate_json(data: st.DataObject, doc: object) -> object:
    """Replace, delete or retype one node somewhere in `doc` (drawn by hypothesis)."""
    if not isinstance(doc, (dict, list)) or not doc or data.draw(st.integers(0, 3)) == 0:
        return data.draw(JSON)
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = data.draw(st.sampled_from(keys))
    if data.draw(st.integers(0, 4)) == 0:
        del doc[key]
    else:
        doc[key] = _mutate_json(data, doc[key])
    return doc


@fuzz(300)
@given(data=st.data())
def test_any_manifest_mutation_is_refused_or_loads_the_exact_model(original, base, data):
    _, d = _fresh_copy(original, base)
    (d / MANIFEST_NAME).write_text(json.dumps(_mutate_json(data, _manifest_doc(d))))
    try:
        got = load_shards(d)
    except WeightsError:
        event("refused")
        return
    event("loaded")
    assert _bits(got) == _bits(_state())  # whatever was accepted is exactly the exported model


def _corrupt(data: st.DataObject, raw: bytes) -> bytes:
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "overwrite"]))
    if op == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
    if op == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if op == "extend":
        return raw + data.draw(st.binary(min_size=1, max_size=64))
    at = data.draw(st.integers(0, len(raw) - 1))
    junk = data.draw(st.binary(min_size=1, max_size=32))
    return raw[:at] + junk + raw[at + len(junk) :]


@fuzz(200)
@given(data=st.data())
def test_any_shard_corruption_is_refused_by_load_verify_and_aggregation(original, base, data):
    scratch, d = _fresh_copy(original, base)
    m = Manifest.from_dir(d)
    victim = d / m.shards[data.draw(st.integers(0, len(m.shards) - 1))].file
    raw = victim.read_bytes()
    bad = _corrupt(data, raw)
    victim.write_bytes(bad)
    changed = bad != raw
    for check in (
        lambda: load_shards(d),
        lambda: verify_shards(m),
        lambda: fedavg_manifests([(original, 2), (d, 1)], scratch / "g", SHARD),
    ):
        if changed:
            with pytest.raises(WeightsError):
                check()
        else:
            check()
        assert not changed or not (scratch / "g").exists()  # a refused aggregation leaves nothing
        shutil.rmtree(scratch / "g", ignore_errors=True)


@fuzz(200)
@given(data=st.data())
def test_a_malicious_client_with_a_consistent_manifest_cannot_crash_the_reader(original, base, data):
    # The client controls shard bytes AND manifest (digest and size re-computed): only the
    # parsing of what it sent stands between it and the server. Refused, or exactly its layout.
    scratch, d = _fresh_copy(original, base)
    doc = _manifest_doc(d)
    i = data.draw(st.integers(0, len(doc["shards"]) - 1))
    victim = d / doc["shards"][i]["file"]
    bad = _corrupt(data, victim.read_bytes())
    victim.write_bytes(bad)
    doc["shards"][i].update(digest=blake3.blake3(bad).hexdigest(), bytes=len(bad))
    doc["total_bytes"] = sum(s["bytes"] for s in doc["shards"])
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    m = Manifest.from_dir(d)
    try:
        got = load_shards(d)
    except WeightsError:
        got = None
    event("refused" if got is None else "loaded")
    if got is not None:
        assert [(k, tuple(v.shape), v.dtype) for k, v in got.items()] == [
            (t.name, t.shape, t.torch_dtype) for t in m.tensors
        ]
    try:
        fedavg_manifests([(d, 1), (original, 1)], scratch / "g", SHARD)
    except NonFiniteWeightsError as e:
        assert e.inputs == [0]  # the corrupted client, never the intact one
    except WeightsError:
        pass
    assert (scratch / "g").exists() == (scratch / "g" / MANIFEST_NAME).is_file()


@fuzz(100)
@given(n=st.integers(1, 4), data=st.data())
def test_non_finite_uploads_are_refused_naming_exactly_the_contributing_culprits(base, n, data):
    scratch = _fresh(base)
    states = [_state(c) for c in range(n)]
    weights = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n).filter(lambda w: sum(w) > 0))
    floating = ["embed", "w", "b"]
    poison = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, n - 1),
                st.sampled_from(floating),
                st.integers(0, 15),
                st.sampled_from([float("nan"), float("inf"), float("-inf")]),
            ),
            max_size=4,
        )
    )
    for c, name, at, value in poison:
        states[c][name].view(-1)[at] = value
    expected: dict[int, set[str]] = {}
    for c, name, _, _ in poison:
        if weights[c] > 0:  # a zero-weight client does not contribute: it is not read
            expected.setdefault(c, set()).add(name)
    ms = [save_shards(s, scratch / f"c{c}", SHARD) for c, s in enumerate(states)]
    names = [f"client {10 + c}" for c in range(n)]
    if not expected:
        ref = fedavg_states(list(zip(states, weights)), names)
        got = load_shards(fedavg_manifests(list(zip(ms, weights)), scratch / "g", SHARD, names=names).root)
        assert _bits(got) == _bits(ref)
        return
    for run in (
        lambda: fedavg_states(list(zip(states, weights)), names),
        lambda: fedavg_manifests(list(zip(ms, weights)), scratch / "g", SHARD, names=names),
    ):
        with pytest.raises(NonFiniteWeightsError) as e:
            run()
        assert {i: {t for t, _, _ in bad} for i, bad in e.value.culprits.items()} == expected
        assert all(f"client {10 + i}" in str(e.value) for i in expected)
        assert not (scratch / "g").exists()


_RESUME_FAULTS = [
    "flip shard byte",
    "truncate shard",
    "delete shard",
    "garble manifest",
    "garble marker",
    "delete marker",
    "delete round",
    "symlink round out",
    "empty manifest",
]


@fuzz(150)
@given(
    faults=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(_RESUME_FAULTS), st.binary(max_size=40)), min_size=1, max_size=3
    )
)
def test_resume_after_any_corruption_refuses_or_picks_a_verified_round_and_deletes_nothing(base, faults):
    scratch = _fresh(base)
    run = RunDir(scratch / "run", total_rounds=5)
    for r in range(4):
        save_shards(_state(r), run.member_dir(r), SHARD)
        run.complete_round(r, {"val_success": r / 10})
    for r, fault, junk in faults:
        rd = run.rounds_dir / f"round-{r:04d}"
        if not rd.is_dir() or rd.is_symlink():
            continue
        shard = next(rd.glob("actor/*.safetensors"), None)
        if fault == "flip shard byte" and shard:
            raw = bytearray(shard.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            shard.write_bytes(bytes(raw))
        elif fault == "truncate shard" and shard:
            shard.write_bytes(shard.read_bytes()[:-7])
        elif fault == "delete shard" and shard:
            shard.unlink()
        elif fault == "garble manifest":
            (rd / "actor" / MANIFEST_NAME).write_bytes(junk)
        elif fault == "garble marker":
            (rd / MARKER).write_bytes(junk)
        elif fault == "delete marker":
            (rd / MARKER).unlink(missing_ok=True)
        elif fault == "delete round":
            shutil.rmtree(rd)
        elif fault == "symlink round out":
            shutil.rmtree(rd)
            os.symlink(scratch, rd)
        elif fault == "empty manifest":
            (rd / "actor" / MANIFEST_NAME).write_text("{}")
    before = {
        p.name: sorted(q.name for q in p.rglob("*"))
        for p in run.rounds_dir.iterdir()
        if p.is_dir() and not p.is_symlink()
    }
    fresh = RunDir(run.path, total_rounds=5)
    try:
        last = fresh.prepare_resume()
    except (RunDirError, PathEscapeError) as e:
        event(f"refused: {type(e).__name__}")
        after = {
            p.name: sorted(q.name for q in p.rglob("*"))
            for p in run.rounds_dir.iterdir()
            if p.is_dir() and not p.is_symlink()
        }
        assert after == before  # a refusal touches nothing
        return
    event(f"resumed after round {last}")
    if last is not None:
        verify_shards(Manifest.from_dir(run.member_dir(last)))  # the resume round is intact
        assert run.rounds_on_disk() == list(range(last + 1))
    after = {p.name.split(".")[0]: sorted(q.name for q in p.rglob("*")) for p in run.rounds_dir.iterdir()}
    assert {k.split(".")[0]: v for k, v in before.items()} == after  # renamed aside, never deleted
