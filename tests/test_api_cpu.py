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
    "all_gather": "(self, /, input, output, *, stream=None, algo=None)",
    "reduce_scatter": "(self, /, input, output, op=0, *, stream=None, algo=None)",
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
        "(world_size, unique_id, rank, device=None, timeout=None, *, blocking=None)"
    for prop in ("rank", "size", "device", "handle", "destroyed", "timeout", "blocking"):
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


@pytest.mark.parametrize("var, find", [("PYCCL_NCCL_LIBRARY", "nccl_candidates"),
                                       ("PYCCL_CUDART_LIBRARY", "cudart_candidates")])
def test_a_library_override_that_names_no_file_is_said(monkeypatch, tmp_path, var, find):
    from pyccl import _libs
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    monkeypatch.setenv(var, str(lib))  # a file: the first candidate, nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(_libs, find)()[0] == str(lib)
    monkeypatch.setenv(var, str(tmp_path / "nowhere.so"))
    with pytest.warns(RuntimeWarning) as said:
        got = getattr(_libs, find)()
    assert [str(w.message) for w in said] == [
        f"pyccl: {var}={str(tmp_path / 'nowhere.so')!r} is not a file; looking for the library elsewhere"]
    assert str(tmp_path / "nowhere.so") not in got
    monkeypatch.setenv(var, "")  # blank: unset, nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(_libs, find)()


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
    monkeypatch.setenv("RANK", "1_0")  # int() would read 10
    with pytest.raises(ValueError, match=r"^init_from_env: RANK='1_0' is not an integer$"):
        pyccl.init_from_env()
    monkeypatch.setenv("RANK", " 1 ")  # spaces around a number are taken
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match=r"^init_from_env: LOCAL_RANK=-1 is out of range for LOCAL_WORLD_SIZE=2$"):
        pyccl.init_from_env()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"^init_from_env: LOCAL_RANK=1 is out of range for LOCAL_WORLD_SIZE=1$"):
        pyccl.init_from_env()
    monkeypatch.setenv("MASTER_PORT", "70000")
    # LOCAL_RANK unset: its default, RANK=1, is not held against LOCAL_WORLD_SIZE=1 (as before)
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match=r"^init_from_env: MASTER_PORT=70000 is not a port \(1 to 65535\)$"):
        pyccl.init_from_env()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")  # blank is unset: WORLD_SIZE
    with pytest.raises(ValueError, match=r"^init_from_env: MASTER_PORT=70000 is not a port \(1 to 65535\)$"):
        pyccl.init_from_env()
    monkeypatch.setenv("MASTER_ADDR", "")  # blank is unset
    with pytest.raises(RuntimeError, match=r"^init_from_env: environment variables MASTER_ADDR are not set"):
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


# ---- one spelling per idea: reduction ops and device= (csrc/args.c reads both for every API)

OPS_TAKEN = ("SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, their names as strings ('sum', ...), "
             "or a torch.distributed.ReduceOp")


def _stand_in(tmp_path_factory, scenario):
    """Run tests/child_fakegpu.py's `scenario` on the stand-in GPU library; its RESULT."""
    from _fakes import run_stand_in
    return run_stand_in(tmp_path_factory.mktemp("fakegpu"), scenario)


def test_op_spellings_reach_nccl_as_its_ops(tmp_path_factory):
    """Communicator.all_reduce, .reduce and the drop-in's all_reduce (on that communicator) pass
    NCCL the same op for every spelling (ncclSum 0, ncclProd 1, ncclMax 2, ncclMin 3, ncclAvg 4)."""
    got = _stand_in(tmp_path_factory, "op_spellings")
    want = {"int 2": 2, "pyccl.MIN": 3, "'sum'": 0, "'Prod'": 1, "'AVG'": 4, "RedOpType MAX": 2,
            "RedOpType PRODUCT": 1, "ReduceOp(AVG)": 4, "ReduceOp(MIN)": 3}
    for label, op in want.items():
        assert got[label] == [op, op, op], label
    premul = OPS_TAKEN.replace("or a torch.distributed.ReduceOp",
                               "a torch.distributed.ReduceOp, or pyccl.premul_sum(x)")
    assert got["RedOpType BXOR"] == [
        ["ValueError", f"all_reduce: op=ReduceOp.BXOR has no NCCL reduction ({premul})"],
        ["ValueError", f"all_reduce: op=ReduceOp.BXOR has no NCCL reduction ({OPS_TAKEN})"]]
    assert got["ReduceOp(PREMUL_SUM)"] == [
        ["ValueError", "all_reduce: op=ReduceOp.PREMUL_SUM is not taken here; pass pyccl.premul_sum(x)"],
        ["ValueError", "all_reduce: op=ReduceOp.PREMUL_SUM is not taken here"]]
    assert got["'xor'"] == [["ValueError", f"all_reduce: op='xor' is not a reduction op ({premul})"],
                            ["ValueError", f"all_reduce: op='xor' is not a reduction op ({OPS_TAKEN})"]]


def test_reduce_op_reads_torch_reduce_op():
    """torch's ReduceOp numbers its ops differently (SUM 0, AVG 1, PRODUCT 2, MIN 3, MAX 4):
    the reading goes by name, so ReduceOp.MAX is NCCL's MAX (2), not 4 (NCCL's AVG)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    R = dist.ReduceOp
    want = {R.SUM: pyccl.SUM, R.PRODUCT: pyccl.PROD, R.MAX: pyccl.MAX, R.MIN: pyccl.MIN, R.AVG: pyccl.AVG}
    for kind, op in want.items():
        assert pyccl._C._reduce_op("all_reduce", kind) == op, kind
        assert pyccl._C._reduce_op("all_reduce", R(kind)) == op, kind  # a ReduceOp holding it
    assert [pyccl._C._reduce_op("x", s) for s in ("sum", "PROD", "Max", "min", "avg")] == [0, 1, 2, 3, 4]
    for name in ("BAND", "BOR", "BXOR"):
        with pytest.raises(ValueError, match="^" + re.escape(
                f"reduce: op=ReduceOp.{name} has no NCCL reduction ({OPS_TAKEN})") + "$"):
            pyccl._C._reduce_op("reduce", getattr(R, name))
    with pytest.raises(ValueError, match=r"^all_reduce: op=ReduceOp\.PREMUL_SUM is not taken here$"):
        pyccl._C._reduce_op("all_reduce", R.PREMUL_SUM)
    for bad, text in (("sum\0", "op='sum\\x00' is not a reduction op"), ("su", "op='su' is not a reduction op"),
                      (5, "op=5 is not a reduction op")):
        with pytest.raises(ValueError, match="^" + re.escape(f"x: {text} ({OPS_TAKEN})") + "$"):
            pyccl._C._reduce_op("x", bad)
    for bad in (1.0, True, None, pyccl.premul_sum(2)):
        with pytest.raises(TypeError, match="^" + re.escape(
                f"x: op must be a reduction op ({OPS_TAKEN}), got {type(bad).__name__}") + "$"):
            pyccl._C._reduce_op("x", bad)


def test_device_forms_put_the_communicator_there(tmp_path_factory):
    """Communicator(device=), pyccl.init_rank(device=) and init_ranks(devices=) take an int,
    'cuda:N' or a torch.device; 'cuda', torch.device('cuda') and None are the current device."""
    got = _stand_in(tmp_path_factory, "device_forms")
    for label in ("1", "'cuda:1'", "device('cuda', 1)", "'cuda' (current: 1)", "device('cuda') (current: 1)",
                  "None (current: 1)"):
        assert got[label] == [1, 1], label
    assert got["init_ranks"] == [1, 0]
    assert got["device('cpu')"] == ["ValueError", "Communicator: device must be a CUDA device ('cuda:N'), got 'cpu'"]
    assert got["'cuda:5'"] == ["ValueError", "Communicator: device 5 does not exist (this process sees 2 GPUs)"]
    assert got["init_ranks 'cuda'"] == ["ValueError",
                                         "init_ranks: devices[0] must name its index ('cuda:N'), got 'cuda'"]


@pytest.mark.parametrize("form, index", [(0, 0), (3, 3), ("cuda:2", 2), ("cuda", None), (None, None),
                                         (torch.device("cuda", 1), 1), (torch.device("cuda"), None)])
def test_read_device_forms(form, index):
    assert pyccl._C._read_device("empty", "device", form) == index


@pytest.mark.parametrize("form, exc, text", [
    ("cpu", ValueError, "device must be a CUDA device ('cuda:N'), got 'cpu'"),
    (torch.device("cpu"), ValueError, "device must be a CUDA device ('cuda:N'), got 'cpu'"),
    ("cuda:", ValueError, "device must be a CUDA device ('cuda:N'), got 'cuda:'"),
    ("cuda:1 ", ValueError, "device must be a CUDA device ('cuda:N'), got 'cuda:1 '"),
    ("cuda:-1", ValueError, "device must be a CUDA device ('cuda:N'), got 'cuda:-1'"),
    ("cuda:99999999999", ValueError, "device='cuda:99999999999' is out of range"),
    (-1, ValueError, "device must be >= 0, got -1"),
    (1 << 40, ValueError, "device=1099511627776 is out of range"),
    (True, TypeError, "device must be an int, 'cuda:N' or a CUDA torch.device, got bool"),
    (1.0, TypeError, "device must be an int, 'cuda:N' or a CUDA torch.device, got float"),
])
def test_read_device_refusals(form, exc, text):
    with pytest.raises(exc, match="^" + re.escape("Communicator: " + text) + "$"):
        pyccl._C._read_device("Communicator", "device", form)


# ---- without a GPU, and on a torch built without CUDA: pyccl.CudaError in pyccl's words

NO_GPU = r" no CUDA GPU is available \(cudaGetDeviceCount: "  # then the CUDA runtime's own words


def _no_gpu_here():
    from conftest import gpu_count
    if gpu_count() > 0:
        pytest.skip("checks the no-GPU messages; this machine has a GPU")


@pytest.mark.parametrize("call, op", [
    (lambda: pyccl.empty(4), "empty"),
    (lambda: pyccl.empty(4, device="cuda:0"), "empty"),
    (lambda: pyccl.empty((2, 2), device=torch.device("cuda", 0)), "empty"),
    (lambda: pyccl.mem_pool(), "mem_pool"),
    (lambda: pyccl.Communicator(1, pyccl.unique_id(), 0, device=torch.device("cuda", 0)), "Communicator"),
    (lambda: pyccl.init_ranks(1, pyccl.unique_id(), [0], ["cuda:0"]), "init_ranks"),
    (lambda: pyccl._C._ar_launch_floor(0, 0, 10, False), "_ar_launch_floor"),
    (lambda: pyccl._C._watch_costs(0, 0, 10), "_watch_costs"),
])
def test_no_gpu_raises_cuda_error(call, op):
    _no_gpu_here()
    with pytest.raises(pyccl.CudaError, match="^" + op + ":" + NO_GPU):
        call()


def test_no_gpu_init_from_env(monkeypatch):
    _no_gpu_here()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(pyccl.CudaError, match="^init_from_env:" + NO_GPU):
        pyccl.init_from_env(device="cuda:0")


def test_no_gpu_init_process_group(tmp_path):
    """dist.init_process_group("pyccl") ends in pyccl.CudaError, not torch's CUDA internals."""
    _no_gpu_here()
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    with pytest.raises(pyccl.CudaError, match="^pyccl backend:" + NO_GPU):
        dist.init_process_group("pyccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    assert not dist.is_initialized()


def test_no_gpu_ops_name_the_group():
    """pyccl.ops needs a communicator (which needs a GPU): without one, its message names the group."""
    with pytest.raises(ValueError, match=re.escape(
            "pyccl.ops.all_reduce: group 'tp' names no live pyccl Communicator and no torch.distributed "
            "process group") + "$"):
        pyccl.ops.all_reduce(torch.ones(2), "tp")


@pytest.mark.parametrize("call, op", [
    (lambda: pyccl.empty(4), "empty"),
    (lambda: pyccl.mem_pool(), "mem_pool"),
    (lambda: pyccl.distributed._new_communicator(1, pyccl.unique_id(), 0, None), "pyccl backend"),
])
def test_torch_without_cuda_raises_cuda_error(monkeypatch, call, op):
    """A GPU pyccl sees but a torch built without CUDA: pyccl.CudaError saying so (not torch's
    AssertionError "Torch not compiled with CUDA enabled" or an AttributeError)."""
    from pyccl import _gpu
    monkeypatch.setattr(_gpu, "_C", type("C", (), {"_gpu_count": staticmethod(lambda op: 1),
                                                   "CudaError": pyccl.CudaError}))
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(pyccl.CudaError, match="^" + re.escape(
            f"{op}: this torch ({torch.__version__}) is built without CUDA; pyccl needs a CUDA build of "
            "torch") + "$"):
        call()


def test_input_first_and_keywords(tmp_path_factory):
    """The methods that move data between tensors keep NCCL's order (input first) positionally,
    and take both by name in any order (how code ported from torch.distributed says which is
    which); one rank copies input into output, so a swap would leave output zero."""
    got = _stand_in(tmp_path_factory, "keyword_order")
    # all_to_all_single and scatter by name: NCCL sends from the input and receives into the output
    assert got.pop("sent from, received into") == {"all_to_all_single output=, input=": ["input", "output"],
                                                    "scatter tensor=, inputs=": ["input", "output"]}
    assert got == {label: [[1.0, 2.0], [1.0, 2.0]] for label in (
        "all_gather positional", "all_gather input=, output=", "all_gather output=, input=",
        "reduce_scatter output=, input=", "reduce_scatter output=, input=, op='sum'")}
    for name, first in (("all_gather", "input"), ("reduce_scatter", "input"), ("all_to_all_single", "input"),
                        ("all_to_all", "input"), ("scatter", "inputs"), ("gather", "tensor")):
        params = list(inspect.signature(getattr(pyccl.Communicator, name)).parameters.values())
        assert params[1].name == first and params[1].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
        if name != "gather":
            assert "torch.distributed puts the output first" in getattr(pyccl.Communicator, name).__doc__, name
