"""tools.wheelhouse with real pip, offline: tiny packages are built into real wheels (and one
into a real sdist) in a temp dir, brought into a wheelhouse by `build` from --find-links,
split into small tar parts, damaged, joined and installed with pip --target. Two sdists with C
code (an extension module, and a ctypes library shipped by a setup.py that calls itself pure,
as jericho and fast-downward-textworld do) are compiled by gcc through --build-python."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import platform
import random
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools import wheelhouse as wh

TARGET = wh.Target(f"{sys.version_info[0]}.{sys.version_info[1]}", "cp", wh.manylinux_platforms("2.28", "x86_64"))
BIG_BYTES = 150_000  # incompressible: the big wheel is cut across several 64 KiB parts
PART_BYTES = 64 * 1024


def _pyproject(name: str, version: str) -> str:
    return (
        f'[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\n'
        f'[tool.setuptools]\npackages = ["{name}"]\n'
        f'[tool.setuptools.package-data]\n{name} = ["*.bin"]\n'
    )


def _package(root: Path, name: str, version: str, extra: dict[str, bytes] | None = None) -> Path:
    src = root / name
    (src / name).mkdir(parents=True)
    (src / "pyproject.toml").write_text(_pyproject(name, version))
    (src / name / "__init__.py").write_text(f"VALUE = {name!r} + '-{version}'\n")
    for fname, data in (extra or {}).items():
        (src / name / fname).write_bytes(data)
    return src


def _sdist(out: Path, name: str, version: str, files: dict[str, str] | None = None) -> None:
    """A real sdist (what PyPI serves for antlr4-python3-runtime): source only, no wheel."""
    top = f"{name}-{version}"
    files = {
        **(
            files
            or {"pyproject.toml": _pyproject(name, version), f"{name}/__init__.py": f"VALUE = {name!r} + '-sdist'\n"}
        ),
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
    }
    with tarfile.open(out / f"{top}.tar.gz", "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    """A find-links directory: two wheels built by pip from local projects, and one sdist."""
    root = tmp_path_factory.mktemp("pkgs")
    big = random.Random(0).randbytes(BIG_BYTES)
    srcs = [_package(root, "whdemo_a", "1.0"), _package(root, "whdemo_big", "1.0", {"blob.bin": big})]
    links = root / "links"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(links),
            *map(str, srcs),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    _sdist(links, "whdemo_src", "1.0")
    return links


@pytest.fixture(scope="module")
def house(index, tmp_path_factory) -> tuple[Path, wh.Manifest]:
    out = tmp_path_factory.mktemp("house") / "wh"
    freeze = out.parent / "target-freeze.txt"
    freeze.write_text("whdemo-skip==1.0\nwhdemo_big==0.5\ntorch==2.11.0+cu130\n")
    reqs = ["whdemo-a==1.0", "whdemo_big>=1", "whdemo-src==1.0", "whdemo-skip>=1", "torch==2.11.0"]
    m = wh.build(
        reqs, out, TARGET, wh.read_freeze(freeze), skip=(), pip_index_args=["--no-index", "--find-links", str(index)]
    )
    return out, m


def test_build_brings_wheels_for_the_target_and_skips_what_it_has(house):
    out, m = house
    assert {w.name: (w.version, w.source) for w in m.wheels} == {
        "whdemo-a": ("1.0", "download"),
        "whdemo-big": ("1.0", "download"),  # the target's 0.5 misses the pin
        "whdemo-src": ("1.0", "sdist-build"),
    }
    assert {s["requirement"]: s["reason"] for s in m.skipped} == {
        "whdemo-skip>=1": "target has whdemo-skip 1.0",
        "torch==2.11.0": "target has torch 2.11.0+cu130",
    }
    for w in m.wheels:
        data = (out / w.file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == w.sha256 and len(data) == w.size
    assert wh.load_manifest(out).to_json() == m.to_json()
    assert wh.main(["verify", str(out)]) == 0


def test_split_join_gives_identical_wheels(house, tmp_path):
    out, m = house
    index = wh.split(out, tmp_path / "parts", PART_BYTES)
    parts = sorted((tmp_path / "parts").glob("part-*.tar"))
    assert len(parts) == len(index["parts"]) >= 3
    assert all(p.stat().st_size < PART_BYTES for p in parts)
    big = next(w for w in m.wheels if w.name == "whdemo-big")
    chunks = [pc for p in index["parts"] for pc in p["pieces"] if pc["wheel"] == big.file]
    assert len(chunks) >= 3 and len(
        {p["file"] for p in index["parts"] for pc in p["pieces"] if pc["wheel"] == big.file}
    ) == len(chunks)
    joined = wh.join(tmp_path / "parts", tmp_path / "joined")
    for w in joined.wheels:
        assert hashlib.sha256((tmp_path / "joined" / w.file).read_bytes()).hexdigest() == w.sha256
        assert (tmp_path / "joined" / w.file).read_bytes() == (out / w.file).read_bytes()


def test_corrupt_or_missing_part_is_named(house, tmp_path, capsys):
    out, _ = house
    parts = tmp_path / "parts"
    index = wh.split(out, parts, PART_BYTES)
    victim = parts / index["parts"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert wh.main(["join", str(parts), "-o", str(tmp_path / "j1")]) == 2
    err = capsys.readouterr().err
    assert f"1 of {len(index['parts'])} parts" in err and victim.name in err and "corrupt" in err
    victim.unlink()
    with pytest.raises(wh.WheelhouseError, match=rf"missing .*{victim.name}"):
        wh.join(parts, tmp_path / "j2")


def test_plan_parts_covers_every_byte_once_below_the_limit():
    rng = random.Random(1)
    files = [(f"f{i}.whl", rng.choice([0, 10, 5000, 70_000, 300_000, rng.randrange(1, 200_000)])) for i in range(40)]
    plan = wh.plan_parts(files, PART_BYTES)
    cap = PART_BYTES - 1 - wh._TAR_END
    for pieces in plan:
        assert sum(pc.size + wh._MEMBER_OVERHEAD for pc in pieces) <= cap
    for name, size in files:
        spans = sorted((pc.offset, pc.size) for part in plan for pc in part if pc.wheel == name)
        assert spans[0][0] == 0 and sum(s for _, s in spans) == size
        assert all(o1 + s1 == o2 for (o1, s1), (o2, _) in zip(spans, spans[1:]))


def test_install_target_is_importable(house, tmp_path):
    out, _ = house
    wh.split(out, tmp_path / "parts", PART_BYTES)
    site = tmp_path / "site"
    assert wh.main(["install", str(tmp_path / "parts"), "--target", str(site)]) == 0
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import whdemo_a, whdemo_src, whdemo_big, importlib.resources as r; "
        "print(whdemo_a.VALUE, whdemo_src.VALUE, len(r.files('whdemo_big').joinpath('blob.bin').read_bytes()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.stdout.split() == ["whdemo_a-1.0", "whdemo_src-sdist", str(BIG_BYTES)], proc.stderr


def test_missing_requirement_and_foreign_wheel_fail_clearly(index, tmp_path):
    with pytest.raises(wh.WheelhouseError, match="whdemo-nothere==9.9: no wheel for the target"):
        wh.build(
            ["whdemo-a==1.0", "whdemo-nothere==9.9"],
            tmp_path / "a",
            TARGET,
            pip_index_args=["--no-index", "--find-links", str(index)],
        )
    foreign = tmp_path / "whdemo_c-1.0-cp27-cp27mu-manylinux1_x86_64.whl"
    shutil.copyfile(next(index.glob("whdemo_a-*.whl")), foreign)
    with pytest.raises(wh.WheelhouseError, match="whdemo_c-1.0-cp27.*no tag the target accepts"):
        wh.build([str(foreign)], tmp_path / "b", TARGET)
    with pytest.raises(wh.WheelhouseError, match="not empty"):
        wh.build([], tmp_path, TARGET)


def test_manylinux_platforms_cover_older_glibc_only():
    tags = wh.manylinux_platforms("2.28", "x86_64")
    assert "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags and "manylinux1_x86_64" in tags
    assert "manylinux_2_31_x86_64" not in tags
    with pytest.raises(wh.WheelhouseError, match="expected 2.N"):
        wh.manylinux_platforms("3.1", "x86_64")


# ----------------------------------------------------------------------------- sdists with C code

SETUPTOOLS = '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
# jericho's pattern: setup.py compiles a library, ships it as package data, and the wheel is
# declared pure (py3-none-any) because no extension module is involved
CTYPES_SETUP = """import os, subprocess
from setuptools import setup
here = os.path.dirname(os.path.abspath(__file__))
subprocess.check_call(["gcc", "-shared", "-fPIC", "-o", "whdemo_lib/libtiny.so", "tiny.c"], cwd=here)
setup(name="whdemo_lib", version="1.0", packages=["whdemo_lib"], package_data={"whdemo_lib": ["libtiny.so"]})
"""
EXT_SETUP = """from setuptools import Extension, setup
setup(name="whdemo_ext", version="1.0", ext_modules=[Extension("whdemo_ext", ["whdemo_ext.c"])])
"""
EXT_C = """#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "whdemo_ext", "", -1, methods};
PyMODINIT_FUNC PyInit_whdemo_ext(void) { return PyModule_Create(&mod); }
"""
HERE = wh.Target(
    f"{sys.version_info[0]}.{sys.version_info[1]}",
    "cp",
    wh.manylinux_platforms(platform.libc_ver()[1] or "2.5", platform.machine()),
)
needs_gcc = pytest.mark.skipif(
    shutil.which("gcc") is None or not platform.libc_ver()[1], reason="needs gcc on glibc Linux"
)


@pytest.fixture(scope="module")
def c_links(tmp_path_factory) -> Path:
    links = tmp_path_factory.mktemp("clinks")
    _sdist(
        links,
        "whdemo_lib",
        "1.0",
        {
            "pyproject.toml": SETUPTOOLS,
            "setup.py": CTYPES_SETUP,
            "tiny.c": "int tiny_answer(void) { return 41; }\n",
            "whdemo_lib/__init__.py": "",
        },
    )
    _sdist(links, "whdemo_ext", "1.0", {"pyproject.toml": SETUPTOOLS, "setup.py": EXT_SETUP, "whdemo_ext.c": EXT_C})
    return links


def _record_matches(wheel: Path) -> bool:
    """Every hashed RECORD row of `wheel` names a member with that sha256 and size."""
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = [row.rsplit(",", 2) for row in zf.read(record).decode().splitlines()]
        return all(
            digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            and int(size) == len(data)
            for path, digest, size in rows
            if digest
            for data in [zf.read(path)]
        )


@needs_gcc
def test_build_python_compiles_sdists_for_the_target(c_links, tmp_path):
    out = tmp_path / "wh"
    builder = wh.Builder.for_target(sys.executable, HERE)
    m = wh.build(
        ["whdemo-lib==1.0", "whdemo-ext==1.0"],
        out,
        HERE,
        pip_index_args=["--no-index", "--find-links", str(c_links)],
        builder=builder,
    )
    arch, py = platform.machine(), f"cp{sys.version_info[0]}{sys.version_info[1]}"
    lib = next(w for w in m.wheels if w.name == "whdemo-lib")
    ext = next(w for w in m.wheels if w.name == "whdemo-ext")
    assert lib.file == f"whdemo_lib-1.0-py3-none-linux_{arch}.whl" and lib.source == "sdist-build"
    assert lib.build == {
        "python": sys.executable,
        "version": platform.python_version(),
        "glibc": platform.libc_ver()[1],
        "machine": arch,
        "compiled": "whdemo_lib/libtiny.so",
        "retagged_from": "whdemo_lib-1.0-py3-none-any.whl",
    }
    assert ext.file.startswith(f"whdemo_ext-1.0-{py}-{py}-linux_{arch}") and "retagged_from" not in ext.build
    assert all(_record_matches(out / w.file) for w in m.wheels)
    with zipfile.ZipFile(out / lib.file) as zf:
        assert f"Tag: py3-none-linux_{arch}" in zf.read("whdemo_lib-1.0.dist-info/WHEEL").decode().splitlines()
    # pip refuses wheels whose tags the interpreter does not accept: installing is the target's check
    site = tmp_path / "site"
    wh.install(out, site)
    code = (
        "import ctypes, whdemo_ext, whdemo_lib, pathlib; "
        "lib = ctypes.CDLL(str(pathlib.Path(whdemo_lib.__file__).with_name('libtiny.so'))); "
        "print(lib.tiny_answer(), whdemo_ext.answer())"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.stdout.split() == ["41", "42"], proc.stderr


@needs_gcc
def test_compiled_sdist_without_build_python_is_refused(c_links, tmp_path):
    """A py3-none-any wheel carrying a .so is not pure: without --build-python it is refused."""
    with pytest.raises(wh.WheelhouseError, match=r"whdemo-lib==1.0: only an sdist.*libtiny\.so.*--build-python"):
        wh.build(
            ["whdemo-lib==1.0"], tmp_path / "wh", HERE, pip_index_args=["--no-index", "--find-links", str(c_links)]
        )


def test_build_python_of_another_version_or_newer_glibc_is_refused(tmp_path, capsys):
    other = "3.10" if sys.version_info[:2] != (3, 10) else "3.11"
    argv = ["build", "whdemo-a==1.0", "-o", str(tmp_path / "wh"), "--python-version", other]
    assert wh.main([*argv, "--build-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert f"is Python {platform.python_version()}, the target is {other}" in err and not (tmp_path / "wh").exists()
    with pytest.raises(wh.WheelhouseError, match="does not run"):
        wh.Builder.for_target(str(tmp_path / "no-python"), HERE)
    if platform.libc_ver()[1]:
        old = wh.Target(HERE.python_version, "cp", wh.manylinux_platforms("2.5", platform.machine()))
        with pytest.raises(wh.WheelhouseError, match=r"runs on glibc .*the target has 2\.5 .*glibc <= 2\.5"):
            wh.Builder.for_target(sys.executable, old)
        arm = wh.Target(HERE.python_version, "cp", wh.manylinux_platforms("2.39", "riscv64"))
        with pytest.raises(wh.WheelhouseError, match=f"runs on {platform.machine()}, the target on riscv64"):
            wh.Builder.for_target(sys.executable, arm)


# ----------------------------------------------------------------------------- the ALFWorld list

TARGET_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}


def _closure(roots: list[str]) -> dict[str, str]:
    """{name: installed version} of `roots` and everything they require here (markers evaluated
    for the target's Python 3.12 on Linux, extras followed)."""
    from importlib import metadata

    from packaging.markers import default_environment

    env = {**default_environment(), **TARGET_MARKERS}
    found: dict[str, str] = {}
    done: set[tuple[str, str]] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        dist = metadata.distribution(req.name)
        name = canonicalize_name(dist.metadata["Name"])
        found[name] = dist.version
        for extra in {"", *req.extras} - {e for n, e in done if n == name}:
            done.add((name, extra))
            for dep in map(Requirement, dist.requires or []):
                if dep.marker.evaluate({**env, "extra": extra}) if dep.marker else extra == "":
                    todo.append(dep)
    return found


def test_alfworld_list_is_what_the_image_and_builtin_set_lack():
    """requirements/gpu-alfworld.txt = the closure of alfworld + textworld[pddl] in this venv
    minus what the H200 image's freeze satisfies and what gpu-builtin.txt brings, at the
    versions installed here (the ones envs/alfworld is tested with)."""
    pytest.importorskip("alfworld")
    root = Path(__file__).resolve().parents[2] / "requirements"
    alf = {Requirement(r) for r in wh.read_requirements([root / "gpu-alfworld.txt"])}
    builtin = {canonicalize_name(Requirement(r).name) for r in wh.read_requirements([root / "gpu-builtin.txt"])}
    image = wh.read_freeze(root / "h200-image-freeze.txt")
    closure = _closure(["alfworld", "textworld[pddl]"])
    lacking = {n: v for n, v in closure.items() if n not in builtin and n not in image}
    assert {canonicalize_name(r.name): str(r.specifier) for r in alf} == {n: f"=={v}" for n, v in lacking.items()}
