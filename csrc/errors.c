/* Turning NCCL and CUDA result codes into Python exceptions.
 *
 * One place builds each exception, so every failure carries the same
 * attributes: NcclError has .code, .error_string (ncclGetErrorString) and
 * .last_error (ncclGetLastError, NCCL's own explanation); CudaError has .code
 * and .error_string.  Both subclass RuntimeError, which is what torch raises. */
#include "pyccl.h"

static void
raise_with_attrs(PyObject *type, PyObject *msg, int code, const char *errstr,
                 const char *last, int with_last)
{
    PyObject *exc = NULL, *v = NULL;
    if (msg == NULL) {
        return;
    }
    exc = PyObject_CallOneArg(type, msg);
    if (exc == NULL) {
        goto done;
    }
    v = PyLong_FromLong(code);
    if (v == NULL || PyObject_SetAttrString(exc, "code", v) < 0) {
        goto done;
    }
    Py_SETREF(v, PyUnicode_FromString(errstr ? errstr : ""));
    if (v == NULL || PyObject_SetAttrString(exc, "error_string", v) < 0) {
        goto done;
    }
    if (with_last) {
        Py_SETREF(v, PyUnicode_FromString(last ? last : ""));
        if (v == NULL || PyObject_SetAttrString(exc, "last_error", v) < 0) {
            goto done;
        }
    }
    PyErr_SetObject(type, exc);
done:
    Py_XDECREF(v);
    Py_XDECREF(exc);
    Py_DECREF(msg);
}

void
pyccl_raise_nccl(pyccl_state *st, const char *op, ncclResult_t res,
                 const char *last)
{
    const char *errstr = st->api.ncclGetErrorString
                             ? st->api.ncclGetErrorString(res)
                             : "unknown";
    PyObject *msg;
    if (last && last[0]) {
        msg = PyUnicode_FromFormat("%s: NCCL error %d (%s): %s", op, (int)res,
                                   errstr, last);
    }
    else {
        msg = PyUnicode_FromFormat("%s: NCCL error %d (%s)", op, (int)res,
                                   errstr);
    }
    raise_with_attrs(st->NcclError, msg, (int)res, errstr, last, 1);
}

void
pyccl_raise_cuda(pyccl_state *st, const char *op, const char *call,
                 cudaError_t err)
{
    const char *errstr = st->api.cudaGetErrorString
                             ? st->api.cudaGetErrorString(err)
                             : "unknown";
    PyObject *msg = PyUnicode_FromFormat("%s: %s failed: CUDA error %d (%s)",
                                         op, call, (int)err, errstr);
    raise_with_attrs(st->CudaError, msg, (int)err, errstr, NULL, 0);
}
