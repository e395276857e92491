/* A watched communicator's life around its calls (see watchdog.c): its
 * creation (a non-blocking init, polled; the watch given), split, destroy
 * (finalize within the timeout, else abort), abort(), wait(),
 * get_async_error(), and failing it from outside (the own kernels). */
#include "timeouts.h"
#include "locks.h"
#include "watch.h"
#include "enqueue.h"
#include "tensor.h"
#include "errors.h"
#include "args.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------------- creation ---------------- */

/* Poll comm (GIL released, in a waiter) until NCCL's call on it is done.
 * 0: done, *res is its result; 1: deadline passed; -1: interrupted. */
static int
poll_comm(waiter *wt, const pyccl_api *a, ncclComm_t comm, double deadline,
          ncclResult_t *res)
{
    for (;;) {
        ncclResult_t e = ncclSuccess;
        ncclResult_t r = a->ncclCommGetAsyncError(comm, &e);
        if (r != ncclSuccess) {
            *res = r;
            return 0;
        }
        if (e != ncclInProgress) {
            *res = e;
            return 0;
        }
        if (pyccl_now_s() > deadline) {
            return 1;
        }
        if (waiter_pause(wt) < 0) {
            return -1;
        }
    }
}

int
pyccl_watch_init(pyccl_state *st, const char *op, ncclComm_t *out, int nranks,
                 const ncclUniqueId *uid, int rank, int device, double timeout,
                 int blocking)
{
    const pyccl_api *a = &st->api;
    if (a->ncclCommInitRankConfig == NULL || a->ncclCommGetAsyncError == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: timeout= needs NCCL >= 2.14 (non-blocking "
                     "communicators); this NCCL is %d",
                     op, a->nccl_version);
        return -1;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking;
    ncclComm_t comm = NULL;
    ncclResult_t r, res = ncclSuccess;
    cudaError_t ce;
    char last[512] = "";
    int polled = 0;
    waiter wt;
    double deadline = pyccl_now_s() + timeout;
    waiter_start(&wt, 1);
    int prev;
    ce = pyccl_device_enter(a, device, &prev);
    if (ce == cudaSuccess) {
        /* NCCL's init thread keeps the device current at this call. */
        r = a->ncclCommInitRankConfig(&comm, nranks, *uid, rank, &config);
        pyccl_device_leave(a, device, prev);
        if (r == ncclSuccess || r == ncclInProgress) {
            polled = comm != NULL ? poll_comm(&wt, a, comm, deadline, &res) : 0;
        }
        else {
            res = r;
        }
        if ((polled != 0 || res != ncclSuccess) && a->ncclGetLastError) {
            strncpy(last, a->ncclGetLastError(comm), sizeof last - 1);
        }
        if ((polled != 0 || res != ncclSuccess) && comm != NULL) {
            a->ncclCommAbort(comm); /* its abort flag ends the init's waits */
            comm = NULL;
        }
    }
    waiter_finish(&wt);
    if (ce != cudaSuccess) {
        pyccl_raise_cuda(st, op, "cudaSetDevice", ce);
        return -1;
    }
    if (polled < 0) {
        return -1; /* KeyboardInterrupt (or a handler's exception) */
    }
    if (polled > 0) {
        return pyccl_raise_timeout(st, op, timeout,
                                   "rank %d of %d timed out after %s s waiting for its peers "
                                   "to join (every rank must call it with the same unique_id "
                                   "and world_size); the communicator was aborted",
                                   rank, nranks, pyccl_secs(timeout).s);
    }
    if (res != ncclSuccess) {
        pyccl_raise_nccl(st, op, res, last);
        return -1;
    }
    *out = comm;
    return 0;
}

int
pyccl_watch_attach(pyccl_state *st, const char *op, pyccl_comm *c,
                   double timeout)
{
    struct pyccl_watch *w = new_watch(st, c, timeout);
    if (w != NULL) {
        w->timeout_text = pyccl_secs(timeout);
        w->blocking = c->blocking;
    }
    if (w != NULL && register_watch(st, op, w) == 0) {
        c->watch = w;
        c->timeout = timeout;
        return 0;
    }
    if (w != NULL) {
        free_watch(w);
    }
    ncclComm_t comm = c->comm;
    c->comm = NULL;
    const pyccl_api *a = &st->api;
    Py_BEGIN_ALLOW_THREADS
    a->ncclCommAbort(comm);
    Py_END_ALLOW_THREADS
    return -1;
}

/* ---------------- split, destroy, abort, errors ---------------- */

/* A split's or shrink's child handle, made: poll it until it is ready
 * (once the parent's job is; no GIL needed, the parent's watch is locked),
 * then read its rank and size.  poll_comm's result; *res NCCL's. */
static int
child_ready(waiter *wt, const pyccl_api *a, ncclComm_t child, double deadline,
            ncclResult_t *res, int *rank, int *size)
{
    wt->interruptible = 0;
    int polled = poll_comm(wt, a, child, deadline, res);
    wt->interruptible = 1;
    if (*res == ncclSuccess && polled == 0) {
        *res = a->ncclCommUserRank(child, rank);
    }
    if (*res == ncclSuccess && polled == 0) {
        *res = a->ncclCommCount(child, size);
    }
    return polled;
}

int
pyccl_watch_split(pyccl_state *st, pyccl_comm *c, int color, int key,
                  ncclComm_t *child, int *child_rank, int *child_size)
{
    const pyccl_api *a = &st->api;
    struct pyccl_watch *w = c->watch;
    *child = NULL;
    if (pyccl_group_depth() > 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "split: a communicator with a timeout cannot be split "
                        "inside pyccl.group(); split it outside the group");
        return -1;
    }
    /* A non-blocking split writes the child's handle when it completes,
     * possibly after a timeout gave up on it: the slot must outlive this
     * call then (it is leaked). */
    ncclComm_t *slot = PyMem_RawCalloc(1, sizeof *slot);
    if (slot == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ncclResult_t r, res = ncclSuccess;
    char last[512] = "";
    int which = 0, got, polled = 0, rank = -1, size = 0;
    waiter wt;
    waiter_start(&wt, 1);
    got = acquire_all(&wt, &w, 1, 0, &which);
    if (got == 0 && pyccl_group_others(c)) {
        pyccl_unlock(w->mu); /* NCCL would work on c beside that group */
        got = 2;
    }
    if (got == 0) {
        double deadline = pyccl_now_s() + w->timeout;
        /* NULL config: the child is non-blocking like its parent */
        r = a->ncclCommSplit(*w->comm, color, key, slot, NULL);
        if (r == ncclSuccess || r == ncclInProgress) {
            w->busy++;
            polled = poll_watch(&wt, w, deadline, &res);
            w->busy--;
        }
        else {
            res = r;
        }
        if (polled == 0 && res == ncclSuccess && *slot != NULL) {
            polled = child_ready(&wt, a, *slot, deadline, &res, &rank, &size);
        }
        pyccl_nccl_failed(a, res, *w->comm, last, sizeof last);
        if (polled == 1) {
            fail_timeout(w, "split", "its peers");
        }
        else if (polled < 0) {
            fail_interrupted(w, "split");
        }
        else if (res != ncclSuccess && *w->comm != NULL) {
            ncclResult_t e = ncclSuccess;
            a->ncclCommGetAsyncError(*w->comm, &e);
            if (e != ncclSuccess && e != ncclInProgress) {
                fail_nccl(w, "split", e);
            }
        }
        pyccl_unlock(w->mu);
        if (res != ncclSuccess && polled == 0 && *slot != NULL) {
            a->ncclCommAbort(*slot); /* the child is no use alone */
            *slot = NULL;
        }
    }
    waiter_finish(&wt);
    if (got == 2) {
        PyMem_RawFree(slot);
        return pyccl_raise_other_group("split", c);
    }
    if (got < 0 || polled < 0) {
        return -1; /* leaks the slot: NCCL may still write it */
    }
    if (got > 0 || polled > 0 || failed_kind(w)) {
        if (got > 0 || polled == 0) {
            PyMem_RawFree(slot); /* else NCCL may still write it: leaked */
        }
        pyccl_watch_check(st, "split", c);
        return -1;
    }
    ncclComm_t nc = *slot;
    PyMem_RawFree(slot);
    if (res != ncclSuccess) {
        pyccl_raise_nccl(st, "split", res, last);
        return -1;
    }
    *child = nc;
    *child_rank = rank;
    *child_size = size;
    return 0;
}

int
pyccl_watch_destroy(pyccl_state *st, const char *op, pyccl_comm *c,
                    int may_raise)
{
    struct pyccl_watch *w = c->watch;
    const pyccl_api *a = &st->api;
    lock_watch(w);
    if (in_group_of(w) > 0 || w->busy > 0) {
        pyccl_unlock(w->mu);
        if (may_raise) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: the communicator (rank %d of %d) is in use: "
                         "enqueued on inside a pyccl.group() that has not "
                         "ended, or by another thread; destroy it afterwards",
                         op, c->rank, c->size);
            return -1;
        }
        /* not reached from garbage collection: an open group and a busy
         * call both hold a reference */
        return 0;
    }
    w->closing = 1;
    /* The handle goes with the watch that finishes it off, and from here on
     * the Communicator looks destroyed to other threads (which then never
     * reach w). */
    w->closing_comm = *w->comm;
    w->comm = &w->closing_comm;
    c->comm = NULL;
    pyccl_unlock(w->mu);
    c->watch = NULL;
    unregister_watch(st, w);
    if (__atomic_load_n(&c->abort_asked, __ATOMIC_ACQUIRE) && !failed_kind(w)) {
        /* abort() came while destroy() ran: no finalize, which waits for peers */
        Py_BEGIN_ALLOW_THREADS
        pyccl_lock(w->mu, PYCCL_LOCK_COMM);
        watch_fail(w, PYCCL_FAIL_ABORTED, 0, "the communicator (rank %d of %d) has been aborted",
             w->rank, w->size);
        pyccl_unlock(w->mu);
        Py_END_ALLOW_THREADS
    }
    int rc = 0;
    if (!failed_kind(w) && *w->comm != NULL) {
        /* First the tracked work (as long as it keeps finishing within the
         * timeout), then NCCL's finalize (bounded by the timeout): peers that
         * are gone must not hang destroy(). */
        rc = wait_work(st, op, w, 0.0, may_raise);
        if (rc == 0 && *w->comm != NULL) {
            int polled = 0;
            ncclResult_t res = ncclSuccess;
            waiter wt;
            waiter_start(&wt, 0); /* a half-finalized comm cannot be left */
            pyccl_lock(w->mu, PYCCL_LOCK_COMM);
            if (a->ncclCommFinalize != NULL) {
                ncclResult_t r = a->ncclCommFinalize(*w->comm);
                if (r == ncclSuccess || r == ncclInProgress) {
                    polled = poll_comm(&wt, a, *w->comm, pyccl_now_s() + w->timeout,
                                       &res);
                }
                else {
                    res = r;
                }
            }
            if (polled > 0) {
                fail_timeout(w, op, "its outstanding work");
            }
            else {
                ncclComm_t comm = *w->comm;
                *w->comm = NULL;
                ncclResult_t r = a->ncclCommDestroy(comm);
                res = res != ncclSuccess ? res : r;
            }
            pyccl_unlock(w->mu);
            waiter_finish(&wt);
            if (polled > 0) {
                rc = 1;
            }
            else if (res != ncclSuccess) {
                pyccl_raise_nccl(st, op, res, NULL);
                rc = -1;
            }
        }
        else if (rc < 0 && !failed_kind(w)) {
            /* ^C while waiting for the work: NCCL cannot be finalized
             * without it, so it is aborted */
            Py_BEGIN_ALLOW_THREADS
            pyccl_lock(w->mu, PYCCL_LOCK_COMM);
            fail_interrupted(w, op);
            pyccl_unlock(w->mu);
            Py_END_ALLOW_THREADS
        }
    }
    if (rc > 0) {
        rc = raise_failure(st, op, w);
    }
    if (!may_raise) {
        PyErr_Clear();
    }
    free_watch(w);
    return rc;
}

int
pyccl_watch_abort(pyccl_state *st, pyccl_comm *c)
{
    /* the door (call.c) decided that c may be aborted now */
    struct pyccl_watch *w = c->watch;
    if (w == NULL) {
        if (c->comm == NULL) {
            return 0; /* destroyed: nothing to abort */
        }
        char reason[128];
        snprintf(reason, sizeof reason,
                 "the communicator (rank %d of %d) has been aborted", c->rank,
                 c->size);
        return mark_untimed(st, c, PYCCL_FAIL_ABORTED, reason, 1);
    }
    if (pyccl_trylock(w->mu, PYCCL_LOCK_COMM) != 0) {
        /* Another thread holds the lock: when it is inside an NCCL or CUDA
         * call that may block (a launch behind stuck work), the handle is
         * aborted under it, which is what lets that call return. */
        Py_BEGIN_ALLOW_THREADS
        watch_claim_call(w);
        pyccl_lock(w->mu, PYCCL_LOCK_COMM);
        Py_END_ALLOW_THREADS
    }
    if (c->in_group > 0) {
        /* another thread's pyccl.group() took c while this one waited (the
         * door saw none): its work is in NCCL's group, the handle stays */
        pyccl_unlock(w->mu);
        return pyccl_raise_abort_in_group(c);
    }
    /* A thread polling it (busy) sees the abort and raises. */
    Py_BEGIN_ALLOW_THREADS
    watch_fail(w, PYCCL_FAIL_ABORTED, 0,
         "the communicator (rank %d of %d) has been aborted", c->rank, c->size);
    if (w->revoked != NULL) { /* failed before: its kept handle goes now */
        w->api->ncclCommAbort(w->revoked);
        w->revoked = NULL;
    }
    Py_END_ALLOW_THREADS
    pyccl_unlock(w->mu);
    return 0;
}

PyObject *
pyccl_comm_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                PyObject *kwnames)
{
    pyccl_comm *c = (pyccl_comm *)self;
    PyObject *tobj = nargs > 0 ? args[0] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw > 1) {
        PyErr_Format(PyExc_TypeError,
                     "wait() takes at most 1 argument (%zd given)", nargs + nkw);
        return NULL;
    }
    if (nkw == 1) {
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0),
                                             "timeout") != 0) {
            PyErr_Format(PyExc_TypeError,
                         "wait() got an unexpected keyword argument '%U'",
                         PyTuple_GET_ITEM(kwnames, 0));
            return NULL;
        }
        tobj = args[0];
    }
    double limit;
    if (pyccl_read_timeout("wait", tobj, &limit) < 0) {
        return NULL;
    }
    pyccl_state *st = watch_state_of(self);
    if (st == NULL || pyccl_comm_alive(st, "wait", c) < 0) {
        return NULL;
    }
    if (c->watch == NULL) {
        /* no timeout of its own: without a limit, as long as it takes, or
         * until abort() from another thread ended the work (then raised:
         * it did not finish, as a watched communicator's wait says) */
        if (wait_streams(st, "wait", c, limit) < 0 || wait_end(st, "wait", c) < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    /* without a limit: as long as the work keeps finishing within the timeout */
    if (pyccl_watch_wait(st, "wait", c, limit) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *
pyccl_comm_get_async_error(PyObject *self, PyObject *Py_UNUSED(unused))
{
    pyccl_comm *c = (pyccl_comm *)self;
    pyccl_state *st = watch_state_of(self);
    if (st == NULL) {
        return NULL;
    }
    struct pyccl_watch *w = c->watch;
    if (w != NULL && failed_kind(w) && failed_kind(w) != PYCCL_FAIL_ABORTED) {
        return pyccl_failure_exception(st, "get_async_error", failed_kind(w),
                                       w->code, w->reason, w->timeout);
    }
    if (pyccl_comm_alive(st, "get_async_error", c) < 0) {
        return NULL;
    }
    const pyccl_api *a = &st->api;
    if (a->ncclCommGetAsyncError == NULL) {
        Py_RETURN_NONE;
    }
    ncclResult_t e = ncclSuccess, r = ncclSuccess;
    if (w == NULL) {
        /* under the communicator's lock, as every NCCL call on it (NCCL
         * communicators are not thread-safe); the GIL, taken back with the
         * lock, keeps destroy() and abort() off until the call returned,
         * and either may have ended the handle while this thread waited */
        pyccl_comm_lock(c);
        if (c->watch == NULL && c->comm != NULL) {
            r = a->ncclCommGetAsyncError(c->comm, &e);
        }
        pyccl_unlock(&c->mu);
    }
    else {
        lock_watch(w);
        if (*w->comm != NULL && !w->busy && !in_group_of(w)) {
            r = a->ncclCommGetAsyncError(*w->comm, &e);
            if (r == ncclSuccess && e != ncclSuccess && e != ncclInProgress) {
                /* what the watchdog would do within 10 ms */
                Py_BEGIN_ALLOW_THREADS
                fail_nccl(w, "get_async_error", e);
                Py_END_ALLOW_THREADS
            }
        }
        pyccl_unlock(w->mu);
        if (failed_kind(w)) {
            return pyccl_failure_exception(st, "get_async_error",
                                           failed_kind(w), w->code, w->reason,
                                           w->timeout);
        }
    }
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, "get_async_error", r, NULL);
        return NULL;
    }
    if (e == ncclSuccess || e == ncclInProgress) {
        Py_RETURN_NONE;
    }
    PyObject *msg = PyUnicode_FromFormat(
        "rank %d of %d: NCCL reports error %d (%s)", c->rank, c->size, (int)e,
        a->ncclGetErrorString(e));
    if (msg == NULL) {
        return NULL;
    }
    PyObject *exc = pyccl_failure_exception(st, "get_async_error",
                                            PYCCL_FAIL_NCCL, (int)e,
                                            PyUnicode_AsUTF8(msg), 0.0);
    Py_DECREF(msg);
    return exc;
}

int
pyccl_comm_give_up(pyccl_state *st, const char *op, pyccl_comm *c, const char *failure,
                   const char *otherwise)
{
    if (failure != NULL) {
        pyccl_comm_time_out(st, c, NULL, failure);
    }
    if (pyccl_comm_alive(st, op, c) == 0) {
        PyErr_SetString(PyExc_RuntimeError, otherwise);
    }
    return -1;
}


int
pyccl_watch_shrink(pyccl_state *st, pyccl_comm *c, int *exclude, int n,
                   ncclComm_t *child, int *child_rank, int *child_size)
{
    const pyccl_api *a = &st->api;
    struct pyccl_watch *w = c->watch;
    *child = NULL;
    /* As for split: a non-blocking shrink writes the child's handle when it
     * completes, maybe after a timeout gave up on it (then the slot leaks). */
    ncclComm_t *slot = PyMem_RawCalloc(1, sizeof *slot);
    if (slot == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ncclResult_t r, res = ncclSuccess;
    char last[512] = "";
    int polled = 0, rank = -1, size = 0, failed = 0, none = 0;
    waiter wt;
    waiter_start(&wt, 1);
    for (;;) { /* no other thread inside NCCL on it */
        pyccl_lock(w->mu, PYCCL_LOCK_COMM);
        if (!w->busy) {
            break;
        }
        pyccl_unlock(w->mu);
        if (waiter_pause(&wt) < 0) {
            waiter_finish(&wt);
            PyMem_RawFree(slot);
            return -1;
        }
    }
    if (pyccl_group_others(c)) {
        /* as a call's enqueue: NCCL would work on c beside that group */
        pyccl_unlock(w->mu);
        waiter_finish(&wt);
        PyMem_RawFree(slot);
        return pyccl_raise_other_group("shrink", c);
    }
    failed = failed_kind(w) != 0;
    /* a failed communicator: its revoked handle (none once aborted) */
    ncclComm_t parent = failed ? w->revoked : *w->comm;
    double deadline = pyccl_now_s() + w->timeout;
    if (parent == NULL) {
        none = 1;
    }
    else {
        if (failed) {
            /* revoked: its work stops; management calls wait for that */
            polled = poll_comm(&wt, a, parent, deadline, &res);
            res = ncclSuccess;
        }
        r = polled != 0 ? ncclInProgress
                        : a->ncclCommShrink(parent, exclude, n, slot, NULL,
                                            failed ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT);
        if (polled == 0 && (r == ncclSuccess || r == ncclInProgress)) {
            polled = poll_comm(&wt, a, parent, deadline, &res);
        }
        else if (polled == 0) {
            res = r;
        }
        if (polled == 0 && res == ncclSuccess && *slot != NULL) {
            polled = child_ready(&wt, a, *slot, deadline, &res, &rank, &size);
        }
        pyccl_nccl_failed(a, res, parent, last, sizeof last);
        if (!failed && polled == 1) {
            fail_timeout(w, "shrink", "its peers");
        }
        else if (!failed && polled < 0) {
            fail_interrupted(w, "shrink");
        }
    }
    pyccl_unlock(w->mu);
    if (polled == 0 && res != ncclSuccess && *slot != NULL) {
        a->ncclCommAbort(*slot); /* the child is no use alone */
        *slot = NULL;
    }
    waiter_finish(&wt);
    if (none) {
        PyMem_RawFree(slot);
        char why[96] = "";
        if (w->revoke_result > 0) { /* NCCL refused the revoke: say so */
            snprintf(why, sizeof why, "; ncclCommRevoke returned %d (%s)", w->revoke_result,
                     a->ncclGetErrorString((ncclResult_t)w->revoke_result));
        }
        PyErr_Format(PyExc_RuntimeError,
                     "shrink: the communicator (rank %d of %d) was aborted, so no handle is left "
                     "to shrink (a communicator whose timeout or error failed it is kept for "
                     "shrink() where NCCL has ncclCommRevoke, until abort() or destroy())%s",
                     c->rank, c->size, why);
        return -1;
    }
    if (polled < 0) {
        return -1; /* KeyboardInterrupt; the slot leaks: NCCL may still write it */
    }
    if (polled > 0) {
        return pyccl_raise_timeout(st, "shrink", w->timeout,
                                   "rank %d of %d timed out after %s s waiting for the ranks "
                                   "left to shrink", c->rank, c->size, pyccl_secs(w->timeout).s);
    }
    ncclComm_t nc = *slot;
    PyMem_RawFree(slot);
    if (res != ncclSuccess) {
        pyccl_raise_nccl(st, "shrink", res, last);
        return -1;
    }
    *child = nc;
    *child_rank = rank;
    *child_size = size;
    return 0;
}
