/* Communicator.split(): a new Communicator of the ranks that passed the same
 * color.  With a timeout the watchdog splits (the child gets a watch too);
 * inside pyccl.group() NCCL writes the child's handle only when the group
 * ends, so the child stays pending until then (communicator.c). */
#include "comm_ops.h"
#include "communicator.h"
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "args.h"
#include "errors.h"

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
        if (pyccl_call_begin(x.st, "split", x.c) < 0 || pyccl_call_note_group(x.c) < 0) {
            Py_XDECREF(child);
            return NULL;
        }
        pyccl_comm_lock(x.c); /* a short call: no GIL release around it */
        ncclResult_t r = api->ncclCommSplit(x.c->comm, color, key, slot, NULL);
        pyccl_nccl_failed(api, r, x.c->comm, last, sizeof last);
        pthread_mutex_unlock(&x.c->mu);
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
    Py_BEGIN_ALLOW_THREADS
    pyccl_comms_lock(&x.c, 1);
    r = api->ncclCommSplit(x.c->comm, color, key, &nc, NULL);
    if (r == ncclSuccess && nc != NULL) {
        r = api->ncclCommUserRank(nc, &rank);
        if (r == ncclSuccess) {
            r = api->ncclCommCount(nc, &size);
        }
    }
    pyccl_nccl_failed(api, r, x.c->comm, last, sizeof last);
    pyccl_comms_unlock(&x.c, 1);
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
