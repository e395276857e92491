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
pyccl_stream(pyccl_state *st, const char *op, const char *what,
             PyObject *stream, int device, cudaStream_t *out)
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
                     "%s: %s is a stream of cuda:%lld but its tensor is on "
                     "cuda:%d",
                     op, what, (long long)sdev, device);
        return -1;
    }
    if (read_i64(stream, st->s_cuda_stream, 0, &raw) < 0) {
        return -1;
    }
    *out = (cudaStream_t)(intptr_t)raw;
    return 0;
}
