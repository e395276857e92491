/* The one door for using a communicator: begin, submit, end; destroy()'s and
 * abort()'s decisions (call.h says the states).
 *
 * Everything here runs with the GIL held, which orders it: a decision taken
 * here (destroy begun, a call counted) is seen by every thread's next entry.
 * The GIL may be released between a call's begin and end (NCCL calls,
 * kernel launches, waits); c->inflight says how many calls are in that
 * stretch, and destroy() refuses while any is.  This file is the only one
 * that writes c->inflight and c->life; c->in_group is written where this
 * thread's pyccl.group() is kept (enqueue.c), as a call joins the group. */
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "errors.h"

/* ---------------- begin / end ---------------- */

int
pyccl_call_begin(pyccl_state *st, const char *op, pyccl_comm *c)
{
    if (pyccl_comm_alive(st, op, c) < 0) {
        return -1;
    }
    c->inflight++;
    return 0;
}

void
pyccl_call_hold(pyccl_comm *c)
{
    c->inflight++;
}

int
pyccl_call_hold_wait(pyccl_comm *c)
{
    /* a watched communicator's wait reads its watch, so it is counted
     * (destroy() waits for it to leave the watch); without a watch the wait
     * reads only the streams noted, which outlive the handle, and is not
     * counted: abort() from another thread is how such a wait ends early */
    if (c->watch == NULL) {
        return 0;
    }
    c->inflight++;
    return 1;
}

void
pyccl_call_end(pyccl_comm *c)
{
    c->inflight--;
}

int
pyccl_call_begin_all(pyccl_state *st, const char *op, pyccl_comm *const *cs,
                     Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pyccl_call_begin(st, op, cs[i]) < 0) {
            pyccl_call_end_all(cs, i);
            return -1;
        }
    }
    return 0;
}

void
pyccl_call_end_all(pyccl_comm *const *cs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        pyccl_call_end(cs[i]);
    }
}

/* ---------------- submit ---------------- */

int
pyccl_call_submit(pyccl_state *st, const char *op, const pyccl_task *tasks,
                  Py_ssize_t n, int redop, const pyccl_premul *premul,
                  PyThread_type_lock serialize, pyccl_comm *const *comms,
                  Py_ssize_t ncomms)
{
    return pyccl_enqueue(st, op, tasks, n, redop, premul, serialize, comms, ncomms);
}

int
pyccl_call_run(pyccl_state *st, const char *op, pyccl_comm *c, const pyccl_task *tasks,
               Py_ssize_t n, int redop, const pyccl_premul *premul)
{
    /* The call begins: the enqueue checks c before it enqueues anything
     * (its failure first, as pyccl_call_begin would: nothing runs between). */
    pyccl_watch_reap(st);
    pyccl_call_hold(c);
    int rc = pyccl_enqueue(st, op, tasks, n, redop, premul, NULL, &c, 1);
    pyccl_call_end(c);
    return rc;
}

int
pyccl_call_track(pyccl_state *st, const char *op, pyccl_comm *c, cudaStream_t s,
                 int *stop, const char *gave_up)
{
    /* never inside a pyccl.group(): the own kernels leave those to NCCL */
    if (gave_up != NULL) {
        /* failed now (the watch's record where c had none): the enqueue
         * below finds the failure and raises it, enqueuing nothing */
        pyccl_comm_time_out(st, c, stop, gave_up);
        if (!pyccl_comm_failed(c)) {
            return 0; /* no memory for the record: c stays as it was */
        }
    }
    if (gave_up == NULL && c->watch != NULL) {
        /* with a timeout: the kernels' waits on peers are bounded by it,
         * and the watchdog reads their word; no event */
        return pyccl_watch_launched(st, op, c, s);
    }
    /* a row of the kernel launched: noted (without a watch), or, with a
     * watch that only records a failure, that failure raised */
    const pyccl_task launched = {.coll = PYCCL_LAUNCHED, .comm = c->comm, .stream = s};
    return pyccl_enqueue(st, op, &launched, 1, ncclSum, NULL, NULL, &c, 1);
}

/* ---------------- destroy and abort ---------------- */

/* In a child made by fork(): c is a copy (its locks maybe held by a thread
 * that does not exist here, its handle the parent's), so destroy() and
 * abort() only forget it: gone, nothing called, nothing freed. */
static int
forget_in_child(pyccl_comm *c)
{
    if (c->pid == pyccl_pid()) {
        return 0;
    }
    c->life = PYCCL_LIFE_GONE;
    return 1;
}

int
pyccl_call_destroy_begin(pyccl_state *st, const char *op, pyccl_comm *c)
{
    if (forget_in_child(c)) {
        return 1;
    }
    pyccl_watch_reap(st);
    if (c->pending) {
        return pyccl_raise_not_ready(op);
    }
    if (c->life != PYCCL_LIFE_USABLE) {
        return 1; /* destroyed already, or by another thread right now */
    }
    if (c->in_group > 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: the communicator (rank %d of %d) is in use: "
                     "enqueued on inside a pyccl.group() that has not "
                     "ended, or by another thread; destroy it afterwards",
                     op, c->rank, c->size);
        return -1;
    }
    if (c->inflight > 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: the communicator (rank %d of %d) is in use by "
                     "another thread; destroy it once that call returned",
                     op, c->rank, c->size);
        return -1;
    }
    c->life = PYCCL_LIFE_DESTROYING;
    return 0;
}

void
pyccl_call_destroy_end(pyccl_comm *c)
{
    c->life = PYCCL_LIFE_GONE;
}

int
pyccl_call_abort_check(pyccl_state *st, pyccl_comm *c)
{
    if (forget_in_child(c)) {
        return 2;
    }
    pyccl_watch_reap(st);
    if (c->pending) {
        return pyccl_raise_not_ready("abort");
    }
    if (c->life == PYCCL_LIFE_DESTROYING) {
        /* destroy() owns the handle now; what it may wait for (the own
         * kernels, its release barrier) is told to give up */
        __atomic_store_n(&c->abort_asked, 1, __ATOMIC_RELEASE);
        return 1;
    }
    if (c->in_group > 0) {
        return pyccl_raise_abort_in_group(c);
    }
    /* Calls of other threads in flight, with or without a timeout: the
     * abort waits for the communicator's lock, which a thread holds only
     * while inside NCCL (never across a wait on peers), and each of those
     * calls looks at the handle again under the lock before it calls NCCL
     * (pyccl_comm_enter, the enqueue's second look), raising "aborted". */
    __atomic_add_fetch(&c->aborting, 1, __ATOMIC_RELEASE);
    return 0;
}

void
pyccl_call_abort_end(pyccl_comm *c)
{
    __atomic_sub_fetch(&c->aborting, 1, __ATOMIC_RELEASE);
}
