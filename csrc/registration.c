/* comm.register(tensor) and comm.register_window(tensor): NCCL user-buffer
 * registration (ncclCommRegister, NCCL >= 2.19: zero-copy) and symmetric
 * windows (ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC, NCCL >= 2.27:
 * NCCL's symmetric kernels), each returned as a pyccl.Registration handle.
 *
 * A handle holds its communicator and its tensor (so the memory outlives the
 * registration); the communicator lists its open handles (c->regs, in
 * reg_list.c, a layer below), so that destroy() and garbage collection
 * deregister them first and abort() forgets them.  close() (or the handle's
 * garbage collection) deregisters, through reg_list.c.  A window is
 * collective: the ranks first agree, through an NCCL all_gather on the
 * communicator itself, that every rank registers the same number of bytes of
 * usable memory, and all raise together otherwise. */
#include "registration.h"
#include "reg_list.h"
#include "comm_ops.h"
#include "communicator.h"
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "tensor.h"
#include "loader.h"
#include "errors.h"

#include <dlfcn.h>
#include <string.h>
#include <time.h>

static const char *
reg_op(int window)
{
    return window ? "register_window" : "register";
}

/* ---------------- the driver's view: is the memory cuMem's? ---------------- */

typedef int (*retain_fn)(unsigned long long *, void *);
typedef int (*release_fn)(unsigned long long);

/* 1: cuMem-backed, 0: not, -1: the driver cannot tell (NCCL decides). */
static int
is_cumem(void *ptr)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) {
        h = dlopen("libcuda.so.1", RTLD_NOW);
    }
    if (h == NULL) {
        return -1;
    }
    retain_fn retain = (retain_fn)dlsym(h, "cuMemRetainAllocationHandle");
    release_fn release = (release_fn)dlsym(h, "cuMemRelease");
    int ok = -1;
    if (retain != NULL && release != NULL) {
        unsigned long long handle = 0;
        if (retain(&handle, ptr) == 0) {
            release(handle); /* the retain took a reference */
            ok = 1;
        }
        else {
            ok = 0;
        }
    }
    dlclose(h);
    return ok;
}

/* ---------------- register / register_window ---------------- */

#define NOT_CUMEM_HINT                                                                 \
    "the tensor's memory was not allocated with cuMem (torch's default caching "       \
    "allocator uses cudaMalloc); allocate it with pyccl.empty() or inside "            \
    "torch.cuda.use_mem_pool(pyccl.mem_pool())"

enum { REC_OK = 0, REC_REFUSED = 1, REC_NOT_CUMEM = 2 };

/* The ranks' (nbytes, state) through an all_gather on c itself, synchronously
 * on stream s; fills all[2 * size].  -1 with an exception. */
static int
exchange(call_ctx *x, cudaStream_t s, const int64_t mine[2], int64_t *all)
{
    pyccl_state *st = x->st;
    pyccl_comm *c = x->c;
    const pyccl_api *a = &st->api;
    size_t rec = 2 * sizeof(int64_t);
    char *dev = NULL;
    cudaError_t ce;
    const char *what = "cudaMalloc";
    if (a->cudaMemcpy == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s: the loaded CUDA runtime lacks cudaMemcpy",
                     x->op);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    int prev;
    pyccl_device_enter(a, c->device, &prev);
    ce = a->cudaMalloc((void **)&dev, rec * (size_t)c->size);
    if (ce == cudaSuccess) {
        what = "cudaMemcpy";
        ce = a->cudaMemcpy(dev + rec * (size_t)c->rank, mine, rec, cudaMemcpyHostToDevice);
    }
    if (ce == cudaSuccess) {
        what = "cudaDeviceSynchronize"; /* the copy is done before s reads it */
        ce = a->cudaDeviceSynchronize();
    }
    pyccl_device_leave(a, c->device, prev);
    Py_END_ALLOW_THREADS
    if (ce != cudaSuccess) {
        pyccl_raise_cuda(st, x->op, what, ce);
        goto error;
    }
    pyccl_task tk;
    ops_task(&tk, PYCCL_ALL_GATHER, dev + rec * (size_t)c->rank, dev, rec, ncclUint8, 0, x, s);
    int rc = pyccl_call_submit(st, x->op, &tk, 1, ncclSum, NULL, NULL, &c, 1);
    if (rc < 0 || ops_wait_call(x, s) < 0) {
        goto error;
    }
    Py_BEGIN_ALLOW_THREADS
    int prev;
    pyccl_device_enter(a, c->device, &prev);
    what = "cudaMemcpy";
    ce = a->cudaMemcpy(all, dev, rec * (size_t)c->size, cudaMemcpyDeviceToHost);
    a->cudaFree(dev);
    pyccl_device_leave(a, c->device, prev);
    Py_END_ALLOW_THREADS
    if (ce != cudaSuccess) {
        pyccl_raise_cuda(st, x->op, what, ce);
        return -1;
    }
    return 0;
error:
    if (dev != NULL) {
        Py_BEGIN_ALLOW_THREADS
        int prev;
        pyccl_device_enter(a, c->device, &prev);
        a->cudaFree(dev);
        pyccl_device_leave(a, c->device, prev);
        Py_END_ALLOW_THREADS
    }
    return -1;
}

/* After the exchange, on every rank alike: the first rank that refused its
 * tensor (that rank raises its own exception, the others name it), else a
 * ValueError listing every rank's size when they differ. */
static int
agree(call_ctx *x, const int64_t *all, PyObject *own_error)
{
    int n = x->c->size;
    /* first a rank that refused its argument (its size means nothing then) */
    for (int r = 0; r < n; r++) {
        int64_t state = all[2 * r + 1];
        if (state == REC_OK) {
            continue;
        }
        if (r == x->c->rank && own_error != NULL) {
            PyErr_SetRaisedException(Py_NewRef(own_error));
        }
        else if (r == x->c->rank) {
            PyErr_Format(PyExc_ValueError, "%s: %s", x->op, NOT_CUMEM_HINT);
        }
        else {
            PyErr_Format(state == REC_NOT_CUMEM ? PyExc_ValueError : PyExc_RuntimeError,
                         "%s: rank %d %s (see the error on that rank); nothing was "
                         "registered",
                         x->op, r,
                         state == REC_NOT_CUMEM
                             ? "gave memory that was not allocated with cuMem"
                             : "refused its tensor");
        }
        return -1;
    }
    int same = 1;
    for (int r = 1; r < n; r++) {
        same &= all[2 * r] == all[0];
    }
    if (same) {
        return 0;
    }
    PyObject *parts = PyList_New(0);
    if (parts == NULL) {
        return -1;
    }
    for (int r = 0; r < n; r++) {
        PyObject *p = PyUnicode_FromFormat("rank %d: %lld", r, (long long)all[2 * r]);
        if (p == NULL || PyList_Append(parts, p) < 0) {
            Py_XDECREF(p);
            Py_DECREF(parts);
            return -1;
        }
        Py_DECREF(p);
    }
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *joined = sep ? PyUnicode_Join(sep, parts) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(parts);
    if (joined == NULL) {
        return -1;
    }
    PyErr_Format(PyExc_ValueError,
                 "%s: every rank must register the same number of bytes; %U", x->op, joined);
    Py_DECREF(joined);
    return -1;
}

static PyObject *
make_reg(call_ctx *x, PyObject *tensor, const pyccl_tensor *t, void *handle, int window)
{
    PyTypeObject *tp = (PyTypeObject *)x->st->RegistrationType;
    pyccl_reg *r = (pyccl_reg *)tp->tp_alloc(tp, 0);
    if (r == NULL) {
        return NULL;
    }
    r->comm = (pyccl_comm *)Py_NewRef((PyObject *)x->c);
    r->tensor = Py_NewRef(tensor);
    r->handle = handle;
    r->ptr = t->ptr;
    r->nbytes = t->nbytes;
    r->window = window;
    r->open = 1;
    pyccl_reg_link(x->c, r);
    return (PyObject *)r;
}

/* The checks of one rank's tensor: 0, or -1 with the exception set. */
static int
check_tensor(call_ctx *x, PyObject *tensor, pyccl_tensor *t)
{
    if (ops_read_on_comm(x, "tensor", tensor, t) < 0) {
        return -1;
    }
    if (t->nbytes == 0) {
        PyErr_Format(PyExc_ValueError, "%s: tensor has no bytes to register (0 elements)",
                     x->op);
        return -1;
    }
    return 0;
}

static PyObject *
do_register(PyObject *self, PyObject *tensor, int window)
{
    call_ctx x;
    const char *op = reg_op(window);
    cudaStream_t s;
    if (ops_ctx_init(&x, self, op) < 0 || pyccl_comm_alive(x.st, op, x.c) < 0) {
        return NULL;
    }
    const pyccl_api *a = &x.st->api;
    if (pyccl_need_nccl(x.st, op,
                        window ? (const void *)a->ncclCommWindowRegister
                               : (const void *)a->ncclCommRegister,
                        window ? "ncclCommWindowRegister" : "ncclCommRegister",
                        window ? "2.27" : "2.19") < 0 ||
        ops_stream(&x, Py_None, &s) < 0) {
        return NULL;
    }
    enum cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    cudaError_t ce = a->cudaStreamIsCapturing(s, &capturing);
    if (ce != cudaSuccess) {
        pyccl_raise_cuda(x.st, op, "cudaStreamIsCapturing", ce);
        return NULL;
    }
    if (capturing != cudaStreamCaptureStatusNone) { /* NCCL 2.28/2.29 crash when asked to */
        PyErr_Format(PyExc_RuntimeError,
                     "%s: cannot register memory during CUDA graph capture; register "
                     "before capturing",
                     op);
        return NULL;
    }
    if (pyccl_group_depth() > 0) {
        /* a window's exchange would only be queued until the group ends,
         * and NCCL fills a handle made in a group only then */
        PyErr_Format(PyExc_RuntimeError,
                     "%s: cannot register memory inside pyccl.group(); register before "
                     "the group",
                     op);
        return NULL;
    }
    pyccl_tensor t;
    memset(&t, 0, sizeof t);
    void *handle = NULL;
    PyObject *res = NULL;
    if (!window) {
        /* begun after the tensor's code, which may destroy c */
        if (check_tensor(&x, tensor, &t) < 0 || pyccl_call_begin(x.st, op, x.c) < 0) {
            return NULL;
        }
        if (pyccl_reg_call(x.st, op, x.c, 0, t.ptr, (size_t)t.nbytes, &handle) == 0) {
            res = make_reg(&x, tensor, &t, handle, 0);
        }
        pyccl_call_end(x.c);
        return res;
    }
    /* Collective: a local refusal is exchanged too, so every rank raises. */
    int64_t mine[2] = {0, REC_OK};
    PyObject *own = NULL;
    if (check_tensor(&x, tensor, &t) < 0) {
        own = PyErr_GetRaisedException();
        mine[1] = REC_REFUSED;
    }
    else {
        mine[0] = t.nbytes;
        if (is_cumem(t.ptr) == 0) {
            mine[1] = REC_NOT_CUMEM;
        }
    }
    int64_t *all = PyMem_Calloc((size_t)x.c->size, 2 * sizeof(int64_t));
    if (all == NULL) {
        Py_XDECREF(own);
        return PyErr_NoMemory();
    }
    if (pyccl_call_begin(x.st, op, x.c) < 0) {
        PyMem_Free(all);
        Py_XDECREF(own);
        return NULL;
    }
    int rc = exchange(&x, s, mine, all) < 0 || agree(&x, all, own) < 0;
    PyMem_Free(all);
    Py_XDECREF(own);
    if (!rc && pyccl_reg_call(x.st, op, x.c, 1, t.ptr, (size_t)t.nbytes, &handle) == 0) {
        res = make_reg(&x, tensor, &t, handle, 1);
    }
    pyccl_call_end(x.c);
    return res;
}

PyObject *
pyccl_comm_register(PyObject *self, PyObject *tensor)
{
    return do_register(self, tensor, 0);
}

PyObject *
pyccl_comm_register_window(PyObject *self, PyObject *tensor)
{
    return do_register(self, tensor, 1);
}

/* ---------------- pyccl.Registration ---------------- */

static int reg_usable(PyObject *self, const char *what);

static pyccl_state *
reg_state(PyObject *self)
{
    return PyType_GetModuleState(Py_TYPE(self));
}

static PyObject *
reg_close(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    pyccl_reg *r = (pyccl_reg *)self;
    if (pyccl_reg_close(reg_state(self), r, 0, PYCCL_CLOSE_BY_USER) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
reg_enter(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    if (reg_usable(self, "__enter__") < 0) {
        return NULL;
    }
    return Py_NewRef(self);
}

static PyObject *
reg_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs;
    return reg_close(self, NULL);
}

static void
reg_dealloc(PyObject *self)
{
    pyccl_reg *r = (pyccl_reg *)self;
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    pyccl_state *st = PyType_GetModuleState(tp);
    if (r->open) {
        PyObject *exc = PyErr_GetRaisedException();
        /* nobody to report a failure to; at exit: nothing is freed */
        if (pyccl_reg_close(st, r, st == NULL || st->exiting || Py_IsFinalizing(),
                            PYCCL_CLOSE_BY_DEALLOC) < 0) {
            PyErr_Clear();
        }
        PyErr_SetRaisedException(exc);
    }
    Py_CLEAR(r->tensor);
    Py_CLEAR(r->comm);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int
reg_traverse(PyObject *self, visitproc visit, void *arg)
{
    pyccl_reg *r = (pyccl_reg *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(r->tensor);
    Py_VISIT((PyObject *)r->comm);
    return 0;
}

/* -1 with RuntimeError saying why r cannot be used; 0 while it can. */
static int
reg_usable(PyObject *self, const char *what)
{
    pyccl_reg *r = (pyccl_reg *)self;
    if (!r->open && r->gone) {
        PyErr_Format(PyExc_RuntimeError,
                     "Registration.%s: the registration was closed when its communicator "
                     "(rank %d of %d) was %s",
                     what, r->comm->rank, r->comm->size,
                     r->gone == 2 ? "aborted" : "destroyed");
        return -1;
    }
    if (!r->open) {
        PyErr_Format(PyExc_RuntimeError, "Registration.%s: the registration is closed",
                     what);
        return -1;
    }
    pyccl_comm *c = r->comm;
    if (c->comm == NULL || pyccl_comm_failed(c)) {
        PyErr_Format(PyExc_RuntimeError,
                     "Registration.%s: its communicator (rank %d of %d) has been %s", what,
                     c->rank, c->size, pyccl_comm_failed(c) ? "aborted" : "destroyed");
        return -1;
    }
    return 0;
}

static PyObject *
reg_get_handle(PyObject *self, void *Py_UNUSED(closure))
{
    if (reg_usable(self, "handle") < 0) {
        return NULL;
    }
    return PyLong_FromVoidPtr(((pyccl_reg *)self)->handle);
}

static PyObject *
reg_get_tensor(PyObject *self, void *Py_UNUSED(closure))
{
    if (reg_usable(self, "tensor") < 0) {
        return NULL;
    }
    return Py_NewRef(((pyccl_reg *)self)->tensor);
}

/* closed (closure NULL) and window: the two flags, as bools */
static PyObject *
reg_get_flag(PyObject *self, void *closure)
{
    pyccl_reg *r = (pyccl_reg *)self;
    return PyBool_FromLong(closure == NULL ? !r->open : r->window);
}

static PyObject *
reg_get_data_ptr(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(((pyccl_reg *)self)->ptr);
}

static PyObject *
reg_repr(PyObject *self)
{
    pyccl_reg *r = (pyccl_reg *)self;
    return PyUnicode_FromFormat("<pyccl.Registration %s %lld bytes at %p rank=%d%s>",
                                r->window ? "window" : "buffer", (long long)r->nbytes,
                                (void *)r->ptr, r->comm->rank, r->open ? "" : " closed");
}

static PyMethodDef reg_methods[] = {
    {"close", reg_close, METH_NOARGS,
     "close($self, /)\n--\n\nDeregister now (idempotent). A window's close is "
     "collective: close windows on every rank, in the same order."},
    {"__enter__", reg_enter, METH_NOARGS, "__enter__($self, /)\n--\n\nReturn the handle."},
    {"__exit__", (PyCFunction)(void (*)(void))reg_exit, METH_FASTCALL,
     "__exit__($self, exc_type, exc, tb, /)\n--\n\nclose()."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reg_getset[] = {
    {"handle", reg_get_handle, NULL,
     "NCCL's registration handle or ncclWindow_t, as an int (RuntimeError once "
     "closed or its communicator is gone).", NULL},
    {"tensor", reg_get_tensor, NULL, "The registered tensor (kept alive while open).", NULL},
    {"closed", reg_get_flag, NULL,
     "True after close(), or once its communicator was destroyed or aborted.", NULL},
    {"window", reg_get_flag, NULL,
     "True for register_window()'s handles, False for register()'s.", "window"},
    {"data_ptr", reg_get_data_ptr, NULL, "The address registered (int).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef reg_members[] = {
    {"nbytes", Py_T_LONGLONG, offsetof(pyccl_reg, nbytes), Py_READONLY, "Bytes registered."},
    {"communicator", Py_T_OBJECT_EX, offsetof(pyccl_reg, comm), Py_READONLY,
     "The Communicator it was registered with."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot reg_slots[] = {
    {Py_tp_dealloc, reg_dealloc},
    {Py_tp_traverse, reg_traverse},
    {Py_tp_repr, reg_repr},
    {Py_tp_methods, reg_methods},
    {Py_tp_getset, reg_getset},
    {Py_tp_members, reg_members},
    {Py_tp_doc,
     "A buffer registered with a communicator (Communicator.register) or a "
     "symmetric window (Communicator.register_window). close() or a `with` "
     "block deregisters; destroy() of the communicator deregisters every open "
     "handle, abort() forgets them."},
    {0, NULL},
};

PyType_Spec pyccl_reg_spec = {
    .name = "pyccl.Registration",
    .basicsize = sizeof(pyccl_reg),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = reg_slots,
};
