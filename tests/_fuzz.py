"""The fuzz test's child side (tests/child_fakegpu.py, scenario fuzz): seeded random
and hostile calls of every public entry point on the stand-in GPU library.

Every call must return or raise one of EXPECTED; anything else (SystemError
above all) is reported with the seed and the call's index, and a crash kills
the process, which the parent reports with the seed.  Sizes are bounded so a
call that passes validation never moves more bytes than its buffers hold
(every buffer has BUF_BYTES): the lies that stay are the ones pyccl must
refuse (negative or overflowing sizes, bad pointers and devices, fresh or
broken dtypes, lists emptied and communicators destroyed during the checks).
"""
import os
import random
import sys
import traceback

import torch  # the stub

import pyccl
from _hostile import A, FreshDtype, HostileError, HostileOp, HostileStream, T, boom, fresh_dtype, raising, then

EXPECTED = (TypeError, ValueError, RuntimeError, HostileError)
CAP = 1024               # float32 elements of every T/A buffer: 4 KiB
MAX_NUMEL = 64           # sizes: x 4 (all_gather's whole side) x itemsize (<= 16) <= 4 KiB


class Fuzz:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.comms = []
        # every array of the current call: work queued inside pyccl.group()
        # reads its buffers when the group ends, as NCCL does, so they must
        # outlive the call (the caller's duty, as with torch tensors)
        self.keep = []
        self.regs = []   # open (or closed) Registration handles, dropped at random

    # ---------------------------------------------------------------- values

    def pick(self, *xs):
        return xs[self.rng.randrange(len(xs))]

    def numel(self):
        return self.rng.choice([0, 1, 2, 3, 4, 7, 8, 16, MAX_NUMEL])

    def junk(self):
        return self.pick(None, 3, -1, 2.5, "x", b"y", [], (), {}, object(), True, 1 << 70, float("nan"))

    def comm(self):
        """A communicator, sometimes timed, sometimes dead."""
        r = self.rng.random()
        if self.comms and r < 0.6:
            return self.rng.choice(self.comms)
        world = self.pick(1, 2, 2, 2, 4)
        c = pyccl.Communicator(world, pyccl.unique_id(), self.rng.randrange(world),
                               device=self.pick(None, None, 0, 1),
                               timeout=self.pick(None, None, None, 5.0))
        if self.rng.random() < 0.1:
            self.pick(c.destroy, c.abort)()
        self.comms.append(c)
        if len(self.comms) > 8:
            old = self.comms.pop(0)
            if not old.destroyed and self.rng.random() < 0.5:
                old.destroy()
        return c

    def hostile_value(self, name, c, container):
        """A hostile override for attribute `name` (None: leave it honest)."""
        acts = [lambda: None]
        if container is not None:
            acts.append(container.clear)
        if c is not None:
            acts += [c.destroy, c.abort]
        act = self.rng.choice(acts)
        table = {
            "numel": lambda: self.pick(-1, -3, 1 << 63, 1 << 64, "4", 2.5, None, raising("numel"),
                                       then(act, self.numel())),
            "get_device": lambda: self.pick(-1, 1, 7, 1 << 32, -(1 << 40), "0", None, raising("get_device"),
                                            then(act, 0)),
            "data_ptr": lambda: self.pick(-8, 1 << 64, (1 << 64) - 1, "p", None, raising("data_ptr")),
            "dtype": lambda: self.pick(fresh_dtype(self.pick(-4, 0, 1, 3, 4, 16, 1 << 40, "4")),
                                       FreshDtype(self.pick(2, 4, 8)), torch.int32, torch.bool, torch.float16,
                                       torch.float64, None, 7, raising("dtype"), then(act, torch.float32)),
            "is_cuda": lambda: self.pick(False, raising("is_cuda"), then(act, True)),
            "layout": lambda: self.pick(object(), raising("layout"), then(act, torch.strided)),
            "is_contiguous": lambda: self.pick(False, raising("is_contiguous"), then(act, True)),
            "len": lambda: self.pick(0, 1, 3, raising("len"), then(act, 2)),
        }
        return table[name]()

    def array(self, c=None, container=None, n=None, device=0):
        """A tensor-like: honest (mostly), hostile, or __cuda_array_interface__ only."""
        a = self._array(c, container, n, device)
        self.keep.append(a)
        return a

    def _array(self, c, container, n, device):
        n = self.numel() if n is None else n
        r = self.rng.random()
        if r < 0.45:
            return T(n, device, cap=CAP)
        if r < 0.75:
            over = {}
            for _ in range(self.rng.randrange(1, 3)):
                name = self.pick("numel", "get_device", "data_ptr", "dtype", "is_cuda", "layout",
                                 "is_contiguous", "len")
                over[name] = self.hostile_value(name, c, container)
            return T(n, device, cap=CAP, **over)
        if r < 0.95:
            return self.cai(n, c, container)
        return self.junk()

    def cai(self, n, c, container):
        keys = {}
        on_read = None
        r = self.rng.random()
        if r < 0.15:
            keys["shape"] = self.pick((1 << 62,), (1 << 63,), (-1,), (2, -2), [n], "n", (2.5,), (1 << 31, 1 << 31))
        elif r < 0.25:
            keys["typestr"] = self.pick("<f4", "|i1", "<c8", "?", "", "<f4<f4", 4)
        elif r < 0.35:
            keys["data"] = self.pick((0, False), (-8, False), ((1 << 64), False), (), "d", (None, False))
        elif r < 0.42:
            keys["strides"] = self.pick((8,), (4, 4), "s", (None,), ())
        elif r < 0.47:
            keys["mask"] = object()
        elif r < 0.6:
            acts = [] if container is None else [container.clear]
            acts += [] if c is None else [c.destroy, c.abort]
            acts.append(lambda: boom("cai"))
            on_read = self.rng.choice(acts)
        # shape (2^62,) stays "<f4": 2^62 x 4 bytes, refused for its size
        return A(n, shape=keys.pop("shape", None), on_read=on_read, cap=CAP, **keys)

    def arrays(self, c, k, n=None):
        """A list of k arrays, some of which may empty the list while read."""
        lst = []
        lst += [self.array(c, lst, n) for _ in range(k)]
        return lst

    def stream(self, c):
        r = self.rng.random()
        if r < 0.7:
            return None
        if r < 0.85 and c is not None:
            return HostileStream(self.pick(lambda: None, c.destroy, c.abort, lambda: boom("stream")),
                                 device=self.pick(0, 0, 1))
        return self.junk()

    def op(self, c):
        r = self.rng.random()
        if r < 0.5:
            return self.pick(None, pyccl.SUM, pyccl.MAX, pyccl.PROD, pyccl.MIN, pyccl.AVG)
        if r < 0.7:
            return pyccl.premul_sum(self.pick(0.5, 2, -3))
        if r < 0.85 and c is not None:
            return HostileOp(self.pick(lambda: None, c.destroy, c.abort), self.pick(2.0, float("nan"), 1e300))
        return self.pick(-1, 5, 99, 1 << 40, "sum", 2.5, True)

    def rank(self, c):
        return self.pick(0, 0, 1, -1, 3, 1 << 40, "0", None, True)

    # ---------------------------------------------------------------- calls

    def call(self):
        """One random call: (description, thunk)."""
        c = self.comm()
        n = self.numel()
        k = self.pick("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send", "recv",
                      "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "split",
                      "all_reduce_coalesced", "wait", "misc", "nccl", "nccl", "nccl", "nccl", "_C",
                      "register", "registration")
        arr = lambda m=None: self.array(c, None, n if m is None else m)  # noqa: E731
        many = lambda m=None: self.pick(self.arrays(c, self.pick(c.size if not c.destroyed else 2, 1, 3), m),  # noqa: E731
                                        arr(None if m is None else m * self.pick(1, 2, 4)))
        kw = {}
        if self.rng.random() < 0.5:
            kw["stream"] = self.stream(c)
        if k == "all_reduce":
            if self.rng.random() < 0.3:
                kw["out"] = self.pick(None, arr())
            if self.rng.random() < 0.2:
                kw["algo"] = self.pick(None, "nccl", "oneshot", "twoshot", "auto", "x", 3)
            return k, lambda: c.all_reduce(arr(), self.op(c), **kw)
        if k in ("broadcast", "reduce"):
            if self.rng.random() < 0.3:
                kw["out"] = self.pick(None, arr())
            if k == "reduce":
                return k, lambda: c.reduce(arr(), self.rank(c), self.op(c), **kw)
            return k, lambda: c.broadcast(arr(), self.rank(c), **kw)
        if k == "all_gather":
            return k, lambda: c.all_gather(arr(), self.pick(self.arrays(c, self.pick(c.size, 1), n),
                                                            arr(n * self.pick(1, 2, 4))), **kw)
        if k == "reduce_scatter":
            return k, lambda: c.reduce_scatter(self.pick(self.arrays(c, self.pick(c.size, 1), n),
                                                         arr(n * self.pick(1, 2, 4))), arr(), self.op(c), **kw)
        if k in ("send", "recv"):
            return k, lambda: getattr(c, k)(arr(), self.rank(c), **kw)
        if k == "all_to_all":
            return k, lambda: c.all_to_all(many(n), many(n), **kw)
        if k == "all_to_all_single":
            def splits():
                return self.pick(None, None, [n // 2, n - n // 2], [n], [-1, n + 1], "s", [1 << 70, 0], [2.5, 0])
            return k, lambda: c.all_to_all_single(arr(2 * n), arr(2 * n), splits(), splits(), **kw)
        if k in ("gather", "scatter"):
            other = self.pick(None, many(n))
            if k == "gather":
                return k, lambda: c.gather(arr(), other, self.rank(c), **kw)
            return k, lambda: c.scatter(other, arr(), self.rank(c), **kw)
        if k == "barrier":
            return k, lambda: c.barrier(**kw)
        if k == "split":
            return k, lambda: c.split(self.pick(0, 1, -1, 1 << 40, "a", None), self.pick(None, 0, 5, "k"))
        if k == "all_reduce_coalesced":
            return k, lambda: c.all_reduce_coalesced(self.pick(self.arrays(c, self.pick(0, 1, 2, 3)), arr()),
                                                     self.op(c))
        if k == "wait":
            return k, lambda: c.wait(self.pick(None, 1.0, -1, "t"))
        if k == "misc":
            name = self.pick("destroy", "abort", "get_async_error", "rank", "size", "device", "destroyed",
                             "timeout", "handle", "all_reduce_info", "_all_reduce_epoch", "repr")
            if name == "repr":
                return name, lambda: repr(c)
            return name, lambda: (lambda v: v() if callable(v) else v)(getattr(c, name))
        if k == "nccl":
            return self.nccl_call(c)
        if k == "register":
            def register():
                what = self.pick("array", "array", "nccl_mem", "junk")
                buf = (arr() if what == "array" else self.junk() if what == "junk"
                       else pyccl._C._nccl_mem_alloc(self.pick(4, 64, 4096), self.pick(0, 0, 1)))
                self.regs.append(self.pick(c.register, c.register_window)(buf))
                if len(self.regs) > 12:
                    self.regs.pop(self.rng.randrange(len(self.regs)))  # dropped: deregistered by GC
            return k, register
        if k == "registration":
            name = self.pick("close", "close", "handle", "tensor", "closed", "enter", "repr", "drop")

            def use():
                if not self.regs:
                    return
                h = self.rng.choice(self.regs)
                if name == "drop":
                    self.regs.remove(h)
                elif name == "enter":
                    with h:
                        pass
                elif name == "repr":
                    repr(h)
                else:
                    (lambda v: v() if callable(v) else v)(getattr(h, name))
            return "registration." + name, use
        return self.c_call()

    def nccl_call(self, c):
        name = self.pick("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "is_available",
                         "version", "unique_id", "init_rank")
        n = self.numel()
        nd = self.pick(1, 1, 2)
        use_comms = self.rng.random() < 0.6
        comms = [c] if nd == 1 else [c, self.comm()]
        kw = {}
        if use_comms:
            kw["comms"] = self.pick(comms, comms, [c] * 3, self.junk())
        if self.rng.random() < 0.3:
            kw["streams"] = self.pick(None, [self.stream(c) for _ in range(nd)], self.junk())

        def ins(m=n):
            lst = []
            lst += [self.array(c, lst, m, device=d) for d in range(nd)]
            return self.pick(lst, lst, tuple(lst), self.array(c, None, m), self.junk())
        nccl = pyccl.nccl
        if name == "all_reduce":
            return "nccl." + name, lambda: nccl.all_reduce(ins(), self.pick(None, ins()), self.op(None), **kw)
        if name == "reduce":
            return "nccl." + name, lambda: nccl.reduce(ins(), self.pick(None, self.array(c, None, n)),
                                                       self.rank(None), self.op(None), **kw)
        if name == "broadcast":
            return "nccl." + name, lambda: nccl.broadcast(ins(), self.rank(None), **kw)
        if name == "all_gather":
            return "nccl." + name, lambda: nccl.all_gather(ins(), ins(n * self.pick(1, 2)), **kw)
        if name == "reduce_scatter":
            return "nccl." + name, lambda: nccl.reduce_scatter(ins(n * self.pick(1, 2)), ins(), self.op(None),
                                                               **kw)
        if name == "is_available":
            return "nccl." + name, lambda: nccl.is_available(ins())
        if name == "version":
            return "nccl." + name, nccl.version
        if name == "unique_id":
            return "nccl." + name, nccl.unique_id
        return "nccl." + name, lambda: nccl.init_rank(self.pick(1, 2, 0, -1, "2"),
                                                     self.pick(pyccl.unique_id(), b"x" * 3, "u", None),
                                                     self.pick(0, 1, 5, -1))

    def c_call(self):
        C = pyccl._C
        name = self.pick("_nccl_all_reduce", "_nccl_reduce", "_nccl_broadcast", "_nccl_all_gather",
                         "_nccl_reduce_scatter", "_nccl_init_rank", "_nccl_init_ranks", "_nccl_unique_id",
                         "_nccl_version", "_nccl_version_suffix", "_read_timeout", "_ar_built",
                         "_library_paths", "group")
        if name == "group":
            desc, inner = self.call()
            def grouped():
                with pyccl.group():
                    inner()
            return desc, grouped
        if name == "_nccl_init_ranks":
            return name, lambda: C._nccl_init_ranks(self.pick(1, 2, 4, -1, "2"),
                                                    self.pick(pyccl.unique_id(), b"x", None),
                                                    self.pick([0], [0, 1], [5], ["a"], None, [1 << 40]),
                                                    self.pick([0], [0, 1], [9], [-1], None, [1 << 40]))
        fn = getattr(C, name)
        nargs = self.pick(0, 1, 2, 3, 4, 5, 6)
        args = []
        for _ in range(nargs):
            r = self.rng.random()
            if r < 0.4:
                lst = []
                lst += [self.array(None, lst, 4, device=d) for d in range(self.pick(1, 2))]
                args.append(lst)
            elif r < 0.6:
                args.append(self.pick(0, 1, None))
            else:
                args.append(self.junk())
        return name, lambda: fn(*args)


def run(seed, calls, misuse=lambda: 0):
    """Run `calls` calls; returns counts.  A wrong exception propagates (after
    a FUZZ FAILURE line naming seed and call), and so does a call after which
    misuse() (the stand-in library's count of calls on dead handles) grew."""
    fz = Fuzz(seed)
    counts = {}
    trace = os.environ.get("PYCCL_FUZZ_TRACE") == "1"   # print every call's outcome
    for i in range(calls):
        try:
            desc, thunk = fz.call()
        except EXPECTED as e:   # making a communicator may be refused too
            counts["setup:" + type(e).__name__] = counts.get("setup:" + type(e).__name__, 0) + 1
            continue
        before = misuse()
        try:
            thunk()
            key = desc + ":ok"
        except EXPECTED as e:
            key = desc + ":" + type(e).__name__
        except (IndexError, AttributeError) as e:
            # pure-Python parts kept from torch.cuda.nccl: reduce's outputs[root]
            # lookup, is_available's t.is_sparse on a non-tensor
            if (desc, type(e)) not in (("nccl.reduce", IndexError), ("nccl.is_available", AttributeError)):
                sys.stdout.write(f"FUZZ FAILURE seed={seed} call={i} ({desc})\n{traceback.format_exc()}")
                raise
            key = desc + ":" + type(e).__name__
        except BaseException:
            sys.stdout.write(f"FUZZ FAILURE seed={seed} call={i} ({desc})\n{traceback.format_exc()}")
            sys.stdout.flush()
            raise
        counts[key] = counts.get(key, 0) + 1
        fz.keep.clear()
        if trace:
            sys.stdout.write(f"call {i}: {key}\n")
        if misuse() != before:
            sys.stdout.write(f"FUZZ FAILURE seed={seed} call={i} ({desc}): NCCL was called on a dead handle\n")
            raise AssertionError(f"seed={seed} call={i} ({desc}): NCCL was called on a dead handle")
    for c in fz.comms:
        if not c.destroyed:
            c.destroy()
    before = misuse()
    fz.regs.clear()   # the handles' deallocation: nothing may reach NCCL on a dead handle
    assert misuse() == before, f"seed={seed}: a dropped registration called NCCL on a dead handle"
    return counts
