/* pyccl.Communicator: one NCCL communicator (one rank on one device).
 *
 * Created by Communicator(world_size, unique_id, rank, device=None), by
 * init_rank (torch's spelling) or, for comms=None, as a clique over the
 * devices of one process (clique.c).
 * destroy() frees it at once, garbage collection frees it otherwise, and at
 * interpreter exit nothing is freed: the CUDA runtime may already be going
 * away, and a leak there is harmless while a crash is not.  With timeout=
 * it is an NCCL non-blocking communicator under the watchdog (watchdog.c),
 * which then owns its handle. */
#include "communicator.h"
#include "reg_list.h"
#include "ar.h"
#include "call.h"
#include "timeouts.h"
#include "tensor.h"
#include "loader.h"
#include "args.h"
#include "errors.h"

#include <string.h>

/* The type's part of the module state: its communicators' names and the
 * splits waiting for their group's end. */
struct pyccl_comms {
    /* [(Communicator, thread ident)] split inside a group that has not ended:
     * kept alive until then, because NCCL writes their handle at the end */
    PyObject *pending_splits;
    /* Communicator.name -> weakref of it, for the torch custom ops
     * (pyccl/ops.py): filled when a communicator's name is first read,
     * emptied by its dealloc */
    PyObject *comm_names;
    unsigned long long comm_serial;
};

int
pyccl_comms_state_init(pyccl_state *st)
{
    struct pyccl_comms *p = st->comms = PyMem_Calloc(1, sizeof *p);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    p->pending_splits = PyList_New(0);
    p->comm_names = PyDict_New();
    return p->pending_splits != NULL && p->comm_names != NULL ? 0 : -1;
}

int
pyccl_comms_state_traverse(pyccl_state *st, visitproc visit, void *arg)
{
    if (st->comms != NULL) {
        Py_VISIT(st->comms->pending_splits);
        Py_VISIT(st->comms->comm_names);
    }
    return 0;
}

void
pyccl_comms_state_clear(pyccl_state *st)
{
    if (st->comms != NULL) {
        Py_CLEAR(st->comms->pending_splits);
        Py_CLEAR(st->comms->comm_names);
    }
}

void
pyccl_comms_state_free(pyccl_state *st)
{
    pyccl_comms_state_clear(st);
    PyMem_Free(st->comms);
    st->comms = NULL;
}

/* _communicator(name): the live Communicator whose .name is `name` (a str),
 * or None. */
PyObject *
pyccl_comm_by_name(pyccl_state *st, PyObject *name)
{
    PyObject *ref = PyDict_GetItemWithError(st->comms->comm_names, name); /* borrowed */
    if (ref == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    /* dealloc removes the entry before the object goes: the referent lives */
    return Py_NewRef(PyWeakref_GetObject(ref));
}

int
pyccl_is_comm(pyccl_state *st, PyObject *obj)
{
    return PyObject_TypeCheck(obj, (PyTypeObject *)st->CommunicatorType);
}

PyObject *
pyccl_comm_new(pyccl_state *st, ncclComm_t comm, int rank, int size, int device)
{
    PyTypeObject *tp = (PyTypeObject *)st->CommunicatorType;
    pyccl_comm *c = (pyccl_comm *)tp->tp_alloc(tp, 0);
    if (c == NULL) {
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->pid = pyccl_pid();
    c->blocking = 1;
    c->comm = comm;
    c->rank = rank;
    c->size = size;
    c->device = device;
    return (PyObject *)c;
}

/* Destroy with the GIL released: ncclCommDestroy waits for the
 * communicator's outstanding work.  With a watch: ncclInProgress means the
 * exception (NcclTimeoutError, ...) is set when may_raise. */
static ncclResult_t
destroy_comm(pyccl_state *st, pyccl_comm *c, int may_raise)
{
    /* first, while the communicator works: registered memory (forgotten at
     * exit), then the own all-reduce's peer memory (freed behind a barrier of
     * every rank's destroy(); after abort() or on garbage collection no
     * barrier can be had, and only the exported region is kept) */
    pyccl_release_registrations(st, c, st->exiting || !st->api.loaded);
    pyccl_ar_release(st, c, c->comm != NULL && may_raise);
    if (!st->exiting) {
        pyccl_lead_free(&st->api, c);
    }
    ncclComm_t comm = c->comm;
    void *scratch = c->scratch;
    ncclResult_t r = ncclSuccess;
    if (st->exiting || !st->api.loaded) {
        c->comm = NULL;
        c->scratch = NULL;
        return r; /* leaked, watch included */
    }
    if (c->watch != NULL) {
        /* finalized within the timeout, else aborted (watchdog.c) */
        if (pyccl_watch_destroy(st, "destroy", c, may_raise) < 0) {
            if (c->watch != NULL) {
                return ncclInProgress; /* refused: in use; nothing done */
            }
            r = ncclInProgress; /* the exception is set */
        }
        comm = NULL;
    }
    c->comm = NULL;
    c->scratch = NULL;
    if (comm == NULL && scratch == NULL) {
        return r;
    }
    const pyccl_api *a = &st->api;
    /* abort() came while destroy() ran (its peers may be gone): the
     * handle is aborted, not destroyed, which could wait for them */
    int aborted = __atomic_load_n(&c->abort_asked, __ATOMIC_ACQUIRE);
    Py_BEGIN_ALLOW_THREADS
    if (comm != NULL) {
        r = aborted ? a->ncclCommAbort(comm) : a->ncclCommDestroy(comm);
    }
    if (scratch != NULL) {
        int prev;
        pyccl_device_enter(a, c->device, &prev);
        a->cudaFree(scratch);
        pyccl_device_leave(a, c->device, prev);
    }
    Py_END_ALLOW_THREADS
    return r;
}

/* Shared by Communicator() and _nccl_init_rank(). */
static PyObject *
comm_init(pyccl_state *st, const char *op, PyObject *nranks_obj,
          PyObject *uid_obj, PyObject *rank_obj, PyObject *device_obj,
          PyObject *timeout_obj, PyObject *blocking_obj)
{
    int nranks, rank, device = -1, ndev = 0, prev = -1, blocking = -1;
    double timeout = 0.0;
    ncclUniqueId uid;
    /* "init_rank" is the drop-in's (torch.cuda.nccl's texts) */
    if (pyccl_read_int(op, "world_size", nranks_obj, &nranks) < 0 ||
        pyccl_read_unique_id(op, strcmp(op, "init_rank") == 0, uid_obj, &uid) < 0 ||
        pyccl_read_int(op, "rank", rank_obj, &rank) < 0) {
        return NULL;
    }
    if (pyccl_read_device(op, "device", device_obj, &device) < 0) {
        return NULL;
    }
    if (pyccl_read_timeout(op, timeout_obj, &timeout) < 0) {
        return NULL;
    }
    if (blocking_obj != NULL && blocking_obj != Py_None) {
        if (!PyBool_Check(blocking_obj)) {
            PyErr_Format(PyExc_TypeError,
                         "%s: blocking must be True, False or None, got %.200s",
                         op, Py_TYPE(blocking_obj)->tp_name);
            return NULL;
        }
        blocking = blocking_obj == Py_True;
    }
    if (blocking == 0 && !(timeout > 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: blocking=False needs a timeout (a non-blocking communicator's "
                     "calls are polled until their deadline); got timeout=None",
                     op);
        return NULL;
    }
    /* default: with a timeout, non-blocking (every host-side wait bounded);
     * without one, blocking */
    if (blocking < 0) {
        blocking = !(timeout > 0);
    }
    if (nranks < 1) {
        PyErr_Format(PyExc_ValueError, "%s: world_size must be >= 1, got %d",
                     op, nranks);
        return NULL;
    }
    if (rank < 0 || rank >= nranks) {
        PyErr_Format(PyExc_ValueError,
                     "%s: rank %d is out of range for world_size %d "
                     "(ranks are 0..%d)",
                     op, rank, nranks, nranks - 1);
        return NULL;
    }
    if (pyccl_gpu_count(st, op, &ndev) < 0) {
        return NULL;
    }
    const pyccl_api *a = &st->api;
    cudaError_t ce;
    if ((ce = a->cudaGetDevice(&prev)) != cudaSuccess) {
        pyccl_raise_cuda(st, op, "cudaGetDevice", ce);
        return NULL;
    }
    if (device < 0) { /* None, "cuda": the current device */
        device = prev;
    }
    if (device >= ndev) {
        PyErr_Format(PyExc_ValueError,
                     "%s: device %d does not exist (this process sees %d GPUs)",
                     op, device, ndev);
        return NULL;
    }
    ncclComm_t comm = NULL;
    ncclResult_t r;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    if (timeout > 0) {
        /* non-blocking: bounded by the timeout, interruptible */
        if (pyccl_watch_init(st, op, &comm, nranks, &uid, rank, device, timeout,
                             blocking) < 0) {
            return NULL;
        }
    }
    else {
        Py_BEGIN_ALLOW_THREADS
        ce = a->cudaSetDevice(device);
        if (ce == cudaSuccess) {
            r = a->ncclCommInitRank(&comm, nranks, uid, rank);
            pyccl_nccl_failed(a, r, NULL, last, sizeof last);
            a->cudaSetDevice(prev);
        }
        else {
            r = ncclSuccess;
        }
        Py_END_ALLOW_THREADS
        if (ce != cudaSuccess) {
            pyccl_raise_cuda(st, op, "cudaSetDevice", ce);
            return NULL;
        }
        if (r != ncclSuccess) {
            pyccl_raise_nccl(st, op, r, last);
            return NULL;
        }
    }
    PyObject *c = pyccl_comm_new(st, comm, rank, nranks, device);
    if (c == NULL) {
        Py_BEGIN_ALLOW_THREADS
        if (timeout > 0) {
            a->ncclCommAbort(comm);
        }
        else {
            a->ncclCommDestroy(comm);
        }
        Py_END_ALLOW_THREADS
        return NULL;
    }
    ((pyccl_comm *)c)->blocking = blocking;
    if (timeout > 0 && pyccl_watch_attach(st, op, (pyccl_comm *)c, timeout) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    return c;
}

PyObject *
pyccl_init_rank(pyccl_state *st, PyObject *nranks, PyObject *uid,
                PyObject *rank)
{
    return comm_init(st, "init_rank", nranks, uid, rank, NULL, NULL, NULL);
}

static PyObject *
comm_tp_new(PyTypeObject *tp, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"world_size", "unique_id", "rank", "device",
                             "timeout", "blocking", NULL};
    PyObject *n, *uid, *rank, *device = Py_None, *timeout = Py_None, *blocking = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|OO$O:Communicator",
                                     kwlist, &n, &uid, &rank, &device,
                                     &timeout, &blocking)) {
        return NULL;
    }
    pyccl_state *st = pyccl_state_of_type(tp);
    if (st == NULL) {
        return NULL;
    }
    return comm_init(st, "Communicator", n, uid, rank, device, timeout, blocking);
}

static void
comm_dealloc(PyObject *self)
{
    pyccl_comm *c = (pyccl_comm *)self;
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (c->weakreflist != NULL) {
        PyObject_ClearWeakRefs(self);
    }
    pyccl_state *st = PyType_GetModuleState(tp);
    if (st != NULL && (c->comm != NULL || c->watch != NULL) &&
        !Py_IsFinalizing() && pyccl_call_destroy_begin(st, "destroy", c) == 0) {
        /* A failure here has nobody to report to; the memory is gone either
         * way once the process ends. */
        (void)destroy_comm(st, c, 0);
        pyccl_call_destroy_end(c);
    }
    if (c->name != NULL) {
        PyObject *exc = PyErr_GetRaisedException();
        if (st != NULL && st->comms->comm_names != NULL &&
            PyDict_DelItem(st->comms->comm_names, c->name) < 0) {
            PyErr_Clear();
        }
        PyErr_SetRaisedException(exc);
        Py_CLEAR(c->name);
    }
    if (st != NULL && !st->exiting) {
        pyccl_lead_free(&st->api, c);
    }
    PyMem_Free(c->streams);
    pthread_mutex_destroy(&c->mu);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int
comm_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static PyObject *
comm_destroy(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    pyccl_comm *c = (pyccl_comm *)self;
    pyccl_state *st = PyType_GetModuleState(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    /* decided once, before anything is done: other threads' entries see it */
    int d = pyccl_call_destroy_begin(st, "destroy", c);
    if (d != 0) {
        return d < 0 ? NULL : Py_NewRef(Py_None);
    }
    ncclResult_t r = destroy_comm(st, c, 1);
    pyccl_call_destroy_end(c);
    if (r == ncclInProgress) {
        return NULL; /* timed communicator: raised by watchdog.c */
    }
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, "destroy", r, NULL);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
comm_enter(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self);
}

static PyObject *
comm_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs;
    return comm_destroy(self, NULL);
}

static PyObject *
comm_repr(PyObject *self)
{
    pyccl_comm *c = (pyccl_comm *)self;
    int failed = pyccl_comm_failed(c);
    return PyUnicode_FromFormat("<pyccl.Communicator rank=%d size=%d "
                                "device=cuda:%d%s>",
                                c->rank, c->size, c->device,
                                failed ? " aborted" : c->comm ? "" : " destroyed");
}

/* rank and size (closure: the attribute's name), which a communicator made
 * inside pyccl.group() knows only once the group ended. */
static PyObject *
comm_get_rank_or_size(PyObject *self, void *closure)
{
    const char *what = closure;
    pyccl_comm *c = (pyccl_comm *)self;
    pyccl_state *st = PyType_GetModuleState(Py_TYPE(self));
    if (st == NULL || pyccl_comm_refresh(st, what, c) < 0) {
        return NULL;
    }
    return PyLong_FromLong(what[0] == 'r' ? c->rank : c->size);
}

/* The handle while usable: not once the watchdog aborted it (then the
 * handle is freed even before a call noticed). */
static ncclComm_t
usable_handle(pyccl_comm *c)
{
    if (pyccl_comm_failed(c) || c->life == PYCCL_LIFE_GONE || c->pid != pyccl_pid()) {
        return NULL; /* a fork()'s copy has no handle of its own */
    }
    return c->comm;
}

static PyObject *
comm_get_handle(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(usable_handle((pyccl_comm *)self));
}

static PyObject *
comm_get_destroyed(PyObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(usable_handle((pyccl_comm *)self) == NULL);
}

static PyObject *
comm_get_timeout(PyObject *self, void *Py_UNUSED(closure))
{
    double t = pyccl_comm_timeout((pyccl_comm *)self);
    if (t > 0) {
        return PyFloat_FromDouble(t);
    }
    Py_RETURN_NONE;
}

static PyObject *
comm_get_blocking(PyObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(((pyccl_comm *)self)->blocking);
}

static PyObject *
comm_get_ar_info(PyObject *self, void *Py_UNUSED(closure))
{
    pyccl_state *st = PyType_GetModuleState(Py_TYPE(self));
    return st == NULL ? NULL : pyccl_ar_info(st, (pyccl_comm *)self);
}

static PyObject *
comm_ar_epoch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    pyccl_state *st = PyType_GetModuleState(Py_TYPE(self));
    if (st == NULL || pyccl_comm_alive(st, "_all_reduce_epoch", (pyccl_comm *)self) < 0) {
        return NULL;
    }
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "_all_reduce_epoch() takes at most 1 argument (%zd given)",
                     nargs);
        return NULL;
    }
    return pyccl_ar_epoch(st, (pyccl_comm *)self, nargs ? args[0] : NULL);
}

/* abort(): pyccl's own kernels waiting for peers return first, then the
 * watchdog's abort (watchdog.c). */
static PyObject *
comm_abort(PyObject *self, PyObject *Py_UNUSED(unused))
{
    pyccl_comm *c = (pyccl_comm *)self;
    pyccl_state *st = PyType_GetModuleState(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    /* decided before any side effect: a refused abort() changes nothing */
    int d = pyccl_call_abort_check(st, c);
    if (d < 0) {
        return NULL;
    }
    if (d == 2) {
        Py_RETURN_NONE; /* a fork()'s copy: forgotten, the parent's kernels untouched */
    }
    pyccl_ar_stop(c); /* the own kernels waiting for peers return first */
    if (d > 0) {
        Py_RETURN_NONE; /* destroy() runs: it aborts the handle itself */
    }
    pyccl_call_hold(c);
    int rc = pyccl_watch_abort(st, c);
    pyccl_call_end(c);
    pyccl_call_abort_end(c);
    if (rc < 0) {
        return NULL;
    }
    /* the own kernels returned (the stop word): what they held goes now,
     * but the exported region (a peer may still map it) */
    pyccl_ar_release(st, c, 0);
    /* the handle is gone: so are its registrations */
    pyccl_release_registrations(st, c, 2);
    Py_RETURN_NONE;
}

/* wait() and get_async_error() look at the watch: counted in flight, so
 * destroy() from another thread waits for them to leave it.  A wait()
 * without a watch is not (pyccl_call_hold_wait): it never touches the
 * handle, and abort() from another thread is how such a wait ends early. */
static PyObject *
comm_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    pyccl_comm *c = (pyccl_comm *)self;
    int held = pyccl_call_hold_wait(c);
    PyObject *res = pyccl_comm_wait(self, args, nargs, kwnames);
    if (held) {
        pyccl_call_end(c);
    }
    return res;
}

static PyObject *
comm_get_async_error(PyObject *self, PyObject *unused)
{
    pyccl_call_hold((pyccl_comm *)self);
    PyObject *res = pyccl_comm_get_async_error(self, unused);
    pyccl_call_end((pyccl_comm *)self);
    return res;
}

/* The methods that move data from one tensor to another take the input first,
 * as NCCL and torch.cuda.nccl do; torch.distributed takes the output first. */
#define PYCCL_INPUT_FIRST                                                         \
    "The input comes first (NCCL's order); torch.distributed puts the output "   \
    "first. Code ported from it should pass both by name."

static PyMethodDef comm_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))pyccl_comm_all_reduce,
     METH_FASTCALL | METH_KEYWORDS,
     "all_reduce($self, /, tensor, op=0, *, out=None, stream=None, algo=None)\n--\n\n"
     "Reduce `tensor` over all ranks; the result lands in `out` (default: in place).\n"
     "op: pyccl.SUM/PROD/MAX/MIN/AVG, its name ('sum', any case), a\n"
     "torch.distributed.ReduceOp or pyccl.premul_sum(x).\n\n"
     "algo: 'auto' (None), 'nccl', 'oneshot' or 'twoshot'. 'auto' runs pyccl's own\n"
     "peer-memory kernels for float32/float16/bfloat16/int32 SUM/MAX/MIN up to\n"
     "all_reduce_info['twoshot_max'] bytes when every rank shares the host, NCCL\n"
     "otherwise. The first such call sets up peer memory on all ranks together;\n"
     "destroy() is then collective. PYCCL_DISABLE_OWN_KERNELS=1 turns them off."},
    {"broadcast", (PyCFunction)(void (*)(void))pyccl_comm_broadcast,
     METH_FASTCALL | METH_KEYWORDS,
     "broadcast($self, /, tensor, root, *, out=None, stream=None)\n--\n\n"
     "Copy the root's `tensor` to every rank's `out` (default: in place)."},
    {"reduce", (PyCFunction)(void (*)(void))pyccl_comm_reduce,
     METH_FASTCALL | METH_KEYWORDS,
     "reduce($self, /, tensor, root, op=0, *, out=None, stream=None)\n--\n\n"
     "Reduce `tensor` over all ranks into the root's `out` (default: in place)."},
    {"all_gather", (PyCFunction)(void (*)(void))pyccl_comm_all_gather,
     METH_FASTCALL | METH_KEYWORDS,
     "all_gather($self, /, input, output, *, stream=None, algo=None)\n--\n\n"
     "Every rank's `input`, in rank order, into `output`: one tensor of size x "
     "input elements or a list of `size` tensors. algo: 'auto' (None) and 'nccl' "
     "are NCCL's; 'oneshot' is pyccl's own kernel (2 to 8 ranks of one host, one "
     "output tensor, any dtype).\n\n" PYCCL_INPUT_FIRST},
    {"reduce_scatter", (PyCFunction)(void (*)(void))pyccl_comm_reduce_scatter,
     METH_FASTCALL | METH_KEYWORDS,
     "reduce_scatter($self, /, input, output, op=0, *, stream=None, algo=None)\n--\n\n"
     "Reduce `input` (one tensor of size x output elements, or a list of `size` "
     "tensors) and give rank r chunk r in `output`. op: pyccl.SUM/PROD/MAX/MIN/AVG, "
     "its name ('sum'), a torch.distributed.ReduceOp or pyccl.premul_sum(x). algo: "
     "'auto' (None) and 'nccl' are NCCL's; 'oneshot' is pyccl's own kernel (2 to 8 "
     "ranks of one host, one input tensor, float32, float16, bfloat16 or int32 with "
     "SUM, MAX or MIN).\n\n" PYCCL_INPUT_FIRST},
    {"send", (PyCFunction)(void (*)(void))pyccl_comm_send,
     METH_FASTCALL | METH_KEYWORDS,
     "send($self, /, tensor, peer, *, stream=None)\n--\n\n"
     "Send `tensor` to rank `peer` (pair with its recv; use pyccl.group() for "
     "exchanges that must progress together)."},
    {"recv", (PyCFunction)(void (*)(void))pyccl_comm_recv,
     METH_FASTCALL | METH_KEYWORDS,
     "recv($self, /, tensor, peer, *, stream=None)\n--\n\n"
     "Receive into `tensor` from rank `peer` (pair with that rank's send)."},
    {"all_to_all", (PyCFunction)(void (*)(void))pyccl_comm_all_to_all,
     METH_FASTCALL | METH_KEYWORDS,
     "all_to_all($self, /, input, output, *, stream=None)\n--\n\n"
     "Chunk j of this rank's input goes to rank j; chunk i of output comes from "
     "rank i. Each side: one tensor of size x chunk elements or a list of tensors.\n\n"
     PYCCL_INPUT_FIRST},
    {"all_to_all_single", (PyCFunction)(void (*)(void))pyccl_comm_all_to_all_single,
     METH_FASTCALL | METH_KEYWORDS,
     "all_to_all_single($self, /, input, output, input_splits=None, output_splits=None, *, "
     "stream=None)\n--\n\n"
     "all_to_all with per-rank row counts along dim 0 (None: equal splits).\n\n"
     PYCCL_INPUT_FIRST},
    {"gather", (PyCFunction)(void (*)(void))pyccl_comm_gather,
     METH_FASTCALL | METH_KEYWORDS,
     "gather($self, /, tensor, outputs, root, *, stream=None)\n--\n\n"
     "Every rank's `tensor` into the root's `outputs` (a list of `size` tensors "
     "or one tensor of size x elements); other ranks may pass None."},
    {"scatter", (PyCFunction)(void (*)(void))pyccl_comm_scatter,
     METH_FASTCALL | METH_KEYWORDS,
     "scatter($self, /, inputs, tensor, root, *, stream=None)\n--\n\n"
     "Chunk r of the root's `inputs` into rank r's `tensor`; other ranks may pass "
     "None as inputs.\n\n" PYCCL_INPUT_FIRST},
    {"barrier", (PyCFunction)(void (*)(void))pyccl_comm_barrier,
     METH_FASTCALL | METH_KEYWORDS,
     "barrier($self, /, *, stream=None)\n--\n\n"
     "Return once every rank has called barrier (a one-element all-reduce, then a "
     "wait on the host)."},
    {"split", (PyCFunction)(void (*)(void))pyccl_comm_split,
     METH_FASTCALL | METH_KEYWORDS,
     "split($self, /, color, key=None)\n--\n\n"
     "A new Communicator of the ranks that passed the same color, ordered by key "
     "(default: this rank). color < 0: not a member; returns None."},
    {"shrink", (PyCFunction)(void (*)(void))pyccl_comm_shrink,
     METH_FASTCALL | METH_KEYWORDS,
     "shrink($self, /, exclude)\n--\n\n"
     "A new Communicator of the ranks not in `exclude` (a sequence of ranks), renumbered in "
     "their order (NCCL's ncclCommShrink, NCCL >= 2.27). Every remaining rank calls it; an "
     "excluded rank does not. With a timeout it also works after a peer died: a communicator "
     "that failed keeps its NCCL handle revoked (NCCL >= 2.28) for shrink() until abort() "
     "or destroy(). The new communicator has the same timeout, and pyccl's own kernels set "
     "up again on its first all_reduce. Destroy the old one afterwards."},
    {"all_reduce_coalesced", (PyCFunction)(void (*)(void))pyccl_comm_all_reduce_coalesced,
     METH_FASTCALL | METH_KEYWORDS,
     "all_reduce_coalesced($self, /, tensors, op=0, *, algo=None)\n--\n\n"
     "all_reduce of many tensors (one dtype, this device) in place as one collective: "
     "one launch of pyccl's copy kernel packs up to 160 tensors into a flat buffer "
     "(tensors[0].new_empty), one all_reduce (algo= as in all_reduce), one launch unpacks "
     "them, all on the current stream, no Python call per tensor (without pyccl's kernels "
     "on this GPU: torch's pack and unpack, an operator per tensor). "
     "For many small gradients, where a call per tensor is latency-bound."},
    {"register", pyccl_comm_register, METH_O,
     "register($self, tensor, /)\n--\n\nRegister `tensor`'s memory with NCCL "
     "(ncclCommRegister, NCCL >= 2.19) for zero-copy collectives; returns a "
     "pyccl.Registration (close() or `with` deregisters; destroy() deregisters "
     "what is still open). Not during CUDA graph capture."},
    {"register_window", pyccl_comm_register_window, METH_O,
     "register_window($self, tensor, /)\n--\n\nCollective: register `tensor` "
     "as an NCCL symmetric window (ncclCommWindowRegister with "
     "NCCL_WIN_COLL_SYMMETRIC, NCCL >= 2.27), so collectives on it can use "
     "NCCL's symmetric kernels. Every rank registers the same number of bytes "
     "of cuMem memory (pyccl.empty() or pyccl.mem_pool()); returns a "
     "pyccl.Registration. Not during CUDA graph capture."},
    {"destroy", comm_destroy, METH_NOARGS,
     "destroy($self, /)\n--\n\nFree the NCCL communicator now (idempotent). Using it "
     "afterwards raises RuntimeError. With a timeout: waits for the outstanding "
     "work while each call's work finishes within it, then finalizes (at most "
     "the timeout); past either it aborts and raises NcclTimeoutError. "
     "Collective (every rank calls it) once all_reduce set up pyccl's own "
     "kernels (its first call of a supported dtype and op, any size): their "
     "peer memory is freed after a barrier."},
    {"abort", comm_abort, METH_NOARGS,
     "abort($self, /)\n--\n\nAbort the NCCL communicator now (ncclCommAbort): its "
     "kernels stop waiting for peers and return, results unfinished; every "
     "later call raises RuntimeError. Idempotent; for the emergency (another "
     "thread may call it while this one waits on the GPU). It waits for a "
     "thread inside an NCCL call on it (Ctrl-C ends that wait), and raises "
     "RuntimeError while a pyccl.group() that has not ended holds work of it."},
    {"wait", (PyCFunction)(void (*)(void))comm_wait,
     METH_FASTCALL | METH_KEYWORDS,
     "wait($self, /, timeout=None)\n--\n\nBlock (GIL released; Ctrl-C "
     "interrupts) until the work enqueued on this communicator so far has "
     "finished on the GPU. timeout: seconds at most; default: as long as "
     "each call's work finishes within the communicator's timeout (none: "
     "as long as it takes). Raises NcclTimeoutError if it does not finish "
     "in time (the communicator is aborted once a call's work exceeded its "
     "own timeout), or the error that aborted it. Without a timeout of its own "
     "it waits for everything enqueued so far on the streams it was used "
     "on; with one, so it does on the streams pyccl's own kernels ran on "
     "(their calls record no event)."},
    {"get_async_error", comm_get_async_error, METH_NOARGS,
     "get_async_error($self, /)\n--\n\nNone while all is well, else the exception "
     "(not raised) that the next call would raise: an NcclTimeoutError or "
     "NcclError instance once the communicator failed, or an NcclError for "
     "the error NCCL reports (ncclCommGetAsyncError). RuntimeError once it "
     "was destroyed or abort()ed."},

    {"_all_reduce_epoch", (PyCFunction)(void (*)(void))comm_ar_epoch, METH_FASTCALL,
     "_all_reduce_epoch($self, value=None, /)\n--\n\nTesting aid: every rank's own-kernel epoch "
     "counter; sets it to value (on all ranks alike, nothing in flight)."},
    {"__enter__", comm_enter, METH_NOARGS, "__enter__($self, /)\n--\n\nReturn the communicator itself."},
    {"__exit__", (PyCFunction)(void (*)(void))comm_exit, METH_FASTCALL,
     "__exit__($self, exc_type, exc, tb, /)\n--\n\nDestroy the communicator (as destroy())."},
    {NULL, NULL, 0, NULL},
};

/* .name: made on first read and entered in the module's name -> weakref
 * table, which dealloc empties again (so a name never outlives its
 * communicator, and a later one never gets it: the serial only grows). */
static PyObject *
comm_get_name(PyObject *self, void *closure)
{
    pyccl_comm *c = (pyccl_comm *)self;
    if (c->name == NULL) {
        pyccl_state *st = PyType_GetModuleState(Py_TYPE(self));
        if (st == NULL || st->comms->comm_names == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "Communicator.name: pyccl._C is being torn down");
            return NULL;
        }
        PyObject *name =
            PyUnicode_FromFormat("pyccl.Communicator.%llu", ++st->comms->comm_serial);
        PyObject *ref = name != NULL ? PyWeakref_NewRef(self, NULL) : NULL;
        int rc = ref != NULL ? PyDict_SetItem(st->comms->comm_names, name, ref) : -1;
        Py_XDECREF(ref);
        if (rc < 0) {
            Py_XDECREF(name);
            return NULL;
        }
        c->name = name;
    }
    return Py_NewRef(c->name);
}

static PyGetSetDef comm_getset[] = {
    {"rank", comm_get_rank_or_size, NULL, "This communicator's rank.", "rank"},
    {"size", comm_get_rank_or_size, NULL, "Number of ranks.", "size"},
    {"name", comm_get_name, NULL,
     "A name unique in this process ('pyccl.Communicator.<n>'), by which the "
     "torch custom ops torch.ops.pyccl.* (pyccl.ops) find this communicator.",
     NULL},
    {"destroyed", comm_get_destroyed, NULL,
     "True after destroy() or abort(), or once the watchdog aborted it.", NULL},
    {"timeout", comm_get_timeout, NULL,
     "The timeout in seconds (a float), or None: blocking NCCL semantics.",
     NULL},
    {"blocking", comm_get_blocking, NULL,
     "NCCL's mode of the handle: True (blocking; a timeout watches the GPU "
     "work of every NCCL call, at the cost of an event; pyccl's own kernels "
     "bound their own waits) or False (non-blocking: "
     "every host-side NCCL call is bounded by the timeout too, at NCCL's "
     "cost of a thread per launch).",
     NULL},
    {"all_reduce_info", comm_get_ar_info, NULL,
     "How all_reduce picks pyccl's own kernels on this communicator: state "
     "('not set up', 'ready', 'off'), reason, buffer_bytes, oneshot_max, "
     "twoshot_max, ll_max, blocks, threads, timeout, built, pdl (kernels "
     "launched with programmatic dependent launch), parked (regions of this "
     "process's released communicators kept until every peer closed its "
     "mapping of them or exited).", NULL},
    {"handle", comm_get_handle, NULL,
     "The ncclComm_t as an int (0 once destroyed), for other NCCL users.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef comm_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(pyccl_comm, weakreflist),
     Py_READONLY, NULL},
    {"device", Py_T_INT, offsetof(pyccl_comm, device), Py_READONLY, "CUDA device index."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_new, comm_tp_new},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_traverse, comm_traverse},
    {Py_tp_repr, comm_repr},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {Py_tp_members, comm_members},
    {Py_tp_doc,
     "Communicator(world_size, unique_id, rank, device=None, timeout=None, *, blocking=None)\n--\n\n"
     "One rank of an NCCL communicator on one CUDA device: device is an int, "
     "'cuda:N' or a torch.device ('cuda', torch.device('cuda') or None: the "
     "current one). Every rank passes the same unique_id.\n\n"
     "timeout (seconds, or a datetime.timedelta): every collective's work on "
     "the GPU must finish within it, else the communicator is aborted and "
     "NcclTimeoutError raised (by the call itself, or by the next call on it "
     "/ comm.wait()); pyccl's watchdog checks an event recorded after each "
     "NCCL call, and pyccl's own kernels give up waiting for peers after it. "
     "None: nothing watched (a lost peer can hang the others).\n\n"
     "blocking: NCCL's mode of the handle. With a timeout the default is "
     "False (non-blocking): the init and every host-side NCCL call (a "
     "connection, a split, a registration) are bounded by the timeout too, "
     "at NCCL's cost of a thread per launch (about 100 us of host time per "
     "call). True: each call costs what an untimed one does plus the event; "
     "a peer that never joins hangs the init, as without a timeout. Without "
     "a timeout: blocking (False is refused)."},
    {0, NULL},
};

PyType_Spec pyccl_comm_spec = {
    .name = "pyccl.Communicator",
    .basicsize = sizeof(pyccl_comm),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = comm_slots,
};


/* The outermost group of this thread ended: the communicators split inside it
 * now hold what NCCL wrote (NULL if the group failed). */
void
pyccl_resolve_pending_splits(pyccl_state *st)
{
    PyObject *keep = PyList_New(0);
    PyObject *me = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (keep == NULL || me == NULL) {
        /* out of memory: keep every entry alive rather than free too early */
        Py_XDECREF(keep);
        Py_XDECREF(me);
        PyErr_Clear();
        return;
    }
    Py_ssize_t n = PyList_GET_SIZE(st->comms->pending_splits);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(st->comms->pending_splits, i);
        PyObject *owner = PyTuple_GET_ITEM(item, 1);
        int mine = PyObject_RichCompareBool(owner, me, Py_EQ);
        if (mine == 1) {
            ((pyccl_comm *)PyTuple_GET_ITEM(item, 0))->pending = 0;
        } else if (PyList_Append(keep, item) < 0) {
            PyErr_Clear();
        }
    }
    Py_DECREF(me);
    Py_SETREF(st->comms->pending_splits, keep);
}

int
pyccl_add_pending_split(pyccl_state *st, PyObject *comm)
{
    PyObject *item = Py_BuildValue("(Ok)", comm, PyThread_get_thread_ident());
    if (item == NULL) {
        return -1;
    }
    int r = PyList_Append(st->comms->pending_splits, item);
    Py_DECREF(item);
    return r;
}
