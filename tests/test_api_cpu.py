"""CPU tier of the per-rank API: surface, signatures and the launchers' errors."""
import inspect
import re

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
    assert str(inspect.signature(pyccl.Communicator)) == "(world_size, unique_id, rank, device=None)"
    for prop in ("rank", "size", "device", "handle", "destroyed"):
        assert isinstance(getattr(pyccl.Communicator, prop), property) or \
            type(getattr(pyccl.Communicator, prop)).__name__ == "getset_descriptor", prop
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
    # Had the group stayed open, nesting would be off and this would not balance.
    with pyccl.group():
        pass


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


def test_all_reduce_info_without_a_gpu():
    """The own-kernel settings are readable on the type; a Communicator is needed for state."""
    prop = pyccl.Communicator.all_reduce_info
    assert "oneshot_max" in prop.__doc__ and "twoshot_max" in prop.__doc__
    assert isinstance(pyccl._C._fastar_built(), bool)
