"""Packaging: one version source, an sdist that carries every file the build and the tests
need, and a built extension that needs no run path and links only the C library.

The sdist is made by setuptools' own PEP 517 hook (what `python -m build --sdist` calls)
in a scratch copy of the files git knows, so the checkout is left alone.  The complete
isolated build (sdist, a wheel from it, installed in a fresh venv) is tools/package-check.sh.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_NAME = "pyccl-nccl"


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _version():
    ns = {}
    exec(_read("pyccl/_version.py"), ns)
    return ns["__version__"]


def _pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads(_read("pyproject.toml"))


def _git_files(*paths):
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"git ls-files failed: {r.stderr.strip()}")
    return [p for p in r.stdout.split("\0") if p]


def test_version_has_one_source():
    meta = _pyproject()
    project = meta["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pyccl._version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", _version())
    # no other file of the package writes a version
    for path in glob.glob(os.path.join(ROOT, "pyccl", "**", "*.py"), recursive=True):
        if os.path.basename(path) != "_version.py":
            with open(path, encoding="utf-8") as f:
                assert not re.search(r"^__version__\s*=", f.read(), re.M), path
    assert f"## [{_version()}]" in _read("CHANGELOG.md")


def test_imported_version_is_the_source():
    pyccl = pytest.importorskip("pyccl")
    assert pyccl.__version__ == _version()


def test_metadata():
    project = _pyproject()["project"]
    assert project["name"] == DIST_NAME
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in _read("LICENSE") and "Version 2.0" in _read("LICENSE")
    # the supported torch versions are stated here and nowhere else in the metadata
    assert [d for d in project["dependencies"] if d.startswith("torch")] == ["torch>=2.11"]
    extras = project["optional-dependencies"]
    assert "numpy" in extras["numpy"] and "mpi4py" in extras["mpi"] and "matplotlib" in extras["bench"]
    requires = _pyproject()["build-system"]["requires"]
    for wheel in ("nvidia-nccl-cu13", "nvidia-cuda-runtime", "nvidia-cuda-crt"):
        assert any(r.startswith(wheel) for r in requires), wheel


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """(file names in the sdist without its top folder, PKG-INFO text)."""
    pytest.importorskip("tomllib")
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject.toml's license expression)")
    tmp = tmp_path_factory.mktemp("sdist")
    src, out = tmp / "src", tmp / "out"
    for rel in _git_files():
        if os.path.isfile(os.path.join(ROOT, rel)):  # a file deleted but not yet committed: left out
            os.makedirs(src / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), src / rel)
    out.mkdir()
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    name = r.stdout.strip().splitlines()[-1]
    with tarfile.open(out / name) as tar:
        members = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name]
        top = tar.getmembers()[0].name.split("/")[0]
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    return set(members), pkg_info


def test_sdist_carries_every_file_the_build_needs(sdist):
    files, _ = sdist
    needed = _git_files("csrc", "pyccl", "tests", "examples")
    needed += ["setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md"]
    missing = sorted(set(needed) - files)
    assert not missing, f"not in the sdist: {missing}"
    assert not [f for f in files if f.endswith((".so", ".pyc", ".o"))]


def test_sdist_metadata(sdist):
    _, pkg_info = sdist
    fields = dict(line.split(": ", 1) for line in pkg_info.split("\n\n")[0].splitlines() if ": " in line)
    assert fields["Name"] == DIST_NAME
    assert fields["Version"] == _version()
    assert fields["License-Expression"] == "Apache-2.0"
    assert "Requires-Dist: torch>=2.11" in pkg_info


def test_extension_needs_no_run_path():
    """The built pyccl._C finds NCCL and CUDA at run time: no RPATH/RUNPATH (the build
    interpreter's lib folder would be one) and nothing needed beyond the C library."""
    pyccl = pytest.importorskip("pyccl")
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    so = pyccl._C.__file__
    r = subprocess.run(["readelf", "-d", so], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "RPATH" not in r.stdout and "RUNPATH" not in r.stdout, r.stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", r.stdout)
    allowed = ("libc.so", "libdl.so", "libpthread.so", "libm.so", "ld-linux", "libasan.so", "libubsan.so")
    assert needed and all(n.startswith(allowed) for n in needed), needed
