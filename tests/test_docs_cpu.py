"""Every public name of pyccl has a docstring (what `help()` and the API reference show),
every environment variable pyccl reads is in docs/environment.md, and the documentation build
(docs/conf.py) imports the checkout's pyccl where it is built, else the installed one.

Walks pyccl's top-level names, the public functions and classes of its modules
(pyccl.nccl, pyccl.ops, pyccl.distributed, pyccl.launch, pyccl.memory, pyccl.bench),
the methods and properties of Communicator, Registration and the other public classes,
and the exceptions.  Constants (ints, dicts, strings) carry no docstring of their own.
"""
import glob
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

import pyccl

MODULES = ["pyccl", "pyccl.nccl", "pyccl.ops", "pyccl.distributed", "pyccl.launch", "pyccl.memory",
           "pyccl.bench", "pyccl.bench.cli"]
_PLAIN = (int, float, str, bytes, dict, list, tuple, frozenset, set, type(None))


def _doc(obj):
    if inspect.ismemberdescriptor(obj):  # __slots__ members: docstring from the slots dict (help() shows it)
        return inspect.getdoc(obj)
    return getattr(obj, "__doc__", None)


def _public(names):
    return sorted(n for n in names if not n.startswith("_"))


def _ours(obj):
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "pyccl"


def _members(cls):
    """The public attributes a class defines itself (not the ones it inherits from torch or object)."""
    for name in _public(vars(cls)):
        attr = vars(cls)[name]
        if isinstance(attr, _PLAIN) or inspect.isclass(attr):
            continue
        yield name, attr


def _public_names():
    seen = {}
    for modname in MODULES:
        mod = importlib.import_module(modname)
        seen[modname] = mod
        names = set(getattr(mod, "__all__", ())) | set(_public(dir(mod)))
        for name in sorted(names):
            obj = getattr(mod, name)
            if inspect.ismodule(obj) or isinstance(obj, _PLAIN) or not _ours(obj):
                continue
            qual = f"{modname}.{name}"
            seen.setdefault(qual, obj)
            if inspect.isclass(obj):
                for member, attr in _members(obj):
                    seen.setdefault(f"{qual}.{member}", attr)
    return seen


NAMES = _public_names()


def test_the_walk_sees_the_api():
    # the walk itself must reach the names users call, else the test below proves nothing
    for must in ("pyccl.Communicator", "pyccl.Communicator.all_reduce", "pyccl.Communicator.rank",
                 "pyccl.Communicator.all_reduce_info", "pyccl.Registration", "pyccl.Registration.close",
                 "pyccl.NcclError", "pyccl.NcclTimeoutError", "pyccl.CudaError", "pyccl.nccl.all_reduce",
                 "pyccl.nccl.init_rank", "pyccl.ops.all_reduce", "pyccl.empty", "pyccl.mem_pool",
                 "pyccl.init_from_env", "pyccl.group", "pyccl.premul_sum",
                 "pyccl.distributed.ProcessGroupPyccl.allreduce", "pyccl.bench.main"):
        assert must in NAMES, must
    assert len(NAMES) > 80


@pytest.mark.parametrize("name", sorted(NAMES))
def test_has_docstring(name):
    doc = _doc(NAMES[name])
    assert doc and doc.strip(), f"{name} has no docstring"


def test_help_shows_it():
    # pydoc's text for a C function: the signature line and the text after it
    import pydoc
    text = pydoc.render_doc(pyccl.nccl.all_reduce, renderer=pydoc.plaintext)
    assert "Reduce" in text
    text = pydoc.render_doc(pyccl.Communicator.all_reduce, renderer=pydoc.plaintext)
    assert "all_reduce(self, /, tensor" in text and "Reduce `tensor`" in text


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read_names():
    """PYCCL_* names that pyccl's code reads from the environment (C getenv and its helper, Python
    os.environ / os.getenv, setup.py)."""
    pattern = re.compile(r'(?:getenv|env_long|environ\.get|environ\[|_override)\(?\s*(?:f,\s*)?"(PYCCL_[A-Z0-9_]+)"')
    files = glob.glob(os.path.join(_REPO, "csrc", "*.c")) + [os.path.join(_REPO, "setup.py")]
    files += glob.glob(os.path.join(_REPO, "pyccl", "**", "*.py"), recursive=True)
    names = set()
    for path in files:
        with open(path, encoding="utf-8") as f:
            names.update(pattern.findall(f.read()))
    return names


def test_every_environment_variable_is_documented():
    names = _read_names()
    assert {"PYCCL_NCCL_LIBRARY", "PYCCL_CUDART_LIBRARY", "PYCCL_QUIET", "PYCCL_REQUIRE_KERNELS",
            "PYCCL_CUDA_ARCHS", "PYCCL_DISABLE_OWN_KERNELS", "PYCCL_AR_BUFFER_MB"} <= names, names
    with open(os.path.join(_REPO, "docs", "environment.md"), encoding="utf-8") as f:
        page = f.read()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"docs/environment.md does not describe {missing}"


@pytest.mark.parametrize("built", [True, False], ids=["built-in-place", "installed"])
def test_the_docs_import_the_checkout_where_built_else_the_installed_pyccl(tmp_path, built):
    """docs/conf.py, run as tools/docs.sh runs sphinx (from the checkout, which is first on
    sys.path): a checkout whose pyccl has its extension built is the one documented; one without
    (after `pip install .`) must not shadow the installed pyccl (whose import would fail with
    "cannot import name '_C' from partially initialized module 'pyccl'")."""
    import importlib.machinery
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    (checkout / "docs").mkdir(parents=True)
    (checkout / "pyccl").mkdir()
    (site / "pyccl").mkdir(parents=True)
    with open(os.path.join(_REPO, "docs", "conf.py"), encoding="utf-8") as f:
        (checkout / "docs" / "conf.py").write_text(f.read())
    (checkout / "pyccl" / "__init__.py").write_text(
        "__version__ = 'checkout'\n" if built else
        "raise ImportError(\"cannot import name '_C' from partially initialized module 'pyccl'\")\n")
    if built:
        (checkout / "pyccl" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_text("")
    (site / "pyccl" / "__init__.py").write_text("__version__ = 'installed'\n")
    code = ("import runpy, sys, types\n"
            "try:\n"
            "    import docutils.nodes, sphinx.util.docutils\n"
            "except ImportError:  # without Sphinx: the two names conf.py takes from it\n"
            "    for name in ('docutils', 'docutils.nodes', 'sphinx', 'sphinx.util', 'sphinx.util.docutils'):\n"
            "        sys.modules[name] = types.ModuleType(name)\n"
            "    sys.modules['docutils'].nodes = sys.modules['docutils.nodes']\n"
            "    sys.modules['sphinx.util.docutils'].SphinxDirective = object\n"
            "sys.path.insert(0, '')  # python -m sphinx: the current folder first\n"
            "print(runpy.run_path('docs/conf.py')['release'])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(checkout), capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(site)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["checkout" if built else "installed"]
