"""pyccl's own all-reduce kernels at N ranks on ONE GPU (helper of tests/test_ar_sim_gpu.py).

The kernels (csrc/kernels/allreduce.cu, as compiled into pyccl._C: `_C._ar_fatbin()`) see each
rank's region through a pointer (ar_abi.h: `base[r]`) and never ask where it lives. Here every
"rank" is a region of the same GPU's memory and a launch on a stream of its own, all launched
before any is waited for, so their barriers and LL flags meet as across GPUs: the reductions,
tails, epochs and halves, flags and give-up path run as they do on N GPUs. What this cannot show
is anything about a second GPU: peer mappings, NVLink ordering, the set-up (ar_setup.c), NCCL.
Those need the multi-GPU tier (test_ar_gpu.py).

The launch mirrors ar.c's `launch` (its thread count for the LL variant, `aligned`, `ll_slot`,
and, with pdl=True, programmatic dependent launch through cuLaunchKernelEx, as ar.c does on sm_90+).
"""
import ctypes

import torch

import pyccl

MAX_RANKS = 8
MAX_BLOCKS = 64
COUNTER_OFF = 8192
DEVERR_OFF = 8448
DATA_OFF = 65536
VARIANTS = {"ll": 0, "oneshot": 1, "twoshot": 2}
TYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32"}
OP_NAMES = {0: "sum", 2: "max", 3: "min"}  # pyccl.SUM, MAX, MIN


class Params(ctypes.Structure):
    """pyccl_ar_params (csrc/kernels/ar_abi.h), field for field."""
    _fields_ = [
        ("in_", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("base", ctypes.c_void_p * MAX_RANKS), ("host_error", ctypes.c_void_p),
        ("nbytes", ctypes.c_ulonglong), ("half_bytes", ctypes.c_ulonglong),
        ("timeout_ns", ctypes.c_ulonglong), ("magic", ctypes.c_uint), ("aligned", ctypes.c_int),
        ("ll_slot", ctypes.c_ulonglong), ("rank", ctypes.c_int), ("nranks", ctypes.c_int),
        ("skew_ns", ctypes.c_uint), ("stride", ctypes.c_ulonglong),
        ("done", ctypes.c_void_p), ("mark", ctypes.c_ulonglong),
    ]


assert ctypes.sizeof(Params) == 168, ctypes.sizeof(Params)  # what ar.c passes by value


class LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute (ar_load.h's cu_launch_attr): its 64-byte value union as the int that
    programmatic stream serialization reads, then the rest.  (A `c_char * 64` field would read
    back as a new bytes object, never as the struct's own memory.)"""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (ar_load.h's cu_launch_config)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttr)), ("nattrs", ctypes.c_uint)]


assert ctypes.sizeof(LaunchAttr) == 72 and ctypes.sizeof(LaunchConfig) == 56
PROGRAMMATIC_STREAM_SERIALIZATION = 6


def pdl_attr():
    """The launch attribute that turns programmatic dependent launch on, as ar.c sets it."""
    attr = LaunchAttr()
    attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value = 1
    return attr


class SimError(RuntimeError):
    pass


def _driver():
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    cu.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                       ctypes.c_char_p]
    cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
        ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    cu.cuModuleUnload.argtypes = [ctypes.c_void_p]
    cu.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                    ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return cu


def _check(cu, r, what):
    if r != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(r, ctypes.byref(name))
        raise SimError(f"{what}: CUresult {r} ({(name.value or b'?').decode()})")


class Kernels:
    """The compiled-in fatbin loaded into torch's context on the current device."""

    def __init__(self):
        image = pyccl._C._ar_fatbin()
        if image is None:
            raise SimError("pyccl was built without nvcc: no own kernels")
        torch.zeros(1, device="cuda")  # torch's primary context, current on this thread
        self.cu = _driver()
        self.mod = ctypes.c_void_p()
        _check(self.cu, self.cu.cuModuleLoadData(ctypes.byref(self.mod), image), "cuModuleLoadData")
        self.fns = {}

    def fn(self, variant, dtype, op):
        name = f"pyccl_ar_{VARIANTS[variant]}_{TYPE_NAMES[dtype]}_{OP_NAMES[op]}"
        if name not in self.fns:
            f = ctypes.c_void_p()
            _check(self.cu, self.cu.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()),
                   name)
            self.fns[name] = f
        return self.fns[name]

    def launch(self, fn, blocks, threads, stream, prm, pdl=False):
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(prm), ctypes.c_void_p))
        if not pdl:
            _check(self.cu, self.cu.cuLaunchKernel(fn, blocks, 1, 1, threads, 1, 1, 0,
                                                   ctypes.c_void_p(stream.cuda_stream), args,
                                                   None),
                   "cuLaunchKernel")
            return
        attr = pdl_attr()
        cfg = LaunchConfig((blocks, 1, 1), (threads, 1, 1), 0, stream.cuda_stream,
                           ctypes.pointer(attr), 1)
        _check(self.cu, self.cu.cuLaunchKernelEx(ctypes.byref(cfg), fn, args, None),
               "cuLaunchKernelEx")


class Group:
    """N ranks' regions on one GPU, laid out as ar_setup.c lays out one rank's (zeroed, as the
    set-up clears it), and one stream per rank."""

    def __init__(self, kernels, nranks, half=1 << 20, ll_max=1 << 16, blocks=8, threads=512,
                 timeout_s=5.0):
        assert 2 <= nranks <= MAX_RANKS and 1 <= blocks <= MAX_BLOCKS
        self.k, self.n, self.half, self.ll_max = kernels, nranks, half, ll_max
        self.blocks, self.threads, self.timeout_ns = blocks, threads, int(timeout_s * 1e9)
        total = DATA_OFF + 2 * half + 2 * nranks * 2 * ll_max
        self.regions = [torch.zeros(total, dtype=torch.uint8, device="cuda") for _ in range(nranks)]
        self.host_error = torch.zeros(nranks * 4, dtype=torch.int32, device="cuda")  # 16 B apart
        self.streams = [torch.cuda.Stream() for _ in range(nranks)]

    def deverr(self, rank):
        return int(self.regions[rank][DEVERR_OFF:DEVERR_OFF + 4].view(torch.int32).item())

    def counters(self, rank):
        return self.regions[rank][COUNTER_OFF:COUNTER_OFF + 4 * MAX_BLOCKS].view(torch.int32)

    def all_reduce(self, ins, outs, op, variant, ranks=None, skew_ns=0, pdl=False, chain=1):
        """Launch rank r's kernel for ins[r] -> outs[r] on its stream, for every r in ranks
        (default all), all before any is waited for; returns without waiting.  chain > 1: that
        many calls in a row on each rank's stream, nothing between them (in place, each reads
        what the one before wrote), all of rank 0's launched before rank 1's: rank 0's first
        call waits for its peers while the next ones are already queued behind it."""
        ranks = range(self.n) if ranks is None else ranks
        dtype = ins[0].dtype
        nbytes = ins[0].numel() * ins[0].element_size()
        limit = self.ll_max if variant == "ll" else self.half
        assert 0 < nbytes <= limit, (nbytes, limit)
        fn = self.k.fn(variant, dtype, op)
        threads = self.threads
        if variant == "ll":  # ar.c: one 8-byte line per thread is enough, whole warps
            lines = (nbytes + 7) // 8
            per = (lines + self.blocks - 1) // self.blocks
            threads = min(threads, (per + 31) & ~31)
        here = torch.cuda.current_stream()
        keep = []
        for r in ranks:
            self.streams[r].wait_stream(here)  # the inputs were written on the current stream
        for r in [r for r in ranks for _ in range(chain)]:
            s = self.streams[r]
            prm = Params()
            prm.in_, prm.out = ins[r].data_ptr(), outs[r].data_ptr()
            for q in range(self.n):
                prm.base[q] = self.regions[q].data_ptr()
            prm.host_error = self.host_error.data_ptr() + 16 * r
            prm.nbytes, prm.half_bytes, prm.timeout_ns = nbytes, self.half, self.timeout_ns
            prm.aligned = int((ins[r].data_ptr() | outs[r].data_ptr()) % 16 == 0)
            prm.ll_slot = 2 * self.ll_max
            prm.rank, prm.nranks, prm.skew_ns = r, self.n, skew_ns
            self.k.launch(fn, self.blocks, threads, s, prm, pdl)
            keep.append(prm)  # the driver copied it at launch; kept only for clarity
        for r in ranks:
            here.wait_stream(self.streams[r])
        return keep
