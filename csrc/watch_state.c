/* A watched communicator as the door and the methods see it: its timeout
 * read (seconds or a datetime.timedelta), its failure looked at and raised,
 * its lock entered around a short NCCL call, a failure recorded for a
 * communicator (with or without a watch) that gives up; waits with the GIL
 * released (a signal between pauses) and the poll of an NCCL call in
 * progress; the communicators of groups whose thread ended with them open
 * (handed over at the thread's end by enqueue.c, failed at the door's next
 * look: pyccl_watch_reap). */
#include "timeouts.h"
#include "locks.h"
#include "watch.h"
#include "enqueue.h"
#include "tensor.h"
#include "errors.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int
mark_untimed(pyccl_state *st, pyccl_comm *c, int kind, const char *reason, int abort)
{
    const pyccl_api *a = &st->api;
    struct pyccl_watch *w = new_watch(st, c, 0.0);
    if (w == NULL) {
        return -1;
    }
    snprintf(w->reason, sizeof w->reason, "%s", reason);
    w->failed = kind;
    /* Under c's lock: no other thread is inside NCCL on the handle (an
     * own-kernel set-up waits between its calls), and none uses it after.
     * abort() waits for a thread inside an NCCL call (a blocking handle
     * cannot be aborted under it) with signals looked at between pauses:
     * Ctrl-C ends that wait, nothing changed. */
    if (abort && pyccl_trylock(&c->mu, PYCCL_LOCK_COMM) != 0) {
        waiter wt;
        int got = 0;
        waiter_start(&wt, 1);
        while (!got) {
            if (waiter_pause(&wt) < 0) {
                break;
            }
            got = pyccl_trylock(&c->mu, PYCCL_LOCK_COMM) == 0;
        }
        waiter_finish(&wt);
        if (!got) {
            free_watch(w);
            return -1; /* the signal handler's exception */
        }
    }
    else if (!abort) {
        pyccl_comm_lock(c);
    }
    if (abort && c->in_group > 0) {
        /* another thread's pyccl.group() took c while this one waited for
         * the lock (the door saw none): its work is in NCCL's group */
        pyccl_unlock(&c->mu);
        free_watch(w);
        return pyccl_raise_abort_in_group(c);
    }
    Py_BEGIN_ALLOW_THREADS
    ncclComm_t comm = c->comm;
    c->comm = NULL;
    /* the record before NCCL's abort (which takes a while): a call of
     * another thread that looks meanwhile raises it, not "destroyed" */
    __atomic_store_n(&c->watch, w, __ATOMIC_RELEASE);
    if (comm != NULL && a->loaded) {
        a->ncclCommAbort(comm);
    }
    pyccl_lead_free(a, c);
    pyccl_unlock(&c->mu);
    Py_END_ALLOW_THREADS
    return 0;
}

void
pyccl_lead_free(const pyccl_api *a, pyccl_comm *c)
{
    if (c->lead == NULL || __atomic_load_n(&c->lead_waiters, __ATOMIC_ACQUIRE) > 0) {
        return;
    }
    /* not in a fork's child (its copy names the parent's events), nor at
     * exit: there they are left to the process's end */
    if (a->loaded && c->pid == pyccl_pid() && !Py_IsFinalizing()) {
        for (int i = 0; i < PYCCL_LEAD_MARKS + 1; i++) {
            a->cudaEventDestroy(c->lead[i]);
        }
    }
    PyMem_RawFree(c->lead);
    c->lead = NULL;
    c->nlead = 0;
}

void
fail_comm(pyccl_state *st, pyccl_comm *c, int kind, const char *reason)
{
    struct pyccl_watch *w = c->watch;
    if (w == NULL) {
        if (mark_untimed(st, c, kind, reason, 0) < 0) {
            PyErr_Clear();
        }
        return;
    }
    lock_watch(w);
    Py_BEGIN_ALLOW_THREADS
    watch_fail(w, kind, 0, "%s", reason);
    Py_END_ALLOW_THREADS
    pyccl_unlock(w->mu);
}

void
pyccl_comm_time_out(pyccl_state *st, pyccl_comm *c, int *stop, const char *reason)
{
    if (stop != NULL) {
        /* the own kernels that wait for peers give up first */
        *(volatile int *)stop = 2;
    }
    fail_comm(st, c, PYCCL_FAIL_TIMEOUT, reason);
}

/* ---------------- Python-facing helpers ---------------- */

pyccl_state *
watch_state_of(PyObject *self)
{
    return pyccl_state_of_type(Py_TYPE(self));
}

int
raise_failure(pyccl_state *st, const char *op, struct pyccl_watch *w)
{
    return pyccl_raise_failure(st, op, failed_kind(w), w->code, w->reason, w->timeout);
}

double
pyccl_comm_timeout(const pyccl_comm *c)
{
    return c->timeout;
}

int
pyccl_comm_failed(const pyccl_comm *c)
{
    return c->watch != NULL && failed_kind(c->watch);
}

int
pyccl_watch_check(pyccl_state *st, const char *op, pyccl_comm *c)
{
    struct pyccl_watch *w = c->watch;
    if (w == NULL || !failed_kind(w)) {
        return 0;
    }
    return raise_failure(st, op, w);
}

int
pyccl_comm_alive(pyccl_state *st, const char *op, pyccl_comm *c)
{
    if (pyccl_raise_forked(op, c) < 0) {
        return -1; /* nothing of it read: a parent's thread may hold its locks */
    }
    pyccl_watch_reap(st); /* a group whose thread ended fails its communicators */
    if (c->watch != NULL && pyccl_watch_check(st, op, c) < 0) {
        return -1; /* timed out or aborted */
    }
    if (pyccl_raise_unusable(op, c) < 0) {
        if (pyccl_comm_failed(c)) {
            /* failed between the two looks (abort() and the watchdog fail
             * a watch without the GIL, the failure published before the
             * handle goes): that is what happened to it */
            PyErr_Clear();
            return pyccl_watch_check(st, op, c);
        }
        return -1;
    }
    return 0;
}

int
pyccl_comm_refresh(pyccl_state *st, const char *op, pyccl_comm *c)
{
    if (c->pending) {
        return pyccl_comm_alive(st, op, c); /* raises "not ready" */
    }
    if (c->size > 0 || c->comm == NULL) {
        return 0;
    }
    int rank = -1, size = 0;
    ncclResult_t r = st->api.ncclCommUserRank(c->comm, &rank);
    if (r == ncclSuccess) {
        r = st->api.ncclCommCount(c->comm, &size);
    }
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, op, r, NULL);
        return -1;
    }
    if (size <= 0) {
        return pyccl_raise_not_ready(op);
    }
    c->rank = rank;
    c->size = size;
    return 0;
}

/* Lock w (its communicator's lock), the GIL released only while waiting. */
void
lock_watch(struct pyccl_watch *w)
{
    pyccl_lock_released(w->mu, PYCCL_LOCK_COMM);
}

int
pyccl_comm_enter(pyccl_state *st, const char *op, pyccl_comm *c)
{
    /* the one lock of c, with or without a watch: abort() changes `watch`
     * only under it, and the caller's call is begun (destroy() waits) */
    pyccl_comm_lock(c);
    struct pyccl_watch *w = c->watch;
    if (w == NULL ? c->comm != NULL : !failed_kind(w)) {
        if (pyccl_group_others(c)) {
            /* as a collective's enqueue: NCCL would work on c beside that
             * group (its end holds no lock of ours) */
            pyccl_unlock(&c->mu);
            return pyccl_raise_other_group(op, c);
        }
        return 0;
    }
    /* abort(), a failure or destroy() ended the handle while this thread
     * waited for the lock: nothing for NCCL */
    pyccl_unlock(&c->mu);
    return w != NULL ? pyccl_watch_check(st, op, c) : pyccl_raise_unusable(op, c);
}

void
pyccl_comm_leave(pyccl_comm *c)
{
    pyccl_unlock(&c->mu);
}

/* ---------------- waiting with the GIL released ---------------- */

int
pyccl_wait_mark(const volatile unsigned long long *done, unsigned long long mark,
                const volatile int *stop, int *waiters)
{
    if (*done >= mark || *stop != 0) {
        return 0;
    }
    __atomic_add_fetch(waiters, 1, __ATOMIC_ACQ_REL);
    waiter wt;
    waiter_start(&wt, 1);
    int rc = 0;
    while (*done < mark && *stop == 0) {
        if (waiter_pause(&wt) < 0) {
            rc = -1;
            break;
        }
    }
    /* the words are not read again: their owner may free them now */
    __atomic_sub_fetch(waiters, 1, __ATOMIC_ACQ_REL);
    waiter_finish(&wt);
    return rc;
}

void
waiter_start(waiter *wt, int interruptible)
{
    wt->spins = 0;
    wt->interruptible = interruptible;
    wt->next_signals = pyccl_now_s() + PYCCL_SIGNAL_PERIOD;
    wt->ts = PyEval_SaveThread();
}

void
waiter_finish(waiter *wt)
{
    PyEval_RestoreThread(wt->ts);
}

/* Sleep a little, longer the longer the wait (collectives often end within
 * microseconds); every 20 ms take the GIL for PyErr_CheckSignals.  -1 when
 * a signal handler raised (the exception stays set for waiter_finish).
 * Never called with a watch's lock held. */
int
waiter_pause(waiter *wt)
{
    unsigned k = wt->spins++;
    if (k < 64) {
        sched_yield();
    }
    else {
        struct timespec d = {0, k < 256 ? 20000L : k < 1024 ? 200000L : 1000000L};
        nanosleep(&d, NULL);
    }
    if (!wt->interruptible) {
        return 0;
    }
    double now = pyccl_now_s();
    if (now >= wt->next_signals) {
        wt->next_signals = now + PYCCL_SIGNAL_PERIOD;
        PyEval_RestoreThread(wt->ts);
        int r = PyErr_CheckSignals();
        wt->ts = PyEval_SaveThread();
        if (r < 0) {
            return -1;
        }
    }
    return 0;
}

/* ---------------- polling an NCCL call in progress ---------------- */

int
poll_watch(waiter *wt, struct pyccl_watch *w, double deadline, ncclResult_t *res)
{
    for (;;) {
        if (*w->comm == NULL) {
            return 2; /* aborted meanwhile (abort() from a signal handler) */
        }
        ncclResult_t e = ncclSuccess;
        w->api->ncclCommGetAsyncError(*w->comm, &e);
        if (e != ncclInProgress) {
            *res = e;
            return 0;
        }
        if (pyccl_now_s() > deadline) {
            return 1;
        }
        pyccl_unlock(w->mu);
        int sig = waiter_pause(wt);
        pyccl_lock(w->mu, PYCCL_LOCK_COMM);
        if (sig < 0) {
            return -1;
        }
    }
}

/* ---------------- groups of threads that ended ---------------- */

/* A communicator whose group's thread ended: failed, with what happened. */
static void
fail_lost(pyccl_comm *c, void *arg)
{
    pyccl_state *st = arg;
    char reason[256];
    snprintf(reason, sizeof reason,
             "the communicator (rank %d of %d) had work queued in a pyccl.group() of a "
             "thread that ended without ending the group; that work never ran, and the "
             "communicator was aborted",
             c->rank, c->size);
    fail_comm(st, c, PYCCL_FAIL_ABORTED, reason);
}

void
pyccl_watch_reap(pyccl_state *st)
{
    pyccl_group_reap(fail_lost, st);
}
