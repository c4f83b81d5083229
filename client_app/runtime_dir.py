"""Where a node's trainer services keep their sockets, pid and lock files, and who owns them.

The directory is private to this user: created 0700, and an existing one is refused unless it
is a real directory (not a symlink) owned by this user and writable by nobody else, because
whoever can write into it can plant a socket another lane connects to, or a symlink that a
lane's pid file is written through. Files in it are opened with `O_NOFOLLOW` and must be
regular files owned by us.

Scope: in simulation every virtual node of a host shares one directory (lanes are the unit:
Ray actors on one lane share its service). In deployment each SuperNode gets a subdirectory
of its own (`node-<pid>-<start time>` of the SuperNode process), so two SuperNodes on one host
never share a trainer service, and the service's owner is the SuperNode itself: it outlives the
per-message ClientApp processes and stops when its node stops.
"""

from __future__ import annotations

import atexit
import errno
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

ENV_VAR = "FEDAGENT_RUNTIME_DIR"
PARENT_PID_FLAG = "--parent-pid"


class RuntimeDirError(RuntimeError):
    """The runtime directory or a file in it is not safe to use; the message names the fix."""


def base_runtime_dir() -> Path:
    """This user's runtime dir: `$FEDAGENT_RUNTIME_DIR`, else `<tmp>/fedagent-<uid>` (short:
    Unix socket paths are limited to ~107 bytes)."""
    return private_dir(Path(os.environ.get(ENV_VAR) or Path(tempfile.gettempdir()) / f"fedagent-{os.geteuid()}"))


def private_dir(path: Path) -> Path:
    """Create `path` (mode 0700) or accept an existing one only if it is safe; returns it."""
    try:
        path.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    fix = f"remove it, or point {ENV_VAR} at a directory of your own (mode 0700)"
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime dir {path} is not a directory (a symlink or a file); {fix}")
    if st.st_uid != os.geteuid():
        raise RuntimeDirError(
            f"runtime dir {path} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}): another user could control its sockets; {fix}"
        )
    if st.st_mode & 0o022:
        raise RuntimeDirError(
            f"runtime dir {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}); {fix}, or `chmod 700` it"
        )
    return path


def _open_private(path: Path, flags: int) -> int:
    """os.open without following a symlink at `path`; the result must be our own regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RuntimeDirError(f"{path} is a symlink; refusing to open it (someone planted it: remove it)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise RuntimeDirError(f"{path} is not a regular file owned by this user; remove it")
    return fd


def open_lock(path: Path) -> int:
    """A lock file's descriptor (created 0600, never through a symlink)."""
    return _open_private(path, os.O_RDWR | os.O_CREAT)


def write_private(path: Path, text: str) -> None:
    fd = _open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def read_private(path: Path) -> str | None:
    """The file's text, or None when it does not exist."""
    try:
        fd = _open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as fh:
        return fh.read()


def started(p: psutil.Process) -> float:
    """When `p` started, a value fixed for its whole life, so another process computes the same.

    psutil's `create_time()` is the boot time in wall-clock seconds plus the start offset, and
    Linux derives the boot time from the current clock: every NTP step or slew of a VM's clock
    moves it (a lane service once took its live owner for a reused PID and quit during start-up).
    On Linux this is the start in seconds since boot instead (`/proc/<pid>/stat`, the kernel's
    own record); elsewhere psutil's create_time(), which on macOS and Windows is a timestamp the
    kernel stored at the start."""
    if not sys.platform.startswith("linux"):
        return p.create_time()
    try:
        stat_line = Path(f"/proc/{p.pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # gone before or while it was read
        raise psutil.NoSuchProcess(p.pid) from None
    fields = stat_line[stat_line.rfind(b")") + 2 :].split()  # after the command name, from field 3
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks


@dataclass(frozen=True)
class NodeOwner:
    """The process a node's trainer services live and die with.

    `pid` and `create_time` (`started`) identify it (a reused PID is a different process);
    `scope` is the runtime subdirectory of its services ("" = shared by every virtual node of
    the host).
    """

    pid: int
    create_time: float
    scope: str

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.pid)
            return started(p) == self.create_time and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def runtime_dir(self) -> Path:
        base = base_runtime_dir()
        return private_dir(base / self.scope) if self.scope else base

    def as_arg(self) -> str:
        return f"{self.pid}:{self.create_time!r}"

    @classmethod
    def from_arg(cls, arg: str) -> NodeOwner:
        pid, created = arg.split(":", 1)
        return cls(int(pid), float(created), "")


def _parent_pid_flag(cmdline: list[str]) -> int | None:
    for i, arg in enumerate(cmdline):
        if arg == PARENT_PID_FLAG and i + 1 < len(cmdline):
            return int(cmdline[i + 1])
        if arg.startswith(PARENT_PID_FLAG + "="):
            return int(arg.split("=", 1)[1])
    return None


def node_owner(argv: list[str] | None = None, pid: int | None = None) -> NodeOwner:
    """Who owns this process's trainer services.

    Flower deployment starts each ClientApp as `flwr-clientapp ... --parent-pid <SuperExec>`,
    and a SuperNode in subprocess isolation starts its SuperExec with `--parent-pid <SuperNode>`;
    each of them exits when its `--parent-pid` does. The root of that chain (the SuperNode, or
    an operator-started SuperExec in `--isolation process`) is the node: it owns the services
    and gets a runtime scope of its own. A process without `--parent-pid` (a simulation actor)
    owns its services itself, in the shared scope.
    """
    me = psutil.Process(pid) if pid is not None else psutil.Process()
    nxt = _parent_pid_flag(list(sys.argv if argv is None else argv))
    if nxt is None:
        return NodeOwner(me.pid, started(me), "")
    seen = {me.pid}
    root = me
    while nxt is not None and nxt not in seen:
        seen.add(nxt)
        try:
            root = psutil.Process(nxt)
            nxt = _parent_pid_flag(root.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            raise RuntimeDirError(f"the node process {nxt} this ClientApp belongs to is gone") from None
    try:
        created = started(root)
    except psutil.NoSuchProcess:
        raise RuntimeDirError(f"the node process {root.pid} this ClientApp belongs to is gone") from None
    return NodeOwner(root.pid, created, f"node-{root.pid}-{int(created * 1000)}")


_OWN_FILES: list[tuple[Path, int]] = []  # (file, the pid that created it)


def remove_at_exit(path: Path) -> None:
    """Remove `path` when this process ends, normally (atexit) or through `remove_own_files`,
    which a process that leaves with `os._exit` calls first; never from a forked child."""
    if not _OWN_FILES:
        atexit.register(remove_own_files)
    _OWN_FILES.append((path, os.getpid()))


def remove_own_files() -> None:
    for path, pid in _OWN_FILES:
        if pid == os.getpid():
            path.unlink(missing_ok=True)


SERVICE_MODULE = "client_app.service"


def live_cpu_services() -> int:
    """How many CPU-lane trainer services of this user run on this host now, over every node's
    runtime dir (their pid files `svc-<run>-cpu*.pid`, every CPU lane): the trainers that share its cores. A pid
    counts only while its process is a trainer service (a stale file's reused pid does not)."""
    base = base_runtime_dir()
    live = set()
    for pid_file in [*base.glob("svc-*-cpu*.pid"), *base.glob("node-*/svc-*-cpu*.pid")]:
        try:
            pid = int(read_private(pid_file) or "")
            if SERVICE_MODULE in psutil.Process(pid).cmdline():
                live.add(pid)
        except (ValueError, RuntimeDirError, OSError, psutil.Error):
            continue  # unreadable, gone, or not ours: not a trainer on these cores
    return len(live)
