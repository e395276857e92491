/* pyccl._C: PEP 489 module definition.  The exec slot builds the module state
 * (each layer's part through its own init, the exception types, the heap
 * types, constants) and the module's GC slots visit and clear it the same
 * way; the bindings live in python_nccl.c.  Importing needs no GPU, driver,
 * NCCL or torch: those are looked up on first use. */
#include "registration.h"
#include "memory.h"
#include "communicator.h"
#include "ar.h"
#include "timeouts.h"
#include "tensor.h"
#include "loader.h"
#include "args.h"
#include "locks.h"
#include "errors.h"

extern PyMethodDef pyccl_nccl_methods[];

/* _set_library_candidates(nccl_paths, cudart_paths): where to look for the
 * libraries when torch has not loaded them (pyccl/_libs.py computes these). */
static PyObject *
set_library_candidates(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    pyccl_state *st = PyModule_GetState(m);
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "_set_library_candidates(nccl_paths: list[str], "
                        "cudart_paths: list[str])");
        return NULL;
    }
    for (int k = 0; k < 2; k++) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[k]); i++) {
            if (!PyUnicode_Check(PyList_GET_ITEM(args[k], i))) {
                PyErr_SetString(PyExc_TypeError,
                                "_set_library_candidates: paths must be str");
                return NULL;
            }
        }
    }
    if (pyccl_set_library_candidates(st, args[0], args[1]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Registered with atexit: from here on communicators are leaked, not
 * destroyed (see communicator.c), and the watchdog stops (watchdog.c). */
static PyObject *
at_exit(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    pyccl_state *st = PyModule_GetState(m);
    st->exiting = 1;
    pyccl_ar_stop_all(); /* own kernels still waiting for peers return */
    pyccl_watchdog_at_exit(st);
    Py_RETURN_NONE;
}

/* _read_timeout(op, timeout) -> float or None: Communicator's check of a
 * timeout argument, for the Python launchers' own messages. */
static PyObject *
read_timeout(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "_read_timeout(op: str, timeout)");
        return NULL;
    }
    const char *op = PyUnicode_AsUTF8(args[0]);
    double t;
    if (op == NULL || pyccl_read_timeout(op, args[1], &t) < 0) {
        return NULL;
    }
    if (t > 0) {
        return PyFloat_FromDouble(t);
    }
    Py_RETURN_NONE;
}

/* The op name of a reader called from Python: args[0] as a str. */
static const char *
op_name(const char *usage, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    return PyUnicode_AsUTF8(args[0]);
}

/* _reduce_op(op, value) -> int: pyccl's op (SUM..AVG) for any spelling the
 * Communicator takes but premul_sum, for pyccl.ops and the torch.distributed
 * backend: the conversion is the one of args.c. */
static PyObject *
reduce_op(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    const char *op = op_name("_reduce_op(op: str, value)", args, nargs, 2);
    int redop;
    if (op == NULL ||
        pyccl_read_redop(PyModule_GetState(m), op, args[1], 0, &redop, NULL) < 0) {
        return NULL;
    }
    return PyLong_FromLong(redop);
}

/* _read_device(op, what, value) -> int or None (the current device): the
 * Communicator's reading of a device argument, for the Python side. */
static PyObject *
read_device(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    const char *op = op_name("_read_device(op: str, what: str, value)", args, nargs, 3);
    const char *what = op && PyUnicode_Check(args[1]) ? PyUnicode_AsUTF8(args[1]) : NULL;
    int device;
    if (what == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "_read_device(op: str, what: str, value)");
        }
        return NULL;
    }
    if (pyccl_read_device(op, what, args[2], &device) < 0) {
        return NULL;
    }
    if (device < 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLong(device);
}

/* _gpu_count(op) -> int >= 1, or CudaError "<op>: no CUDA GPU is available
 * (...)": the check before GPU work that starts in Python. */
static PyObject *
gpu_count(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    const char *op = op_name("_gpu_count(op: str)", args, nargs, 1);
    int ndev = 0;
    if (op == NULL || pyccl_gpu_count(PyModule_GetState(m), op, &ndev) < 0) {
        return NULL;
    }
    return PyLong_FromLong(ndev);
}

/* _library_paths() -> (nccl, cudart): the files actually in use. */
static PyObject *
library_paths(PyObject *m, PyObject *Py_UNUSED(ignored));

/* _communicator(name) -> the live Communicator whose .name is `name`, or
 * None: how the torch custom ops (pyccl/ops.py) find theirs. */
static PyObject *
communicator_by_name(PyObject *m, PyObject *name)
{
    pyccl_state *st = PyModule_GetState(m);
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "_communicator: name must be a str, got %s",
                     Py_TYPE(name)->tp_name);
        return NULL;
    }
    return pyccl_comm_by_name(st, name);
}

#ifdef PYCCL_DEBUG_LOCKS
/* Debug builds: two locks taken against csrc/locks.h's order (or, given a
 * true argument, a communicator-class lock waited for with the GIL held),
 * which the check turns into an abort naming them (the CPU tier's proof that
 * it runs). */
static PyObject *
debug_break_lock_order(PyObject *m, PyObject *gil)
{
    int with_gil = PyObject_IsTrue(gil);
    if (with_gil < 0) {
        return NULL;
    }
    pyccl_lock_selftest(with_gil);
    Py_RETURN_NONE;
}
#endif

static PyMethodDef module_methods[] = {
#ifdef PYCCL_DEBUG_LOCKS
    {"_debug_break_lock_order", debug_break_lock_order, METH_O, NULL},
#endif
    {"_set_library_candidates",
     (PyCFunction)(void (*)(void))set_library_candidates, METH_FASTCALL, NULL},
    {"_at_exit", at_exit, METH_NOARGS, NULL},
    {"_read_timeout", (PyCFunction)(void (*)(void))read_timeout, METH_FASTCALL,
     "_read_timeout(op, timeout) -> float or None (TypeError/ValueError "
     "naming op)."},
    {"_reduce_op", (PyCFunction)(void (*)(void))reduce_op, METH_FASTCALL,
     "_reduce_op(op, value) -> int: pyccl's reduction op for any spelling "
     "(TypeError/ValueError naming op)."},
    {"_read_device", (PyCFunction)(void (*)(void))read_device, METH_FASTCALL,
     "_read_device(op, what, value) -> device index, or None for the current "
     "device (TypeError/ValueError naming op and what)."},
    {"_gpu_count", (PyCFunction)(void (*)(void))gpu_count, METH_FASTCALL,
     "_gpu_count(op) -> number of CUDA devices (CudaError naming op when none)."},
    {"_communicator", communicator_by_name, METH_O,
     "_communicator(name) -> the live Communicator with that .name, or None."},
    {"_nccl_mem_alloc", (PyCFunction)(void (*)(void))pyccl_mem_alloc, METH_FASTCALL,
     "_nccl_mem_alloc(nbytes, device) -> NcclBuffer: memory from ncclMemAlloc "
     "(pyccl.empty)."},
    {"_mem_pool_functions", pyccl_mem_pool_functions, METH_NOARGS,
     "_mem_pool_functions() -> (alloc_name, free_name): NCCL loaded; the "
     "CUDAPluggableAllocator functions of this shared object (pyccl.mem_pool)."},
    {"_library_paths", library_paths, METH_NOARGS,
     "(nccl_path, cudart_path) of the loaded libraries."},
    {NULL, NULL, 0, NULL},
};

#include <dlfcn.h>
#include <link.h>

static PyObject *
handle_path(void *h)
{
    struct link_map *lm = NULL;
    if (h == NULL || dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || lm == NULL) {
        Py_RETURN_NONE;
    }
    return PyUnicode_DecodeFSDefault(lm->l_name);
}

static PyObject *
library_paths(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    pyccl_state *st = PyModule_GetState(m);
    if (pyccl_load(st, "library_paths") < 0) {
        return NULL;
    }
    PyObject *a = handle_path(st->api.nccl_handle);
    PyObject *b = a ? handle_path(st->api.cudart_handle) : NULL;
    PyObject *r = b ? PyTuple_Pack(2, a, b) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

/* A PyObject * field of the state, by its offset. */
static PyObject **
state_slot(pyccl_state *st, size_t off)
{
    return (PyObject **)((char *)st + off);
}

/* The exception and heap types the state holds: visited by the garbage
 * collector, and cleared (each layer's part visits and clears its own). */
static const size_t visited[] = {
    offsetof(pyccl_state, NcclError),        offsetof(pyccl_state, CudaError),
    offsetof(pyccl_state, NcclTimeoutError), offsetof(pyccl_state, CommunicatorType),
    offsetof(pyccl_state, NcclBufferType),   offsetof(pyccl_state, RegistrationType),
};

static int
module_exec(PyObject *m)
{
    pyccl_state *st = PyModule_GetState(m);
    pyccl_pid_init();
    /* the layers' parts first: allocated whenever a type of the module exists */
    if (pyccl_torch_state_init(st) < 0 || pyccl_redops_state_init(st) < 0 ||
        pyccl_libs_state_init(st) < 0 || pyccl_cliques_state_init(st) < 0 ||
        pyccl_comms_state_init(st) < 0) {
        return -1;
    }
    st->NcclError = PyErr_NewExceptionWithDoc(
        "pyccl.NcclError",
        "An NCCL call failed. Attributes: code (ncclResult_t), error_string "
        "(ncclGetErrorString) and last_error (ncclGetLastError).",
        PyExc_RuntimeError, NULL);
    if (st->NcclError == NULL || PyModule_AddObjectRef(m, "NcclError", st->NcclError) < 0) {
        return -1;
    }
    st->CudaError = PyErr_NewExceptionWithDoc(
        "pyccl.CudaError",
        "A CUDA runtime call failed (or no GPU is available). Attributes: "
        "code and error_string.",
        PyExc_RuntimeError, NULL);
    if (st->CudaError == NULL || PyModule_AddObjectRef(m, "CudaError", st->CudaError) < 0) {
        return -1;
    }
    /* Also a TimeoutError, so `except TimeoutError` catches it; its
     * OSError layout extends RuntimeError's, so both bases fit. */
    PyObject *bases = PyTuple_Pack(2, st->NcclError, PyExc_TimeoutError);
    if (bases == NULL) {
        return -1;
    }
    st->NcclTimeoutError = PyErr_NewExceptionWithDoc(
        "pyccl.NcclTimeoutError",
        "A communicator created with timeout= (or pyccl's own kernels under "
        "PYCCL_AR_TIMEOUT) gave up waiting for its peers (or comm.wait() for "
        "its work). Unless the message says otherwise the "
        "communicator was aborted: make a new one. An NcclError (code is "
        "ncclInProgress) and a TimeoutError; .timeout is the limit in seconds.",
        bases, NULL);
    Py_DECREF(bases);
    if (st->NcclTimeoutError == NULL ||
        PyModule_AddObjectRef(m, "NcclTimeoutError", st->NcclTimeoutError) < 0) {
        return -1;
    }
    st->CommunicatorType = PyType_FromModuleAndSpec(m, &pyccl_comm_spec, NULL);
    if (st->CommunicatorType == NULL ||
        PyModule_AddObjectRef(m, "Communicator", st->CommunicatorType) < 0) {
        return -1;
    }
    st->NcclBufferType = PyType_FromModuleAndSpec(m, &pyccl_buffer_spec, NULL);
    if (st->NcclBufferType == NULL ||
        PyModule_AddObjectRef(m, "NcclBuffer", st->NcclBufferType) < 0) {
        return -1;
    }
    st->RegistrationType = PyType_FromModuleAndSpec(m, &pyccl_reg_spec, NULL);
    if (st->RegistrationType == NULL ||
        PyModule_AddObjectRef(m, "Registration", st->RegistrationType) < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(m, "SUM", ncclSum) < 0 ||
        PyModule_AddIntConstant(m, "PROD", ncclProd) < 0 ||
        PyModule_AddIntConstant(m, "MAX", ncclMax) < 0 ||
        PyModule_AddIntConstant(m, "MIN", ncclMin) < 0 ||
        PyModule_AddIntConstant(m, "AVG", ncclAvg) < 0 ||
        PyModule_AddIntConstant(m, "NCCL_UNIQUE_ID_BYTES", NCCL_UNIQUE_ID_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "NCCL_BUILD_VERSION", NCCL_VERSION_CODE) < 0 ||
        PyModule_AddIntConstant(m, "_MAX_PENDING", PYCCL_MAX_PENDING) < 0) {
        return -1;
    }
    if (PyModule_AddFunctions(m, pyccl_nccl_methods) < 0) {
        return -1;
    }
    /* Leak, never destroy, communicators once the interpreter is exiting. */
    PyObject *atexit = PyImport_ImportModule("atexit");
    if (atexit == NULL) {
        return -1;
    }
    PyObject *hook = PyObject_GetAttrString(m, "_at_exit");
    PyObject *r = hook ? PyObject_CallMethod(atexit, "register", "O", hook) : NULL;
    Py_XDECREF(hook);
    Py_DECREF(atexit);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

static int
module_traverse(PyObject *m, visitproc visit, void *arg)
{
    pyccl_state *st = PyModule_GetState(m);
    if (st == NULL) {
        return 0;
    }
    for (size_t i = 0; i < sizeof visited / sizeof visited[0]; i++) {
        Py_VISIT(*state_slot(st, visited[i]));
    }
    int rc;
    if ((rc = pyccl_torch_state_traverse(st, visit, arg)) != 0 ||
        (rc = pyccl_redops_state_traverse(st, visit, arg)) != 0 ||
        (rc = pyccl_cliques_state_traverse(st, visit, arg)) != 0 ||
        (rc = pyccl_comms_state_traverse(st, visit, arg)) != 0) {
        return rc;
    }
    return 0;
}

static int
module_clear(PyObject *m)
{
    pyccl_state *st = PyModule_GetState(m);
    if (st == NULL) {
        return 0;
    }
    /* Cleared only at interpreter teardown: mark exiting first so the
     * clique's communicators are leaked, not destroyed, and close the
     * reader's part before all: from then on no GPU work starts
     * (pyccl_state_ready).  The cliques go next. */
    st->exiting = 1;
    pyccl_torch_state_clear(st);
    pyccl_cliques_state_clear(st);
    pyccl_comms_state_clear(st);
    for (size_t i = 0; i < sizeof visited / sizeof visited[0]; i++) {
        Py_CLEAR(*state_slot(st, visited[i]));
    }
    pyccl_redops_state_clear(st);
    pyccl_libs_state_clear(st);
    return 0;
}

static void
module_free(void *m)
{
    pyccl_state *st = PyModule_GetState((PyObject *)m);
    module_clear((PyObject *)m);
    if (st != NULL) {
        pyccl_watchdog_free(st);
        pyccl_torch_state_free(st);
        pyccl_redops_state_free(st);
        pyccl_libs_state_free(st);
        pyccl_cliques_state_free(st);
        pyccl_comms_state_free(st);
    }
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pyccl._C",
    .m_doc = "NCCL collectives for PyTorch tensors, in C (no libtorch link).",
    .m_size = sizeof(pyccl_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
