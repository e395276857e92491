/* Argument readers (see args.h): one place reads a bounded int, a unique
 * id, or fast-call keywords, so every binding words the same mistake the same
 * way. */
#include "args.h"

#include <string.h>

int
pyccl_parse_args(const char *op, PyObject *const *args, Py_ssize_t nargs,
                 PyObject *kwnames, const char *const *names, int nnames,
                 int npos, int nreq, PyObject **out)
{
    memset(out, 0, sizeof(PyObject *) * (size_t)nnames);
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError,
                     "%s() takes at most %d positional arguments (%zd given)",
                     op, npos, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = args[i];
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < nnames && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) {
            j++;
        }
        if (j == nnames) {
            PyErr_Format(PyExc_TypeError,
                         "%s() got an unexpected keyword argument '%U'", op, key);
            return -1;
        }
        if (out[j] != NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s() got multiple values for argument '%s'", op,
                         names[j]);
            return -1;
        }
        out[j] = args[nargs + k];
    }
    for (int j = 0; j < nreq; j++) {
        if (out[j] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'",
                         op, names[j]);
            return -1;
        }
    }
    return 0;
}

int
pyccl_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)",
                     name, want, nargs);
        return -1;
    }
    return 0;
}

int
pyccl_read_bounded(const char *op, const char *what, PyObject *obj, long lo,
                   long hi, int *out)
{
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int, got %.200s", op,
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow;
    long v = PyLong_AsLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow < 0 || (!overflow && v < lo)) {
        return PYCCL_BELOW;
    }
    if (overflow > 0 || v > hi) {
        return PYCCL_ABOVE;
    }
    *out = (int)v;
    return 0;
}

int
pyccl_read_int(const char *op, const char *what, PyObject *obj, int *out)
{
    int r = pyccl_read_bounded(op, what, obj, INT32_MIN, INT32_MAX, out);
    if (r > 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s=%S is out of range", op, what,
                     obj);
        return -1;
    }
    return r;
}

int
pyccl_read_unique_id(const char *op, PyObject *uid, ncclUniqueId *out)
{
    Py_buffer view;
    if (!PyObject_CheckBuffer(uid) || PyUnicode_Check(uid)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: unique_id must be bytes (from unique_id()), got %.200s",
                     op, Py_TYPE(uid)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(uid, &view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (view.len != NCCL_UNIQUE_ID_BYTES) {
        /* torch's text (without torch's SystemError on Python >= 3.10) */
        PyErr_Format(PyExc_RuntimeError,
                     "invalid unique_id (expected %d bytes, got %zd)",
                     NCCL_UNIQUE_ID_BYTES, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy(out->internal, view.buf, NCCL_UNIQUE_ID_BYTES);
    PyBuffer_Release(&view);
    return 0;
}
