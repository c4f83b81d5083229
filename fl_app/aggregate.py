"""FedAvg in fp32: the example-count-weighted mean of client models (invariant 2).

Two entry points with one arithmetic (`fold_with`, applied to the same tensor-relative pieces),
so they give identical bits; each runs that `Combine` through one of two piece walkers,
`stream_manifests` (shards on disk) and `combine_states` (state dicts in memory), which the robust
aggregators (fl_app.robust) and the server optimizers (fl_app.server_opt) run their own pieces on:
- `fedavg_manifests` streams shard files. For each shard it opens that shard of every client,
  and walks the tensors piece by piece (`PIECE_BYTES`): reader threads read each client's next
  piece while hashing it, the main thread folds the pieces into one output piece, checks it is
  finite and hands it to the `ShardWriter`, which hashes and writes it on two more threads.
  Every byte is read once, hashed once and written once; memory stays at a few pieces per
  client, never a shard, let alone N models. A shard's digests are compared when all of its
  pieces are read, before the next shard starts; any failure aborts the writer, which deletes
  what it wrote, so the output never looks complete and a retry finds it empty.
- `fedavg_states` averages in-memory state dicts (the inline transport path).
Both walkers take any number of inputs and outputs (none: a read-only pass, e.g. for scores) and
call the `Combine` once per piece with the inputs' pieces in lock step.
`fedavg_refs` takes a round's replies as the channel's refs and picks the one that applies.

Per tensor, in client order: acc = x_0 * f_0, then acc += x_i * f_i (one fused multiply-add),
with f_i = w_i / sum(w) and all math in fp32: nothing is widened to float64, nothing narrowed.
A client whose factor is exactly 1 (a single client, or all others weigh 0) is copied, not
multiplied, so FedAvg over one client is the identity bit for bit. Zero-weight clients are
skipped (not even read). Non-floating buffers are not averaged: every client must hold the
same values.

A server learning rate eta != 1 (`federation.server_lr`) makes the new model w + eta * (avg - w),
w the round's global model, computed as the same fold with one more input: the clients with
factors eta * f_i, then w with 1 - eta. At eta = 1 w is not read and the bits are FedAvg's.

Compressed updates (`federation.update: delta-int8 | delta-int4`, fl_app.quant) are inputs too,
beside the model they are deltas from: `walk_shard` reads each one's bytes for a piece of that
model (a whole number of blocks) and decodes them onto its piece, so the `Combine` sees the
client's model x = w + codes * scale as for a full upload, and every aggregator, score and
guard below applies unchanged.

Non-finite uploads (NaN/Inf) are refused (issue #18): NaN and Inf survive every later
multiply-add, so the finished sum is finite exactly when every contributing input is (unless
the mean overflowed fp32, refused as well), and one check per output piece (on data still in
cache) detects them without a pass over the inputs. Only then are the inputs scanned to name
the culprits in a `NonFiniteWeightsError`.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fl_app.channel import Channel, WeightsRef
from fl_app.host import one_torch_thread
from fl_app.quant import UpdateMeta, bad_update_tensors, check_update_layout, decode_piece, is_update
from fl_app.weights import (
    Manifest,
    ShardStream,
    ShardWriter,
    TensorInfo,
    WeightsError,
    all_finite,
    dtype_name,
    load_shards,
    read_shard,
    same_layout,
    save_shards,
)

PIECE_BYTES = 1 << 20  # fold granularity: all live buffers stay in the last-level cache; a multiple of 64
_BUFFERS_PER_INPUT = 3  # one being folded, one read ahead, one being read
_OUT_BUFFERS = 3  # one being folded, two being hashed/written
_READERS = 2  # reader threads (each reads and hashes its share of the inputs)


def weight_factors(weights: Sequence[float]) -> list[float]:
    """w_i / sum(w): the FedAvg factors; weights are example counts (>= 0, not all 0)."""
    if not weights:
        raise WeightsError("FedAvg needs at least one client")
    bad = [w for w in weights if not (w >= 0 and w != float("inf"))]
    total = float(sum(weights))
    if bad or total <= 0:
        raise WeightsError(
            f"FedAvg weights must be finite example counts >= 0 with a positive sum "
            f"(got {list(weights)}); check the clients' num-examples metric"
        )
    return [float(w) / total for w in weights]


def server_step_factors(weights: Sequence[float], server_lr: float, has_previous: bool) -> tuple[list[float], float]:
    """The clients' factors and the round's global model's: (eta * f_i, 1 - eta), so that the fold
    gives w + eta * (avg - w); at eta = 1 exactly FedAvg's factors and 0 (w is not read)."""
    if not (0 < server_lr <= 10):
        raise WeightsError(f"server_lr must be in (0, 10], got {server_lr}; 1 is FedAvg (federation.server_lr)")
    factors = weight_factors(weights)
    if server_lr == 1.0:
        return factors, 0.0
    if not has_previous:
        raise WeightsError(f"server_lr={server_lr} steps from the round's global model; pass it as `previous`")
    return [server_lr * f for f in factors], 1.0 - server_lr


PREVIOUS = "the round's global model"  # the extra input's label in errors


class NonFiniteWeightsError(WeightsError):
    """Some inputs hold NaN/Inf; nothing was written. `culprits` maps each bad input's index (in
    the caller's order) to its bad tensors as (name, non-finite count, numel); `names` are the
    inputs' labels. The server can drop exactly those inputs and aggregate the rest."""

    def __init__(self, message: str, culprits: Mapping[int, Sequence[tuple[str, int, int]]], names: Sequence[str]):
        super().__init__(message)
        self.culprits = {i: list(v) for i, v in culprits.items()}
        self.names = list(names)

    @property
    def inputs(self) -> list[int]:
        return sorted(self.culprits)


# ---- the arithmetic ---------------------------------------------------------------------------
def _fold(acc: torch.Tensor, x: torch.Tensor, factor: float, first: bool, name: str) -> None:
    """Fold one client's piece into the output piece (see the module doc for the exact arithmetic)."""
    if not x.is_floating_point():
        if first:
            acc.copy_(x)
        elif not torch.equal(acc, x):
            raise WeightsError(
                f"non-floating buffer {name!r} differs between clients; it cannot be "
                "averaged: make every client export the same value (or drop it from the export)"
            )
    elif first:
        if factor == 1.0:
            acc.copy_(x)
        else:
            torch.mul(x, factor, out=acc)
    else:
        acc.add_(x, alpha=factor)


# (the tensor, its input pieces in input order, the output pieces to fill in output order); raises
# `NonFinitePiece` on NaN/Inf, or any error to stop the walk
Combine = Callable[[TensorInfo, list[torch.Tensor], list[torch.Tensor]], None]


class NonFinitePiece(Exception):
    """A pass met NaN/Inf in the piece of tensor `where` (the walker then names the culprits)."""

    def __init__(self, where: str):
        self.where = where


def fold_with(factors: Sequence[float]) -> Combine:
    """FedAvg's piece arithmetic: the inputs folded with `factors` in input order into the one
    output (`_fold`), which must be finite."""

    def combine(info: TensorInfo, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        (acc,) = outs
        for k, (x, f) in enumerate(zip(ins, factors, strict=True)):
            _fold(acc, x, f, k == 0, info.name)
        if not all_finite(acc):
            raise NonFinitePiece(repr(info.name))

    return combine


def _pieces(nbytes: int, itemsize: int) -> Iterator[tuple[int, int]]:
    """(offset, length) in elements of the tensor-relative pieces both entry points fold."""
    step = PIECE_BYTES // itemsize
    numel = nbytes // itemsize
    for off in range(0, numel, step):
        yield off, min(step, numel - off)


def _check_fp32(tensors: Sequence[tuple[str, torch.dtype]]) -> None:
    bad = [f"{n} ({d})" for n, d in tensors if d.is_floating_point and d != torch.float32]
    if bad:
        raise WeightsError(
            f"{', '.join(bad[:3])} {'is' if len(bad) == 1 else 'are'} not fp32; FedAvg accumulates "
            "fp32 only (invariant 1): export fp32 master weights"
        )


def _labels(names: Sequence[str] | None, n: int) -> list[str]:
    if names is None:
        return [f"input {i}" for i in range(n)]
    if len(names) != n:
        raise WeightsError(f"got {len(names)} input names for {n} inputs")
    return [str(x) for x in names]


# ---- non-finite inputs: found cheaply, named on the error path -------------------------------
def _bad_tensors(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    out = []
    for name, t in tensors.items():
        if t.is_floating_point():
            n = int((~torch.isfinite(t)).sum())
            if n:
                out.append((name, n, t.numel()))
    return out


def _bad_in(m: Manifest, s: int, verify: bool, label: str) -> list[tuple[str, int, int]]:
    """`_bad_tensors` of shard s of an input, a compressed update's as it decodes."""
    tensors = read_shard(m, s, verify)
    return _bad_tensors(tensors) if not is_update(m) else bad_update_tensors(UpdateMeta.of(m, label), tensors)


def _non_finite_error(culprits: dict[int, list[tuple[str, int, int]]], labels: list[str], where: str) -> WeightsError:
    if not culprits:
        return NonFiniteWeightsError(
            f"the weighted mean of {where} overflowed fp32 although every input is finite; nothing was written. "
            "Some client's weights are near the fp32 limit (3.4e38): its training diverged",
            {},
            labels,
        )
    if PREVIOUS in (labels[i] for i in culprits):
        return WeightsError(
            f"{PREVIOUS} (the server's last checkpoint) holds non-finite values; nothing was written. Resume "
            "from an earlier round (move the later rounds aside) or restart the run"
        )
    parts = []
    for i, bad in sorted(culprits.items()):
        shown = ", ".join(f"{n!r} ({c} of {total} values)" for n, c, total in bad[:3])
        parts.append(
            f"{labels[i]} (input {i}): {shown}" + (f" and {len(bad) - 3} more tensors" if len(bad) > 3 else "")
        )
    return NonFiniteWeightsError(
        "non-finite values (NaN/Inf) in the weights of " + "; ".join(parts) + ". FedAvg refuses them (they would "
        "poison every later round); nothing was written. Drop these inputs and aggregate the others, or find "
        "why their training diverged (e.g. a too high learning rate)",
        culprits,
        labels,
    )


# ---- in memory --------------------------------------------------------------------------------
def fedavg_states(
    inputs: Sequence[tuple[Mapping[str, torch.Tensor], float]],
    names: Sequence[str] | None = None,
    previous: Mapping[str, torch.Tensor] | None = None,
    server_lr: float = 1.0,
) -> dict[str, torch.Tensor]:
    """FedAvg of in-memory state dicts (inputs are not modified). Same bits as `fedavg_manifests`.
    `names` label the inputs in errors (e.g. "client 7"); NaN/Inf raise NonFiniteWeightsError.
    With `server_lr` != 1, the step from `previous` (the round's global model) instead."""
    factors, f_previous = server_step_factors([w for _, w in inputs], server_lr, previous is not None)
    states, labels = [s for s, _ in inputs], _labels(names, len(inputs))
    if previous is not None and f_previous:
        states, factors, labels = [*states, previous], [*factors, f_previous], [*labels, PREVIOUS]
    live = [(i, s) for i, (s, f) in enumerate(zip(states, factors)) if f != 0]
    (out,) = combine_states(live, labels, fold_with([f for f in factors if f != 0]))
    return out


def combine_states(
    live: Sequence[tuple[int, Mapping[str, torch.Tensor]]],
    labels: Sequence[str],
    combine: Combine,
    n_outputs: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """One pass of `combine` over in-memory state dicts (`live`: (index in `labels`, state)), piece
    by piece as `stream_manifests` walks shards, so both give the same bits; returns the
    `n_outputs` output states (none: a read-only pass). NaN/Inf raise NonFiniteWeightsError."""
    keys = list(live[0][1].keys())
    for _, s in live[1:]:
        if list(s.keys()) != keys:
            raise WeightsError(
                "client state dicts hold different tensor names/orders; clients must export the same model"
            )
    _check_fp32([(k, s[k].dtype) for _, s in live for k in keys])
    outs: list[dict[str, torch.Tensor]] = [{} for _ in range(n_outputs)]
    with one_torch_thread():  # the pipeline's own threads use the other cores
        for key in keys:
            xs = [s[key].detach().cpu().contiguous() for _, s in live]
            x0 = xs[0]
            for x in xs[1:]:
                if x.shape != x0.shape or x.dtype != x0.dtype:
                    raise WeightsError(
                        f"{key!r} has shape {list(x.shape)} ({x.dtype}) in one client and "
                        f"{list(x0.shape)} ({x0.dtype}) in another: clients must export the same model"
                    )
            info = TensorInfo(key, tuple(x0.shape), dtype_name(x0.dtype))
            accs = [torch.empty_like(x0) for _ in outs]
            try:
                for off, n in _pieces(x0.numel() * x0.element_size(), x0.element_size()):
                    combine(info, [x.view(-1)[off : off + n] for x in xs], [a.view(-1)[off : off + n] for a in accs])
            except NonFinitePiece as e:
                culprits = {i: bad for i, s in live if (bad := _bad_tensors(s))}
                raise _non_finite_error(culprits, list(labels), e.where) from None
            for out, acc in zip(outs, accs):
                out[key] = acc
    return outs


# ---- streaming --------------------------------------------------------------------------------
class _Readers:
    """Reader threads that fill each input's buffers with its next pieces, in order, hashing as
    they read (each input's stream is read by one thread, so its hash sees bytes in order)."""

    def __init__(self, streams: list[ShardStream], pieces: list[list[int]], buffers: list[list[torch.Tensor]]):
        self.free: list[queue.Queue] = [queue.Queue() for _ in streams]
        self.ready: list[queue.Queue] = [queue.Queue() for _ in streams]
        for q, bufs in zip(self.free, buffers):
            for b in bufs:
                q.put(b)
        self.stop = threading.Event()
        n_threads = min(_READERS, len(streams))
        self.threads = [
            threading.Thread(
                target=self._run,
                name=f"fedavg-read-{r}",
                daemon=True,
                args=([(k, streams[k]) for k in range(r, len(streams), n_threads)], pieces),
            )
            for r in range(n_threads)
        ]
        for t in self.threads:
            t.start()

    def _run(self, mine: list[tuple[int, ShardStream]], pieces: list[list[int]]) -> None:
        """`pieces[k]`: input k's piece sizes in bytes, in order (one per work item)."""
        try:
            for i in range(len(pieces[0])):
                for k, stream in mine:
                    buf = self.free[k].get()
                    if self.stop.is_set():
                        return
                    stream.readinto(buf.numpy().data[: pieces[k][i]])
                    self.ready[k].put(buf)
        except Exception as e:  # handed to the main thread at its next get for these inputs
            for k, _ in mine:
                self.ready[k].put(e)

    def get(self, k: int) -> torch.Tensor:
        item = self.ready[k].get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        for q in self.free:
            q.put(None)  # wake a reader waiting for a buffer
        for t in self.threads:
            t.join()


@dataclass
class PieceBuffers:
    """Piece buffers, allocated once per aggregation and reused for every shard (no page faults
    or allocator churn per shard): `_BUFFERS_PER_INPUT` per live input, `_OUT_BUFFERS` per output."""

    inputs: list[list[torch.Tensor]]
    outs: list[list[torch.Tensor]]

    @classmethod
    def for_model(
        cls, manifest: Manifest, n_inputs: int, n_outputs: int = 1, also: Sequence[Manifest] = ()
    ) -> PieceBuffers:
        """Buffers for pieces of `manifest`'s tensors (and of the updates `also`, whose pieces are
        their own bytes for the same values)."""
        size = max([min(PIECE_BYTES, t.nbytes) for m in (manifest, *also) for t in m.tensors] or [0])
        new = lambda: torch.empty(size, dtype=torch.uint8)  # noqa: E731
        return cls(
            [[new() for _ in range(_BUFFERS_PER_INPUT)] for _ in range(n_inputs)],
            [[new() for _ in range(_OUT_BUFFERS)] for _ in range(n_outputs)],
        )


def walk_shard(
    writers: Sequence[ShardWriter],
    inputs: Sequence[Manifest],
    labels: Sequence[str],
    s: int,
    verify: bool,
    buffers: PieceBuffers,
    combine: Combine,
) -> None:
    """Stream shard s of every input, piece by piece in lock step, into the next shard of every
    writer, all laid out as the first full-weights input's shard (the base): `combine` fills the
    output pieces from the input pieces (and raises to stop). A compressed update among the
    inputs (fl_app.quant, checked against the base by `stream_manifests`) reaches `combine` as
    its client's model, decoded piece by piece onto the base's piece. Every input byte is read
    and hashed once, every output byte hashed and written once; a shard's digests are compared
    when all its pieces are read."""
    streams: list[ShardStream] = []
    readers = None
    metas = [UpdateMeta.of(m, labels[k]) if is_update(m) else None for k, m in enumerate(inputs)]
    base = metas.index(None)
    try:
        for m in inputs:
            streams.append(ShardStream(m, s, verify))
        slots = streams[base].slots
        names = [sl.info.name for sl in slots]
        for label, st, meta in zip(labels, streams, metas):
            same = st.slots == slots if meta is None else [sl.info.name for sl in st.slots] == names
            if not same:
                raise WeightsError(
                    f"shard {st.path} lays its tensors out differently from {streams[base].path} "
                    f"({labels[base]} and {label}); clients must export with the same "
                    "version of fedagent-flower"
                )
        for writer in writers:
            writer.begin_shard(streams[base].info.tensors, [sl.info for sl in slots])
        work = [(sl, off, n) for sl in slots for off, n in _pieces(sl.info.nbytes, sl.info.itemsize)]
        if work:
            sizes = [
                [n * sl.info.itemsize if m is None else m.piece_bytes(sl.info, n) for sl, _, n in work] for m in metas
            ]
            readers = _Readers(streams, sizes, buffers.inputs)
            free: list[queue.Queue] = [queue.Queue() for _ in writers]
            for q, bufs in zip(free, buffers.outs):
                for b in bufs:
                    q.put(b)
            for i, (sl, _, n) in enumerate(work):
                dtype, nbytes = sl.info.torch_dtype, n * sl.info.itemsize
                outs = [q.get() for q in free]
                ins = [readers.get(k) for k in range(len(streams))]
                views = [
                    b[:nbytes].view(dtype) if m is None else b[: sizes[k][i]]
                    for k, (b, m) in enumerate(zip(ins, metas))
                ]
                w = views[base]
                views = [v if m is None else decode_piece(m, sl.info, v, n, w) for v, m in zip(views, metas)]
                combine(sl.info, views, [o[:nbytes].view(dtype) for o in outs])
                for k, b in enumerate(ins):
                    readers.free[k].put(b)
                for writer, q, out in zip(writers, free, outs):
                    done = writer.write(out.numpy().data[:nbytes])
                    done.add_done_callback(functools.partial(_give_back, q, out))
        for st in streams:
            st.finish()  # every byte of the shard was read: compare the digests
        for writer in writers:
            writer.end_shard()
    finally:
        if readers is not None:
            readers.close()
        for st in streams:
            st.close()


def _give_back(pool: queue.Queue, buf: torch.Tensor, _written: object) -> None:
    pool.put(buf)


def fedavg_manifests(
    inputs: Sequence[tuple[Manifest | Path, float]],
    out_dir: Path,
    max_shard_bytes: int,
    verify: bool = True,
    names: Sequence[str] | None = None,
    previous: Manifest | Path | None = None,
    server_lr: float = 1.0,
) -> Manifest:
    """Streaming FedAvg of sharded client models into `out_dir` (manifest written last).

    Every input byte is size- and digest-checked; on any error (corrupt or non-finite input,
    mismatched clients) nothing stays in `out_dir`, so the output never looks complete. `names`
    label the inputs in errors (e.g. "client 7"); NaN/Inf raise NonFiniteWeightsError. With
    `server_lr` != 1, the step from `previous` (the round's global model) instead.
    """
    manifests = [m if isinstance(m, Manifest) else Manifest.from_dir(m) for m, _ in inputs]
    factors, f_previous = server_step_factors([w for _, w in inputs], server_lr, previous is not None)
    labels = _labels(names, len(inputs))
    if previous is not None and f_previous:
        why = "a server_lr != 1 steps from it (or use server_lr 1)"
        manifests.append(step_from_manifest(previous, manifests[0], why))
        factors, labels = [*factors, f_previous], [*labels, PREVIOUS]
    live = [(i, m) for i, (m, f) in enumerate(zip(manifests, factors)) if f != 0]
    fold = fold_with([f for f in factors if f != 0])
    (out,) = stream_manifests(live, labels, fold, [out_dir], max_shard_bytes, verify)
    return out


def step_from_manifest(previous: Manifest | Path, clients: Manifest, why: str) -> Manifest:
    """The round's global model as an input beside the clients' uploads, which it must lay out as
    they do; `why` says what reads it (the error's fix)."""
    step_from = previous if isinstance(previous, Manifest) else Manifest.from_dir(previous)
    if not same_layout([clients, step_from]):
        raise WeightsError(
            f"{PREVIOUS} ({step_from.root}) and the clients' uploads lay their tensors or shards out "
            f"differently (was run.shard_max_mb changed on resume?); {why}, so they must match: keep the "
            "run's shard size"
        )
    return step_from


def stream_manifests(
    live: Sequence[tuple[int, Manifest]],
    labels: Sequence[str],
    combine: Combine,
    out_dirs: Sequence[Path],
    max_shard_bytes: int,
    verify: bool = True,
) -> list[Manifest]:
    """One streaming pass of `combine` over sharded inputs (`live`: (index in `labels`,
    manifest)) into the fresh weights dirs `out_dirs` (none: a read-only pass), returning their
    manifests. Memory stays at a few pieces per input and output (module doc); a non-finite
    input raises NonFiniteWeightsError naming every culprit, and on any error nothing stays in
    the outputs (every manifest is written last)."""
    manifests = [m for _, m in live]
    input_labels = [labels[i] for i, _ in live]
    models = [m for m in manifests if not is_update(m)]
    updates = [(label, m) for label, m in zip(input_labels, manifests) if is_update(m)]
    if not models:
        raise WeightsError(
            "compressed updates need the model they are deltas from among the inputs (the round's global model)"
        )
    if not same_layout(models):
        raise WeightsError(
            "client manifests disagree on tensors or shard layout; every client must "
            "export the same model with the same shard size (run.shard_max_mb)"
        )
    for label, u in updates:
        check_update_layout(UpdateMeta.of(u, label), u, models[0], label)
    if models[0].max_shard_bytes != max_shard_bytes:
        raise WeightsError(
            f"clients split the model into shards of <= {models[0].max_shard_bytes} bytes, the "
            f"aggregate is asked for {max_shard_bytes}: server and clients must share run.shard_max_mb"
        )
    _check_fp32([(t.name, t.torch_dtype) for t in models[0].tensors])
    buffers = PieceBuffers.for_model(models[0], len(manifests), len(out_dirs), [u for _, u in updates])
    try:
        with contextlib.ExitStack() as stack, one_torch_thread():
            writers = [stack.enter_context(ShardWriter(d, max_shard_bytes)) for d in out_dirs]
            for s in range(len(manifests[0].shards)):
                walk_shard(writers, manifests, input_labels, s, verify, buffers, combine)
            return [writer.finish() for writer in reversed(writers)][::-1]  # the first output's manifest last
    except NonFinitePiece as e:
        culprits = {}
        for i, m in live:  # the error path: read everything again, verified, to name every culprit
            bad = [b for s in range(len(m.shards)) for b in _bad_in(m, s, verify, labels[i])]
            if bad:
                culprits[i] = bad
        raise _non_finite_error(culprits, list(labels), e.where) from None


def fedavg_refs(
    items: Sequence[tuple[WeightsRef, Mapping[str, torch.Tensor], float]],
    channel: Channel,
    out_dir: Path,
    names: Sequence[str] | None = None,
    previous: Path | None = None,
    server_lr: float = 1.0,
) -> Manifest:
    """FedAvg of client replies (ref, inline state, num-examples) into the fresh weights dir `out_dir`.

    Inline replies are averaged in memory, store replies are streamed shard by shard; the two
    give identical bits. One round's replies all travel one way (same model, same threshold).
    `names` label the replies in errors (a non-finite upload: `NonFiniteWeightsError`). With
    `server_lr` != 1 the result steps from `previous`, the round's global weights dir.
    """
    step = previous if server_lr != 1.0 else None  # FedAvg itself never reads it
    if replies_inline(items):
        avg = fedavg_states(
            [(channel.state(r, a), w) for r, a, w in items],
            names=names,
            previous=load_shards(step) if step is not None else None,
            server_lr=server_lr,
        )
        return save_shards(avg, out_dir, channel.shard_bytes)
    return fedavg_manifests(
        [(channel.manifest(r), w) for r, _, w in items],
        out_dir,
        channel.shard_bytes,
        names=names,
        previous=step,
        server_lr=server_lr,
    )


def replies_inline(items: Sequence[tuple[WeightsRef, object, float]]) -> bool:
    """Whether a round's replies all travel inline (True) or all by reference (False); anything
    else is an error: one round's replies share one model and one threshold."""
    if not items:
        raise WeightsError("no client replies to aggregate")
    inline = {ref.inline for ref, _, _ in items}
    if len(inline) > 1:
        raise WeightsError(
            "some replies are inline and some by reference; clients of one round must share "
            "run.inline_max_mb (it is part of the run config)"
        )
    return inline == {True}
