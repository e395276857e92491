/* The registrations of a communicator, below the type: each open
 * registration is in its communicator's list (c->regs), so that destroy()
 * and garbage collection deregister them first and abort() forgets them; the
 * NCCL calls that make and end a registration (ncclCommRegister,
 * ncclCommWindowRegister and their deregistrations) go through the door
 * like any call on the communicator.  register(), register_window() and the
 * pyccl.Registration type over the record are registration.c's, with the
 * methods. */
#include "reg_list.h"
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "errors.h"

void
pyccl_reg_link(pyccl_comm *c, pyccl_reg *r)
{
    r->next = c->regs;
    if (r->next != NULL) {
        r->next->prev = r;
    }
    c->regs = r;
}

static void
unlink_reg(pyccl_reg *r)
{
    if (r->prev != NULL) {
        r->prev->next = r->next;
    }
    else if (r->comm != NULL && r->comm->regs == r) {
        r->comm->regs = r->next;
    }
    if (r->next != NULL) {
        r->next->prev = r->prev;
    }
    r->next = r->prev = NULL;
    r->open = 0;
}

/* One NCCL registration call on c (GIL released by the caller, c entered):
 * kind 0 register, 1 window register, 2 deregister, 3 window deregister.  On
 * a communicator with a timeout (non-blocking) an ncclInProgress is polled
 * with ncclCommGetAsyncError until done or `deadline` (then *late = 1). */
static ncclResult_t
nccl_call(const pyccl_api *a, ncclComm_t comm, int kind, void *ptr, size_t n,
          void **handle, double deadline, int *late, char *last, size_t size)
{
    ncclResult_t r;
    switch (kind) {
    case 0: r = a->ncclCommRegister(comm, ptr, n, handle); break;
    case 1:
        r = a->ncclCommWindowRegister(comm, ptr, n, (ncclWindow_t *)handle,
                                      NCCL_WIN_COLL_SYMMETRIC);
        break;
    case 2: r = a->ncclCommDeregister(comm, *handle); break;
    default: r = a->ncclCommWindowDeregister(comm, (ncclWindow_t)*handle); break;
    }
    /* polled after ncclSuccess too: NCCL 2.28.9's window registration
     * returns it with a non-blocking communicator still in progress */
    r = pyccl_nccl_settle(a, comm, r, deadline);
    if (r == ncclInProgress) {
        *late = 1;
    }
    pyccl_nccl_failed(a, r, comm, last, size);
    return r;
}

/* The call with c entered and the GIL released; -1 with an exception (a
 * time-out fails the communicator, as any call on it past its timeout). */
int
pyccl_reg_call(pyccl_state *st, const char *op, pyccl_comm *c, int kind, void *ptr,
               size_t n, void **handle)
{
    if (pyccl_comm_enter(st, op, c) < 0) {
        return -1;
    }
    const pyccl_api *a = &st->api;
    ncclComm_t comm = c->comm;
    double timeout = pyccl_comm_timeout(c);
    double deadline = timeout > 0 ? pyccl_now_s() + timeout : 0; /* 0: none */
    int late = 0;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    ncclResult_t r;
    Py_BEGIN_ALLOW_THREADS
    r = nccl_call(a, comm, kind, ptr, n, handle, deadline, &late, last, sizeof last);
    Py_END_ALLOW_THREADS
    pyccl_comm_leave(c);
    if (late) {
        char reason[256];
        snprintf(reason, sizeof reason,
                 "%s: rank %d of %d timed out after %s s waiting for its peers; the "
                 "communicator was aborted",
                 op, c->rank, c->size, pyccl_secs(timeout).s);
        return pyccl_comm_give_up(st, op, c, reason, reason);
    }
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, op, r, last);
        return -1;
    }
    return 0;
}

/* Deregister r if its communicator can still take the call; mark it closed
 * either way.  The registration is claimed (closed, unlinked) with the GIL
 * held before anything else, so a second close() (another thread's, or
 * destroy()'s) finds it closed and never deregisters it again.
 * `who`: destroy()'s or abort()'s own release (c is theirs,
 * PYCCL_CLOSE_BY_COMM); otherwise the call is begun on c like any other.
 * While c is being destroyed, close() leaves r to destroy(), and a
 * registration garbage collected meanwhile is only unlinked (NCCL frees it
 * with the handle).  -1 with an exception when NCCL refused. */
int
pyccl_reg_close(pyccl_state *st, pyccl_reg *r, int forget, int who)
{
    if (!r->open) {
        return 0;
    }
    pyccl_comm *c = r->comm;
    const int by_comm = who == PYCCL_CLOSE_BY_COMM;
    if (who == PYCCL_CLOSE_BY_USER && c->life == PYCCL_LIFE_DESTROYING) {
        return 0; /* destroy() deregisters it, in its order */
    }
    if (!by_comm && !forget && c->in_group > 0 && c->comm != NULL && !pyccl_comm_failed(c)) {
        /* work of c queued in an open group may be on this memory: NCCL runs
         * it at the group's end */
        PyErr_Format(PyExc_RuntimeError,
                     "Registration.close: the communicator (rank %d of %d) has work queued "
                     "in a pyccl.group() that has not ended; close the registration after "
                     "the group",
                     c->rank, c->size);
        return -1;
    }
    if (!by_comm && !forget && c->comm != NULL && c->life == PYCCL_LIFE_USABLE &&
        !pyccl_comm_failed(c) && !c->pending && st != NULL && st->api.loaded &&
        !st->exiting) {
        /* the work enqueued so far (which may use this memory) first, as
         * wait() waits for it, counted in flight the same way; the
         * registration stays open when the wait fails */
        const int held = pyccl_call_hold_wait(c);
        int drained = pyccl_comm_drain(st, "Registration.close", c);
        if (held) {
            pyccl_call_end(c);
        }
        if (drained < 0) {
            return -1;
        }
    }
    if (!r->open) {
        return 0; /* another thread closed it while this one waited */
    }
    void *h = r->handle;
    int window = r->window;
    PyObject *tensor = r->tensor;
    unlink_reg(r);
    r->handle = NULL;
    r->tensor = NULL;
    int rc = 0;
    int usable = c->comm != NULL && !pyccl_comm_failed(c) && !c->pending &&
                 (by_comm || c->life == PYCCL_LIFE_USABLE);
    if (!forget && usable && st != NULL && st->api.loaded && !st->exiting) {
        if (by_comm || pyccl_call_begin(st, "Registration.close", c) == 0) {
            rc = pyccl_reg_call(st, "Registration.close", c, window ? 3 : 2, NULL, 0, &h);
            if (!by_comm) {
                pyccl_call_end(c);
            }
        }
        else {
            PyErr_Clear(); /* cannot happen: usable was checked with the GIL */
        }
    }
    Py_XDECREF(tensor);
    return rc;
}

void
pyccl_release_registrations(pyccl_state *st, pyccl_comm *c, int forget)
{
    int gone = forget == 2 ? 2 : 1;
    if (!forget && c->regs != NULL && c->comm != NULL && !pyccl_comm_failed(c) &&
        st->api.loaded && !st->exiting) {
        /* the work enqueued so far may use the registered memory: it ends
         * before the memory is deregistered (bounded by a timeout, which
         * fails the communicator: then nothing is deregistered through it) */
        PyObject *exc = PyErr_GetRaisedException();
        if (pyccl_comm_drain(st, "destroy", c) < 0) {
            PyErr_Clear();
        }
        PyErr_SetRaisedException(exc);
    }
    /* newest first: windows were made in one order on every rank, and go in
     * the reverse one on every rank */
    while (c->regs != NULL) {
        pyccl_reg *r = c->regs;
        PyObject *exc = PyErr_GetRaisedException();
        r->gone = gone;
        if (pyccl_reg_close(st, r, forget || st->exiting, PYCCL_CLOSE_BY_COMM) < 0) {
            PyErr_Clear();
        }
        PyErr_SetRaisedException(exc);
        if (c->regs == r) { /* cannot happen: pyccl_reg_close unlinks */
            unlink_reg(r);
        }
    }
}
