/* Reading torch tensors and streams through their Python-level protocol.
 *
 * pyccl does not link libtorch, so a tensor is read with the attributes any
 * Python code would use (is_cuda, layout, dtype, is_contiguous(), numel(),
 * get_device(), data_ptr()) through interned names and vectorcall; dtypes are
 * compared by identity with the torch.dtype objects looked up once.  The
 * checks and their texts follow torch.cuda.nccl, since pyccl.nccl must fail
 * the way torch does. */
#include "tensor.h"
#include "loader.h"

#include <limits.h>
#include <stddef.h>
#include <string.h>

cudaError_t
pyccl_device_enter(const pyccl_api *a, int device, int *prev)
{
    /* the device this thread last made current through here: a thread that
     * never set one may still read `device` from cudaGetDevice (0 by
     * default) while the driver has no context current on it */
    static _Thread_local int bound = -1;
    if (a->cudaGetDevice(prev) != cudaSuccess) {
        a->cudaGetLastError();
        *prev = -1;
    }
    if (*prev == device && bound == device) {
        return cudaSuccess;
    }
    cudaError_t e = a->cudaSetDevice(device);
    if (e == cudaSuccess) {
        bound = device;
    }
    return e;
}

void
pyccl_device_leave(const pyccl_api *a, int device, int prev)
{
    if (prev >= 0 && prev != device) {
        a->cudaSetDevice(prev);
    }
}

/* fp8 reductions need NCCL's native fp8 types (NCCL 2.24); torch sends fp8
 * as uint8 and so sums bytes. */
#define PYCCL_NCCL_FP8 22400

const pyccl_dtype_info pyccl_dtype_table[PYCCL_NDTYPES] = {
    {"float16", "Half", ncclFloat16, 2, 0},
    {"bfloat16", "BFloat16", ncclBfloat16, 2, 0},
    {"float32", "Float", ncclFloat32, 4, 0},
    {"float64", "Double", ncclFloat64, 8, 0},
    {"int8", "Char", ncclInt8, 1, 0},
    {"uint8", "Byte", ncclUint8, 1, 0},
    {"int32", "Int", ncclInt32, 4, 0},
    {"int64", "Long", ncclInt64, 8, 0},
    {"uint32", "UInt32", ncclUint32, 4, 0},
    {"uint64", "UInt64", ncclUint64, 8, 0},
    {"float8_e4m3fn", "Float8_e4m3fn", ncclFloat8e4m3, 1, PYCCL_NCCL_FP8},
    {"float8_e5m2", "Float8_e5m2", ncclFloat8e5m2, 1, PYCCL_NCCL_FP8},
    /* No NCCL type: movable as bytes, never reducible. */
    {"bool", "Bool", -1, 1, 0},
    {"int16", "Short", -1, 2, 0},
    {"uint16", "UInt16", -1, 2, 0},
    {"complex32", "ComplexHalf", -1, 4, 0},
    {"complex64", "ComplexFloat", -1, 8, 0},
    {"complex128", "ComplexDouble", -1, 16, 0},
    {"float8_e4m3fnuz", "Float8_e4m3fnuz", -1, 1, 0},
    {"float8_e5m2fnuz", "Float8_e5m2fnuz", -1, 1, 0},
    {"float8_e8m0fnu", "Float8_e8m0fnu", -1, 1, 0},
};

/* The reader's part of the module state: the torch objects looked up on
 * first use (import pyccl._C needs no torch) and the attribute names read
 * off tensors, arrays and streams, interned once. */
struct pyccl_torch {
    int torch_ready;
    int closed;                  /* the module was torn down (m_clear): no more GPU work */
    PyObject *Tensor;            /* torch.Tensor */
    PyObject *Stream;            /* torch.cuda.Stream */
    PyObject *strided;           /* torch.strided */
    PyObject *current_raw_stream;/* torch._C._cuda_getCurrentRawStream or NULL */
    PyObject *pack[3];           /* all_reduce_coalesced's: torch._C._nn.flatten_dense_tensors,
                                    unflatten_dense_tensors, torch._foreach_copy_ (first use) */
    PyObject *dtypes[PYCCL_NDTYPES]; /* torch.<attr> for each table row, or NULL */
    PyObject *s_is_cuda, *s_layout, *s_dtype, *s_is_contiguous, *s_numel,
             *s_get_device, *s_data_ptr, *s_cuda_stream, *s_device_index,
             *s_itemsize, *s_cai, *s_shape, *s_typestr, *s_data, *s_strides,
             *s_device;
};

/* The attribute names looked up on every call. */
static const struct {
    size_t off;
    const char *text;
} interned[] = {
    {offsetof(struct pyccl_torch, s_is_cuda), "is_cuda"},
    {offsetof(struct pyccl_torch, s_layout), "layout"},
    {offsetof(struct pyccl_torch, s_dtype), "dtype"},
    {offsetof(struct pyccl_torch, s_is_contiguous), "is_contiguous"},
    {offsetof(struct pyccl_torch, s_numel), "numel"},
    {offsetof(struct pyccl_torch, s_get_device), "get_device"},
    {offsetof(struct pyccl_torch, s_data_ptr), "data_ptr"},
    {offsetof(struct pyccl_torch, s_cuda_stream), "cuda_stream"},
    {offsetof(struct pyccl_torch, s_device_index), "device_index"},
    {offsetof(struct pyccl_torch, s_itemsize), "itemsize"},
    {offsetof(struct pyccl_torch, s_device), "device"},
    {offsetof(struct pyccl_torch, s_cai), "__cuda_array_interface__"},
    {offsetof(struct pyccl_torch, s_shape), "shape"},
    {offsetof(struct pyccl_torch, s_typestr), "typestr"},
    {offsetof(struct pyccl_torch, s_data), "data"},
    {offsetof(struct pyccl_torch, s_strides), "strides"},
};

static PyObject **
interned_slot(struct pyccl_torch *t, size_t i)
{
    return (PyObject **)((char *)t + interned[i].off);
}

int
pyccl_torch_state_init(pyccl_state *st)
{
    struct pyccl_torch *t = st->torch = PyMem_Calloc(1, sizeof *t);
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < sizeof interned / sizeof interned[0]; i++) {
        if ((*interned_slot(t, i) = PyUnicode_InternFromString(interned[i].text)) == NULL) {
            return -1;
        }
    }
    return 0;
}

int
pyccl_torch_state_traverse(pyccl_state *st, visitproc visit, void *arg)
{
    if (st->torch != NULL) {
        Py_VISIT(st->torch->Tensor);
        Py_VISIT(st->torch->Stream);
    }
    return 0;
}

void
pyccl_torch_state_clear(pyccl_state *st)
{
    struct pyccl_torch *t = st->torch;
    if (t == NULL) {
        return;
    }
    t->closed = 1;
    t->torch_ready = 0;
    Py_CLEAR(t->Tensor);
    Py_CLEAR(t->Stream);
    Py_CLEAR(t->strided);
    Py_CLEAR(t->current_raw_stream);
    for (int i = 0; i < 3; i++) {
        Py_CLEAR(t->pack[i]);
    }
    for (int i = 0; i < PYCCL_NDTYPES; i++) {
        Py_CLEAR(t->dtypes[i]);
    }
    for (size_t i = 0; i < sizeof interned / sizeof interned[0]; i++) {
        Py_CLEAR(*interned_slot(t, i));
    }
}

void
pyccl_torch_state_free(pyccl_state *st)
{
    pyccl_torch_state_clear(st);
    PyMem_Free(st->torch);
    st->torch = NULL;
}

int
pyccl_torch_init(pyccl_state *st)
{
    if (st->torch->torch_ready) {
        return 0;
    }
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) {
        return -1;
    }
    PyObject *cuda = NULL, *tc = NULL;
    int rc = -1;
    Py_XSETREF(st->torch->Tensor, PyObject_GetAttrString(torch, "Tensor"));
    Py_XSETREF(st->torch->strided, PyObject_GetAttrString(torch, "strided"));
    cuda = PyImport_ImportModule("torch.cuda");
    if (st->torch->Tensor == NULL || st->torch->strided == NULL || cuda == NULL) {
        goto done;
    }
    Py_XSETREF(st->torch->Stream, PyObject_GetAttrString(cuda, "Stream"));
    if (st->torch->Stream == NULL) {
        goto done;
    }
    for (int i = 0; i < PYCCL_NDTYPES; i++) {
        /* Older torch lacks some dtypes: leave those rows NULL. */
        Py_XSETREF(st->torch->dtypes[i],
                   PyObject_GetAttrString(torch, pyccl_dtype_table[i].attr));
        if (st->torch->dtypes[i] == NULL) {
            PyErr_Clear();
        }
    }
    tc = PyObject_GetAttrString(torch, "_C");
    if (tc == NULL) {
        goto done;
    }
    /* Absent in CPU-only torch builds; only GPU work needs it. */
    Py_XSETREF(st->torch->current_raw_stream,
               PyObject_GetAttrString(tc, "_cuda_getCurrentRawStream"));
    if (st->torch->current_raw_stream == NULL) {
        PyErr_Clear();
    }
    st->torch->torch_ready = 1;
    rc = 0;
done:
    Py_XDECREF(tc);
    Py_XDECREF(cuda);
    Py_DECREF(torch);
    return rc;
}

int
pyccl_torch_pack(pyccl_state *st, PyObject **flatten, PyObject **unflatten, PyObject **copy)
{
    struct pyccl_torch *t = st->torch;
    if (t->pack[2] == NULL) {
        PyObject *torch = PyImport_ImportModule("torch");
        PyObject *tc = torch != NULL ? PyObject_GetAttrString(torch, "_C") : NULL;
        /* torch._C._nn: an attribute of the extension, not a module importable by name */
        PyObject *nn = tc != NULL ? PyObject_GetAttrString(tc, "_nn") : NULL;
        if (nn != NULL) {
            Py_XSETREF(t->pack[0], PyObject_GetAttrString(nn, "flatten_dense_tensors"));
            Py_XSETREF(t->pack[1], t->pack[0] != NULL
                                       ? PyObject_GetAttrString(nn, "unflatten_dense_tensors")
                                       : NULL);
            Py_XSETREF(t->pack[2], t->pack[1] != NULL
                                       ? PyObject_GetAttrString(torch, "_foreach_copy_")
                                       : NULL);
        }
        Py_XDECREF(nn);
        Py_XDECREF(tc);
        Py_XDECREF(torch);
        if (t->pack[2] == NULL) {
            return -1;
        }
    }
    *flatten = t->pack[0];
    *unflatten = t->pack[1];
    *copy = t->pack[2];
    return 0;
}

int
pyccl_is_tensor(pyccl_state *st, PyObject *obj)
{
    return PyObject_TypeCheck(obj, (PyTypeObject *)st->torch->Tensor);
}

static PyObject *
call0(PyObject *obj, PyObject *name)
{
    return PyObject_VectorcallMethod(
        name, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Read an int-returning method or attribute (for stream attributes, which
 * are torch's own); -1 on error with exception. */
static int
read_bool(PyObject *obj, PyObject *name, int method)
{
    PyObject *v = method ? call0(obj, name) : PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* ---- the reader: every attribute read is checked here ---- */

/* An attribute value that must be an int in [lo, hi]: TypeError when it is
 * no int, ValueError "<op>: <what><label> is V, expected <expect>" when it
 * is out of range.  The value's own __index__ may run (numpy ints). */
static int
checked_int(const char *op, const char *what, const char *label, PyObject *v,
            long long lo, long long hi, const char *expect, int64_t *out)
{
    PyObject *i = PyNumber_Index(v);
    if (i == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
            return -1; /* the object's own __index__ raised: keep that */
        }
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s%s returned %.200s, expected an int",
                     op, what, label, Py_TYPE(v)->tp_name);
        return -1;
    }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        Py_DECREF(i);
        return -1;
    }
    if (overflow || x < lo || x > hi) {
        PyErr_Format(PyExc_ValueError, "%s: %s%s is %S, expected %s", op, what,
                     label, i, expect);
        Py_DECREF(i);
        return -1;
    }
    Py_DECREF(i);
    *out = (int64_t)x;
    return 0;
}

/* checked_int of obj.name() (method) or obj.name. */
static int
read_checked(PyObject *obj, PyObject *name, int method, const char *op,
             const char *what, const char *label, long long lo, long long hi,
             const char *expect, int64_t *out)
{
    PyObject *v = method ? call0(obj, name) : PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    int rc = checked_int(op, what, label, v, lo, hi, expect, out);
    Py_DECREF(v);
    return rc;
}

int
pyccl_mul_size(const char *op, const char *what, int64_t a, int64_t b,
               const char *how, int64_t *out)
{
    if (__builtin_mul_overflow(a, b, out)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s has %lld elements; times %s %lld that overflows "
                     "a 64-bit count",
                     op, what, (long long)a, how, (long long)b);
        return -1;
    }
    return 0;
}

/* The checks every array passes, whichever way it was read: byte size
 * without overflow, a pointer when there are bytes, no wrap past the top of
 * the address space. */
static int
check_extent(const char *op, const char *what, pyccl_tensor *t)
{
    if (pyccl_mul_size(op, what, t->numel, t->itemsize, "the item size",
                       &t->nbytes) < 0) {
        return -1;
    }
    uintptr_t lo = (uintptr_t)t->ptr;
    if (t->nbytes > 0 && lo == 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s has a null data pointer", op,
                     what);
        return -1;
    }
    if (lo + (uintptr_t)t->nbytes < lo) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s (%lld bytes at %p) runs past the end of the "
                     "address space",
                     op, what, (long long)t->nbytes, (void *)lo);
        return -1;
    }
    return 0;
}

static int fill_tensor(pyccl_state *st, const char *op, const char *what,
                       PyObject *obj, PyObject *dtype, pyccl_tensor *t);

int
pyccl_check_tensor(pyccl_state *st, const char *op, const char *what,
                   PyObject *obj, PyObject **ref_dtype, pyccl_tensor *t)
{
    int is_cuda = read_bool(obj, st->torch->s_is_cuda, 0);
    if (is_cuda < 0) {
        return -1;
    }
    PyObject *layout = PyObject_GetAttr(obj, st->torch->s_layout);
    if (layout == NULL) {
        return -1;
    }
    int dense = layout == st->torch->strided;
    Py_DECREF(layout);
    if (!is_cuda || !dense) {
        PyErr_SetString(PyExc_RuntimeError,
                        "input and output elements have to be cuda dense Tensors");
        return -1;
    }
    PyObject *dtype = PyObject_GetAttr(obj, st->torch->s_dtype);
    if (dtype == NULL) {
        return -1;
    }
    /* The first dtype is kept (the caller releases it): a `dtype` property
     * may return a fresh object, which must outlive the comparisons. */
    if (*ref_dtype == NULL) {
        *ref_dtype = dtype;
    }
    else {
        int same = dtype == *ref_dtype;
        Py_DECREF(dtype);
        dtype = *ref_dtype;
        if (!same) {
            PyErr_SetString(PyExc_RuntimeError,
                            "all inputs and outputs must be of the same Tensor dtype");
            return -1;
        }
    }
    int contiguous = read_bool(obj, st->torch->s_is_contiguous, 1);
    if (contiguous < 0) {
        return -1;
    }
    if (!contiguous) {
        PyErr_SetString(PyExc_RuntimeError,
                        "all inputs and outputs have to be contiguous");
        return -1;
    }
    return fill_tensor(st, op, what, obj, dtype, t);
}

/* Read numel, device and data pointer, place the dtype in the table, and
 * check them all.  `dtype` is only borrowed for this call. */
static int
fill_tensor(pyccl_state *st, const char *op, const char *what, PyObject *obj,
            PyObject *dtype, pyccl_tensor *t)
{
    int64_t numel, device, ptr;
    if (read_checked(obj, st->torch->s_numel, 1, op, what, ".numel()", 0, INT64_MAX,
                     "0 or more", &numel) < 0 ||
        read_checked(obj, st->torch->s_get_device, 1, op, what, ".get_device()", 0,
                     INT_MAX, "a CUDA device index (0 to 2147483647)",
                     &device) < 0) {
        return -1;
    }
    /* an address is unsigned: read it as such */
    PyObject *pv = call0(obj, st->torch->s_data_ptr);
    if (pv == NULL) {
        return -1;
    }
    PyObject *pi = PyNumber_Index(pv);
    if (pi == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: %s.data_ptr() returned %.200s, expected an int",
                         op, what, Py_TYPE(pv)->tp_name);
        }
        Py_DECREF(pv);
        return -1;
    }
    Py_DECREF(pv);
    unsigned long long uptr = PyLong_AsUnsignedLongLong(pi);
    if (uptr == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError,
                     "%s: %s.data_ptr() is %S, expected an address (0 to 2**64-1)",
                     op, what, pi);
        Py_DECREF(pi);
        return -1;
    }
    Py_DECREF(pi);
    ptr = (int64_t)uptr;
    t->obj = obj;
    t->ptr = (char *)(uintptr_t)ptr;
    t->numel = numel;
    t->rows = -1;
    t->device = (int)device;
    t->dtype = -1;
    t->itemsize = 0;
    t->dtype_name[0] = '\0';
    for (int i = 0; i < PYCCL_NDTYPES; i++) {
        if (st->torch->dtypes[i] == dtype) {
            t->dtype = i;
            t->itemsize = pyccl_dtype_table[i].itemsize;
            break;
        }
    }
    if (t->dtype < 0) {
        /* A dtype newer than this table: its size still lets it move.  Its
         * name is copied for messages and comparisons: the object itself may
         * be gone when they are made. */
        int64_t isz;
        PyObject *iv;
        if (PyObject_GetOptionalAttr(dtype, st->torch->s_itemsize, &iv) < 0) {
            return -1;
        }
        if (iv == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s: %s.dtype is a %.200s, expected a torch.dtype "
                         "(or an object with an itemsize)",
                         op, what, Py_TYPE(dtype)->tp_name);
            return -1;
        }
        int rc = checked_int(op, what, ".dtype.itemsize", iv, 0, 16,
                             "1, 2, 4, 8 or 16", &isz);
        Py_DECREF(iv);
        if (rc < 0) {
            return -1;
        }
        if (isz == 0 || (isz & (isz - 1)) != 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s.dtype.itemsize is %lld, expected 1, 2, 4, 8 or 16",
                         op, what, (long long)isz);
            return -1;
        }
        t->itemsize = (int)isz;
        PyObject *s = PyObject_Str(dtype);
        if (s == NULL) {
            return -1;
        }
        Py_ssize_t len;
        const char *u = PyUnicode_AsUTF8AndSize(s, &len);
        if (u == NULL) {
            Py_DECREF(s);
            return -1;
        }
        if ((size_t)len >= sizeof t->dtype_name) {
            len = (Py_ssize_t)sizeof t->dtype_name - 1;
        }
        memcpy(t->dtype_name, u, (size_t)len);
        t->dtype_name[len] = '\0';
        Py_DECREF(s);
    }
    return check_extent(op, what, t);
}

PyObject *
pyccl_dtype_name(const pyccl_tensor *t)
{
    if (t->dtype < 0) {
        return PyUnicode_FromString(t->dtype_name);
    }
    return PyUnicode_FromFormat("torch.%s", pyccl_dtype_table[t->dtype].attr);
}

int
pyccl_reduce_type(pyccl_state *st, const char *op, const char *what,
                  const pyccl_tensor *t)
{
    if (t->dtype >= 0) {
        const pyccl_dtype_info *d = &pyccl_dtype_table[t->dtype];
        if (d->nccl >= 0) {
            if (st->api.nccl_version >= d->min_nccl_version) {
                return d->nccl;
            }
            PyErr_Format(PyExc_RuntimeError,
                         "%s: reducing torch.%s needs NCCL >= 2.24 with native "
                         "fp8 types; the loaded NCCL is version code %d",
                         op, d->attr, st->api.nccl_version);
            return -1;
        }
        if (strcmp(d->attr, "bool") == 0) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: cannot reduce torch.bool tensors (NCCL has no "
                         "boolean reduction); convert to torch.uint8 first",
                         op);
            return -1;
        }
    }
    if (what == NULL) {
        /* torch's text, so pyccl.nccl fails the way torch.cuda.nccl does */
        PyErr_Format(PyExc_RuntimeError, "Unconvertible NCCL type %s",
                     t->dtype >= 0 ? pyccl_dtype_table[t->dtype].scalar_name
                                   : t->dtype_name);
        return -1;
    }
    /* TypeError, as torch.distributed's NCCL backend raises for a dtype it
     * cannot reduce */
    PyObject *name = pyccl_dtype_name(t);
    if (name != NULL) {
        PyErr_Format(PyExc_TypeError,
                     "%s: %s has dtype %U, which NCCL cannot reduce (the "
                     "moves, such as broadcast and all_gather, take any dtype)",
                     op, what, name);
        Py_DECREF(name);
    }
    return -1;
}

void
pyccl_move_type(pyccl_state *st, const pyccl_tensor *t, int *type,
                size_t *count, size_t numel)
{
    if (t->dtype >= 0) {
        const pyccl_dtype_info *d = &pyccl_dtype_table[t->dtype];
        if (d->nccl >= 0 && st->api.nccl_version >= d->min_nccl_version) {
            *type = d->nccl;
            *count = numel;
            return;
        }
    }
    *type = ncclUint8;
    *count = numel * (size_t)t->itemsize;
}

int
pyccl_check_overlap(const char *op, const char *a_what, const pyccl_tensor *a,
                    const char *b_what, const pyccl_tensor *b,
                    int64_t offset, const char *slot)
{
    uintptr_t a_lo = (uintptr_t)a->ptr, b_lo = (uintptr_t)b->ptr;
    int64_t a_bytes = a->nbytes, b_bytes = b->nbytes;
    if (a_bytes == 0 || b_bytes == 0 || a_lo >= b_lo + (uintptr_t)b_bytes ||
        b_lo >= a_lo + (uintptr_t)a_bytes) {
        return 0; /* disjoint */
    }
    if (offset < 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s (%lld bytes at %p) overlaps %s "
                     "(%lld bytes at %p); %s",
                     op, a_what, (long long)a_bytes, (void *)a_lo, b_what,
                     (long long)b_bytes, (void *)b_lo, slot);
        return -1;
    }
    if (a_lo == b_lo + (uintptr_t)offset) {
        return 0; /* NCCL's in-place form */
    }
    PyErr_Format(PyExc_ValueError, "%s: %s (%lld bytes at %p) overlaps %s "
                 "(%lld bytes at %p) but is not %s; in place, %s must be the "
                 "%lld bytes at %p",
                 op, a_what, (long long)a_bytes, (void *)a_lo, b_what,
                 (long long)b_bytes, (void *)b_lo, slot, a_what,
                 (long long)a_bytes, (void *)(b_lo + (uintptr_t)offset));
    return -1;
}

/* A stream's attribute `name` (label ".cuda_stream" or ".device_index") as
 * an int in [lo, hi], hi -1 meaning 2**64-1.  A stream subclass's property
 * is user code: what it raises is passed on with a note naming op and the
 * attribute (PEP 678, where Python has it); a missing attribute, a value
 * that is no int or one out of range is TypeError / ValueError
 * "<op>: <what><label> ...". */
static int
read_stream_attr(PyObject *stream, PyObject *name, const char *op,
                 const char *what, const char *label, long long lo,
                 long long hi, const char *expect, int64_t *out)
{
    PyObject *v = PyObject_GetAttr(stream, name);
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: %s (a %.200s) has no attribute %s, which a "
                         "torch.cuda.Stream has",
                         op, what, Py_TYPE(stream)->tp_name, label + 1);
            return -1;
        }
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *note = PyUnicode_FromFormat("%s: raised while reading %s%s",
                                              op, what, label);
        if (note != NULL && value != NULL && PyObject_HasAttrString(value, "add_note")) {
            PyObject *r = PyObject_CallMethod(value, "add_note", "O", note);
            Py_XDECREF(r);
        }
        PyErr_Clear(); /* a note that cannot be added is no reason to lose the exception */
        Py_XDECREF(note);
        PyErr_Restore(type, value, tb);
        return -1;
    }
    PyObject *i = PyLong_Check(v) ? Py_NewRef(v) : NULL;
    if (i == NULL && !PyBool_Check(v) && PyIndex_Check(v)) {
        i = PyNumber_Index(v); /* numpy ints; their own __index__ may raise */
        if (i == NULL) {
            Py_DECREF(v);
            return -1;
        }
    }
    if (i == NULL || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "%s: %s%s is a %.200s, expected an int",
                     op, what, label, Py_TYPE(v)->tp_name);
        Py_XDECREF(i);
        Py_DECREF(v);
        return -1;
    }
    Py_DECREF(v);
    int bad;
    if (hi == -1) {
        unsigned long long u = PyLong_AsUnsignedLongLong(i);
        bad = u == (unsigned long long)-1 && PyErr_Occurred();
        if (bad) {
            PyErr_Clear(); /* negative or past 64 bits */
        }
        *out = (int64_t)u;
    }
    else {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
        bad = overflow || x < lo || x > hi;
        *out = (int64_t)x;
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError, "%s: %s%s is %S, expected %s", op, what,
                     label, i, expect);
    }
    Py_DECREF(i);
    return bad ? -1 : 0;
}

int
pyccl_stream(pyccl_state *st, const char *op, const char *what,
             PyObject *stream, int device, const char *owner,
             cudaStream_t *out)
{
    int64_t raw;
    if (stream == NULL || stream == Py_None) {
        if (st->torch->current_raw_stream == NULL) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: this torch build has no CUDA support", op);
            return -1;
        }
        PyObject *dev = PyLong_FromLong(device);
        if (dev == NULL) {
            return -1;
        }
        PyObject *v = PyObject_CallOneArg(st->torch->current_raw_stream, dev);
        Py_DECREF(dev);
        if (v == NULL) {
            return -1;
        }
        raw = PyLong_AsLongLong(v);
        Py_DECREF(v);
        if (raw == -1 && PyErr_Occurred()) {
            return -1;
        }
        *out = (cudaStream_t)(intptr_t)raw;
        return 0;
    }
    if (!PyObject_TypeCheck(stream, (PyTypeObject *)st->torch->Stream)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: %s must be a torch.cuda.Stream or None, got %.200s",
                     op, what, Py_TYPE(stream)->tp_name);
        return -1;
    }
    int64_t sdev;
    if (read_stream_attr(stream, st->torch->s_device_index, op, what, ".device_index",
                         0, INT32_MAX, "a CUDA device index (0 to 2147483647)",
                         &sdev) < 0) {
        return -1;
    }
    if (sdev != device) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s is a stream of cuda:%lld but %s is on cuda:%d",
                     op, what, (long long)sdev, owner, device);
        return -1;
    }
    if (read_stream_attr(stream, st->torch->s_cuda_stream, op, what, ".cuda_stream",
                         0, -1, "a CUDA stream handle (0 to 2**64-1)", &raw) < 0) {
        return -1;
    }
    *out = (cudaStream_t)(uintptr_t)(uint64_t)raw;
    return 0;
}

/* ---- the Communicator API's reader ---- */

/* __cuda_array_interface__ typestr -> table row (little-endian only). */
static int
typestr_row(const char *ts)
{
    static const struct {
        const char *ts;
        const char *attr;
    } map[] = {
        {"<f2", "float16"}, {"<f4", "float32"}, {"<f8", "float64"},
        {"|i1", "int8"},    {"|u1", "uint8"},   {"<i4", "int32"},
        {"<i8", "int64"},   {"<u4", "uint32"},  {"<u8", "uint64"},
        {"|b1", "bool"},    {"<i2", "int16"},   {"<u2", "uint16"},
        {"<c8", "complex64"}, {"<c16", "complex128"},
        {"|i1", "int8"},
    };
    const char *alt = ts;
    char buf[8];
    /* '=' is native order, which is little-endian on every CUDA host. */
    if (ts[0] == '=' && strlen(ts) < sizeof buf) {
        buf[0] = '<';
        strcpy(buf + 1, ts + 1);
        alt = buf;
    }
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        if (strcmp(map[i].ts, alt) == 0 ||
            (alt[0] == '<' && map[i].ts[0] == '|' && strcmp(map[i].ts + 1, alt + 1) == 0)) {
            for (int r = 0; r < PYCCL_NDTYPES; r++) {
                if (strcmp(pyccl_dtype_table[r].attr, map[i].attr) == 0) {
                    return r;
                }
            }
        }
    }
    return -1;
}

static int
malformed(const char *op, const char *what, const char *key)
{
    PyErr_Format(PyExc_TypeError,
                 "%s: %s has a malformed __cuda_array_interface__ (%s)", op,
                 what, key);
    return -1;
}

/* cai[key] as a new reference (NULL: absent, or an error is set).  Held
 * because a later lookup may run a hostile key's __eq__, which can change
 * the dict. */
static PyObject *
cai_get(PyObject *cai, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(cai, key);
    Py_XINCREF(v);
    return v;
}

static int
read_cai_items(pyccl_state *st, const char *op, const char *what, PyObject *obj,
               PyObject *shape, PyObject *typestr, PyObject *data,
               PyObject *strides, PyObject *mask, pyccl_tensor *t);

static int
read_cai(pyccl_state *st, const char *op, const char *what, PyObject *obj,
         PyObject *cai, pyccl_tensor *t)
{
    PyObject *shape = NULL, *typestr = NULL, *data = NULL, *strides = NULL,
             *mask = NULL, *mask_key = NULL;
    int rc = -1;
    if (!PyDict_Check(cai) ||
        (shape = cai_get(cai, st->torch->s_shape)) == NULL ||
        (typestr = cai_get(cai, st->torch->s_typestr)) == NULL ||
        (data = cai_get(cai, st->torch->s_data)) == NULL ||
        ((strides = cai_get(cai, st->torch->s_strides)) == NULL && PyErr_Occurred()) ||
        (mask_key = PyUnicode_FromString("mask")) == NULL ||
        ((mask = cai_get(cai, mask_key)) == NULL && PyErr_Occurred()) ||
        !PyTuple_Check(shape) || !PyUnicode_Check(typestr) ||
        !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError,
                         "%s: %s has a malformed __cuda_array_interface__",
                         op, what);
        }
        goto done;
    }
    rc = read_cai_items(st, op, what, obj, shape, typestr, data, strides, mask,
                        t);
done:
    Py_XDECREF(shape);
    Py_XDECREF(typestr);
    Py_XDECREF(data);
    Py_XDECREF(strides);
    Py_XDECREF(mask);
    Py_XDECREF(mask_key);
    return rc;
}

/* read_cai's checks, on the items it took out of the dict (held). */
static int
read_cai_items(pyccl_state *st, const char *op, const char *what, PyObject *obj,
               PyObject *shape, PyObject *typestr, PyObject *data,
               PyObject *strides, PyObject *mask, pyccl_tensor *t)
{
    const char *ts = PyUnicode_AsUTF8(typestr);
    if (ts == NULL) {
        return -1;
    }
    int row = typestr_row(ts);
    if (row < 0) {
        PyErr_Format(PyExc_TypeError, "%s: %s has element type '%s', which "
                     "pyccl cannot map to a torch dtype", op, what, ts);
        return -1;
    }
    int64_t numel = 1;
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *item = PyTuple_GET_ITEM(shape, i);
        if (!PyLong_Check(item)) {
            return malformed(op, what, "shape");
        }
        int overflow;
        long long d = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (d == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow || d < 0 || (d > 0 && numel > INT64_MAX / d)) {
            PyErr_Format(PyExc_ValueError, "%s: %s has an invalid shape %R",
                         op, what, shape);
            return -1;
        }
        numel *= d;
    }
    int itemsize = pyccl_dtype_table[row].itemsize;
    int64_t nbytes;
    if (pyccl_mul_size(op, what, numel, itemsize, "the item size", &nbytes) < 0) {
        return -1;
    }
    if (strides != NULL && strides != Py_None &&
        (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != nd)) {
        return malformed(op, what, "strides");
    }
    for (Py_ssize_t i = 0; strides != NULL && strides != Py_None && i < nd; i++) {
        if (!PyLong_Check(PyTuple_GET_ITEM(strides, i))) {
            return malformed(op, what, "strides");
        }
    }
    if (strides != NULL && strides != Py_None && numel > 1) {
        /* C-contiguous means each stride is the product of later dims. */
        int64_t expect = itemsize;
        for (Py_ssize_t i = nd - 1; i >= 0; i--) {
            int overflow;
            long long dim = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
            long long s = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(strides, i),
                                                       &overflow);
            if (PyErr_Occurred()) {
                return -1;
            }
            if (dim != 1 && (overflow || s != expect)) {
                PyErr_Format(PyExc_ValueError, "%s: %s must be contiguous",
                             op, what);
                return -1;
            }
            expect *= dim;
        }
    }
    if (mask != NULL && mask != Py_None) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s is a masked array (its __cuda_array_interface__ "
                     "has a mask), which NCCL cannot honour", op, what);
        return -1;
    }
    PyObject *ptr_obj = PyTuple_GET_ITEM(data, 0);
    if (!PyLong_Check(ptr_obj)) {
        return malformed(op, what, "data");
    }
    unsigned long long ptr = PyLong_AsUnsignedLongLong(ptr_obj);
    if (ptr == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* negative or past 64 bits: no address */
        return malformed(op, what, "data");
    }
    if (ptr == 0 && numel > 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s has a null data pointer", op,
                     what);
        return -1;
    }
    int device = -1;
    if (ptr != 0) {
        if (pyccl_load(st, op) < 0) {
            return -1;
        }
        struct cudaPointerAttributes attr;
        cudaError_t e = st->api.cudaPointerGetAttributes(&attr, (void *)(uintptr_t)ptr);
        if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
            st->api.cudaGetLastError();
            PyErr_Format(PyExc_ValueError,
                         "%s: %s must be in CUDA device memory", op, what);
            return -1;
        }
        device = attr.device;
    }
    t->obj = obj;
    t->ptr = (char *)(uintptr_t)ptr;
    t->numel = numel;
    t->rows = nd > 0 ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0)) : 1;
    t->device = device;
    t->dtype = row;
    t->itemsize = itemsize;
    t->dtype_name[0] = '\0';
    return check_extent(op, what, t);
}

int
pyccl_read_array(pyccl_state *st, const char *op, const char *what,
                 PyObject *obj, pyccl_tensor *t)
{
    if (!pyccl_is_tensor(st, obj)) {
        PyObject *cai;
        if (PyObject_GetOptionalAttr(obj, st->torch->s_cai, &cai) < 0) {
            return -1;
        }
        if (cai == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s: %s must be a torch.Tensor or an array with "
                         "__cuda_array_interface__, got %.200s",
                         op, what, Py_TYPE(obj)->tp_name);
            return -1;
        }
        int rc = read_cai(st, op, what, obj, cai, t);
        Py_DECREF(cai);
        return rc;
    }
    int is_cuda = read_bool(obj, st->torch->s_is_cuda, 0);
    if (is_cuda < 0) {
        return -1;
    }
    if (!is_cuda) {
        PyObject *dev;
        if (PyObject_GetOptionalAttr(obj, st->torch->s_device, &dev) < 0) {
            return -1;
        }
        if (dev == NULL) { /* a tensor-like without .device */
            PyErr_Format(PyExc_ValueError,
                         "%s: %s must be a CUDA tensor, got one whose is_cuda "
                         "is false", op, what);
            return -1;
        }
        PyErr_Format(PyExc_ValueError,
                     "%s: %s must be a CUDA tensor, got one on %S", op, what,
                     dev);
        Py_DECREF(dev);
        return -1;
    }
    PyObject *layout = PyObject_GetAttr(obj, st->torch->s_layout);
    if (layout == NULL) {
        return -1;
    }
    if (layout != st->torch->strided) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s must be a dense (strided) tensor, got layout %S",
                     op, what, layout);
        Py_DECREF(layout);
        return -1;
    }
    Py_DECREF(layout);
    int contiguous = read_bool(obj, st->torch->s_is_contiguous, 1);
    if (contiguous < 0) {
        return -1;
    }
    if (!contiguous) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be contiguous", op, what);
        return -1;
    }
    PyObject *dtype = PyObject_GetAttr(obj, st->torch->s_dtype);
    if (dtype == NULL) {
        return -1;
    }
    /* held while it is read: a `dtype` property may return a fresh object */
    int rc = fill_tensor(st, op, what, obj, dtype, t);
    Py_DECREF(dtype);
    return rc;
}

/* st once the module can do GPU work: torch looked up; NULL with
 * RuntimeError once the interpreter tears the module down. */
pyccl_state *
pyccl_state_ready(pyccl_state *st)
{
    if (st != NULL && st->torch->closed) { /* torn down at interpreter exit */
        PyErr_SetString(PyExc_RuntimeError, "pyccl: the interpreter is shutting down");
        return NULL;
    }
    if (st != NULL && pyccl_torch_init(st) < 0) {
        return NULL;
    }
    return st;
}

pyccl_state *
pyccl_state_of_type(PyTypeObject *tp)
{
    return pyccl_state_ready(PyType_GetModuleState(tp));
}
