"""Offline wheelhouses: carry Python packages to a GPU node that has no network.

GPU nodes are often air-gapped and come with their own torch / CUDA / transformers stack, which
must not be replaced; what they lack (flwr, FastAPI, our service deps, vLLM...) has to be
brought as wheels built for THEIR interpreter and platform, often over a channel that caps the
size of one file or one transfer. Every step verifies sha256s, so a truncated copy fails loudly
before pip ever sees it.

    build    (online machine) pip download, --no-deps and --only-binary, for the target's Python,
             implementation and manylinux platforms; skip what the target already has
             (--target-freeze: its `pip list --format=freeze`); a requirement with no wheel is
             built from its sdist: pure-Python results with this interpreter, compiled ones with
             --build-python (the target's Python version, glibc no newer than the target's);
             writes manifest.json (name, version, sha256, size, how it was made, per wheel)
    split    cut a wheelhouse into tar parts below a size limit; a wheel larger than a part is
             cut across parts; parts.json holds each part's sha256 and the wheelhouse manifest
    join     check every part (missing, corrupt), reassemble, check every wheel's sha256
    verify   check a wheelhouse directory against its manifest
    install  join (when given parts) + verify, then `pip install --no-index --no-deps`
             into --target DIR (put it on PYTHONPATH) or into the running environment

    python -m tools.wheelhouse build -r ../shared/reference/gpu-wheels-flwr.txt -o wh \\
        --python-version 3.12 --glibc 2.28 --target-freeze target-freeze.txt
    python -m tools.wheelhouse split wh -o parts --max-mib 55
    python -m tools.wheelhouse install parts --target /tmp/site      # on the GPU node

Standard library + `packaging` only (pip vendors it; every image with pip has it installed).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from fl_app.hashing import sha256_file

MANIFEST = "manifest.json"
PARTS_MANIFEST = "parts.json"
FORMAT = "fedagent-wheelhouse"
PARTS_FORMAT = "fedagent-wheelhouse-parts"
VERSION = 1
MiB = 1 << 20
DEFAULT_MAX_MIB = 55.0
# Bytes a tar member may add beyond its data (PAX header for long names, ustar header, padding
# to 512) and bytes a tar adds at its end (two zero blocks, padding to tarfile's 10 KiB record).
_MEMBER_OVERHEAD = 4 * 512
_TAR_END = 2 * 512 + tarfile.RECORDSIZE


class WheelhouseError(RuntimeError):
    """A wheelhouse or its parts cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class Target:
    """The interpreter and platforms the wheels are for (pip download's --python-version etc.)."""

    python_version: str = "3.12"
    implementation: str = "cp"
    platforms: tuple[str, ...] = ()

    def tags(self) -> set[Tag]:
        """Every wheel tag an interpreter like the target accepts."""
        version = tuple(int(x) for x in self.python_version.split("."))
        if self.implementation != "cp":
            raise WheelhouseError(f"implementation {self.implementation!r} is not supported; only CPython (cp)")
        interpreter = f"cp{version[0]}{version[1]}"
        return set(cpython_tags(version, platforms=self.platforms)) | set(
            compatible_tags(version, interpreter=interpreter, platforms=self.platforms)
        )

    def glibc(self) -> tuple[int, int] | None:
        """The newest glibc among the target's manylinux tags (None: no manylinux tag named)."""
        found = [(2, int(p.split("_")[2])) for p in self.platforms if p.startswith("manylinux_2_")]
        return max(found, default=None)

    def arch(self) -> str | None:
        """The architecture of the target's `linux_<arch>` tag (None: no such tag named)."""
        return next((p.removeprefix("linux_") for p in self.platforms if p.startswith("linux_")), None)


def manylinux_platforms(glibc: str, arch: str) -> tuple[str, ...]:
    """Every Linux platform tag a glibc `glibc` machine's pip accepts, newest first (pip matches
    tags exactly, so a download for `manylinux_2_28` alone would miss wheels tagged 2_17), and
    last the plain `linux_<arch>` that packaging.tags.platform_tags() yields after them: the tag
    of wheels built from sdists by --build-python (PyPI hosts none)."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 5:
        raise WheelhouseError(f"--glibc {glibc}: expected 2.N with N >= 5 (e.g. 2.28; `ldd --version` on the target)")
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tuple(tags + [f"{name}_{arch}" for n, name in legacy.items() if minor >= n] + [f"linux_{arch}"])


@dataclass
class Wheel:
    file: str
    name: str  # canonical project name
    version: str
    sha256: str
    size: int
    source: str  # download | sdist-build | local
    requirement: str
    # sdist-build only: the interpreter (path, version, glibc, machine) and, for a wheel whose
    # setup declared it pure while it carries compiled libraries, those files and its file name
    # before the retag
    build: dict[str, str] = field(default_factory=dict)


@dataclass
class Manifest:
    target: Target
    wheels: list[Wheel] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "target": asdict(self.target),
            "wheels": [asdict(w) for w in self.wheels],
            "skipped": self.skipped,
        }

    @classmethod
    def from_json(cls, data: dict, where: Path) -> Manifest:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise WheelhouseError(
                f"{where} is not a {FORMAT} v{VERSION} manifest; rebuild it with `python -m tools.wheelhouse build`"
            )
        t = data["target"]
        return cls(
            Target(t["python_version"], t["implementation"], tuple(t["platforms"])),
            [Wheel(**w) for w in data["wheels"]],
            list(data["skipped"]),
        )

    @property
    def total_bytes(self) -> int:
        return sum(w.size for w in self.wheels)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _fresh_dir(path: Path, what: str) -> None:
    if path.exists() and any(path.iterdir()):
        raise WheelhouseError(f"{what} directory {path} is not empty; give a new or empty directory")
    path.mkdir(parents=True, exist_ok=True)


# ----------------------------------------------------------------------------- build


def read_requirements(paths: Iterable[Path], extra: Iterable[str] = ()) -> list[str]:
    """Requirement lines from files (comments and blank lines dropped) plus `extra`."""
    lines = []
    for p in paths:
        if not p.is_file():
            raise WheelhouseError(f"requirements file {p} does not exist")
        lines += [ln.split("#", 1)[0].strip() for ln in p.read_text().splitlines()]
    return [ln for ln in [*lines, *extra] if ln]


def read_freeze(path: Path) -> dict[str, str]:
    """{canonical name: version} from the target's `pip list --format=freeze` (or `pip freeze`)."""
    have: dict[str, str] = {}
    for ln in path.read_text().splitlines():
        name, sep, version = ln.strip().partition("==")
        if sep and name and not name.startswith(("#", "-")):
            have[canonicalize_name(name)] = version.strip()
    return have


def _provided_by_target(req: Requirement, have: dict[str, str]) -> str | None:
    """Why the target needs no wheel for `req`, or None (it has none, or one that misses the pin)."""
    version = have.get(canonicalize_name(req.name))
    if version is None:
        return None
    try:
        ok = req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        ok = not req.specifier
    return f"target has {req.name} {version}" if ok else None


def _pip(args: Sequence[str], python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", *args, "--disable-pip-version-check"], capture_output=True, text=True)


def _tail(proc: subprocess.CompletedProcess, lines: int = 6) -> str:
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


@dataclass(frozen=True)
class Builder:
    """The interpreter that builds sdists into wheels. By default this one, and only pure-Python
    results are kept (they run anywhere); one named with --build-python may compile, because
    `for_target` checked that it is the target's CPython version on the target's architecture
    with a glibc no newer than the target's, so what it links against exists there."""

    python: str
    version: str  # e.g. 3.12.1
    glibc: str  # "" off glibc Linux
    machine: str
    compiles: bool = False
    isolation: bool = False  # pip's build isolation: fetch the sdist's build requirements

    @classmethod
    def probe(cls, python: str, compiles: bool = False, isolation: bool = False) -> Builder:
        code = (
            "import json, platform as p; "
            "print(json.dumps([p.python_implementation(), p.python_version(), p.libc_ver()[1], p.machine()]))"
        )
        try:
            proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
        except OSError as e:
            raise WheelhouseError(f"build interpreter {python} does not run ({e}); name a Python executable") from None
        if proc.returncode != 0:
            raise WheelhouseError(f"build interpreter {python} failed to start:\n{_tail(proc)}")
        impl, version, glibc, machine = json.loads(proc.stdout)
        if impl != "CPython":
            raise WheelhouseError(f"build interpreter {python} is {impl}; name a CPython interpreter")
        return cls(python, version, glibc, machine, compiles, isolation)

    @classmethod
    def for_target(cls, python: str, target: Target, isolation: bool = False) -> Builder:
        """`python` (--build-python) if what it compiles runs on `target`; else the reason and the fix."""
        b = cls.probe(python, compiles=True, isolation=isolation)
        glibc, arch = target.glibc(), target.arch()
        if b.version.rsplit(".", 1)[0] != target.python_version:
            raise WheelhouseError(
                f"--build-python {python} is Python {b.version}, the target is {target.python_version} "
                f"(--python-version): name a CPython {target.python_version} interpreter"
            )
        if glibc is None or arch is None:
            raise WheelhouseError(
                "--build-python needs the target's glibc and architecture: give --glibc and --arch, or "
                "--platform tags that include manylinux_2_N_<arch> and linux_<arch>"
            )
        if b.machine != arch:
            raise WheelhouseError(f"--build-python {python} runs on {b.machine}, the target on {arch}: build on {arch}")
        if not b.glibc or tuple(int(x) for x in b.glibc.split(".")[:2]) > glibc:
            raise WheelhouseError(
                f"--build-python {python} runs on glibc {b.glibc or '(none)'}, the target has {glibc[0]}.{glibc[1]} "
                "(--glibc): what it compiles may need symbols the target lacks; build on a machine "
                f"or container with glibc <= {glibc[0]}.{glibc[1]}"
            )
        return b

    def record(self) -> dict[str, str]:
        return {"python": self.python, "version": self.version, "glibc": self.glibc, "machine": self.machine}


def build(
    requirements: Sequence[str],
    out: Path,
    target: Target,
    have: dict[str, str] | None = None,
    skip: Iterable[str] = (),
    pip_index_args: Sequence[str] = (),
    builder: Builder | None = None,
) -> Manifest:
    """Download (or build from sdists, with `builder`) one wheel per requirement for `target` into `out`.

    A requirement line is a pip requirement (`flwr==1.42.0`) or a path to a local .whl.
    `have` (the target's installed versions) drops requirements the target already satisfies;
    `skip` drops names outright (the target's own torch, say). Every wheel must carry a tag the
    target accepts, and each project may appear once: pip would refuse two versions anyway.
    """
    _fresh_dir(out, "wheelhouse")
    builder = builder or Builder.probe(sys.executable)
    skip = {canonicalize_name(s) for s in skip}
    manifest = Manifest(target)
    wanted: list[Requirement] = []
    files: dict[Path, tuple[str, str, dict[str, str]]] = {}
    for line in requirements:
        if line.endswith(".whl"):
            if not Path(line).is_file():
                raise WheelhouseError(f"local wheel {line} does not exist")
            files[Path(line)] = ("local", Path(line).name, {})
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            raise WheelhouseError(f"bad requirement {line!r}: {e}") from None
        reason = "--skip" if canonicalize_name(req.name) in skip else _provided_by_target(req, have or {})
        if reason:
            manifest.skipped.append({"requirement": line, "reason": reason})
        else:
            wanted.append(req)
    with tempfile.TemporaryDirectory(dir=out, prefix=".staging-") as tmp:
        staging = Path(tmp)
        for req, (p, source, made) in _fetch(wanted, staging, target, pip_index_args, builder).items():
            files[p] = (source, str(req), made)
        accepted = target.tags()
        seen: dict[str, str] = {}
        for path, (source, requirement, made) in sorted(files.items(), key=lambda kv: kv[0].name):
            name, version, _build, tags = parse_wheel_filename(path.name)
            if not tags & accepted:
                raise WheelhouseError(
                    f"{path.name} has no tag the target accepts (Python {target.python_version}, "
                    f"{', '.join(target.platforms[:3])}...); bring a wheel built for the target"
                )
            if name in seen:
                raise WheelhouseError(f"two wheels for {name}: {seen[name]} and {path.name}; keep one version of each")
            seen[name] = path.name
            shutil.copyfile(path, out / path.name)
            manifest.wheels.append(
                Wheel(
                    path.name,
                    name,
                    str(version),
                    sha256_file(out / path.name),
                    (out / path.name).stat().st_size,
                    source,
                    requirement,
                    made,
                )
            )
    _write_json(out / MANIFEST, manifest.to_json())
    return manifest


def _fetch(
    reqs: Sequence[Requirement], staging: Path, target: Target, pip_index_args: Sequence[str], builder: Builder
) -> dict[Requirement, tuple[Path, str, dict[str, str]]]:
    """{requirement: (wheel path, source, how it was built)}: one pip download for all; a
    requirement pip names as having no wheel for the target is built from its sdist and the
    download repeated without it (files already downloaded are kept)."""
    base = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        target.python_version,
        "--implementation",
        target.implementation,
        *[a for p in target.platforms for a in ("--platform", p)],
        *pip_index_args,
        "-d",
        str(staging / "dl"),
    ]
    pending, errors = list(reqs), []
    found: dict[Requirement, tuple[Path, str, dict[str, str]]] = {}
    while pending:
        proc = _pip([*base, *map(str, pending)])
        if proc.returncode == 0:
            found |= {r: (_one_wheel(staging / "dl", r), "download", {}) for r in pending}
            break
        failed = _named_failure(proc, pending)
        if failed is None:
            raise WheelhouseError(f"pip download failed (exit {proc.returncode}):\n{_tail(proc)}")
        pending.remove(failed)
        try:
            found[failed] = _build_sdist(failed, staging, pip_index_args, proc, builder, target)
        except WheelhouseError as e:
            errors.append(str(e))
    if errors:
        raise WheelhouseError("cannot bring every requirement:\n" + "\n".join(errors))
    return found


def _named_failure(proc: subprocess.CompletedProcess, pending: Sequence[Requirement]) -> Requirement | None:
    """The pending requirement pip's "No matching distribution found for X" names, if any."""
    for line in proc.stderr.splitlines():
        _, sep, text = line.partition("No matching distribution found for ")
        if sep:
            name = canonicalize_name(Requirement(text.strip()).name)
            return next((r for r in pending if canonicalize_name(r.name) == name), None)
    return None


def _build_sdist(
    req: Requirement,
    staging: Path,
    pip_index_args: Sequence[str],
    download: subprocess.CompletedProcess,
    builder: Builder,
    target: Target,
) -> tuple[Path, str, dict[str, str]]:
    """Build `req` from its sdist with `builder`'s pip. A pure-Python result (py3-none-any, no
    compiled file) serves any target; a compiled one only from a `compiles` builder, and one
    whose setup calls itself pure while shipping a compiled library (jericho's libfrotz.so,
    fast-downward's libdownward.so, loaded with ctypes) is retagged `linux_<arch>`."""
    out = staging / f"sdist-{canonicalize_name(req.name)}"
    isolation = [] if builder.isolation else ["--no-build-isolation"]
    args = ["wheel", "--no-deps", f"--no-binary={canonicalize_name(req.name)}", *isolation, *pip_index_args]
    proc = _pip([*args, "-w", str(out), str(req)], builder.python)
    if proc.returncode != 0:
        hint = "" if builder.isolation else " (if it lacks the build backend, e.g. setuptools: pass --build-isolation)"
        raise WheelhouseError(
            f"{req}: no wheel for the target ({_tail(download, 1)}) and its sdist did not build with "
            f"{builder.python}{hint}:\n{_tail(proc)}"
        )
    path = _one_wheel(out, req)
    tags = parse_wheel_filename(path.name)[3]
    compiled = _compiled_files(path)
    made = builder.record()
    if not compiled and all(t.abi == "none" and t.platform == "any" for t in tags):
        return path, "sdist-build", made
    if not builder.compiles:
        raise WheelhouseError(
            f"{req}: only an sdist exists, and building it here gave {path.name}, compiled for THIS machine"
            + (f" ({', '.join(compiled[:3])})" if compiled else "")
            + f"; pass --build-python naming a CPython {target.python_version} on a Linux machine like "
            "the target (same architecture, glibc no newer), or a .whl built there"
        )
    made["compiled"] = ", ".join(compiled)
    if all(t.platform == "any" for t in tags):
        made["retagged_from"] = path.name
        path = _retag(path, f"linux_{builder.machine}")
    return path, "sdist-build", made


def _compiled_files(wheel: Path) -> list[str]:
    """Members of `wheel` that are ELF binaries (extension modules, shared libraries, programs)."""
    with zipfile.ZipFile(wheel) as zf:
        return [i.filename for i in zf.infolist() if not i.is_dir() and zf.open(i).read(4) == b"\x7fELF"]


def _retag(wheel: Path, platform: str) -> Path:
    """`wheel` with platform tag `platform` in its file name, WHEEL file and RECORD (what
    `wheel tags --platform-tag` does); the original file is removed."""
    *head, pys, abis, _ = wheel.name.removesuffix(".whl").split("-")
    new = wheel.with_name("-".join([*head, pys, abis, platform]) + ".whl")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(new, "w") as dst:
        meta = next(n for n in src.namelist() if n.count("/") == 1 and n.endswith(".dist-info/WHEEL"))
        record = meta.removesuffix("WHEEL") + "RECORD"
        lines = [ln for ln in src.read(meta).decode().splitlines() if not ln.startswith("Tag:")]
        tags = [f"Tag: {py}-{abi}-{platform}" for py in pys.split(".") for abi in abis.split(".")]
        wheel_text = "\n".join([*lines, *tags, ""]).encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(wheel_text).digest()).rstrip(b"=").decode()
        rows = src.read(record).decode().splitlines()
        rows = [f"{meta},sha256={digest},{len(wheel_text)}" if r.split(",")[0] == meta else r for r in rows]
        replaced = {meta: wheel_text, record: "\n".join([*rows, ""]).encode()}
        for info in src.infolist():  # same order, compression and file modes
            dst.writestr(info, replaced.get(info.filename) or src.read(info))
    wheel.unlink()
    return new


def _one_wheel(directory: Path, req: Requirement) -> Path:
    matches = [p for p in directory.glob("*.whl") if parse_wheel_filename(p.name)[0] == canonicalize_name(req.name)]
    if len(matches) != 1:
        raise WheelhouseError(f"{req}: expected one wheel in {directory}, found {[p.name for p in matches]}")
    return matches[0]


# ----------------------------------------------------------------------------- verify


def load_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    if not path.is_file():
        raise WheelhouseError(
            f"{directory} has no {MANIFEST}: it is not a wheelhouse made by "
            "`python -m tools.wheelhouse build` (or `join`)"
        )
    return Manifest.from_json(json.loads(path.read_text()), path)


def verify(directory: Path) -> Manifest:
    """Every wheel of the manifest present with its size and sha256; one error lists all misses."""
    manifest = load_manifest(directory)
    problems = []
    for w in manifest.wheels:
        p = directory / w.file
        if not p.is_file():
            problems.append(f"{w.file}: missing")
        elif p.stat().st_size != w.size or sha256_file(p) != w.sha256:
            problems.append(f"{w.file}: corrupt (size {p.stat().st_size}, expected {w.size}; sha256 differs)")
    if problems:
        raise WheelhouseError(
            f"wheelhouse {directory} is damaged; rebuild or re-copy these wheels:\n  " + "\n  ".join(problems)
        )
    return manifest


# ----------------------------------------------------------------------------- split / join


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + size) of wheel `wheel`, stored in a part as tar member `member`."""

    member: str
    wheel: str
    offset: int
    size: int


def plan_parts(files: Sequence[tuple[str, int]], max_bytes: int) -> list[list[Piece]]:
    """Pieces per part so that every part's tar stays below `max_bytes`: largest files first,
    first fit; a file larger than a part fills whole parts with chunks and its rest fits in
    like any file. A pure function of the (name, size) list."""
    capacity = max_bytes - 1 - _TAR_END  # strictly below the limit
    room = capacity - _MEMBER_OVERHEAD
    if room < 4096:
        raise WheelhouseError(f"parts of {max_bytes} bytes are too small to hold data; use a larger --max-mib")
    parts: list[list[Piece]] = []
    used: list[int] = []

    def place(piece: Piece) -> None:
        need = piece.size + _MEMBER_OVERHEAD
        for k, u in enumerate(used):
            if u + need <= capacity:
                parts[k].append(piece)
                used[k] += need
                return
        parts.append([piece])
        used.append(need)

    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        chunks = size // room if size > room else 0
        for c in range(chunks):
            parts.append([Piece(f"{name}.{c:03d}", name, c * room, room)])
            used.append(room + _MEMBER_OVERHEAD)
        rest = size - chunks * room
        if rest or not chunks:
            place(Piece(f"{name}.{chunks:03d}" if chunks else name, name, chunks * room, rest))
    return parts


def split(directory: Path, out: Path, max_bytes: int = int(DEFAULT_MAX_MIB * MiB)) -> dict:
    """Verified wheelhouse -> tar parts below `max_bytes` each, plus parts.json. Returns it."""
    manifest = verify(directory)
    _fresh_dir(out, "parts")
    plan = plan_parts([(w.file, w.size) for w in manifest.wheels], max_bytes)
    parts = []
    for k, pieces in enumerate(plan):
        path = out / f"part-{k:03d}-of-{len(plan):03d}.tar"
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for pc in pieces:
                info = tarfile.TarInfo(pc.member)
                info.size, info.mode, info.mtime = pc.size, 0o644, 0
                with open(directory / pc.wheel, "rb") as f:
                    f.seek(pc.offset)
                    tar.addfile(info, f)
        size = path.stat().st_size
        if size >= max_bytes:  # the overhead bounds above are wrong: never ship it
            raise WheelhouseError(f"internal: {path.name} is {size} bytes, not below {max_bytes}")
        parts.append(
            {"file": path.name, "sha256": sha256_file(path), "size": size, "pieces": [asdict(pc) for pc in pieces]}
        )
    index = {
        "format": PARTS_FORMAT,
        "version": VERSION,
        "max_bytes": max_bytes,
        "manifest": manifest.to_json(),
        "parts": parts,
    }
    _write_json(out / PARTS_MANIFEST, index)
    return index


def join(parts_dir: Path, out: Path) -> Manifest:
    """Check every part, reassemble the wheels into `out`, check every wheel; returns the manifest."""
    index_path = parts_dir / PARTS_MANIFEST
    if not index_path.is_file():
        raise WheelhouseError(
            f"{parts_dir} has no {PARTS_MANIFEST}; copy it along with the parts (`split` writes it next to them)"
        )
    index = json.loads(index_path.read_text())
    if index.get("format") != PARTS_FORMAT or index.get("version") != VERSION:
        raise WheelhouseError(f"{index_path} is not a {PARTS_FORMAT} v{VERSION} index")
    manifest = Manifest.from_json(index["manifest"], index_path)
    n = len(index["parts"])
    missing = [p["file"] for p in index["parts"] if not (parts_dir / p["file"]).is_file()]
    if missing:
        raise WheelhouseError(
            f"{len(missing)} of {n} parts missing from {parts_dir}: {', '.join(missing)}; "
            "copy them again from where `split` wrote them"
        )
    corrupt = []
    for p in index["parts"]:
        path = parts_dir / p["file"]
        size = path.stat().st_size
        if size != p["size"] or sha256_file(path) != p["sha256"]:
            corrupt.append(f"{p['file']} (size {size}, expected {p['size']}; sha256 differs)")
    if corrupt:
        raise WheelhouseError(
            f"{len(corrupt)} of {n} parts in {parts_dir} are corrupt: {', '.join(corrupt)}; copy them again"
        )
    out.mkdir(parents=True, exist_ok=True)
    for w in manifest.wheels:
        with open(out / w.file, "wb") as f:
            f.truncate(w.size)
    for p in index["parts"]:
        with tarfile.open(parts_dir / p["file"]) as tar:
            for pc in map(lambda d: Piece(**d), p["pieces"]):
                src = tar.extractfile(pc.member)  # by name: nothing is extracted to a path
                if src is None:
                    raise WheelhouseError(f"part {p['file']}: member {pc.member} is not a regular file")
                with open(out / pc.wheel, "r+b") as f:
                    f.seek(pc.offset)
                    shutil.copyfileobj(src, f)
    _write_json(out / MANIFEST, manifest.to_json())
    return verify(out)


# ----------------------------------------------------------------------------- install


def install(source: Path, target_dir: Path | None = None, python: str = sys.executable) -> Manifest:
    """Install every wheel of a wheelhouse (or of its parts, joined first) with pip, offline and
    without dependency resolution: the manifest is the complete set."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        if (source / PARTS_MANIFEST).is_file():
            directory = Path(tmp)
            manifest = join(source, directory)
        else:
            directory, manifest = source, verify(source)
        args = ["install", "--no-index", "--no-deps", "--no-compile"]
        if target_dir is not None:
            args += ["--target", str(target_dir), "--upgrade"]
        proc = _pip([*args, *[str(directory / w.file) for w in manifest.wheels]], python)
        if proc.returncode != 0:
            raise WheelhouseError(f"pip install failed (exit {proc.returncode}):\n{_tail(proc, 20)}")
    return manifest


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.wheelhouse", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download wheels for a target interpreter into a new wheelhouse")
    b.add_argument("requirements", nargs="*", help="requirements (name==version) or paths to local .whl files")
    b.add_argument("-r", "--requirement", action="append", type=Path, default=[], help="requirements file")
    b.add_argument("-o", "--out", type=Path, required=True)
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--implementation", default="cp")
    b.add_argument("--glibc", default="2.28", help="the target's glibc (`ldd --version`); all manylinux tags up to it")
    b.add_argument("--arch", default="x86_64")
    b.add_argument("--platform", action="append", default=[], help="explicit platform tags (replace --glibc/--arch)")
    b.add_argument("--target-freeze", type=Path, help="the target's `pip list --format=freeze`: skip what it satisfies")
    b.add_argument("--skip", action="append", default=[], help="never bring this project (the target's own torch)")
    b.add_argument("--find-links", action="append", default=[], help="passed to pip")
    b.add_argument("--no-index", action="store_true", help="passed to pip (offline builds from --find-links)")
    b.add_argument(
        "--build-python",
        help="CPython of the target's version (glibc <= the target's, same arch) that builds sdists with compiled code",
    )
    b.add_argument(
        "--build-isolation",
        action="store_true",
        help="let pip fetch each sdist's build requirements (default: use the build interpreter's own)",
    )
    s = sub.add_parser("split", help="cut a wheelhouse into tar parts below a size limit")
    s.add_argument("wheelhouse", type=Path)
    s.add_argument("-o", "--out", type=Path, required=True)
    s.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB, help="every part stays below this many MiB")
    j = sub.add_parser("join", help="check parts and reassemble the wheelhouse")
    j.add_argument("parts", type=Path)
    j.add_argument("-o", "--out", type=Path, required=True)
    v = sub.add_parser("verify", help="check a wheelhouse against its manifest")
    v.add_argument("wheelhouse", type=Path)
    i = sub.add_parser("install", help="(join and) install a wheelhouse offline")
    i.add_argument("source", type=Path, help="a wheelhouse directory or a parts directory")
    i.add_argument("--target", type=Path, help="install into this directory (then put it on PYTHONPATH)")
    i.add_argument("--python", default=sys.executable, help="interpreter whose pip installs (default: this one)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            platforms = tuple(args.platform) or manylinux_platforms(args.glibc, args.arch)
            target = Target(args.python_version, args.implementation, platforms)
            builder = (
                Builder.for_target(args.build_python, target, args.build_isolation)
                if args.build_python
                else Builder.probe(sys.executable, isolation=args.build_isolation)
            )
            index_args = [a for d in args.find_links for a in ("--find-links", d)] + (
                ["--no-index"] if args.no_index else []
            )
            m = build(
                read_requirements(args.requirement, args.requirements),
                args.out,
                target,
                read_freeze(args.target_freeze) if args.target_freeze else None,
                args.skip,
                index_args,
                builder,
            )
            for sk in m.skipped:
                print(f"skipped {sk['requirement']}: {sk['reason']}")
            for w in m.wheels:
                if w.source == "sdist-build":
                    print(f"built {w.file} from its sdist with {w.build['python']} (Python {w.build['version']})")
            print(f"{len(m.wheels)} wheels, {m.total_bytes / MiB:.1f} MiB -> {args.out}")
        elif args.cmd == "split":
            index = split(args.wheelhouse, args.out, int(args.max_mib * MiB))
            for p in index["parts"]:
                print(f"{p['file']}  {p['size'] / MiB:.2f} MiB  sha256 {p['sha256']}")
        elif args.cmd == "join":
            m = join(args.parts, args.out)
            print(f"{len(m.wheels)} wheels verified -> {args.out}")
        elif args.cmd == "verify":
            m = verify(args.wheelhouse)
            print(f"{len(m.wheels)} wheels, {m.total_bytes / MiB:.1f} MiB: every sha256 matches")
        else:
            m = install(args.source, args.target, args.python)
            print(
                f"installed {len(m.wheels)} wheels"
                + (
                    f" into {args.target}; use it with:\n  export PYTHONPATH={args.target}${{PYTHONPATH:+:$PYTHONPATH}}"
                    if args.target
                    else ""
                )
            )
    except WheelhouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
