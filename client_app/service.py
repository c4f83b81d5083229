"""The trainer service: one long-lived process per (run, GPU lane) holding the persistent trainer.

Why a service: Flower deployment starts a new ClientApp process for every message, and in
simulation virtual clients are not pinned to actors. The model, reference model, env service
and rollout engine must outlive both, so they live here; the ClientApp is a thin adapter
(`client_app.lane`) that talks to this process over a Unix socket.

Lifecycle: started by the first ClientApp message of its node on its lane; serves requests one
at a time, all of its torch work (start-up, every request, close) on one thread
(`compute_thread`); exits on `POST /shutdown` (sent when the run ends), after
`run.service_idle_timeout_s` without a request, or as soon as its owner is gone (the simulation
actor that started it, or in deployment the SuperNode: `client_app.runtime_dir.node_owner`),
then abandoning a request or start-up in progress, since nobody would read its answer. It
belongs to exactly one Flower run: requests naming another run are refused.

Trust: it listens on a 0600 Unix socket in a private runtime dir, and every path a request
carries must resolve inside the run dir or the node's weight cache (`fl_app.paths.confine`),
else the request is refused (403). A failed request is answered with the exception's type and
message (`{"error": {"type", "message"}}`; 4xx for a bad request, 500 for a service failure),
so the caller's error names the root cause instead of a bare `Internal Server Error`.

A lane over several ranks that lost them at a failure (`Trainer.lost`) serves no more calls: the
service answers the failed call (its body says `"exits": true`, so the caller waits for the exit)
and exits with code 1, its log naming the lost rank; its lane then starts a fresh service at the
next call, as for any service that crashed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import mmap
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import psutil
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from client_app import memory_debug
from client_app.lane import is_cpu_lane, lane_devices
from client_app.runtime_dir import NodeOwner, live_cpu_services, remove_own_files
from client_app.trainer.base import ClientTasks, Trainer
from client_app.trainer.device import freeze_survivors, resolve_device
from client_app.variant_envs import VariantEnvServices
from envs.registry import make_env
from fl_app.calls import EvalCall, FitCall, InitCall
from fl_app.config import COMPRESSED, Config, load_config, recipe_mismatch, recipe_sha256, require_model_here
from fl_app.downlink import apply_step
from fl_app.host import CPU_THREADS_VAR, cpu_threads, usable_cores
from fl_app.paths import PathEscapeError, confine
from fl_app.quant import Residuals, UpdateMeta, write_update
from fl_app.weights import (
    MANIFEST_NAME,
    Manifest,
    ShardAlloc,
    WeightsError,
    anon_buffer,
    load_shards,
    save_shards,
)
from partitions.pool import TaskPool
from partitions.registry import plan_partition


def shared_store_root(cfg: Config) -> tuple[Path, ...]:
    """A `file://` weight store's dir (global models are read there in place), else nothing."""
    parts = urlsplit(cfg.run.weight_store.strip())
    return (Path(parts.path),) if parts.scheme == "file" else ()


log = logging.getLogger("fedagent.service")


class Refused(Exception):
    """A request this service will not serve (wrong run, wrong members, wrong order)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


DirPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]  # no NUL: not a path
StepPath = Annotated[str, Field(max_length=4096, pattern=r"^[^\x00]*$")]


class StepRefused(Refused):
    """A compressed step this lane will not use (it holds another global model, or the step does
    not rebuild the call's): the ClientApp falls back to the full download (fl_app.downlink)."""

    def __init__(self, message: str) -> None:
        super().__init__(409, message)


class Dirs(BaseModel):
    """Where a call's weights are on this node: the local dirs the ClientApp got the call's
    global weights into (`Channel.get`), and the dirs this service writes the call's output to."""

    model_config = ConfigDict(extra="forbid")

    weights_in: dict[str, DirPath] = Field(default_factory=dict)  # member -> the global weights' dir
    weights_out: dict[str, DirPath] = Field(default_factory=dict)  # member -> where to write its fp32 shards
    # member -> the dir of the call's compressed step (`FitCall.steps`), in place of weights_in, or
    # '' when the lane holds the call's global model already (nothing fetched; fl_app.downlink)
    steps: dict[str, StepPath] = Field(default_factory=dict)


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def cuda_memory_mb() -> dict[str, float]:
    """This process's current allocated CUDA memory and the device's used memory (every
    process, vLLM's own pool included), read at the fit's fixed phase point (after export;
    invariant 24). Empty on a CPU lane (CUDA is never initialised just to read this)."""
    if not torch.cuda.is_initialized():
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "service_cuda_allocated_mb": torch.cuda.memory_allocated() / 2**20,
        "service_device_used_mb": (total - free) / 2**20,
    }


class ReadBuffers:
    """The host memory a lane reads each round's global into, kept per member and shard and
    reused every round: page-locked on a CUDA lane, so loading the weights into the model copies
    at the link's speed (the driver stages pageable memory through its own pinned buffers), with
    the pinning paid once per lane; an anonymous mapping on a CPU lane (`anon_buffer`). A buffer
    is overwritten only when no tensor views it any more (`TrainerService.read` drops its last
    read first); one still viewed is left to its holders and replaced by a fresh one."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._bufs: dict[tuple[str, int], np.ndarray | mmap.mmap] = {}

    def alloc(self, member: str) -> ShardAlloc:
        def get(index: int, size: int) -> np.ndarray | mmap.mmap:
            size = max(size, 1)
            buf: np.ndarray | mmap.mmap | None = self._bufs.get((member, index))
            # held by the dict, `buf` and getrefcount's argument only: no tensor views it any more
            if buf is not None and len(buf) == size and sys.getrefcount(buf) <= 3:
                return buf
            if self.pin:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
            else:
                buf = anon_buffer(size)
            self._bufs[(member, index)] = buf
            return buf

        return get

    def clear(self) -> None:
        self._bufs.clear()


class TrainerService:
    """Owns the trainer and the node's env service; serialises every request."""

    def __init__(self, cfg: Config, run_id: int, lane: str, run_dir: Path | None = None) -> None:
        self.cfg, self.run_id, self.lane = cfg, run_id, lane
        self.recipe_sha256 = recipe_sha256(cfg)  # what every call's recipe digest must be
        self.run_dir = Path(run_dir) if run_dir is not None else cfg.resolved_run_dir()
        # where request paths may point: the run dir, and the node's cache of fetched/staged weights
        self.roots = (self.run_dir, Path(cfg.run.weight_cache_dir).expanduser(), *shared_store_root(cfg))
        self.lock = threading.Lock()
        self.last_request = time.monotonic()
        self.fits = 0
        self.evals = 0
        self.lost: str | None = None  # why the trainer's lane lost its ranks: the service exits (code 1)
        # per member, the last weights read: (its manifest, verified CPU state); see read()
        self._last_read: dict[str, tuple[Manifest, dict[str, torch.Tensor]]] = {}
        cuda = resolve_device(cfg.run.device).type == "cuda"
        if cuda and lane != "cpu" and is_cpu_lane(lane):
            raise RuntimeError(
                f"lane {lane} of run.cpu_lanes={cfg.run.cpu_lanes} would train on this host's GPU (run.device="
                f"{cfg.run.device} sees one, CUDA_VISIBLE_DEVICES is unset), every CPU lane on the same GPU: set "
                'run.device=cpu, or give each lane a GPU (--federation-config "client-resources-num-gpus=1")'
            )
        gpus = lane_devices(lane)
        if cuda and not is_cpu_lane(lane) and cfg.run.lane_devices > 1 and len(gpus) != cfg.run.lane_devices:
            raise RuntimeError(
                f"lane {lane} has {len(gpus)} GPU(s) (CUDA_VISIBLE_DEVICES) but run.lane_devices="
                f"{cfg.run.lane_devices} ranks need one each: give each lane that many GPUs "
                f'(--federation-config "client-resources-num-gpus={cfg.run.lane_devices}"; deployment: a '
                "SuperNode's CUDA_VISIBLE_DEVICES)"
            )
        self._read_buffers = ReadBuffers(pin=cuda)
        # error feedback of compressed updates, node-local (fl_app.quant.Residuals)
        self.residuals = Residuals(Path(cfg.run.weight_cache_dir).expanduser() / "residuals", self.run_dir)
        self._stack = contextlib.ExitStack()
        self.trainer: Trainer | None = None
        self.env_url = ""
        self.variants: VariantEnvServices | None = None
        # FEDAGENT_MEMORY_DEBUG=1: after each fit, log which tensors grew and who holds them
        self.memory_report = memory_debug.MemoryGrowthReport() if memory_debug.enabled() else None

    def start(self) -> None:
        """Start the env service and build the trainer (the slow, once-per-lane part)."""
        from client_app.trainer import make_trainer
        from envs.service import serve_in_subprocess

        require_model_here(self.cfg.model.path, f"this node ({socket.gethostname()}, lane {self.lane})")
        env = self.cfg.env
        self.env_url = self._stack.enter_context(serve_in_subprocess(env.name, env.pool_size, env.params))
        probe = make_env(env.name, **env.params)
        self.num_tasks, self.val_size = probe.num_tasks, probe.val_size
        self.partition = plan_partition(self.cfg, TaskPool.from_env(probe))  # every client's shard, once
        if self.cfg.federation.val_tasks > self.val_size:
            raise ValueError(
                f"federation.val_tasks={self.cfg.federation.val_tasks} exceeds the env's validation "
                f"split ({self.val_size} tasks); lower val_tasks or raise env.params.val_size"
            )
        self.trainer = make_trainer(self.cfg, self.env_url, run_dir=self.run_dir)
        self._stack.callback(self.trainer.close)
        if self.cfg.env_partition.name != "uniform":  # each client trains on its own env variant
            self.variants = VariantEnvServices(self.cfg, base=probe)
            self._stack.callback(self.variants.close)
        freeze_survivors()
        self.last_request = time.monotonic()  # the idle clock starts when the service can serve

    def client_tasks(self, client_id: int) -> ClientTasks:
        """What this client trains on: its shard, and under env heterogeneity the service of its
        env variant (started on first use)."""
        tasks = ClientTasks(self.shard(client_id))
        if self.variants is None:
            return tasks
        env = self.variants.for_client(client_id, tasks.task_indices)
        return ClientTasks(env.tasks, env_url=env.url, env_variant=env.variant.content_hash)

    def shard(self, client_id: int) -> list[int]:
        """This client's training tasks: every lane recomputes the same global assignment."""
        return self.partition.shard(client_id)

    def confined(self, path: str, what: str) -> Path:
        """`path` resolved (symlinks followed) inside one of `self.roots`, else PathEscapeError."""
        for root in self.roots:
            try:
                return confine(path, root, what)
            except PathEscapeError:
                continue
        raise PathEscapeError(
            f"{what} {path!r} lies outside the run dir {self.roots[0]} and the node's weight "
            f"cache {self.roots[1]} (run.weight_cache_dir)"
            + (f" and the shared weight store {self.roots[2]}" if len(self.roots) > 2 else "")
            + "; the trainer service reads and writes weights only there (a symlink out of them "
            "is refused too)"
        )

    def check(
        self, call: FitCall | EvalCall | InitCall, dirs: Dirs, members: tuple[str, ...]
    ) -> tuple[dict[str, Path], dict[str, Path]]:
        """Validate a call before any work: this run, the server's recipe, the members it names
        (a PPO fit without its critic, or a critic the trainer lacks, fails closed instead of
        training half a model), and every dir confined. Returns the dirs in and out, resolved."""
        self._check_run(call.run_id)
        if call.recipe_sha256 != (own := self.recipe_sha256):
            raise Refused(
                409,
                f"this lane resolved a different recipe than the server (sha256 {own[:12]}... vs "
                f"{call.recipe_sha256[:12]}...): {recipe_mismatch(self.cfg, call.recipe_leaves)}. Server "
                "and nodes must run the same app (FAB) and run config; check the recipe files and "
                "environment on this node",
            )
        assert self.trainer is not None
        self._check_base(call)
        ins, outs = set(call.weights), set(dirs.weights_out)
        want_in = members if not isinstance(call, InitCall) else ()
        want_out = self.trainer.members if not isinstance(call, EvalCall) else ()
        got_in = set(dirs.weights_in) | set(dirs.steps)
        if not set(dirs.steps) <= set(call.steps) or set(dirs.steps) & set(dirs.weights_in):
            raise Refused(
                409,
                f"the dirs name steps for {sorted(dirs.steps)} (weights for {sorted(dirs.weights_in)}) but the "
                f"call carries steps for {sorted(call.steps)}: each member is its global model or its step",
            )
        if ins != set(want_in) or got_in != ins or outs != set(want_out):
            raise Refused(
                409,
                f"the call carries weights for {sorted(ins)} (dirs in {sorted(dirs.weights_in)}, out "
                f"{sorted(outs)}) but this {call.kind} needs {sorted(want_in)} in and {sorted(want_out)} out "
                f"(the trainer federates {list(self.trainer.members)}); server and client must run the same "
                "algo.name",
            )
        return (
            {m: self.confined(d, f"weights_in[{m!r}]") for m, d in dirs.weights_in.items()},
            {m: self.confined(d, f"weights_out[{m!r}]") for m, d in dirs.weights_out.items()},
        )

    def apply_steps(self, call: FitCall | EvalCall, dirs: Dirs, ins: dict[str, Path]) -> dict[str, Path]:
        """`ins` with every member the ClientApp fetched as a compressed step (`dirs.steps`)
        replaced by a verified dir of the call's global model, rebuilt from the lane's last read
        (fl_app.downlink.apply_step) into the lane's own dir, or the last read itself when it is
        that model already. StepRefused (the ClientApp then downloads the full model) when the lane
        holds neither the step's base nor the model, or the step does not rebuild it; the lane's
        last read is replaced only by a rebuilt model that matched the call's manifest digest."""
        out = dict(ins)
        for m, d in dirs.steps.items():
            target, held = call.weights[m].manifest_sha256, self._last_read.get(m)
            if held is not None and held[0].sha256 == target:
                out[m] = self._held_dir(m, *held)
                continue
            meta = UpdateMeta.parse(call.steps[m].update, f"the call's step of {m}")
            if held is None or held[0].sha256 != meta.base or not d:
                raise StepRefused(
                    f"{m}: this lane holds global model {held[0].sha256[:12] if held else 'none'}..., not the "
                    f"step's base {meta.base[:12]}... nor the call's model {target[:12]}...; download it in full"
                )
            try:
                step = load_shards(self.confined(d, f"steps[{m!r}]"))
                dest = self._lane_global_dir(m)
                manifest, state = apply_step(held[0], held[1], meta, step, target, dest.with_name(f"{m}.new"))
            except WeightsError as e:
                raise StepRefused(f"{m}: the compressed step was refused ({e}); download the model in full") from e
            shutil.rmtree(dest, ignore_errors=True)
            Path(str(manifest.root)).rename(dest)
            self._last_read[m] = (Manifest.from_dir(dest), state)
            log.info("%s: rebuilt global model %s... from the step (lane held %s...)", m, target[:12], meta.base[:12])
            out[m] = dest
        return out

    def _lane_global_dir(self, member: str) -> Path:
        """Where this lane keeps the global model it rebuilt from a step (one per member, replaced
        each round), in the node's weight cache."""
        run = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]
        return Path(self.cfg.run.weight_cache_dir).expanduser() / "lane-globals" / run / self.lane / member

    def _held_dir(self, member: str, manifest: Manifest, state: dict[str, torch.Tensor]) -> Path:
        """A dir holding the lane's last read of `member` (its own files if they are still there,
        else written again from memory and checked against its digest)."""
        if manifest.root is not None and (manifest.root / MANIFEST_NAME).exists():
            if Manifest.from_dir(manifest.root).sha256 == manifest.sha256:
                return Path(manifest.root)
        dest = self._lane_global_dir(member)
        shutil.rmtree(dest, ignore_errors=True)
        if save_shards(state, dest, manifest.max_shard_bytes, durable=False).sha256 != manifest.sha256:
            raise StepRefused(f"{member}: the lane's last read does not write back to its digest; download it in full")
        return dest

    def save(self, outs: dict[str, Path], durable: bool) -> int:
        """Write every member's fp32 masters into its (checked) dir, straight from the trainer's
        memory where it holds them whole (builtin; a GPU lane streams them through pinned
        buffers, no host copy of the model; verl hands over its gathered copies);
        returns the bytes written. `durable` fsyncs them: the initial weights, not a fit's
        upload, which the server verifies by digest and a crash makes the round redo anyway."""
        assert self.trainer is not None
        shard = int(self.cfg.run.shard_max_mb * 2**20)
        return sum(
            save_shards(self.trainer.master_weights(m), d, shard, durable=durable).total_bytes for m, d in outs.items()
        )

    def save_updates(self, call: FitCall, ins: dict[str, Path], outs: dict[str, Path]) -> tuple[int, float]:
        """Write every member's compressed update from the global model it loaded (`federation.update`,
        fl_app.quant) with this client's error feedback, and keep the new residuals; returns the
        bytes written and `ef_residual_zeros`: 1 when a member had no residual on this node and
        started from zeros (the client's first fit here), else 0."""
        assert self.trainer is not None
        shard = int(self.cfg.run.shard_max_mb * 2**20)
        fed = self.cfg.federation
        written, zeros = 0, 0.0
        for m, d in outs.items():
            base = Manifest.from_dir(ins[m])
            held, w = self._last_read[m]  # load() read and verified it for this fit
            if held.sha256 != base.sha256:
                raise WeightsError(f"{m}: the lane's last read is not this fit's global model; reload it")
            _, residual = self.residuals.read(call.client_id, m, call.round)
            manifest, new = write_update(
                base, w, self.trainer.master_weights(m), residual, fed.update, fed.quant.block, d
            )
            self.residuals.write(call.client_id, m, call.round, new, shard)
            written += manifest.total_bytes
            zeros = max(zeros, float(residual is None))
        return written, zeros

    def load(self, ins: dict[str, Path]) -> bool:
        """Load every member from its (checked) dir; all are read and verified before any is
        loaded. True when every member was the lane's last read (no shard read again)."""
        assert self.trainer is not None
        reads = {m: self.read(m, d) for m, d in ins.items()}
        for member, (state, _) in reads.items():
            self.trainer.load_weights(state, member)
        return all(again for _, again in reads.values())

    def read(self, member: str, weights_dir: Path) -> tuple[dict[str, torch.Tensor], bool]:
        """`member`'s verified weights from `weights_dir`, and whether they were the lane's last
        read. A round's global model reaches one lane several times (each of its clients' fits,
        the validation); its manifest's sha256 pins every shard's digest, so the same manifest
        means the same bytes, already verified: the lane keeps the last read per member (host
        memory for one actor, and one critic under PPO, replaced each round) instead of reading
        and hashing the shards again. Engines copy what they load (`TrainingEngine.load_weights`),
        so the kept state is never trained in place."""
        manifest = Manifest.from_dir(weights_dir)
        last = self._last_read.get(member)
        if last is not None and last[0].sha256 == manifest.sha256:
            return last[1], True
        del last  # this and the kept read go: the old state dies before the new is read into its buffers
        self._last_read.pop(member, None)
        state = load_shards(manifest, alloc=self._read_buffers.alloc(member))
        self._last_read[member] = (manifest, state)
        return state, False

    def held(self) -> dict[str, str]:
        """member -> the manifest sha256 of the lane's last read (what a compressed step may start from)."""
        return {m: held.sha256 for m, (held, _) in self._last_read.items()}

    def init(self, call: InitCall, dirs: Dirs) -> dict[str, Any]:
        """Export the initial weights (before any load): the run's round 0, and where the critic came from."""
        _, outs = self.check(call, dirs, ())
        with self.lock:
            if self.fits or self.evals:
                raise Refused(409, "initial weights requested after the trainer already loaded others")
            self.save(outs, durable=True)
            assert self.trainer is not None  # save() ran on it
            start = self.trainer.critic_start
            return {
                "fits": self.fits,
                "critic_start": start.as_dict() if start is not None else None,
                "base_sha256": self.trainer.base_sha256,
            }

    def close(self) -> None:
        self._last_read.clear()
        self._read_buffers.clear()
        try:
            self._stack.close()
        finally:
            gc.unfreeze()  # hand the frozen objects back to the collector (a service used in-process: tests, benches)

    def _check_base(self, call: FitCall | EvalCall | InitCall) -> None:
        """Under `federation.update: lora` the run's adapters are deltas to one frozen base: a
        lane whose base is other weights (another model dir, warm start or cache) would add them
        to the wrong model, so a call that names another base, or none, is refused."""
        assert self.trainer is not None
        own = self.trainer.base_sha256
        if isinstance(call, InitCall) or call.base_sha256 == own:
            return
        raise Refused(
            409,
            f"this lane's frozen base (sha256 {own or 'none: full weights'}) is not the run's (sha256 "
            f"{call.base_sha256 or 'none recorded'}): its LoRA adapters would be added to other weights. "
            "Every node must build the same base (model.path, model.init_from, the warm start; check the "
            "model files and caches on this node)",
        )

    def _check_run(self, run_id: int) -> None:
        if run_id != self.run_id:
            raise Refused(409, f"this trainer service belongs to run {self.run_id}, not run {run_id}")

    def fit(self, call: FitCall, dirs: Dirs) -> dict[str, Any]:
        assert self.trainer is not None
        ins, outs = self.check(call, dirs, self.trainer.members)
        if call.client_id >= self.cfg.federation.clients:
            raise Refused(
                422,
                f"client_id {call.client_id} is not a client of this run "
                f"(federation.clients={self.cfg.federation.clients})",
            )
        with self.lock:
            self.last_request = time.monotonic()
            t0 = time.perf_counter()
            ins = self.apply_steps(call, dirs, ins)
            reused = self.load(ins)
            t_load = time.perf_counter() - t0
            res = self.trainer.fit(call, self.client_tasks(call.client_id))
            t1 = time.perf_counter()
            ef: dict[str, float] = {}
            if self.cfg.federation.update not in COMPRESSED:  # fp32 weights (full, or lora's adapters)
                bytes_out = self.save(outs, durable=False)
            else:
                bytes_out, ef["ef_residual_zeros"] = self.save_updates(call, ins, outs)
            t_export = time.perf_counter() - t1
            frozen = freeze_survivors()  # what outlived the fit (compiled graphs on the first) is not scanned again
            self.fits += 1
            metrics = dict(res.metrics)
            metrics.update(
                {
                    "load_s": t_load,
                    "load_reused": float(reused),
                    "export_s": t_export,
                    "fit_total_s": time.perf_counter() - t0,
                    "service_fits": float(self.fits),
                    "service_rss_mb": rss_mb(),
                    "service_frozen_objects": float(frozen),
                    **cuda_memory_mb(),
                    "bytes_in": float(sum(_dir_bytes(d) for d in ins.values())),
                    "bytes_out": float(bytes_out),
                    **ef,
                }
            )
            if self.variants is not None:
                metrics["env_variant_services_started"] = float(self.variants.started)
            self.last_request = time.monotonic()
            if self.memory_report is not None:
                memory_debug.log_growth(self.memory_report, log, f"fit {self.fits}")
            log.info(
                "fit %d (round %d, client %d): load %.2f s%s, rollout %.1f s (weight sync %.2f s), update %.1f s, "
                "export %.2f s; after export: RSS %.0f MB, CUDA allocated %.0f MB, device used %.0f MB",
                self.fits,
                call.round,
                call.client_id,
                t_load,
                " (the lane's last read)" if reused else "",
                metrics.get("rollout_s", 0.0),
                metrics.get("rollout_sync_s", 0.0),
                metrics.get("update_s", 0.0),
                t_export,
                metrics["service_rss_mb"],
                metrics.get("service_cuda_allocated_mb", 0.0),
                metrics.get("service_device_used_mb", 0.0),
            )
            return {"num_examples": res.num_examples, "metrics": metrics}

    def evaluate(self, call: EvalCall, dirs: Dirs) -> dict[str, Any]:
        ins, _ = self.check(call, dirs, ("actor",))
        assert self.trainer is not None
        with self.lock:
            self.last_request = time.monotonic()
            t0 = time.perf_counter()
            ins = self.apply_steps(call, dirs, ins)
            reused = self.load(ins)
            t_load = time.perf_counter() - t0
            res = self.trainer.evaluate(call, range(self.cfg.federation.val_tasks))
            self.evals += 1
            self.last_request = time.monotonic()
            metrics = {**res.metrics, "load_s": t_load, "load_reused": float(reused)}
            return {"num_examples": res.num_examples, "metrics": metrics}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


# Exceptions a bad request causes (the caller's fault: 4xx) and their status; anything else is 500.
REQUEST_ERRORS: tuple[tuple[type[Exception], int], ...] = ((PathEscapeError, 403), (WeightsError, 422))


def error_response(
    status: int, exc: BaseException | str, error_type: str | None = None, exits: bool = False
) -> JSONResponse:
    """The one error body every failed request gets: the exception's type and message, and
    `exits` when the service exits after this answer (its lane lost its ranks)."""
    error: dict[str, Any] = {"type": error_type or type(exc).__name__, "message": str(exc)}
    if exits:
        error["exits"] = True
    return JSONResponse(status_code=status, content={"error": error})


def _validation_message(exc: RequestValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())[:2000]


T = TypeVar("T")


def compute_thread() -> ThreadPoolExecutor:
    """The one thread that runs a lane's torch work, from start-up to close.

    torch's CPU kernels run on OpenMP, and libgomp keeps a pool of worker threads for every
    thread that ever ran a parallel region. Once those pools together hold more threads than the
    machine has cores, libgomp stops spinning at its barriers and puts the threads to sleep at
    every one of them. A lane built on its main thread that fits on a web server's worker
    threads has two pools (docs/benchmarks.md, "The lane's threads", has what that cost)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="lane-compute")


class CoreShare:
    """Keeps a CPU lane's torch threads at its share of the host's cores (`fl_app.host.cpu_threads`):
    every CPU SuperNode of a host runs a trainer service of its own, and each would otherwise take
    every core; a lane over `ranks` ranks runs that many trainers (each rank takes rank 0's
    count with every fit). Called on the compute thread before each piece of torch work
    (OpenMP's thread count is per thread), since another node's service may start or stop at any time."""

    def __init__(self, lane: str, ranks: int = 1) -> None:
        self.cpu = is_cpu_lane(lane)
        self.ranks = ranks
        self.default = torch.get_num_threads()
        cpu_threads(1, self.default)  # a malformed override fails the start-up, naming it

    def __call__(self) -> None:
        if not self.cpu:
            return
        peers = live_cpu_services()
        if (want := cpu_threads(peers * self.ranks, self.default)) != torch.get_num_threads():
            torch.set_num_threads(want)
            log.info(
                "torch threads %d: CPU trainer services on this host %d, usable cores %d (%s overrides)",
                want,
                peers,
                usable_cores(),
                CPU_THREADS_VAR,
            )


def create_app(
    svc: TrainerService, stop: threading.Event, compute: ThreadPoolExecutor, share: CoreShare | None = None
) -> FastAPI:
    """The service's HTTP API; requests that touch the trainer run on `compute` (`compute_thread`),
    each after `share` has set the lane's torch threads."""
    app = FastAPI(title="fedagent trainer service")

    def shared(work: Callable[..., T], *args: Any) -> T:
        if share is not None:
            share()
        return work(*args)

    async def on_compute(work: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(compute, shared, work, *args)
        except Exception:
            if svc.lost is None and svc.trainer is not None and (lost := svc.trainer.lost) is not None:
                svc.lost = lost
                log.error("the lane lost its ranks (%s): exiting after this answer", lost)
                stop.set()  # the watchdog stops the server once the answer is sent
            raise

    def answer(status: int, exc: BaseException | str, error_type: str | None = None) -> JSONResponse:
        return error_response(status, exc, error_type, exits=svc.lost is not None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(422, _validation_message(exc), "RequestValidationError")

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return answer(exc.status, exc)

    def refusal(status: int) -> Any:
        async def handler(request: Request, exc: Exception) -> JSONResponse:
            log.warning("%s %s refused: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
            return answer(status, exc)

        return handler

    for kind, status in REQUEST_ERRORS:
        app.add_exception_handler(kind, refusal(status))

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback into the service log after this answer is sent
        return answer(500, exc)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "ok": True,
            "run_id": svc.run_id,
            "lane": svc.lane,
            "pid": os.getpid(),
            "fits": svc.fits,
            "evals": svc.evals,
            "rss_mb": rss_mb(),
            "held": svc.held(),
        }

    @app.post("/fit")
    async def fit(call: FitCall, dirs: Dirs) -> dict[str, Any]:
        return await on_compute(svc.fit, call, dirs)

    @app.post("/evaluate")
    async def evaluate(call: EvalCall, dirs: Dirs) -> dict[str, Any]:
        return await on_compute(svc.evaluate, call, dirs)

    @app.post("/init")
    async def init(call: InitCall, dirs: Dirs) -> dict[str, Any]:
        return await on_compute(svc.init, call, dirs)

    @app.post("/shutdown")
    def shutdown() -> dict[str, Any]:
        stop.set()
        return {"ok": True, "fits": svc.fits}

    return app


def _watchdog(
    svc: TrainerService,
    server: uvicorn.Server,
    stop: threading.Event,
    terminated: threading.Event,
    owner: NodeOwner | None,
    idle_timeout_s: float,
    sock: Path,
) -> None:
    """Stop the server when asked, when idle too long, when the owner process is gone, or on SIGTERM.

    Runs from the first moment (start-up can take minutes). When the owner is gone or SIGTERM came,
    nobody will read the answer of the request or start-up in progress, so the service exits at
    once instead of finishing it: a stopped run must not keep a lane training.
    """
    while not server.should_exit:
        if stop.wait(0.5):
            log.info("shutdown requested")
            break
        reason = (
            "SIGTERM"
            if terminated.is_set()
            else f"owner process {owner.pid} is gone"
            if owner is not None and not owner.alive()
            else ""
        )
        if reason:
            if svc.lock.locked():
                _exit_now(reason, sock)
            log.info("%s; exiting", reason)
            break
        idle = time.monotonic() - svc.last_request
        if idle > idle_timeout_s and not svc.lock.locked():
            log.info("idle for %.0f s; exiting", idle)
            break
    server.should_exit = True


def _exit_now(reason: str, sock: Path) -> None:
    """Abandon the work in progress: stop the children this process started (by PID), then exit."""
    log.warning("%s during a request or start-up; exiting without finishing it", reason)
    children = psutil.Process().children()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    for child in psutil.wait_procs(children, timeout=5)[1]:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    sock.unlink(missing_ok=True)
    remove_own_files()  # os._exit skips atexit
    logging.shutdown()
    os._exit(1)


def bind_private_socket(path: Path) -> socket.socket:
    """A listening Unix socket at `path` that only this user can connect to (0600 from the
    moment it exists: uvicorn's own `uds=` binding makes it 0666)."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Per-lane trainer service (started by the ClientApp).")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run-id", type=int, required=True)
    ap.add_argument("--lane", required=True)
    ap.add_argument("--run-config", required=True, help="the Flower run config as JSON")
    ap.add_argument("--run-dir", default=None, help="the run dir the server uses (default: the config's)")
    ap.add_argument("--owner", default=None, help="pid:create_time of the process this service dies with")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s service[%(process)d] %(message)s")

    run_config = json.loads(args.run_config)
    cfg = load_config(run_config.get("recipe") or "tiny-shop-grpo", overrides=run_config)
    svc = TrainerService(cfg, args.run_id, args.lane, Path(args.run_dir) if args.run_dir else None)
    stop, terminated = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())  # uvicorn's own handler takes over while serving
    sock = Path(args.socket)
    compute = compute_thread()
    share = compute.submit(CoreShare, args.lane, cfg.run.lane_devices).result()
    app = create_app(svc, stop, compute, share)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=600))
    owner = NodeOwner.from_arg(args.owner) if args.owner else None
    threading.Thread(
        target=_watchdog, daemon=True, args=(svc, server, stop, terminated, owner, cfg.run.service_idle_timeout_s, sock)
    ).start()
    try:
        with svc.lock:
            compute.submit(share).result()
            compute.submit(svc.start).result()
        listener = bind_private_socket(sock)
        log.info("serving run %d lane %s on %s", args.run_id, args.lane, sock)
        server.run(sockets=[listener])
    finally:
        compute.submit(svc.close).result()
        compute.shutdown()
        sock.unlink(missing_ok=True)
        log.info("stopped after %d fits, %d evaluations", svc.fits, svc.evals)
    if svc.lost is not None:
        log.error("exiting with code 1: the lane lost its ranks (%s)", svc.lost)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
