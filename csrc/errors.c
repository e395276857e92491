/* Turning NCCL and CUDA result codes into Python exceptions.
 *
 * One place builds each exception, so every failure carries the same
 * attributes: NcclError has .code, .error_string (ncclGetErrorString) and
 * .last_error (ncclGetLastError, NCCL's own explanation); CudaError has .code
 * and .error_string.  Both subclass RuntimeError, which is what torch raises.
 * NcclTimeoutError (a communicator created with timeout= gave up on its
 * peers) is an NcclError and also a TimeoutError; it adds .timeout.  Notes
 * that are no errors go to the "pyccl" logger (pyccl_log). */
#include "errors.h"

#include <stdarg.h>
#include <string.h>

/* An exception instance of `type` with the attributes; steals msg. */
static PyObject *
make_with_attrs(PyObject *type, PyObject *msg, int code, const char *errstr,
                const char *last, int with_last)
{
    PyObject *exc = NULL, *v = NULL;
    if (msg == NULL) {
        return NULL;
    }
    exc = PyObject_CallOneArg(type, msg);
    if (exc == NULL) {
        goto fail;
    }
    v = PyLong_FromLong(code);
    if (v == NULL || PyObject_SetAttrString(exc, "code", v) < 0) {
        goto fail;
    }
    Py_SETREF(v, PyUnicode_FromString(errstr ? errstr : ""));
    if (v == NULL || PyObject_SetAttrString(exc, "error_string", v) < 0) {
        goto fail;
    }
    if (with_last) {
        Py_SETREF(v, PyUnicode_FromString(last ? last : ""));
        if (v == NULL || PyObject_SetAttrString(exc, "last_error", v) < 0) {
            goto fail;
        }
    }
    Py_XDECREF(v);
    Py_DECREF(msg);
    return exc;
fail:
    Py_XDECREF(v);
    Py_XDECREF(exc);
    Py_DECREF(msg);
    return NULL;
}

static void
raise_with_attrs(PyObject *type, PyObject *msg, int code, const char *errstr,
                 const char *last, int with_last)
{
    PyObject *exc = make_with_attrs(type, msg, code, errstr, last, with_last);
    if (exc != NULL) {
        PyErr_SetObject(type, exc);
        Py_DECREF(exc);
    }
}

int
pyccl_nccl_failed(const pyccl_api *a, ncclResult_t r, ncclComm_t comm,
                  char *last, size_t size)
{
    if (r == ncclSuccess) {
        return 0;
    }
    if (a->ncclGetLastError != NULL && size > 0) {
        strncpy(last, a->ncclGetLastError(comm), size - 1);
        last[size - 1] = '\0';
    }
    return 1;
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

int
pyccl_raise_mixed_group(pyccl_state *st, const char *op)
{
    /* NCCL's code where NCCL would (or might) refuse it */
    ncclResult_t res = ncclInvalidArgument;
    const char *errstr = st->api.ncclGetErrorString ? st->api.ncclGetErrorString(res) : "unknown";
    PyObject *msg = PyUnicode_FromFormat("%s: one pyccl.group() cannot mix communicators with "
                                         "and without a timeout (NCCL's non-blocking and "
                                         "blocking kinds); this call was not enqueued", op);
    if (msg != NULL) {
        raise_with_attrs(st->NcclError, msg, (int)res, errstr, NULL, 0);
    }
    return -1;
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

int
pyccl_raise_not_ready(const char *op)
{
    PyErr_Format(PyExc_RuntimeError,
                 "%s: the communicator is not ready: it was created inside "
                 "pyccl.group(), which has not ended yet", op);
    return -1;
}

static pid_t this_pid; /* 0 until pyccl_pid_init */

static void
pid_in_child(void)
{
    __atomic_store_n(&this_pid, getpid(), __ATOMIC_RELAXED);
}

static void
pid_register(void)
{
    /* without the handler (no memory for it) the id stays 0: pyccl_pid()
     * asks getpid() every time, as it must */
    if (pthread_atfork(NULL, NULL, pid_in_child) == 0) {
        pid_in_child();
    }
}

void
pyccl_pid_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, pid_register);
}

pid_t
pyccl_pid(void)
{
    pid_t p = __atomic_load_n(&this_pid, __ATOMIC_RELAXED);
    return p != 0 ? p : getpid();
}

int
pyccl_raise_forked(const char *op, const pyccl_comm *c)
{
    if (c->pid == pyccl_pid()) {
        return 0;
    }
    PyErr_Format(PyExc_RuntimeError,
                 "%s: the communicator (rank %d of %d) was made by process %d; this process "
                 "(%d) is a child made by fork(), where it cannot be used (NCCL's state does "
                 "not survive a fork): drop it, and make a new one here",
                 op, c->rank, c->size, (int)c->pid, (int)getpid());
    return -1;
}

int
pyccl_raise_abort_in_group(const pyccl_comm *c)
{
    PyErr_Format(PyExc_RuntimeError,
                 "abort: the communicator (rank %d of %d) was used inside "
                 "a pyccl.group() that has not ended; end the group first",
                 c->rank, c->size);
    return -1;
}

int
pyccl_raise_other_group(const char *op, const pyccl_comm *c)
{
    PyErr_Format(PyExc_RuntimeError,
                 "%s: the communicator (rank %d of %d) is in a pyccl.group() open on another "
                 "thread (NCCL takes a communicator's calls from one thread's group at a "
                 "time); end that group first",
                 op, c->rank, c->size);
    return -1;
}

int
pyccl_comm_usable(const pyccl_comm *c, pid_t me)
{
    /* destroy() begun (call.c) counts as done for every other caller */
    return c->pid == me && !c->pending && c->comm != NULL && c->life == PYCCL_LIFE_USABLE;
}

int
pyccl_raise_unusable(const char *op, const pyccl_comm *c)
{
    if (pyccl_comm_usable(c, pyccl_pid())) {
        return 0;
    }
    if (pyccl_raise_forked(op, c) < 0) {
        return -1;
    }
    if (c->pending) {
        return pyccl_raise_not_ready(op);
    }
    PyErr_Format(PyExc_RuntimeError, "%s: the communicator (rank %d of %d) has been destroyed",
                 op, c->rank, c->size);
    return -1;
}

PyObject *
pyccl_failure_exception(pyccl_state *st, const char *op, int kind, int code,
                        const char *reason, double timeout)
{
    /* The reason names the call that failed; a later call names itself too. */
    size_t n = strlen(op);
    PyObject *msg = strncmp(reason, op, n) == 0 && reason[n] == ':'
                        ? PyUnicode_FromString(reason)
                        : PyUnicode_FromFormat("%s: %s", op, reason);
    const pyccl_api *a = &st->api;
    if (st->NcclTimeoutError == NULL) { /* torn down at interpreter exit */
        Py_XDECREF(msg);
        PyErr_SetString(PyExc_RuntimeError,
                        "pyccl: the interpreter is shutting down");
        return NULL;
    }
    switch (kind) {
    case PYCCL_FAIL_TIMEOUT: {
        PyObject *exc = make_with_attrs(
            st->NcclTimeoutError, msg, ncclInProgress,
            a->ncclGetErrorString ? a->ncclGetErrorString(ncclInProgress) : "",
            "", 1);
        PyObject *t = exc ? PyFloat_FromDouble(timeout) : NULL;
        if (t == NULL || PyObject_SetAttrString(exc, "timeout", t) < 0) {
            Py_CLEAR(exc);
        }
        Py_XDECREF(t);
        return exc;
    }
    case PYCCL_FAIL_NCCL:
        return make_with_attrs(
            st->NcclError, msg, code,
            a->ncclGetErrorString ? a->ncclGetErrorString((ncclResult_t)code)
                                  : "",
            "", 1);
    case PYCCL_FAIL_CUDA:
        return make_with_attrs(
            st->CudaError, msg, code,
            a->cudaGetErrorString ? a->cudaGetErrorString((cudaError_t)code)
                                  : "",
            NULL, 0);
    default:
        if (msg == NULL) {
            return NULL;
        }
        PyObject *exc = PyObject_CallOneArg(PyExc_RuntimeError, msg);
        Py_DECREF(msg);
        return exc;
    }
}

/* "5.0", "0.25": seconds as a person would write them (as Python prints a
 * float), the same in every timeout message. */
pyccl_secs_text
pyccl_secs(double s)
{
    pyccl_secs_text t;
    snprintf(t.s, sizeof t.s, "%.1f", s);
    /* else the shortest digits that give s back, as Python's repr */
    for (int digits = 1; digits <= 17 && strtod(t.s, NULL) != s; digits++) {
        snprintf(t.s, sizeof t.s, "%.*g", digits, s);
    }
    return t;
}

int
pyccl_raise_failure(pyccl_state *st, const char *op, int kind, int code,
                    const char *reason, double timeout)
{
    PyObject *exc = pyccl_failure_exception(st, op, kind, code, reason, timeout);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return -1;
}

int
pyccl_raise_timeout(pyccl_state *st, const char *op, double limit, const char *fmt, ...)
{
    char reason[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    return pyccl_raise_failure(st, op, PYCCL_FAIL_TIMEOUT, 0, reason, limit);
}

void
pyccl_log(int level, const char *fmt, ...)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    /* logging is imported here, at the first note, not at pyccl's import */
    PyObject *logging = msg ? PyImport_ImportModule("logging") : NULL;
    PyObject *logger = logging ? PyObject_CallMethod(logging, "getLogger", "s", "pyccl") : NULL;
    /* "%s": the text is the record's argument, never its format */
    PyObject *r = logger ? PyObject_CallMethod(logger, "log", "isO", level, "%s", msg) : NULL;
    if (r == NULL) {
        PyErr_WriteUnraisable(msg);
    }
    Py_XDECREF(r);
    Py_XDECREF(logger);
    Py_XDECREF(logging);
    Py_XDECREF(msg);
    PyErr_Restore(type, value, tb);
}
