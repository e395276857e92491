"""Hostile arguments for the stand-in GPU tier (tests/child_fakegpu.py, stub torch).

pyccl reads a tensor through its Python attributes, so those attributes are
user code: they may lie, raise, return a fresh object on every read, mutate
the list the tensor is in, or destroy the communicator being called.  This
module builds such objects for the bad-input catalogue's stand-in rows
(tests/test_bad_input.py) and for the fuzz test (tests/test_fuzz_cpu.py).
Import it only after the stub torch is installed (it subclasses its Tensor).
"""
import ctypes

import torch  # the stub of tests/child_fakegpu.py

import pyccl


class HostileError(Exception):
    """What a hostile attribute raises: pyccl must pass it on unchanged."""


class FreshDtype:
    """A dtype-like object pyccl's table does not know, made new on every read
    (so pyccl can hold no borrowed pointer to it)."""

    def __init__(self, itemsize=4):
        self.itemsize = itemsize

    def __repr__(self):
        return "FreshDtype"


class Dyn:
    """An attribute computed on every read: fn(tensor_like)."""

    def __init__(self, fn):
        self.fn = fn


def boom(what="attribute"):
    raise HostileError(what)


def raising(what="attribute"):
    return Dyn(lambda _: boom(what))


def fresh_dtype(itemsize=4):
    return Dyn(lambda _: FreshDtype(itemsize))


def then(action, value):
    """Run action() (clear a list, destroy a communicator) and return value."""
    def fn(_):
        action()
        return value
    return Dyn(fn)


class T(torch.Tensor):
    """A tensor-like over n host float32 values, any attribute overridden
    by a value or a Dyn (is_cuda, layout, dtype, is_contiguous, numel,
    get_device, data_ptr, len)."""

    def __init__(self, n=4, device=0, cap=0, **over):
        # cap: room for a numel() that lies upwards (the fuzz test's)
        self.buf = (ctypes.c_float * max(n, cap, 1))(*[float(i + 1) for i in range(max(n, 1))])
        self.n, self.dev, self.over = n, device, over

    def _get(self, name, default):
        if name not in self.over:
            return default
        v = self.over[name]
        return v.fn(self) if isinstance(v, Dyn) else v

    @property
    def is_cuda(self):
        return self._get("is_cuda", True)

    @property
    def is_sparse(self):
        return self._get("is_sparse", False)

    @property
    def layout(self):
        return self._get("layout", torch.strided)

    @property
    def dtype(self):
        return self._get("dtype", torch.float32)

    def is_contiguous(self):
        return self._get("is_contiguous", True)

    def numel(self):
        return self._get("numel", self.n)

    def get_device(self):
        return self._get("get_device", self.dev)

    def data_ptr(self):
        return self._get("data_ptr", ctypes.addressof(self.buf))

    def __len__(self):
        return self._get("len", self.n)

    def view(self, *shape):
        return self

    def new_empty(self, n):
        """all_reduce_coalesced's packed buffer: n elements of this one's dtype and device."""
        return T(n, self.dev, dtype=self.dtype)

    def tolist(self):
        return list(self.buf)[:self.n]


class A:
    """An array known only by __cuda_array_interface__ (float32 host memory
    the stand-in library works on); the dict is made fresh on every read and
    `on_read` (a callable) runs first.  Keys of the dict can be replaced."""

    def __init__(self, n=4, shape=None, typestr="<f4", on_read=None, cap=0, **keys):
        self.buf = (ctypes.c_float * max(n, cap, 1))(*[float(i + 1) for i in range(max(n, 1))])
        self.n, self.shape, self.typestr, self.on_read, self.keys = n, shape, typestr, on_read, keys

    @property
    def __cuda_array_interface__(self):
        if self.on_read is not None:
            self.on_read()
        d = {"shape": self.shape if self.shape is not None else (self.n,), "typestr": self.typestr,
             "data": (ctypes.addressof(self.buf), False), "strides": None, "version": 3}
        d.update(self.keys)
        return d

    def tolist(self):
        return list(self.buf)[:self.n]


class HostileStream(torch.cuda.Stream):
    """A torch.cuda.Stream (as pyccl reads one) whose device_index runs `action`."""

    def __init__(self, action, handle=0x5555, device=0):
        self.action, self.handle, self.device = action, handle, device

    @property
    def device_index(self):
        self.action()
        return self.device

    @property
    def cuda_stream(self):
        return self.handle


class BadStream(torch.cuda.Stream):
    """A torch.cuda.Stream (as pyccl reads one) with device_index 0 and a handle, either
    replaced by a value or a Dyn; None removes the attribute."""

    def __init__(self, **over):
        self.over = {"device_index": 0, "cuda_stream": 0x5555, **over}

    def __getattr__(self, name):  # only for attributes not found the usual way
        if name not in ("device_index", "cuda_stream") or self.__dict__["over"][name] is None:
            raise AttributeError(f"'BadStream' object has no attribute '{name}'")
        v = self.__dict__["over"][name]
        return v.fn(self) if isinstance(v, Dyn) else v


class LyingLen:
    """A sequence of `items` (indexing, no __iter__) whose len() claims `claimed` items."""

    def __init__(self, items, claimed):
        self.items, self.claimed = list(items), claimed

    def __len__(self):
        return self.claimed

    def __getitem__(self, i):
        return self.items[i]


class HostileOp:
    """An op argument like pyccl.premul_sum(x) whose scalar runs `action`."""

    def __init__(self, action, scalar=2.0):
        self.action, self.scalar = action, scalar

    @property
    def premul_scalar(self):
        self.action()
        return self.scalar


def comm(timeout=None, world=2, rank=0, device=None):
    return pyccl.Communicator(world, pyccl.unique_id(), rank, device=device, timeout=timeout)


NAMESPACE = dict(T=T, A=A, HostileError=HostileError, boom=boom, FreshDtype=FreshDtype, Dyn=Dyn, raising=raising,
                 fresh_dtype=fresh_dtype, then=then, HostileStream=HostileStream, HostileOp=HostileOp,
                 BadStream=BadStream, LyingLen=LyingLen,
                 comm=comm, pyccl=pyccl, nccl=pyccl.nccl, torch=torch)
