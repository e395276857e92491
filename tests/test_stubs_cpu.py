"""pyccl/_C.pyi against the built extension (mypy's stubtest), and the types a user's editor
and type checker see through `import pyccl`.

stubtest imports pyccl._C and compares every name, class and signature with the stub, so a
method added, renamed or re-signed in csrc/ without the stub fails here.  A check that passes
for the wrong reason (stubtest finding no stub at all says "Success" too) is ruled out by
running it on a copy whose stub lacks a method and seeing it fail.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pyccl = pytest.importorskip("pyccl")

try:
    import mypy  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true":
        raise  # .ci/run installs it: the stubs must be checked there
    pytest.skip("mypy is not installed (pip install mypy)", allow_module_level=True)

# torch's own sources take mypy ~20 s to read; its types do not matter here
MYPY_INI = "[mypy]\n[mypy-torch.*]\nfollow_imports = skip\nfollow_imports_for_stubs = True\n"


def _copy_package(dst):
    """pyccl's package files (the built _C included) under dst/pyccl."""
    src = os.path.dirname(pyccl.__file__)
    shutil.copytree(src, os.path.join(dst, "pyccl"), ignore=shutil.ignore_patterns("__pycache__"))


def _stubtest(cwd, tmp_path):
    ini = tmp_path / "mypy.ini"
    ini.write_text(MYPY_INI)
    return subprocess.run([sys.executable, "-m", "mypy.stubtest", "pyccl._C", "--mypy-config-file", str(ini)],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_stub_matches_the_built_module(tmp_path):
    _copy_package(tmp_path / "pkg")
    r = _stubtest(tmp_path / "pkg", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found in 1 module" in r.stdout


def test_stubtest_fails_on_a_stub_that_drifted(tmp_path):
    _copy_package(tmp_path / "pkg")
    stub = tmp_path / "pkg" / "pyccl" / "_C.pyi"
    text = stub.read_text()
    drop = "    def barrier(self, *, stream: _Stream = None) -> None: ...\n"
    assert drop in text
    stub.write_text(text.replace(drop, "").replace("def split(self, color:", "def split(self, colour:"))
    r = _stubtest(tmp_path / "pkg", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "pyccl._C.Communicator.barrier is not present in stub" in r.stdout
    assert "pyccl._C.Communicator.split is inconsistent" in r.stdout


def test_a_users_script_is_type_checked_through_import_pyccl(tmp_path):
    """What mypy (and an editor) sees from a script outside the checkout."""
    _copy_package(tmp_path / "pkg")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    script = tmp_path / "train.py"
    script.write_text(
        "import pyccl\n"
        "def step(comm: pyccl.Communicator, grad: object) -> int:\n"
        "    comm.all_reduce(grad, op=pyccl.AVG)\n"
        "    sub = comm.split(color=comm.rank % 2)\n"
        "    reveal_type(sub)\n"
        "    reveal_type(pyccl.NcclTimeoutError(1).timeout)\n"
        "    comm.all_reduce(grad, opp=pyccl.SUM)\n"
        "    return comm.size\n")
    env = dict(os.environ, MYPYPATH=str(tmp_path / "pkg"))
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
                        "--no-incremental", str(script)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert 'Revealed type is "pyccl._C.Communicator | None"' in out, out + r.stderr
    assert 'Revealed type is "float"' in out, out
    assert 'Unexpected keyword argument "opp" for "all_reduce" of "Communicator"' in out, out
    assert "Found 1 error in 1 file" in out, out
