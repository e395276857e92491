/* Reading torch tensors and streams through their Python-level protocol.
 *
 * pyccl does not link libtorch, so a tensor is read with the attributes any
 * Python code would use (is_cuda, layout, dtype, is_contiguous(), numel(),
 * get_device(), data_ptr()) through interned names and vectorcall; dtypes are
 * compared by identity with the torch.dtype objects looked up once.  The
 * checks and their texts follow torch.cuda.nccl, since pyccl.nccl must fail
 * the way torch does. */
#include "pyccl.h"

#include <string.h>

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

int
pyccl_torch_init(pyccl_state *st)
{
    if (st->torch_ready) {
        return 0;
    }
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) {
        return -1;
    }
    PyObject *cuda = NULL, *tc = NULL;
    int rc = -1;
    Py_XSETREF(st->Tensor, PyObject_GetAttrString(torch, "Tensor"));
    Py_XSETREF(st->strided, PyObject_GetAttrString(torch, "strided"));
    cuda = PyImport_ImportModule("torch.cuda");
    if (st->Tensor == NULL || st->strided == NULL || cuda == NULL) {
        goto done;
    }
    Py_XSETREF(st->Stream, PyObject_GetAttrString(cuda, "Stream"));
    if (st->Stream == NULL) {
        goto done;
    }
    for (int i = 0; i < PYCCL_NDTYPES; i++) {
        /* Older torch lacks some dtypes: leave those rows NULL. */
        Py_XSETREF(st->dtypes[i],
                   PyObject_GetAttrString(torch, pyccl_dtype_table[i].attr));
        if (st->dtypes[i] == NULL) {
            PyErr_Clear();
        }
    }
    tc = PyObject_GetAttrString(torch, "_C");
    if (tc == NULL) {
        goto done;
    }
    /* Absent in CPU-only torch builds; only GPU work needs it. */
    Py_XSETREF(st->current_raw_stream,
               PyObject_GetAttrString(tc, "_cuda_getCurrentRawStream"));
    if (st->current_raw_stream == NULL) {
        PyErr_Clear();
    }
    st->torch_ready = 1;
    rc = 0;
done:
    Py_XDECREF(tc);
    Py_XDECREF(cuda);
    Py_DECREF(torch);
    return rc;
}

int
pyccl_is_tensor(pyccl_state *st, PyObject *obj)
{
    return PyObject_TypeCheck(obj, (PyTypeObject *)st->Tensor);
}

static PyObject *
call0(PyObject *obj, PyObject *name)
{
    return PyObject_VectorcallMethod(
        name, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Read an int-returning method or attribute; -1 on error with exception. */
static int
read_i64(PyObject *obj, PyObject *name, int method, int64_t *out)
{
    PyObject *v = method ? call0(obj, name) : PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)x;
    return 0;
}

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

static int fill_tensor(pyccl_state *st, PyObject *obj, PyObject *dtype,
                       pyccl_tensor *t);

int
pyccl_check_tensor(pyccl_state *st, PyObject *obj, PyObject **ref_dtype,
                   pyccl_tensor *t)
{
    int is_cuda = read_bool(obj, st->s_is_cuda, 0);
    if (is_cuda < 0) {
        return -1;
    }
    PyObject *layout = PyObject_GetAttr(obj, st->s_layout);
    if (layout == NULL) {
        return -1;
    }
    int dense = layout == st->strided;
    Py_DECREF(layout);
    if (!is_cuda || !dense) {
        PyErr_SetString(PyExc_RuntimeError,
                        "input and output elements have to be cuda dense Tensors");
        return -1;
    }
    PyObject *dtype = PyObject_GetAttr(obj, st->s_dtype);
    if (dtype == NULL) {
        return -1;
    }
    /* dtype objects are singletons; the reference keeps this one alive. */
    Py_DECREF(dtype);
    if (*ref_dtype == NULL) {
        *ref_dtype = dtype;
    }
    else if (dtype != *ref_dtype) {
        PyErr_SetString(PyExc_RuntimeError,
                        "all inputs and outputs must be of the same Tensor dtype");
        return -1;
    }
    int contiguous = read_bool(obj, st->s_is_contiguous, 1);
    if (contiguous < 0) {
        return -1;
    }
    if (!contiguous) {
        PyErr_SetString(PyExc_RuntimeError,
                        "all inputs and outputs have to be contiguous");
        return -1;
    }
    return fill_tensor(st, obj, dtype, t);
}

/* Read numel, device and data pointer, and place the dtype in the table. */
static int
fill_tensor(pyccl_state *st, PyObject *obj, PyObject *dtype, pyccl_tensor *t)
{
    int64_t numel, device, ptr;
    if (read_i64(obj, st->s_numel, 1, &numel) < 0 ||
        read_i64(obj, st->s_get_device, 1, &device) < 0 ||
        read_i64(obj, st->s_data_ptr, 1, &ptr) < 0) {
        return -1;
    }
    t->obj = obj;
    t->ptr = (char *)(intptr_t)ptr;
    t->numel = numel;
    t->device = (int)device;
    t->dtype_obj = dtype;
    t->dtype = -1;
    t->itemsize = 0;
    for (int i = 0; i < PYCCL_NDTYPES; i++) {
        if (st->dtypes[i] == dtype) {
            t->dtype = i;
            t->itemsize = pyccl_dtype_table[i].itemsize;
            break;
        }
    }
    if (t->dtype < 0) {
        /* A dtype newer than this table: its size still lets it move. */
        int64_t isz;
        if (read_i64(dtype, st->s_itemsize, 0, &isz) < 0) {
            return -1;
        }
        t->itemsize = (int)isz;
    }
    return 0;
}

PyObject *
pyccl_dtype_str(PyObject *dtype_obj)
{
    return PyObject_Str(dtype_obj);
}

PyObject *
pyccl_dtype_name(const pyccl_tensor *t)
{
    if (t->dtype_obj != NULL) {
        return PyObject_Str(t->dtype_obj);
    }
    return PyUnicode_FromFormat("torch.%s", pyccl_dtype_table[t->dtype].attr);
}

int
pyccl_reduce_type(pyccl_state *st, const char *op, const pyccl_tensor *t)
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
        /* torch's text, so pyccl.nccl fails the way torch.cuda.nccl does */
        PyErr_Format(PyExc_RuntimeError, "Unconvertible NCCL type %s",
                     d->scalar_name);
        return -1;
    }
    PyObject *s = pyccl_dtype_str(t->dtype_obj);
    if (s != NULL) {
        PyErr_Format(PyExc_RuntimeError, "Unconvertible NCCL type %U", s);
        Py_DECREF(s);
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
    int64_t a_bytes = a->numel * a->itemsize, b_bytes = b->numel * b->itemsize;
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

int
pyccl_stream(pyccl_state *st, const char *op, const char *what,
             PyObject *stream, int device, const char *owner,
             cudaStream_t *out)
{
    int64_t raw;
    if (stream == NULL || stream == Py_None) {
        if (st->current_raw_stream == NULL) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: this torch build has no CUDA support", op);
            return -1;
        }
        PyObject *dev = PyLong_FromLong(device);
        if (dev == NULL) {
            return -1;
        }
        PyObject *v = PyObject_CallOneArg(st->current_raw_stream, dev);
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
    if (!PyObject_TypeCheck(stream, (PyTypeObject *)st->Stream)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: %s must be a torch.cuda.Stream or None, got %.200s",
                     op, what, Py_TYPE(stream)->tp_name);
        return -1;
    }
    int64_t sdev;
    if (read_i64(stream, st->s_device_index, 0, &sdev) < 0) {
        return -1;
    }
    if (sdev != device) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s is a stream of cuda:%lld but %s is on cuda:%d",
                     op, what, (long long)sdev, owner, device);
        return -1;
    }
    if (read_i64(stream, st->s_cuda_stream, 0, &raw) < 0) {
        return -1;
    }
    *out = (cudaStream_t)(intptr_t)raw;
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

static int
read_cai(pyccl_state *st, const char *op, const char *what, PyObject *obj,
         PyObject *cai, pyccl_tensor *t)
{
    PyObject *shape, *typestr, *data, *strides;
    if (!PyDict_Check(cai) ||
        (shape = PyDict_GetItemWithError(cai, st->s_shape)) == NULL ||
        (typestr = PyDict_GetItemWithError(cai, st->s_typestr)) == NULL ||
        (data = PyDict_GetItemWithError(cai, st->s_data)) == NULL ||
        !PyTuple_Check(shape) || !PyUnicode_Check(typestr) ||
        !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError,
                         "%s: %s has a malformed __cuda_array_interface__",
                         op, what);
        }
        return -1;
    }
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
    strides = PyDict_GetItemWithError(cai, st->s_strides);
    if (strides == NULL && PyErr_Occurred()) {
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
    PyObject *mask = PyDict_GetItemString(cai, "mask");
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
    t->device = device;
    t->dtype = row;
    t->dtype_obj = st->dtypes[row];
    t->itemsize = itemsize;
    return 0;
}

int
pyccl_read_array(pyccl_state *st, const char *op, const char *what,
                 PyObject *obj, pyccl_tensor *t)
{
    if (!pyccl_is_tensor(st, obj)) {
        PyObject *cai;
        if (PyObject_GetOptionalAttr(obj, st->s_cai, &cai) < 0) {
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
    int is_cuda = read_bool(obj, st->s_is_cuda, 0);
    if (is_cuda < 0) {
        return -1;
    }
    if (!is_cuda) {
        PyObject *dev = PyObject_GetAttrString(obj, "device");
        if (dev != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s must be a CUDA tensor, got one on %S", op,
                         what, dev);
            Py_DECREF(dev);
        }
        return -1;
    }
    PyObject *layout = PyObject_GetAttr(obj, st->s_layout);
    if (layout == NULL) {
        return -1;
    }
    if (layout != st->strided) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s must be a dense (strided) tensor, got layout %S",
                     op, what, layout);
        Py_DECREF(layout);
        return -1;
    }
    Py_DECREF(layout);
    int contiguous = read_bool(obj, st->s_is_contiguous, 1);
    if (contiguous < 0) {
        return -1;
    }
    if (!contiguous) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be contiguous", op, what);
        return -1;
    }
    PyObject *dtype = PyObject_GetAttr(obj, st->s_dtype);
    if (dtype == NULL) {
        return -1;
    }
    Py_DECREF(dtype); /* dtype objects are immortal singletons of torch */
    return fill_tensor(st, obj, dtype, t);
}
