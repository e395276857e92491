/* Communicator.split() and .shrink(): a new Communicator of some of the
 * ranks.  split: the ranks that passed the same color; with a timeout the
 * watchdog splits (the child gets a watch too); inside pyccl.group() NCCL
 * writes the child's handle only when the group ends, so the child stays
 * pending until then (communicator.c).  shrink: the ranks not excluded,
 * also from a communicator that failed (its revoked handle). */
#include "comm_ops.h"
#include "locks.h"
#include "communicator.h"
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "args.h"
#include "errors.h"
#include "loader.h"
#include "tensor.h"

/* The split of a communicator with a timeout: the watchdog makes the child's
 * handle within the parent's timeout, the child gets the same timeout. */
static PyObject *
split_watched(call_ctx *x, int color, int key)
{
    ncclComm_t nc;
    int rank, size;
    if (pyccl_watch_split(x->st, x->c, color, key, &nc, &rank, &size) < 0) {
        return NULL;
    }
    if (nc == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *child = pyccl_comm_new(x->st, nc, rank, size, x->c->device);
    if (child == NULL) {
        const pyccl_api *a = &x->st->api;
        Py_BEGIN_ALLOW_THREADS
        a->ncclCommAbort(nc);
        Py_END_ALLOW_THREADS
        return NULL;
    }
    ((pyccl_comm *)child)->blocking = x->c->blocking;
    if (pyccl_watch_attach(x->st, "split", (pyccl_comm *)child, pyccl_comm_timeout(x->c)) < 0) {
        Py_DECREF(child);
        return NULL;
    }
    return child;
}

/* split(color, key=None) -> Communicator or None (color < 0: not a member). */
PyObject *
pyccl_comm_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                 PyObject *kwnames)
{
    static const char *const names[] = {"color", "key"};
    PyObject *a[2];
    call_ctx x;
    int color, key;
    if (pyccl_parse_args("split", args, nargs, kwnames, names, 2, 2, 1, a) < 0 ||
        ops_ctx_init(&x, self, "split") < 0) {
        return NULL;
    }
    int rc = pyccl_read_bounded("split", "color", a[0], 0, INT32_MAX, &color);
    if (rc < 0) {
        return NULL;
    }
    if (rc == PYCCL_ABOVE) {
        PyErr_Format(PyExc_ValueError, "split: color=%S is out of range", a[0]);
        return NULL;
    }
    if (rc == PYCCL_BELOW) {
        color = NCCL_SPLIT_NOCOLOR; /* any negative color: not a member */
    }
    key = x.c->rank;
    if (a[1] != NULL && a[1] != Py_None &&
        pyccl_read_int("split", "key", a[1], &key) < 0) {
        return NULL;
    }
    const pyccl_api *api = &x.st->api;
    if (api->ncclCommSplit == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "split: needs NCCL >= 2.18");
        return NULL;
    }
    if (x.c->watch != NULL) {
        /* the child gets a watch too */
        if (pyccl_call_begin(x.st, "split", x.c) < 0) {
            return NULL;
        }
        PyObject *child = split_watched(&x, color, key);
        pyccl_call_end(x.c);
        return child;
    }
    if (pyccl_group_depth() > 0) {
        /* NCCL writes the child's handle when the group ends, so it goes
         * straight into a Communicator kept alive until then. */
        static ncclComm_t not_member; /* color < 0: NCCL writes NULL here */
        PyObject *child = NULL;
        ncclComm_t *slot = &not_member;
        if (color >= 0) {
            child = pyccl_comm_new(x.st, NULL, -1, 0, x.c->device);
            if (child == NULL || pyccl_add_pending_split(x.st, child) < 0) {
                Py_XDECREF(child);
                return NULL;
            }
            ((pyccl_comm *)child)->pending = 1;
            slot = &((pyccl_comm *)child)->comm;
        }
        char last[PYCCL_LAST_ERROR_SIZE] = "";
        /* NCCL uses the parent at the group's end: it is in the group */
        if (pyccl_call_begin(x.st, "split", x.c) < 0 || pyccl_group_note(x.c) < 0) {
            Py_XDECREF(child);
            return NULL;
        }
        /* a short call: no GIL release around it; abort() from another
         * thread may have ended the handle while this one waited */
        if (pyccl_comm_enter(x.st, "split", x.c) < 0) {
            pyccl_call_end(x.c);
            Py_XDECREF(child); /* stays pending until the group ends */
            return NULL;
        }
        ncclResult_t r = api->ncclCommSplit(x.c->comm, color, key, slot, NULL);
        pyccl_nccl_failed(api, r, x.c->comm, last, sizeof last);
        pyccl_comm_leave(x.c);
        pyccl_call_end(x.c);
        if (r != ncclSuccess) {
            Py_XDECREF(child); /* stays pending until the group ends */
            pyccl_raise_nccl(x.st, "split", r, last);
            return NULL;
        }
        if (child == NULL) {
            Py_RETURN_NONE;
        }
        return child;
    }
    ncclComm_t nc = NULL;
    ncclResult_t r;
    int rank = -1, size = 0;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    if (pyccl_call_begin(x.st, "split", x.c) < 0) {
        return NULL;
    }
    if (pyccl_comm_enter(x.st, "split", x.c) < 0) { /* no watch: the one lock */
        pyccl_call_end(x.c);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    r = api->ncclCommSplit(x.c->comm, color, key, &nc, NULL);
    if (r == ncclSuccess && nc != NULL) {
        r = api->ncclCommUserRank(nc, &rank);
        if (r == ncclSuccess) {
            r = api->ncclCommCount(nc, &size);
        }
    }
    pyccl_nccl_failed(api, r, x.c->comm, last, sizeof last);
    pyccl_comm_leave(x.c);
    Py_END_ALLOW_THREADS
    pyccl_call_end(x.c);
    if (r != ncclSuccess) {
        pyccl_raise_nccl(x.st, "split", r, last);
        return NULL;
    }
    if (nc == NULL) {
        Py_RETURN_NONE;
    }
    return pyccl_comm_new(x.st, nc, rank, size, x.c->device);
}

/* shrink(exclude) -> Communicator of the ranks not in `exclude`, renumbered
 * in their order (NCCL's ncclCommShrink).  Called by every remaining rank,
 * never by an excluded one.  With a timeout it also works once the
 * communicator failed (a dead peer): its handle was revoked, not aborted. */
PyObject *
pyccl_comm_shrink(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames)
{
    static const char *const names[] = {"exclude"};
    PyObject *a[1];
    pyccl_comm *c = (pyccl_comm *)self;
    if (pyccl_parse_args("shrink", args, nargs, kwnames, names, 1, 1, 1, a) < 0) {
        return NULL;
    }
    pyccl_state *st = pyccl_state_of_type(Py_TYPE(self));
    if (st == NULL) {
        return NULL;
    }
    if (c->pending) {
        return pyccl_raise_not_ready("shrink"), NULL;
    }
    if (c->life != PYCCL_LIFE_USABLE || (c->comm == NULL && c->watch == NULL)) {
        PyErr_Format(PyExc_RuntimeError,
                     "shrink: the communicator (rank %d of %d) has been destroyed", c->rank,
                     c->size);
        return NULL;
    }
    /* Read by iteration, never sized by len(): a __len__ that lies (or a
     * length hint of 2**62) must not decide an allocation.  A valid exclude
     * holds distinct ranks other than this one, so the checks below refuse
     * it before it passes c->size items, and an endless iterator ends there. */
    PyObject *it = PyObject_GetIter(a[0]);
    if (it == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "shrink: exclude must be a sequence of ranks, got %.200s",
                         Py_TYPE(a[0])->tp_name);
        }
        return NULL;
    }
    int *ex = PyMem_Calloc((size_t)c->size, sizeof *ex);
    if (ex == NULL) {
        Py_DECREF(it);
        return PyErr_NoMemory();
    }
    PyObject *res = NULL;
    Py_ssize_t n = 0;
    for (PyObject *item; (item = PyIter_Next(it)) != NULL; n++) {
        char what[48];
        snprintf(what, sizeof what, "exclude[%zd]", n);
        int r = n < c->size ? pyccl_read_int("shrink", what, item, &ex[n]) : -1;
        Py_DECREF(item);
        if (r < 0) {
            if (!PyErr_Occurred()) { /* not reached: the checks below come first */
                PyErr_Format(PyExc_ValueError, "shrink: exclude has more than %d ranks",
                             c->size);
            }
            goto done;
        }
        Py_ssize_t i = n;
        if (ex[i] < 0 || ex[i] >= c->size) {
            PyErr_Format(PyExc_ValueError,
                         "shrink: exclude[%zd] is %d, out of range for %d ranks (ranks are 0..%d)",
                         i, ex[i], c->size, c->size - 1);
            goto done;
        }
        for (Py_ssize_t k = 0; k < i; k++) {
            if (ex[k] == ex[i]) {
                PyErr_Format(PyExc_ValueError, "shrink: rank %d is in exclude twice", ex[i]);
                goto done;
            }
        }
        if (ex[i] == c->rank) {
            PyErr_Format(PyExc_ValueError,
                         "shrink: this rank (%d) is in exclude; only the ranks that remain call "
                         "shrink()", c->rank);
            goto done;
        }
    }
    if (PyErr_Occurred()) { /* the iterator's own exception */
        goto done;
    }
    const pyccl_api *api = &st->api;
    if (pyccl_need_nccl(st, "shrink", (const void *)api->ncclCommShrink, "ncclCommShrink",
                        "2.27") < 0) {
        goto done;
    }
    if (pyccl_group_depth() > 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "shrink: cannot shrink inside pyccl.group(); shrink outside the group");
        goto done;
    }
    ncclComm_t nc = NULL;
    int rank = -1, size = 0;
    if (c->watch != NULL) {
        /* also a failed one: counted in flight, its watch checked there */
        pyccl_call_hold(c);
        int rc = pyccl_watch_shrink(st, c, ex, (int)n, &nc, &rank, &size);
        pyccl_call_end(c);
        if (rc < 0) {
            goto done;
        }
        res = pyccl_comm_new(st, nc, rank, size, c->device);
        if (res == NULL) {
            Py_BEGIN_ALLOW_THREADS
            api->ncclCommAbort(nc);
            Py_END_ALLOW_THREADS
        }
        else if ((((pyccl_comm *)res)->blocking = c->blocking, 0) ||
                 pyccl_watch_attach(st, "shrink", (pyccl_comm *)res, pyccl_comm_timeout(c)) < 0) {
            Py_CLEAR(res);
        }
        goto done;
    }
    if (pyccl_call_begin(st, "shrink", c) < 0) {
        goto done;
    }
    ncclResult_t r;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    if (pyccl_comm_enter(st, "shrink", c) < 0) { /* no watch: the one lock */
        pyccl_call_end(c);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    r = api->ncclCommShrink(c->comm, ex, (int)n, &nc, NULL, NCCL_SHRINK_DEFAULT);
    if (r == ncclSuccess && nc != NULL) {
        r = api->ncclCommUserRank(nc, &rank);
        if (r == ncclSuccess) {
            r = api->ncclCommCount(nc, &size);
        }
    }
    pyccl_nccl_failed(api, r, c->comm, last, sizeof last);
    pyccl_comm_leave(c);
    Py_END_ALLOW_THREADS
    pyccl_call_end(c);
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, "shrink", r, last);
        goto done;
    }
    res = pyccl_comm_new(st, nc, rank, size, c->device);
    if (res == NULL) {
        Py_BEGIN_ALLOW_THREADS
        api->ncclCommDestroy(nc);
        Py_END_ALLOW_THREADS
    }
done:
    PyMem_Free(ex);
    Py_DECREF(it);
    return res;
}
