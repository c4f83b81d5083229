"""Run the real app through `flwr run`, and clean up after: against a private local SuperLink
(simulation, `flower`), or against a deployment of real `flower-superlink` and
`flower-supernode` processes (`deployment`), optionally one network + mount namespace per host
(no shared disk), TLS with a CA made here, and SuperNode authentication.

Each use gets its own FLWR_HOME and ports, so tests never touch a user's SuperLink, and
everything started is stopped by PID on every path.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from envs.ports import choose_free_port
from server_app.local_superlink import stop_superlink
from tools.sweep import private_flower_env

ROOT = Path(__file__).resolve().parent.parent
FLWR = str(Path(sys.executable).with_name("flwr"))


def run_config(recipe: Path, run_dir: Path, **extra: object) -> str:
    """A `--run-config` string: the recipe, the run dir, and flat run-config keys."""
    items = {"recipe": f'"{recipe}"', "run-dir": f'"{run_dir}"', **{k: str(v) for k, v in extra.items()}}
    return " ".join(f"{k}={v}" for k, v in items.items())


def run_status(run_dir: Path) -> subprocess.CompletedProcess:
    """`python -m server_app.status RUN_DIR`: exit 0 only when the run is complete (`flwr run`
    exits 0 after a failed run too, so tests ask the run dir, as users are told to)."""
    return subprocess.run(
        [sys.executable, "-m", "server_app.status", str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def spawn(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    """Start `cmd` with its output appended to `log`, in a process session of its own:
    `local_superlink stop` and `Deployment.kill` end whole process groups, never the test's."""
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _cmdline(proc: psutil.Process) -> str:
    """`proc`'s command line, '' once it is gone (or a zombie)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def sigkill(proc: psutil.Process, tree: bool = True) -> None:
    """SIGKILL a process, with `tree` every descendant too (what a crashed machine or `kill -9` does)."""
    procs = [proc, *proc.children(recursive=True)] if tree else [proc]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


class FlowerRun:
    def __init__(self, home: Path) -> None:
        self.home = home
        # Unix socket paths are limited to 107 bytes: Ray's and ours live in a short dir.
        self.short = Path(tempfile.mkdtemp(prefix="fa-", dir="/tmp"))
        self.env = private_flower_env(home, self.short, FLWR)
        self.port = int(self.env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"])

    def command(self, run_config: str, federation_config: str = "num-supernodes=2") -> list[str]:
        return [
            FLWR,
            "run",
            str(ROOT),
            "--run-config",
            run_config,
            "--federation-config",
            federation_config,
            "--stream",
        ]

    def run(
        self, run_config: str, timeout_s: float, federation_config: str = "num-supernodes=2"
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(run_config, federation_config),
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def start(self, run_config: str, log: Path, federation_config: str = "num-supernodes=2") -> subprocess.Popen:
        """`flwr run --stream` in the background, its output into `log`."""
        return spawn(self.command(run_config, federation_config), self.env, ROOT, log)

    def own_processes(self) -> list[psutil.Process]:
        """This harness's runtime processes: those whose environment names its private Ray dir
        (the simulation runtime, its Ray workers and actors, our services), never anyone else's."""
        mine = str(self.short / "ray")
        out = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("RAY_TMPDIR") == mine:
                    out.append(proc)
        return out

    def stop(self) -> None:
        stop_superlink(self.home)
        shutil.rmtree(self.short, ignore_errors=True)

    def superlink_log(self) -> str:
        p = self.home / "local-superlink" / "superlink.log"
        return p.read_text(errors="replace")[-20000:] if p.exists() else ""


@contextmanager
def flower(home: Path) -> Iterator[FlowerRun]:
    home.mkdir(parents=True, exist_ok=True)
    fr = FlowerRun(home)
    try:
        yield fr
    finally:
        fr.stop()


# ---- deployment: a SuperLink and SuperNodes as real processes ------------------------------------

BIN = Path(sys.executable).parent
_DEPLOYMENTS = itertools.count()
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def netns_unavailable() -> str:
    """Why network + mount namespaces cannot be used here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, unshare -m)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    probe = f"fa-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class Certificates:
    """A self-signed CA, a SuperLink certificate for `hosts`, and SuperNode auth keys (made here).

    The SuperLink's own SuperExec dials its Runtime API at the bound address, and at 127.0.0.1
    when it binds 0.0.0.0 (Flower's `resolve_bind_address`): the certificate names loopback too,
    as docs/deployment.md section 5 tells operators."""

    def __init__(self, out: Path, hosts: list[str]) -> None:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        out.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

        def name(cn: str) -> x509.Name:
            return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

        ca_key = ec.generate_private_key(ec.SECP384R1())
        ca = (
            x509.CertificateBuilder()
            .subject_name(name("fedagent test CA"))
            .issuer_name(name("fedagent test CA"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(validity[0])
            .not_valid_after(validity[1])
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP384R1())
        sans = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(hosts[0]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(validity[0])
            .not_valid_after(validity[1])
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        self.ca = out / "ca.pem"
        self.ca.write_bytes(ca.public_bytes(pem))
        self.cert = out / "server.pem"
        self.cert.write_bytes(cert.public_bytes(pem))
        self.key = out / "server.key"
        self.key.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        self.out = out

    def node_key(self, name: str) -> tuple[Path, Path]:
        """(private key, public key) of a SuperNode, in the OpenSSH formats Flower reads."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP384R1())
        private, public = self.out / f"{name}.key", self.out / f"{name}.pub"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            )
        )
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        )
        return private, public


def cert_hosts(host: str) -> list[str]:
    """The SuperLink certificate's names: the address nodes dial, and loopback for its own
    SuperExec (docs/deployment.md section 5's `subjectAltName`)."""
    return [host, "127.0.0.1", "localhost"]


class Network:
    """A bridge in this namespace and one network namespace per host, on a private /24."""

    def __init__(self, tag: str, hosts: list[str]) -> None:
        self.tag = tag
        self.bridge = f"fb{tag}"
        used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        third = next(n for n in range(int(tag) % 200 + 20, 255) if f"10.231.{n}." not in used)
        self.prefix = f"10.231.{third}"
        self.gateway = f"{self.prefix}.1"
        self.addr: dict[str, str] = {}
        self.ns: dict[str, str] = {}
        self.veths: list[str] = []
        try:
            self._build(hosts)
        except BaseException:
            self.close()  # nothing half-built outlives a failed start
            raise

    def _build(self, hosts: list[str]) -> None:
        tag = self.tag
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, host in enumerate(hosts):
            ns, veth, peer = f"fa{tag}{host}", f"fv{tag}{i}", f"fp{tag}{i}"
            self._ip("netns", "add", ns)
            self.ns[host] = ns
            self._ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            self.veths.append(veth)
            self._ip("link", "set", peer, "netns", ns)
            self._ip("link", "set", veth, "master", self.bridge)
            self._ip("link", "set", veth, "up")
            self.addr[host] = f"{self.prefix}.{10 + i}"
            self._ip("netns", "exec", ns, "ip", "addr", "add", f"{self.addr[host]}/24", "dev", peer)
            self._ip("netns", "exec", ns, "ip", "link", "set", peer, "up")
            self._ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def wrap(self, host: str, cmd: list[str], private: list[Path]) -> list[str]:
        """`cmd` run in `host`'s network namespace and, when `private` is given, in a mount
        namespace of its own with an empty tmpfs over each of those dirs (no shared disk)."""
        out = ["ip", "netns", "exec", self.ns[host]]
        if private:
            mounts = " && ".join(f"mkdir -p '{p}' && mount -t tmpfs tmpfs '{p}'" for p in private)
            out += ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]
        return out + cmd

    def close(self) -> None:
        # a veth pair goes with its host end at once; left to the namespace's teardown (which
        # the kernel runs later) its name would still be taken by the next test's network
        for veth in self.veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class Deployment:
    """A SuperLink and `nodes` SuperNodes as real processes (`flower-superlink`, `flower-supernode`),
    optionally each on a host of its own (network namespace) without the server's disk (mount
    namespace), with TLS and SuperNode authentication; `flwr run` against it. Everything started
    is stopped by its PID (process group) on every path."""

    def __init__(
        self,
        root: Path,
        nodes: int = 2,
        netns: bool = False,
        tls: bool = False,
        auth: bool = False,
        no_shared: list[Path] | None = None,
        bind: str | None = None,
        isolation: str = "node",
    ) -> None:
        self.root = root
        # "node" (docs/deployment.md section 2): `python -m client_app.node`, ClientApps forked by
        # its warm SuperExec, short idle polls; "fork": flower-supernode --isolation process beside
        # `python -m client_app.superexec` (forks, Flower's polls); "subprocess": Flower's default,
        # a flwr-clientapp process a message
        assert isolation in ("node", "fork", "subprocess"), isolation
        self.isolation = isolation
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.short = Path(tempfile.mkdtemp(prefix="fd-", dir="/tmp"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.tag = str((os.getpid() * 10 + next(_DEPLOYMENTS)) % 10000)  # one per deployment
        self.net = Network(self.tag, ["link"] + [f"n{i}" for i in range(nodes + 1)]) if netns else None
        self.no_shared = list(no_shared or [])
        self.host = self.net.addr["link"] if self.net else "127.0.0.1"
        self.bind = bind or self.host  # the SuperLink's --host (e.g. 0.0.0.0, as the guide says)
        self.port = choose_free_port()
        self.certs = Certificates(root / "certs", cert_hosts(self.host)) if tls else None
        self.auth = auth
        self.home = root / "flwr-cli"
        self.home.mkdir(exist_ok=True)
        conn = f'root-certificates = "{self.certs.ca}"' if self.certs else "insecure = true"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "{self.host}:{self.port}"\n{conn}\n'
        )
        self.env = {
            **os.environ,
            **FLOWER_ENV,
            "FLWR_HOME": str(self.home),
            "FEDAGENT_RUNTIME_DIR": str(self.short / "rt"),
            "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        }
        self.node_keys: list[tuple[Path, Path]] = []
        self.nodes = nodes

    # -- processes
    def _start(
        self,
        name: str,
        cmd: list[str],
        host: str | None,
        private: list[Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        if self.net is not None and host is not None:
            cmd = self.net.wrap(host, cmd, private or [])
        self.procs[name] = spawn(cmd, {**self.env, **(env or {})}, self.root, self.logs / f"{name}.log")
        return self.procs[name]

    def start_shell(self, name: str, host: str, script: str, cwd: Path) -> subprocess.Popen:
        """`script` (bash, e.g. a command copied from docs/deployment.md) run in `cwd` on `host`,
        without the server's disk on a node host; stopped by its process group like the rest."""
        private = self.no_shared if host != "link" else []
        env = {"FLWR_HOME": str(cwd / ".flwr")}  # each machine its own
        return self._start(name, ["bash", "-c", f"cd '{cwd}' && {script}"], host, private, env)

    def start(self) -> Deployment:
        tls = (
            [
                "--ssl-ca-certfile",
                str(self.certs.ca),
                "--ssl-certfile",
                str(self.certs.cert),
                "--ssl-keyfile",
                str(self.certs.key),
            ]
            if self.certs
            else ["--insecure"]
        )
        self._start(
            "superlink",
            [
                str(BIN / "flower-superlink"),
                *tls,
                "--host",
                self.bind,
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
                *(["--enable-supernode-auth"] if self.auth else []),
            ],
            "link",
            env={"FLWR_HOME": str(self.root / "flwr-superlink")},
        )
        self.wait_started()
        for i in range(self.nodes):
            self.start_node(i)
        return self

    def wait_started(self) -> None:
        """The SuperLink listens and its SuperExec runs (else fail now, naming why)."""
        self._wait_listening()
        self._require_superexec()

    def _wait_listening(self, timeout_s: float = 60.0) -> None:
        import socket

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.procs["superlink"].poll() is None, self.log("superlink")[-3000:]
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex((self.host, self.port)) == 0:
                    return
            time.sleep(0.3)
        raise AssertionError("the SuperLink did not start listening: " + self.log("superlink")[-3000:])

    def _require_superexec(self, timeout_s: float = 30.0) -> None:
        """The SuperLink's own SuperExec (it starts every ServerApp) must be up: when it cannot
        reach the Runtime API (e.g. a certificate that does not name 127.0.0.1 under `--host
        0.0.0.0`) it exits at once, the SuperLink runs on, and every run would stay pending."""
        deadline = time.monotonic() + timeout_s
        while "Starting Flower SuperExec" not in self.log("superlink") and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(2.0)  # a SuperExec that cannot connect has died by now
        link = psutil.Process(self.procs["superlink"].pid)
        alive = [p for p in link.children(recursive=True) if "flower-superexec" in _cmdline(p)]
        if not alive:
            raise AssertionError("the SuperLink's SuperExec is not running: " + self.log("superlink")[-3000:])

    def register(self, name: str) -> Path:
        """A SuperNode key pair; its public key registered with the SuperLink (`flwr supernode register`)."""
        private, public = self.certs.node_key(name)
        p = subprocess.run(
            [FLWR, "supernode", "register", str(public), "deploy"],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        return private

    def start_node(
        self, i: int, key: Path | None = None, registered: bool = True, extra: list[str] = ()
    ) -> subprocess.Popen:
        name = f"n{i}"
        tls = ["--root-certificates", str(self.certs.ca)] if self.certs else ["--insecure"]
        if self.auth:
            key = key or (self.register(name) if registered else self.certs.node_key(name)[0])
            tls += ["--auth-supernode-private-key", str(key)]
        runtime_port = choose_free_port()
        cmd = [
            str(BIN / "flower-supernode"),
            *tls,
            "--superlink",
            f"{self.host}:{self.port}",
            "--port",
            str(runtime_port),
            "--node-config",
            f"partition-id={i} num-partitions={self.nodes}",
            *extra,
        ]
        if self.isolation == "node":  # the node with its warm SuperExec, one command
            cmd = [sys.executable, "-m", "client_app.node", *cmd[1:]]
        elif self.isolation == "fork":  # the node and its SuperExec, one process group (one host)
            superexec = [sys.executable, "-m", "client_app.superexec", "--insecure"]
            superexec += ["--runtime-api-address", f"127.0.0.1:{runtime_port}"]
            node = shlex.join([*cmd, "--isolation", "process"])
            # the host's exit status is the SuperNode's (its SuperExec exits with it)
            script = f"{node} & node=$!; {shlex.join(superexec)} --parent-pid $node & wait $node"
            cmd = ["bash", "-c", script]
        return self._start(name, cmd, name, self.no_shared, env={"FLWR_HOME": str(self.root / f"flwr-{name}")})

    def command(self, run_config: str) -> list[str]:
        return [FLWR, "run", str(ROOT), "deploy", "--run-config", run_config, "--stream"]

    def run(self, run_config: str, timeout_s: float) -> subprocess.CompletedProcess:
        cmd = self.command(run_config)
        return subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)

    def submit(self, run_config: str, log: Path) -> subprocess.Popen:
        """`flwr run . deploy --stream` in the background, its output into `log`."""
        return spawn(self.command(run_config), self.env, ROOT, log)

    def kill(self, name: str) -> None:
        """SIGKILL a host's whole process group (what a crashed machine does to its processes)."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def node_pid(self, name: str) -> int:
        """The pid of host `name`'s SuperNode (`flower-supernode`, or `client_app.node` beside its
        SuperExec): the owner of its trainer services."""
        top = psutil.Process(self.procs[name].pid)
        for proc in [top, *top.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # the program, not a shell whose script names it
                argv = proc.cmdline()
                node = argv[1:3] == ["-m", "client_app.node"]
                if node or any(Path(arg).name == "flower-supernode" for arg in argv[:2]):
                    return proc.pid
        raise AssertionError(f"no SuperNode runs on {name}: " + self.log(name)[-3000:])

    def service_pids(self, run_id: int | str = "*") -> dict[str, list[int]]:
        """Trainer service pids by runtime scope (one scope per SuperNode), of run `run_id` (every
        run's by default: a deployment may serve several)."""
        rt = self.short / "rt"
        out: dict[str, list[int]] = {}
        for p in sorted(rt.rglob(f"svc-{run_id}-*.pid")) if rt.exists() else []:
            out.setdefault(p.parent.name, []).append(int(p.read_text()))
        return out

    def log(self, name: str, since: dict[str, int] | None = None) -> str:
        """Host `name`'s log; with `since` (a `log_marks()`), only what it wrote after that mark."""
        p = self.logs / f"{name}.log"
        text = p.read_text(errors="replace") if p.exists() else ""
        return text[(since or {}).get(name, 0) :]

    def log_marks(self) -> dict[str, int]:
        """Where every host's log ends now: `log(name, since=...)` reads one run's part of it."""
        return {name: len(self.log(name)) for name in self.procs}

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pids in self.service_pids().values():  # services run in sessions of their own
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                    if psutil.Process(pid).cmdline()[1:3] == ["-m", "client_app.service"]:
                        os.kill(pid, signal.SIGKILL)
        if self.net is not None:
            self.net.close()
        shutil.rmtree(self.short, ignore_errors=True)


@contextmanager
def deployment(root: Path, start: bool = True, **kw: object) -> Iterator[Deployment]:
    """A started deployment, or with `start=False` only its hosts (a test starts its own
    commands on them: `Deployment.start_shell`); stopped on every path."""
    d = Deployment(root, **kw)
    try:
        yield d.start() if start else d
    finally:
        d.stop()
