/* Memory from NCCL's allocator (ncclMemAlloc: cuMem-backed, the kind NCCL
 * can register as a symmetric window): the buffer object behind
 * pyccl.empty(), and the two plain C functions torch's
 * CUDAPluggableAllocator calls for pyccl.mem_pool().
 *
 * The buffer is a small object that owns the pointer and shows it through
 * __cuda_array_interface__; torch.as_tensor keeps a reference to it in the
 * tensor's deleter, so ncclMemFree runs when the last tensor sharing the
 * memory is gone.  Nothing is freed at interpreter exit (as communicators). */
#include "memory.h"
#include "tensor.h"
#include "loader.h"
#include "errors.h"

#include <string.h>
#include <sys/types.h>

typedef struct {
    PyObject_HEAD
    void *ptr;
    int64_t nbytes;  /* as asked for (ncclMemAlloc may round the mapping up) */
    int device;
} nccl_buffer;

/* ncclMemAlloc/ncclMemFree on `device` (made current around the call),
 * GIL released.  Shared by the buffer and the pool's functions. */
static ncclResult_t
alloc_on(const pyccl_api *a, int device, size_t n, void **out)
{
    int prev;
    ncclResult_t r = ncclUnhandledCudaError;
    if (pyccl_device_enter(a, device, &prev) == cudaSuccess) {
        r = a->ncclMemAlloc(out, n);
    }
    pyccl_device_leave(a, device, prev);
    return r;
}

static void
free_on(const pyccl_api *a, int device, void *p)
{
    int prev;
    pyccl_device_enter(a, device, &prev);
    a->ncclMemFree(p);
    pyccl_device_leave(a, device, prev);
}

/* ---------------- pyccl._C.NcclBuffer ---------------- */

/* _nccl_mem_alloc(nbytes, device) -> NcclBuffer: pyccl.empty's memory
 * (device -1: the current device).  The
 * Python side has checked the arguments with empty's messages; these checks
 * stand behind it. */
PyObject *
pyccl_mem_alloc(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    pyccl_state *st = PyModule_GetState(m);
    if (nargs != 2 || !PyLong_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_nccl_mem_alloc(nbytes: int, device: int)");
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[0]);
    long device = PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (nbytes <= 0) {
        PyErr_Format(PyExc_ValueError, "empty: the size must be > 0 bytes, got %lld", nbytes);
        return NULL;
    }
    if (pyccl_load(st, "empty") < 0 ||
        pyccl_need_nccl(st, "empty", (const void *)st->api.ncclMemAlloc, "ncclMemAlloc",
                        "2.19") < 0) {
        return NULL;
    }
    const pyccl_api *a = &st->api;
    int ndev = 0;
    if (pyccl_gpu_count(st, "empty", &ndev) < 0) {
        return NULL;
    }
    if (device == -1) { /* the current device */
        int cur = 0;
        cudaError_t ce = a->cudaGetDevice(&cur);
        if (ce != cudaSuccess) {
            pyccl_raise_cuda(st, "empty", "cudaGetDevice", ce);
            return NULL;
        }
        device = cur;
    }
    if (device < 0 || device >= ndev) {
        PyErr_Format(PyExc_ValueError,
                     "empty: device %ld does not exist (this process sees %d GPUs)", device,
                     ndev);
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)st->NcclBufferType;
    nccl_buffer *b = (nccl_buffer *)tp->tp_alloc(tp, 0);
    if (b == NULL) {
        return NULL;
    }
    void *p = NULL;
    ncclResult_t r;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    Py_BEGIN_ALLOW_THREADS
    r = alloc_on(a, (int)device, (size_t)nbytes, &p);
    pyccl_nccl_failed(a, r, NULL, last, sizeof last);
    Py_END_ALLOW_THREADS
    if (r != ncclSuccess) {
        Py_DECREF(b);
        pyccl_raise_nccl(st, "empty", r, last);
        return NULL;
    }
    b->ptr = p;
    b->nbytes = nbytes;
    b->device = (int)device;
    return (PyObject *)b;
}

static void
buffer_dealloc(PyObject *self)
{
    nccl_buffer *b = (nccl_buffer *)self;
    PyTypeObject *tp = Py_TYPE(self);
    pyccl_state *st = PyType_GetModuleState(tp);
    /* at exit: leaked, as the CUDA runtime may be going away */
    if (b->ptr != NULL && st != NULL && !st->exiting && !Py_IsFinalizing() &&
        st->api.ncclMemFree != NULL) {
        const pyccl_api *a = &st->api;
        void *p = b->ptr;
        int dev = b->device;
        Py_BEGIN_ALLOW_THREADS
        free_on(a, dev, p);
        Py_END_ALLOW_THREADS
    }
    b->ptr = NULL;
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Bytes, one dimension: torch reads the typestr through NumPy, which has no
 * bfloat16 or fp8; pyccl.empty views the bytes as the dtype and shape. */
static PyObject *
buffer_cai(PyObject *self, void *Py_UNUSED(closure))
{
    nccl_buffer *b = (nccl_buffer *)self;
    return Py_BuildValue("{s:i,s:(L),s:s,s:(NO),s:O,s:O}", "version", 3, "shape",
                         (long long)b->nbytes, "typestr", "|u1", "data",
                         PyLong_FromVoidPtr(b->ptr), Py_False, "strides", Py_None, "stream",
                         Py_None);
}

static PyObject *
buffer_get_ptr(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(((nccl_buffer *)self)->ptr);
}


static PyObject *
buffer_repr(PyObject *self)
{
    nccl_buffer *b = (nccl_buffer *)self;
    return PyUnicode_FromFormat("<pyccl._C.NcclBuffer %lld bytes at %p on cuda:%d>",
                                (long long)b->nbytes, b->ptr, b->device);
}

static PyGetSetDef buffer_getset[] = {
    {"__cuda_array_interface__", buffer_cai, NULL,
     "The memory as a 1-D uint8 array (version 3).", NULL},
    {"ptr", buffer_get_ptr, NULL, "The device address (int).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef buffer_members[] = {
    {"nbytes", Py_T_LONGLONG, offsetof(nccl_buffer, nbytes), Py_READONLY, "Bytes asked for."},
    {"device", Py_T_INT, offsetof(nccl_buffer, device), Py_READONLY, "CUDA device index."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_repr, buffer_repr},
    {Py_tp_getset, buffer_getset},
    {Py_tp_members, buffer_members},
    {Py_tp_doc,
     "Device memory from ncclMemAlloc, freed with ncclMemFree when the last "
     "reference goes (pyccl.empty() wraps it in a torch.Tensor, which holds one)."},
    {0, NULL},
};

PyType_Spec pyccl_buffer_spec = {
    .name = "pyccl._C.NcclBuffer",
    .basicsize = sizeof(nccl_buffer),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = buffer_slots,
};

/* ---------------- the allocator of pyccl.mem_pool() ----------------
 * torch.cuda.memory.CUDAPluggableAllocator dlsyms these two by name from this
 * shared object and calls them without the GIL and without any context
 * argument, so the NCCL/CUDA table they use cannot be the module state's
 * (which goes with the module): it is copied here, once, when
 * _mem_pool_functions() has loaded NCCL (before torch can call them).  The
 * one mutable static of pyccl._C besides the type specs, for that reason. */
static pyccl_api pool_api;
static int pool_ready; /* set (release) once pool_api is filled */

__attribute__((visibility("default"))) void *
pyccl_nccl_pool_alloc(ssize_t size, int device, cudaStream_t stream)
{
    (void)stream; /* ncclMemAlloc is not stream-ordered */
    void *p = NULL;
    if (size <= 0 || !__atomic_load_n(&pool_ready, __ATOMIC_ACQUIRE) ||
        alloc_on(&pool_api, device, (size_t)size, &p) != ncclSuccess) {
        return NULL; /* torch raises its out-of-memory error */
    }
    return p;
}

__attribute__((visibility("default"))) void
pyccl_nccl_pool_free(void *ptr, ssize_t size, int device, cudaStream_t stream)
{
    (void)size;
    (void)stream;
    if (ptr != NULL && __atomic_load_n(&pool_ready, __ATOMIC_ACQUIRE)) {
        free_on(&pool_api, device, ptr);
    }
}

/* _mem_pool_functions() -> (alloc_name, free_name): NCCL loaded and checked,
 * the two functions ready to be called. */
PyObject *
pyccl_mem_pool_functions(PyObject *m, PyObject *Py_UNUSED(unused))
{
    pyccl_state *st = PyModule_GetState(m);
    if (pyccl_load(st, "mem_pool") < 0 ||
        pyccl_need_nccl(st, "mem_pool", (const void *)st->api.ncclMemAlloc, "ncclMemAlloc",
                        "2.19") < 0) {
        return NULL;
    }
    if (!__atomic_load_n(&pool_ready, __ATOMIC_ACQUIRE)) {
        pool_api = st->api;
        /* release: a thread that sees the flag sees the table (torch's own
         * lock orders this before any call of the pool, which does not exist
         * yet) */
        __atomic_store_n(&pool_ready, 1, __ATOMIC_RELEASE);
    }
    return Py_BuildValue("(ss)", "pyccl_nccl_pool_alloc", "pyccl_nccl_pool_free");
}
