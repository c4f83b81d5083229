"""A SuperExec that forks each ClientApp from a warm process: `flower-superexec` without the 4-7 s
a message.

Flower runs every message of a deployment in a new `flwr-clientapp` process, and each pays its
interpreter start and imports before it serves the message (Flower's own modules and torch,
about 5 of its 7 s on a 2-core box, docs/benchmarks.md). This command is `flower-superexec`
(same flags, same task loop: Flower's own `run_superexec`) with one difference: a ClientApp task
is started with `os.fork()` from this process, which imported Flower's ClientApp runtime and the
app's heavy third-party modules (`PRELOAD`) once, at start. The child then does exactly what
`flwr-clientapp --token T --parent-pid <this process>` does (`run_clientapp`): pull the message,
install the FAB, load the ClientApp from the FAB's directory, run it, push the reply, exit.

What the child must not inherit is reset right after the fork: Flower's exit handlers and
signal handlers of this process (they would close this process's Runtime API connection from
the child), and `sys.argv`, which becomes `flwr-clientapp --parent-pid <this process>` so that the
ClientApp finds its node (`client_app.runtime_dir.node_owner`) as in a spawned process, and the
app's own modules (this one's package included): Flower loads a ClientApp from `sys.modules`
when it is there, and a package imported here would resolve its submodules from this
installation, so without the reset a forked ClientApp could run other code than its run's FAB.
Other task types (ServerApp, simulation) start as `flower-superexec` starts them.

Three of the message path's costs are cut in each ClientApp, none of Flower's checks: its object
pulls retry after 50 ms (doubling up to `PULL_CAP_S`) where Flower's wait 1 s, since a ClientApp
forked at once asks before its SuperNode has the objects (`server_app.pull_backoff`); the run's
FAB is installed (extracted, every file's sha256 checked) once per FAB instead of once per
message (`client_app.fab_once`); and once a FAB is installed, this process imports its
ClientApp from the FAB's dir before it forks the next ClientApp of that FAB (`WarmApp`), which
then finds it imported, while a fork for any other FAB forgets it first.
`FEDAGENT_SUPEREXEC_PROFILE=<dir>` has every ClientApp write its cProfile there (`profiled`):
where a message's time goes.

Use it with a SuperNode in process isolation, next to it on the same machine:

    flower-supernode --isolation process --port 9094 ... &
    python -m client_app.superexec --insecure --runtime-api-address 127.0.0.1:9094
"""

from __future__ import annotations

import contextlib
import cProfile
import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from logging import INFO, WARNING

from flwr.common.config import get_project_config
from flwr.supercore import log
from flwr.supercore.constant import ExecutorType, TaskType
from flwr.supercore.exit.exit_handler import SIGNAL_TO_EXIT_CODE, registered_exit_handlers
from flwr.supercore.superexec import run_superexec as superexec_loop  # the module (its task loop)
from flwr.supercore.superexec.executor import ExecutionSpec, Executor, LaunchResult, SubprocessExecutor
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime import run_clientapp as clientapp_runtime  # the module (its FAB install)
from flwr.supernode.runtime.run_clientapp import install_from_fab as flower_install

from client_app.fab_once import install_once, marked_app_dir
from fl_app.provenance import CODE_PACKAGES  # the app's own packages: each run's FAB brings them
from server_app.pull_backoff import shorten_pull_backoff

# The third-party modules our ClientApp imports that cost time (torch alone ~3 s); Flower's
# runtime is imported above. `FEDAGENT_SUPEREXEC_PRELOAD` (comma-separated) replaces the list.
PRELOAD = ("torch", "safetensors.torch", "numpy", "pydantic", "psutil", "httpx", "yaml", "omegaconf", "threadpoolctl")
PRELOAD_ENV = "FEDAGENT_SUPEREXEC_PRELOAD"
POLL_ENV, POLL_S = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1"  # Flower's default 1 s: ~0.5 s a message
STOP_GRACE_S = 5.0
PROFILE_ENV = "FEDAGENT_SUPEREXEC_PROFILE"  # a dir: each forked ClientApp writes its cProfile there
PULL_CAP_S = 0.2  # a ClientApp's retries ask its own SuperNode (loopback), while that one pulls the objects


class PreloadError(RuntimeError):
    """A module to preload cannot be imported."""


def preload(modules: Iterable[str]) -> None:
    """Import `modules` now, so that every forked ClientApp finds them imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise PreloadError(f"cannot preload {name!r} ({e}); fix {PRELOAD_ENV} or install it") from None


def forget_app_modules() -> None:
    """Drop the app's own modules from `sys.modules`, so that the ClientApp Flower loads next
    comes from the run's FAB directory (first on `sys.path`), as in a fresh process."""
    for name in [m for m in sys.modules if m.split(".")[0] in CODE_PACKAGES]:
        del sys.modules[name]


class WarmApp:
    """The app's own modules imported in this process once per FAB, from the dir an earlier
    ClientApp installed that FAB to, so that the next forks of the same FAB find the ClientApp
    imported (Flower loads it from `sys.modules`) instead of importing it again (~0.2 s).

    Only the FAB they came from may use them: a fork for another FAB (by the task's FAB hash,
    and again by the sha256 of the FAB bytes it receives: `keep_for`) forgets them and their dir
    first, and imports its own FAB's code as a fresh process would."""

    def __init__(self) -> None:
        self.fab: str | None = None
        self.dir: str | None = None

    def load(self, fab_sha256: str | None) -> None:
        """Import the ClientApp of that FAB, if `install_once` installed it and it is ours."""
        app_dir = marked_app_dir(fab_sha256) if fab_sha256 and fab_sha256 != self.fab else None
        if app_dir is None:
            return
        try:
            module = get_project_config(app_dir)["tool"]["flwr"]["app"]["components"]["clientapp"].partition(":")[0]
            if module.split(".")[0] not in CODE_PACKAGES:  # not ours: nothing here would forget it
                return
            self.forget()
            sys.path.insert(0, str(app_dir))
            self.fab, self.dir = fab_sha256, str(app_dir)
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the ClientApp imports it again and reports the error
            log(WARNING, "could not import the ClientApp of FAB %s ahead:\n%s", fab_sha256, traceback.format_exc())
            self.forget()

    def keep_for(self, fab_sha256: str | None) -> None:
        """Forget the imported app unless it is that FAB's."""
        if fab_sha256 is None or fab_sha256 != self.fab:
            self.forget()

    def forget(self) -> None:
        forget_app_modules()
        if self.dir in sys.path:
            sys.path.remove(self.dir)
        self.fab = self.dir = None


class ForkExecutor(SubprocessExecutor):
    """Flower's subprocess executor, except that a ClientApp task is a fork of this process."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.children: set[int] = set()
        self.warm = WarmApp()

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        if spec.task_type != TaskType.CLIENT_APP:
            return super().launch(spec)
        self.warm.load(spec.fab_hash)
        pid = os.fork()
        if pid == 0:
            _serve_in_child(spec, self.warm)  # never returns
        self.children.add(pid)
        log(INFO, "ClientApp of task %d forked as pid %d", spec.task_id, pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap the ClientApps that have exited (no zombies between polls)."""
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
            self.children.discard(pid)

    def close(self) -> None:
        """Stop the ClientApps still running (SIGTERM: each pushes its status and exits), by PID;
        SIGKILL the ones still there after `STOP_GRACE_S`."""
        if os.getpid() != self.owner:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + STOP_GRACE_S
            while self.children and time.monotonic() < deadline:
                self.reconcile()
                time.sleep(0.05)
            if not self.children:
                return


@contextlib.contextmanager
def profiled(out_dir: str | None) -> Iterator[None]:
    """With `out_dir`, cProfile the block into `out_dir/clientapp-<unix time>-<pid>.prof` (also
    when it exits by `SystemExit`, as Flower's ClientApp does): where a message's time goes."""
    if not out_dir:
        yield
        return
    profile, started = cProfile.Profile(), time.time()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(os.path.join(out_dir, f"clientapp-{started:.3f}-{os.getpid()}.prof"))


def _serve_in_child(spec: ExecutionSpec, warm: WarmApp) -> None:
    """The forked child: become `flwr-clientapp --token T --parent-pid <owner>`, serve, exit."""
    code = 1
    try:
        registered_exit_handlers.clear()  # the parent's: its Runtime API client, its executor
        for sig in SIGNAL_TO_EXIT_CODE:
            signal.signal(sig, signal.SIG_DFL)
        if spec.suppress_output:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        warm.keep_for(spec.fab_hash)
        clientapp_runtime.install_from_fab = install_once(flower_install, seen=warm.keep_for)
        parent = os.getppid()
        sys.argv = ["flwr-clientapp", "--parent-pid", str(parent)]
        with profiled(os.environ.get(PROFILE_ENV)):
            clientapp_runtime.run_clientapp(
                runtime_api_address=spec.runtime_api_address,
                token=spec.token,
                insecure=spec.insecure,
                certificates=validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
                parent_pid=parent,
                runtime_dependency_install=spec.runtime_dependency_install,
            )
        code = 0
    except SystemExit as e:  # run_clientapp ends with flwr_exit -> sys.exit(code)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a child must never return into the parent's loop
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def fork_executor_factory(original: Callable[..., Executor]) -> Callable[..., Executor]:
    """`get_executor` with the subprocess executor replaced by `ForkExecutor`."""

    def get_executor(executor_type: ExecutorType, *args: object, **kwargs: object) -> Executor:
        if executor_type == ExecutorType.SUBPROCESS:
            return ForkExecutor()
        return original(executor_type, *args, **kwargs)

    return get_executor


def main() -> None:
    """`flower-superexec`, with ClientApps forked from this warm process."""
    modules = os.environ.get(PRELOAD_ENV)
    try:
        preload(PRELOAD if modules is None else [m.strip() for m in modules.split(",") if m.strip()])
    except PreloadError as e:
        sys.exit(f"client_app.superexec: {e}")
    os.environ.setdefault(POLL_ENV, POLL_S)
    shorten_pull_backoff(cap_s=PULL_CAP_S)
    superexec_loop.get_executor = fork_executor_factory(superexec_loop.get_executor)
    from flwr.supercore.cli.flower_superexec import flower_superexec

    sys.argv[0] = "flower-superexec"
    flower_superexec()


if __name__ == "__main__":
    main()
