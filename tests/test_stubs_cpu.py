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
    # a method pyccl's own (typed) Python does not call: dropping one it calls stops mypy's
    # build before stubtest compares anything
    drop = "    def get_async_error(self) -> NcclError | None: ...\n"
    assert drop in text
    stub.write_text(text.replace(drop, "").replace("def split(self, color:", "def split(self, colour:"))
    r = _stubtest(tmp_path / "pkg", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "pyccl._C.Communicator.get_async_error is not present in stub" in r.stdout
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


# --- mypy --strict on tests/typing/user_script.py: a program that calls every public name ---

USER_SCRIPT = os.path.join(ROOT, "tests", "typing", "user_script.py")
# pyccl.* silent: as for an installed package, mypy reads pyccl's types but reports only the
# user's own lines (pyccl's are not the user's to fix)
STRICT_INI = MYPY_INI + "[mypy-pyccl.*]\nfollow_imports = silent\n"


def _mypy_strict(tmp_path, script):
    _copy_package(tmp_path / "pkg")
    ini = tmp_path / "mypy.ini"
    ini.write_text(STRICT_INI)
    env = dict(os.environ, MYPYPATH=str(tmp_path / "pkg"))
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", str(ini),
                           "--no-incremental", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_script_using_every_public_call_passes_mypy_strict(tmp_path):
    r = _mypy_strict(tmp_path, USER_SCRIPT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found in 1 source file" in r.stdout, r.stdout


def test_mypy_strict_reports_a_misuse_in_that_script(tmp_path):
    """The same check sees wrong calls: it does not pass because everything is Any."""
    script = tmp_path / "misuse.py"
    with open(USER_SCRIPT) as f:
        script.write_text(f.read() + (
            "\n\ndef misuse(comm: pyccl.Communicator) -> int:\n"
            "    pyccl.init_from_env(timeout='30')\n"
            "    comm.wait(timeout='1')\n"
            "    pyccl.nccl.init_rank(2, 'id', 0)\n"
            "    return pyccl.unique_id()\n"))
    r = _mypy_strict(tmp_path, script)
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    assert ('Argument "timeout" to "init_from_env" has incompatible type "str"; '
            'expected "float | timedelta | None"') in out, out
    assert ('Argument "timeout" to "wait" of "Communicator" has incompatible type "str"; '
            'expected "float | timedelta | None"') in out, out
    assert 'Argument 2 to "init_rank" has incompatible type "str"; expected "bytes"' in out, out
    assert 'Incompatible return value type (got "bytes", expected "int")' in out, out
    assert "Found 4 errors in 1 file" in out, out


def _public_names():
    """Every public name of pyccl and its modules a user calls or reads, as the script spells it."""
    import pyccl.distributed
    import pyccl.nccl
    import pyccl.ops

    names = [f"pyccl.{n}" for n in pyccl.__all__]
    for mod in (pyccl.nccl, pyccl.ops, pyccl.distributed):
        for n, v in vars(mod).items():
            if not n.startswith("_") and n != "TYPE_CHECKING" and (getattr(v, "__module__", None) == mod.__name__
                                          or n in getattr(mod, "__all__", ()) or n.isupper()):
                names.append(f"{mod.__name__}.{n}")
    for cls in (pyccl.Communicator, pyccl.Registration):
        names += [f".{n}" for n in dir(cls) if not n.startswith("_")]
    return names


def test_the_typed_script_uses_every_public_name():
    with open(USER_SCRIPT) as f:
        text = f.read().replace("nccl = pyccl.nccl", "").replace(" nccl.", " pyccl.nccl.")
    text = text.replace("(nccl.", "(pyccl.nccl.").replace("[nccl.", "[pyccl.nccl.")
    missing = [n for n in _public_names() if n not in text]
    assert not missing, f"tests/typing/user_script.py does not use {missing}"
