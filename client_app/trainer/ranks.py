"""A lane over k ranks: data parallelism inside one lane, for either engine (issue 41).

With `run.lane_devices: k > 1` a lane's trainer is k processes under torch.distributed: gloo on
the CPU; on CUDA one GPU per rank, NCCL for tensors and gloo beside it for small objects. Rank 0
is the trainer service's own process; it starts ranks 1..k-1 (`python -m
client_app.trainer.ranks`, children that die with it), each building the same trainer, and
stops them by PID on every path. One fit over k ranks (`loop.RLTrainer`):

  * rank 0 sends the fit to every rank (a pickled command on the rank's stdin: an idle rank
    waits there, not in a collective that would time out) and broadcasts the weights it loaded;
  * each iteration's tasks are cut in task order into k contiguous blocks of whole groups
    (`Ranks.share`); a rank plays its block with the episodes' own seeds (episode i samples
    as it would in a 1-rank fit) and computes its groups' advantages, which need nothing
    from the other ranks;
  * every optimizer step takes the 1-rank fit's mini-batch (`RowLayout`: the same seeded order
    over all ranks' rows), each rank backpropagating its rows of it with the loss
    denominators of the whole mini-batch; the gradients are then summed across ranks
    (`Ranks.sum_`, bucketed, in parameter order), so every rank takes the step a 1-rank lane
    takes on those rows, up to the fp32 summation order;
  * rank 0 computes the fit's metrics from every rank's episodes and rows, checks that every
    rank ends the fit with its weights, and exports them as a 1-rank lane does.

The verl engine shards its models over the ranks (FSDP2 over torch's default process group,
world k, formed over the lane's store: `spans_engine`): the ranks join before it is built, every
call that reads or writes its weights (load, export, validation) runs on all of them
(`RLTrainer`, a "call" command), and each step's gradients are FSDP2's reduce-scatter instead
of `Ranks.sum_`.

A rank that dies or fails fails the fit with an error naming it (gloo notices a closed peer at
once; every collective has `RANK_TIMEOUT_S`); rank 0 then stops the other ranks, and the lane is
lost (`Lead.lost`): it refuses every later call, and its trainer service answers the failed call
and exits, so its lane starts a fresh service at the next call, as for any crashed service. One
rule for both engines: verl's modules span the lost group, so fresh ranks could not join them,
and for the builtin engine a fresh service costs about what fresh ranks do (each builds the
trainer). The lane's own groups (`Ranks.connect`) are never torch's default group, so a process
may hold both.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
import torch.distributed as dist

from fl_app.config import Config, recipe_sha256

RANK_TIMEOUT_S = 1800.0  # one collective (ranks wait there for the slowest rank's rollout)
START_TIMEOUT_S = 1800.0  # a rank builds its trainer (a model load) before it joins
BUCKET_BYTES = 32 * 2**20  # gradients are summed in flat buckets of at most this many bytes
_POLL_S = 0.05

T = TypeVar("T")


class RankFailure(RuntimeError):
    """A rank of a k-rank lane died, failed or could not start; the message names it and why."""


@dataclass(frozen=True)
class RowLayout:
    """Where a rank's training rows sit among every rank's, in rank order (= task order, the
    1-rank fit's row order), with every row's generated-token count: what a rank needs to cut
    the 1-rank fit's mini-batches and their loss denominators."""

    tokens: tuple[int, ...]  # generated tokens of every row of every rank
    offset: int  # index of this rank's first row
    size: int  # this rank's rows

    @property
    def total(self) -> int:
        return len(self.tokens)

    def local(self, rows: Sequence[int]) -> list[int]:
        """This rank's rows of the global `rows`, as indices into its own."""
        return [i - self.offset for i in rows if self.offset <= i < self.offset + self.size]


class Ranks:
    """One rank's view of its lane's process groups: gloo for objects and CPU tensors, NCCL for
    CUDA tensors. They are the lane's own, never torch's default group, which a process may hold
    for something else (verl's engine in the same process, a test suite). `connect` forms them."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._cpu: Any = None  # dist.ProcessGroupGloo
        self._cuda: Any = None  # ProcessGroupNCCL on a CUDA lane
        self.store: dist.Store | None = None  # the rendezvous (an engine's own group forms over it too)
        self.timeout_s = RANK_TIMEOUT_S

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def connect(self, store: dist.Store, timeout_s: float) -> None:
        """Form the lane's groups over `store` (every rank calls it; it returns when all have)."""
        self.store, self.timeout_s = store, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self._cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), self.rank, self.world, timeout)
        if self.device.type == "cuda":
            nccl = dist.ProcessGroupNCCL  # CUDA builds of torch only
            options = nccl.Options()
            options._timeout = timeout
            self._cuda = nccl(dist.PrefixStore("nccl", store), self.rank, self.world, options)

    def disconnect(self) -> None:
        self._cpu = self._cuda = None

    def _group(self, t: torch.Tensor) -> Any:
        group = self._cuda if t.is_cuda else self._cpu
        if group is None:
            raise RankFailure(
                "the lane's ranks are not connected (a failed fit stopped them; the next fit starts them)"
            )
        return group

    def _wait(self, work: Any, what: str) -> None:
        """Wait for a collective; its failure (a peer gone, the timeout) is a RankFailure naming it."""
        try:
            work.wait()
        except RuntimeError as e:
            raise RankFailure(
                f"lane rank {self.rank} of {self.world}: the {what} across the ranks failed (a rank died, "
                f"failed or did not answer within the collective timeout): {e}"
            ) from e

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        self._wait(self._group(t).allreduce([t]), "sum")

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self._group(t).broadcast([t], options), "broadcast")

    def share(self, n: int) -> tuple[int, int]:
        """This rank's block [lo, hi) of n items in order: k contiguous blocks, the first n % k
        one item larger (a pure function of n, k and the rank)."""
        base, extra = divmod(n, self.world)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (self.rank < extra)

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's (picklable) `obj`, in rank order, on every rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._wait(self._group(size).allgather([sizes], [size]), "gather")
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        every = [torch.empty_like(padded) for _ in range(self.world)]
        self._wait(self._group(padded).allgather([every], [padded]), "gather")
        return [pickle.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(every, sizes)]

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's `obj` on rank 0 (in rank order), None on the others."""
        every = self.all_gather(obj)
        return every if self.lead else None

    def layout(self, tokens: Sequence[int]) -> RowLayout:
        """The `RowLayout` of this rank's rows, whose generated-token counts are `tokens`."""
        every = self.all_gather(list(tokens))
        offset = sum(len(t) for t in every[: self.rank])
        return RowLayout(tuple(n for t in every for n in t), offset, len(tokens))

    def broadcast_weights(self, members: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Every member's tensors from rank 0 into the others' (same names, order and shapes:
        `check_same_trainer`)."""
        for tensors in members.values():
            for t in tensors.values():
                self.broadcast(t)

    def sum_(self, params: Sequence[torch.nn.Parameter], values: Sequence[float]) -> list[float]:
        """Sum every parameter's gradient over the ranks in place (a missing one counts as 0,
        a rank may hold no row of a mini-batch), in flat buckets of `BUCKET_BYTES` in parameter
        order; and `values` (float64, on the CPU), returned summed."""
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.all_reduce(flat)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))
        summed = torch.tensor(list(values), dtype=torch.float64)
        self.all_reduce(summed)
        return summed.tolist()

    def sum_terms(
        self,
        terms: Mapping[str, tuple[float, int]],
        added: Sequence[str],
        averaged: Sequence[str],
        params: Sequence[torch.nn.Parameter] = (),
    ) -> dict[str, float]:
        """A step's loss terms over the ranks, from each rank's (sum over its micro-batches,
        micro-batches that produced it): an `added` term is the ranks' total, an `averaged` one
        the mean over every rank's micro-batches; a term no rank produced is left out. `params`'
        gradients are summed in the same exchange (`sum_`)."""
        keys = (*added, *averaged)
        values = [terms.get(k, (0.0, 0))[0] for k in keys] + [float(terms.get(k, (0.0, 0))[1]) for k in keys]
        totals = self.sum_(params, values)
        out: dict[str, float] = {}
        for k, total, n in zip(keys, totals, totals[len(keys) :]):
            if n > 0:
                out[k] = total if k in added else total / n
        return out

    def check_same_weights(self, members: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Fail when a rank ends a fit with other weights than rank 0 (every step is the same
        summed gradient on the same weights, so they must be equal bit for bit): a per-tensor
        float64 sum, compared exactly."""
        sums = [float(t.double().sum()) for tensors in members.values() for t in tensors.values()]
        every = self.all_gather(sums)
        diverged = [r for r, s in enumerate(every) if s != every[0]]
        if diverged:
            raise RankFailure(f"lane ranks {diverged} ended the fit with other weights than rank 0: the ranks diverged")

    def check_same_trainer(self, signature: Any) -> None:
        """Fail unless every rank built the same trainer as rank 0 (recipe, members, tensor
        names and shapes, LoRA base)."""
        every = self.all_gather(signature)
        other = [r for r, s in enumerate(every) if s != every[0]]
        if other:
            raise RankFailure(f"lane ranks {other} built another trainer than rank 0: {every[other[0]]} vs {every[0]}")


def _buckets(tensors: Sequence[torch.Tensor], max_bytes: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def bind_device(rank: int, device: torch.device) -> torch.device:
    """Rank r computes on the lane's r-th GPU (its CUDA_VISIBLE_DEVICES), or the CPU."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def trainer_signature(cfg: Config, engine: Any) -> tuple[Any, ...]:
    """What must be equal on every rank for their steps to be one fit's: read without a
    collective (rank 0 computes it alone, at every fit's start), from the trained parameters'
    global shapes (the exchanged tensors)."""
    shapes = tuple((m, tuple((n, tuple(p.shape)) for n, p in engine.parameters(m))) for m in engine.members)
    return recipe_sha256(cfg), shapes, engine.base_sha256


def spans_engine(cfg: Config) -> bool:
    """Whether the training engine's own process group spans the lane's ranks (verl: FSDP2
    shards its models over them), so the ranks join before it is built and every call that reads
    or writes its weights runs on all of them; the builtin engine holds whole weights on every
    rank and only its fits run on all ranks."""
    return cfg.backend == "verl"


def _die_with(parent: int) -> None:
    """Have the kernel kill this rank when rank 0 (`parent`, the thread that started it) exits,
    however it exits (Linux prctl; set here, not in a pre-exec hook, which is unsafe in a
    threaded service); exit at once if it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class _Rank:
    proc: subprocess.Popen[bytes]
    stdin: IO[bytes]


class Lead(Ranks):
    """Rank 0: starts, commands and stops ranks 1..k-1 (`run.lane_devices` - 1 processes)."""

    def __init__(
        self, cfg: Config, env_url: str | None, run_dir: Path | None, device: torch.device, timeout_s: float
    ) -> None:
        world = cfg.run.lane_devices
        super().__init__(0, world, bind_device(0, device))
        self.cfg, self.env_url, self.run_dir, self.timeout_s = cfg, env_url, run_dir, timeout_s
        self._ranks: list[_Rank] = []
        self._store: dist.TCPStore | None = None
        self._lost: str | None = None  # the failure that stopped the ranks: this lane serves no more

    @property
    def lost(self) -> str | None:
        """Why this lane lost its ranks (the failure that stopped them), or None while it can serve."""
        return self._lost

    @property
    def pids(self) -> list[int]:
        """The PIDs of the ranks this lane runs now (1..k-1)."""
        return [r.proc.pid for r in self._ranks]

    def start(self, signature: tuple[Any, ...] | None = None) -> None:
        """Start ranks 1..k-1 unless they run, wait until each is ready (built its trainer, or
        for an engine that spans them, joined: `spans_engine`) or died (its error), form the
        lane's groups and, given rank 0's `signature`, check they built its trainer."""
        if self._ranks:
            return
        if self._lost is not None:
            raise RankFailure(
                f"this lane lost its {self.world} ranks at an earlier failure ({self._lost}); it serves no more "
                "calls: the trainer service exits, and its lane starts a fresh one at the next call"
            )
        try:
            self._start(signature)
        except BaseException as e:
            self._lost = f"{type(e).__name__}: {e}"
            self.stop()
            raise

    def _start(self, signature: tuple[Any, ...] | None) -> None:
        self._store = store = dist.TCPStore(
            "127.0.0.1", 0, self.world, True, datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False
        )
        for rank in range(1, self.world):
            proc = subprocess.Popen(
                [sys.executable, "-m", __name__], stdin=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2]
            )
            assert proc.stdin is not None
            self._ranks.append(_Rank(proc, proc.stdin))
            start = (os.getpid(), rank, self.world, store.port, self.cfg, self.env_url, self.run_dir, self.timeout_s)
            _send(proc.stdin, start)
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank in range(1, self.world):
            while not store.check([f"ready/{rank}"]):
                if (dead := self.dead()) is not None:
                    raise _lost_ranks(dead)
                if time.monotonic() > deadline:
                    raise RankFailure(f"lane rank {rank} did not build its trainer within {START_TIMEOUT_S:.0f} s")
                time.sleep(_POLL_S)
        self.connect(store, self.timeout_s)
        if signature is not None:
            self.check_same_trainer(signature)

    def run(self, command: tuple[Any, ...] | None, work: Callable[[], T]) -> T:
        """Send `command` (if any) to ranks 1..k-1, then do rank 0's part (`work`). On any
        failure the other ranks are stopped (a collective they wait in would never complete) and
        the lane is `lost`; a rank that died or failed is named in the error."""
        try:
            for r in self._ranks if command is not None else ():
                _send(r.stdin, command)
            return work()
        except BaseException as e:
            dead = self.dead(wait_s=2.0)
            self._lost = dead or f"rank 0 failed: {type(e).__name__}: {e}"
            self.stop(graceful=False)
            if dead is not None:
                raise _lost_ranks(dead) from e
            raise

    def dead(self, wait_s: float = 0.0) -> str | None:
        """The ranks that exited (waiting up to `wait_s` for one to), each with how it ended and
        the error it reported; None while all run."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(i + 1, r.proc.pid, code) for i, r in enumerate(self._ranks) if (code := r.proc.poll()) is not None]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        if not dead:
            return None
        lines = []
        for rank, pid, code in dead:
            error = self._reported(rank)
            lines.append(
                f"lane rank {rank} of {self.world} (pid {pid}) {_exit_reason(code)}" + (f": {error}" if error else "")
            )
        return "; ".join(lines)

    def _reported(self, rank: int) -> str:
        key = f"error/{rank}"
        if self._store is None or not self._store.check([key]):
            return ""
        return self._store.get(key).decode(errors="replace")

    def stop(self, graceful: bool = True) -> None:
        """Stop ranks 1..k-1 by PID and leave the process group.
        `graceful`: a close command first (an idle rank closes its trainer and exits; 10 s), then
        SIGTERM, then SIGKILL; after a failure at once SIGTERM (a rank may wait in a collective,
        or not answer at all), SIGKILL after 3 s."""
        timeout_s = 10.0 if graceful else 3.0
        ranks, self._ranks = self._ranks, []
        if not graceful:
            self.disconnect()  # closes rank 0's end: a rank waiting in a collective fails at once
        for r in ranks:
            with contextlib.suppress(OSError):
                if graceful:
                    _send(r.stdin, ("close",))
                r.stdin.close()
        deadline = time.monotonic() + timeout_s
        for r in ranks:
            for stop in (None, r.proc.terminate, r.proc.kill) if graceful else (r.proc.terminate, r.proc.kill):
                if stop is not None:
                    with contextlib.suppress(ProcessLookupError):
                        stop()
                try:
                    r.proc.wait(max(deadline - time.monotonic(), 1.0))
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.disconnect()
        self._store = None


def _lost_ranks(dead: str) -> RankFailure:
    """The error of a call that lost the lane's ranks (`dead` names them)."""
    return RankFailure(
        f"{dead}. The lane stopped its other ranks and serves no more calls: the trainer service exits, and its "
        "lane starts a fresh one at the next call"
    )


def _send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next command, or None when rank 0 closed the pipe (it exited)."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    return pickle.loads(stream.read(int.from_bytes(head, "little")))


def worker_main() -> int:
    """Rank r > 0: build the trainer rank 0 built, join the lane's groups (before the build when
    the engine's own group spans them: `spans_engine`), then run every command rank 0 sends (a
    fit, or a call of the trainer's that every rank makes) until it says close or its pipe
    closes. An error is reported to rank 0 (through the rendezvous store) and ends the process:
    rank 0 then fails the fit naming it."""
    from client_app.trainer import make_trainer
    from client_app.trainer.device import resolve_device

    stdin = sys.stdin.buffer
    start = _receive(stdin)
    if start is None:
        return 0
    parent, rank, world, port, cfg, env_url, run_dir, timeout_s = start
    _die_with(parent)
    # rank 0's SIGTERM unwinds the fit (its env sessions are closed on the way out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=timeout_s))
    try:
        ranks = Ranks(rank, world, bind_device(rank, resolve_device(cfg.run.device)))
        joined = spans_engine(cfg)
        if joined:
            store.set(f"ready/{rank}", "1")
            ranks.connect(store, timeout_s)
        trainer = make_trainer(cfg, env_url, run_dir, ranks=ranks)
        if not joined:
            store.set(f"ready/{rank}", "1")
            ranks.connect(store, timeout_s)
        ranks.check_same_trainer(trainer_signature(cfg, trainer.engine))
        while (command := _receive(stdin)) is not None and command[0] != "close":
            kind, *args, threads = command
            torch.set_num_threads(threads)
            if kind == "fit":
                trainer.fit(*args)
            else:  # ("call", method, arguments): a call every rank makes with rank 0
                method, arguments = args
                getattr(trainer, method)(*arguments)
        trainer.close()
    except BaseException as e:
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}"[:4000])
        raise
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(worker_main())
