"""CPU tier of the per-rank API: surface, signatures and the launchers' errors."""
import datetime
import inspect
import re
import socket
import warnings

import pytest
import torch

import pyccl

SIGNATURES = {
    "all_reduce": "(self, /, tensor, op=0, *, out=None, stream=None, algo=None)",
    "broadcast": "(self, /, tensor, root, *, out=None, stream=None)",
    "reduce": "(self, /, tensor, root, op=0, *, out=None, stream=None)",
    "all_gather": "(self, /, input, output, *, stream=None)",
    "reduce_scatter": "(self, /, input, output, op=0, *, stream=None)",
    "send": "(self, /, tensor, peer, *, stream=None)",
    "recv": "(self, /, tensor, peer, *, stream=None)",
    "all_to_all": "(self, /, input, output, *, stream=None)",
    "all_to_all_single": "(self, /, input, output, input_splits=None, output_splits=None, *, stream=None)",
    "gather": "(self, /, tensor, outputs, root, *, stream=None)",
    "scatter": "(self, /, inputs, tensor, root, *, stream=None)",
    "barrier": "(self, /, *, stream=None)",
    "split": "(self, /, color, key=None)",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_method_signature(name):
    method = getattr(pyccl.Communicator, name)
    assert str(inspect.signature(method)) == SIGNATURES[name]
    assert method.__doc__ and len(method.__doc__) > 40


def test_constructor_and_properties():
    assert str(inspect.signature(pyccl.Communicator)) == \
        "(world_size, unique_id, rank, device=None, timeout=None)"
    for prop in ("rank", "size", "device", "handle", "destroyed", "timeout"):
        # read-only attributes with a docstring (C getters or members)
        d = getattr(pyccl.Communicator, prop)
        assert inspect.isdatadescriptor(d) and d.__doc__, prop
    assert hasattr(pyccl.Communicator, "__enter__") and hasattr(pyccl.Communicator, "__exit__")


def test_top_level_names():
    for name in pyccl.__all__:
        assert hasattr(pyccl, name), name
    assert (pyccl.SUM, pyccl.PROD, pyccl.MAX, pyccl.MIN, pyccl.AVG) == (0, 1, 2, 3, 4)
    assert repr(pyccl.premul_sum(0.25)) == "pyccl.premul_sum(0.25)"
    assert pyccl.premul_sum(3).premul_scalar == 3.0
    assert pyccl.premul_sum(torch.tensor(0.5)).premul_scalar == 0.5


def test_communicator_cannot_be_subclassed():
    with pytest.raises(TypeError):
        class Sub(pyccl.Communicator):
            pass


def test_group_ends_even_when_the_body_raises():
    with pytest.raises(KeyError):
        with pyccl.group():
            raise KeyError("boom")
    # Had the group stayed open, this thread's depth would still be 1 and this end would succeed.
    with pytest.raises(RuntimeError, match=r"^group end: no pyccl\.group\(\) is open on this thread$"):
        pyccl._C._nccl_group_end()
    with pyccl.group():
        pass
    with pytest.raises(RuntimeError, match=r"^group end: no pyccl\.group\(\) is open on this thread$"):
        pyccl._C._nccl_group_end()


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_init_from_env_missing_variables(monkeypatch, missing):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(missing)
    with pytest.raises(RuntimeError, match="^" + re.escape(
            f"init_from_env: environment variables {missing} are not set "
            "(launch with torchrun, or set them yourself)") + "$"):
        pyccl.init_from_env()


def test_init_from_env_bad_values(monkeypatch):
    for k, v in {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"^init_from_env: RANK=2 is out of range for WORLD_SIZE=2$"):
        pyccl.init_from_env()
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match=r"^init_from_env: RANK='zero' is not an integer$"):
        pyccl.init_from_env()


def test_init_from_env_store_listens_on_master_addr_only():
    """torch's TCPStore listens on every interface; init_from_env's on MASTER_ADDR."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from pyccl.launch import _listen_fd

    fd = _listen_fd("127.0.0.1", 0)
    s = socket.socket(fileno=fd)
    addr, port = s.getsockname()
    s.detach()
    assert addr == "127.0.0.1"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10), master_listen_fd=fd)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
    store.set("pyccl/k", b"v")
    assert client.get("pyccl/k") == b"v"
    # another local address reaches nothing (a wildcard listener would answer)
    with socket.socket() as probe:
        probe.settimeout(5)
        assert probe.connect_ex(("127.0.0.2", port)) != 0
    del client, store


def test_init_from_env_store_address_errors():
    from pyccl.launch import _listen_fd

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"^init_from_env: MASTER_PORT={port} is in use on 127\.0\.0\.1 "):
            _listen_fd("127.0.0.1", port)
    # an address this host does not have (TEST-NET-1): torch's wildcard listener, with a warning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _listen_fd("192.0.2.1", 0) is None
    assert any("init_from_env: cannot listen on MASTER_ADDR=192.0.2.1" in str(w.message) for w in seen)


def test_all_reduce_info_without_a_gpu():
    """The own-kernel settings are readable on the type; a Communicator is needed for state."""
    prop = pyccl.Communicator.all_reduce_info
    assert "oneshot_max" in prop.__doc__ and "twoshot_max" in prop.__doc__ and "pdl" in prop.__doc__
    assert isinstance(pyccl._C._ar_built(), bool)
    image = pyccl._C._ar_fatbin()
    assert (image is not None) == pyccl._C._ar_built()
    if image is not None:  # a CUDA fatbin: its magic number, little-endian
        assert image[:4] == (0xBA55ED50).to_bytes(4, "little"), image[:4]
