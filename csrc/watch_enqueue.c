/* The one enqueue of every call (pyccl_enqueue: its communicators checked,
 * the group joined, back-pressure, the NCCL calls, their completion, an
 * event, and what went wrong raised at one place), with or without a
 * timeout: a communicator's watch, where it has one, is a field looked at
 * on the way; and the end of a group (its watched communicators' work
 * tracked, NCCL's marks on the others).  An own kernel's launch is one of its rows
 * (PYCCL_LAUNCHED).  A group left open by a thread that ended is handed
 * over at the thread's end and failed by the door's reap. */
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

/* ---------------- calls under the watch: the enqueue, a group's end ---------------- */

/* Lock all of ws (sorted, distinct) once none is busy and, with need_room,
 * each has room for another event.  0: all locked.  1: ws[*which] failed
 * (nothing locked).  -1: interrupted (nothing locked). */
int
acquire_all(waiter *wt, struct pyccl_watch **ws, int n, int need_room,
            int *which)
{
    for (;;) {
        int i, wait = 0;
        for (i = 0; i < n; i++) {
            struct pyccl_watch *w = ws[i];
            pyccl_lock(w->mu, PYCCL_LOCK_COMM);
            if (w->failed) {
                *which = i;
                break;
            }
            if (w->busy) {
                wait = 1;
                break;
            }
            if (need_room && w->nq >= PYCCL_MAX_PENDING) {
                /* the watchdog drops finished events every 10 ms; a queue
                 * full sooner is looked at here, and waited for if the GPU
                 * is that far behind */
                const char *bad_op = NULL;
                int prev;
                pyccl_device_enter(w->api, w->device, &prev);
                cudaError_t e = watch_retire(w, &bad_op);
                pyccl_device_leave(w->api, w->device, prev);
                if (e != cudaSuccess) {
                    fail_cuda(w, bad_op, e);
                    *which = i;
                    break;
                }
                if (w->nq >= PYCCL_MAX_PENDING) {
                    wait = 1;
                    break;
                }
            }
        }
        if (i == n) {
            return 0;
        }
        for (int j = 0; j <= i; j++) {
            pyccl_unlock(ws[j]->mu);
        }
        if (!wait) {
            return 1;
        }
        if (waiter_pause(wt) < 0) {
            return -1;
        }
    }
}

static int
cmp_ptr(const void *x, const void *y)
{
    uintptr_t a = (uintptr_t)*(void *const *)x, b = (uintptr_t)*(void *const *)y;
    return a < b ? -1 : a > b;
}

/* The enqueue returned ncclInProgress (NCCL finishes the call in its own
 * thread: the first call to a peer connects to it): poll every watch until
 * done.  `busy` keeps other threads and the watchdog off meanwhile, the
 * locks are released while polling and held again on return.  1: the
 * deadline of ws[*which] passed; -1: interrupted; 0: done, *r the first
 * error (ncclInProgress becomes ncclSuccess). */
static int
poll_in_progress(const pyccl_api *a, waiter *wt, struct pyccl_watch **ws, int nw,
                 ncclResult_t *r, int *which)
{
    int polled = 0;
    for (int j = 0; j < nw; j++) {
        ws[j]->busy++;
        pyccl_unlock(ws[j]->mu);
    }
    double t0 = pyccl_now_s();
    for (int j = 0; j < nw && polled == 0; j++) {
        struct pyccl_watch *w = ws[j];
        ncclResult_t e = ncclSuccess;
        pyccl_lock(w->mu, PYCCL_LOCK_COMM);
        int p = poll_watch(wt, w, t0 + w->timeout, &e);
        pyccl_unlock(w->mu);
        if (p == 0 && e != ncclSuccess && *r == ncclInProgress) {
            *r = e;
            *which = j;
        }
        else if (p == 1 || p == -1) {
            polled = p;
            *which = p == 1 ? j : *which;
        }
    }
    for (int j = 0; j < nw; j++) {
        pyccl_lock(ws[j]->mu, PYCCL_LOCK_COMM);
        ws[j]->busy--;
    }
    if (*r == ncclInProgress) {
        *r = ncclSuccess;
    }
    return polled;
}

/* The distinct watches of a call's communicators, in lock order, each with
 * the communicator it came from and whether this call is the first of the
 * thread's open group on it; and for each of the call's rows, the watch
 * (index into ws, -1: none) whose handle it runs on and its stream: what the
 * watch records its events after. */
typedef struct {
    struct pyccl_watch *ws_small[8], **ws;
    pyccl_comm *owners_small[8], **owners;
    int n;
    struct watch_row {
        int j;
        cudaStream_t stream;
    } rows_small[8], *rows;
    Py_ssize_t nrows;
    /* the first of the call's communicators (in their order) with a watch
     * that had failed before the call, or that is not usable (destroy()
     * begun by another thread while this one read its arguments): raised
     * as the door's begin would, failure first, nothing enqueued */
    pyccl_comm *bad;
} watch_set;

/* After the NCCL calls outside a group, every watch locked: fail each as
 * the outcome says (timeout, interrupt, NCCL error; *which the one NCCL
 * failed on), or record an event after its work on each of its streams;
 * then unlock it.  Returns the first event record's error. */
static cudaError_t
settle_watches(const pyccl_api *a, const char *op, const watch_set *g, ncclResult_t r,
               int polled, const char *last, int *which)
{
    cudaError_t rec_err = cudaSuccess;
    for (int j = 0; j < g->n; j++) {
        struct pyccl_watch *w = g->ws[j];
        if (polled > 0) {
            /* one NCCL group: the others cannot finish alone */
            fail_timeout(w, op, "its peers");
        }
        else if (polled < 0) {
            fail_interrupted(w, op);
        }
        else if (r != ncclSuccess && *w->comm != NULL) {
            /* In non-blocking mode a failed call may leave the
             * communicator in error: then it is unusable. */
            ncclResult_t e = ncclSuccess;
            a->ncclCommGetAsyncError(*w->comm, &e);
            if (e != ncclSuccess && e != ncclInProgress) {
                *which = j;
                watch_fail(w, PYCCL_FAIL_NCCL, (int)e,
                     "%s: rank %d of %d: NCCL error %d (%s)%s%s; the "
                     "communicator was aborted",
                     op, w->rank, w->size, (int)e,
                     a->ncclGetErrorString(e), last[0] ? ": " : "",
                     last);
            }
        }
        else if (r == ncclSuccess && *w->comm != NULL) {
            for (Py_ssize_t i = 0; i < g->nrows && rec_err == cudaSuccess; i++) {
                int dup = 0;
                if (g->rows[i].j != j) {
                    continue;
                }
                for (Py_ssize_t k = 0; k < i; k++) {
                    dup |= g->rows[k].j == j && g->rows[k].stream == g->rows[i].stream;
                }
                if (!dup) {
                    call_begin(w, 1);
                    rec_err = watch_record(w, g->rows[i].stream, op);
                    if (call_end(w, op)) {
                        rec_err = cudaSuccess;
                        break;
                    }
                }
            }
        }
        pyccl_unlock(w->mu);
    }
    return rec_err;
}

/* A communicator without a watch was used on stream s (for wait(), which
 * records an event on each): a compare when s is its last stream again.
 * -1 with MemoryError. */
static int
note_stream(pyccl_comm *c, cudaStream_t s)
{
    if (c->nstreams > 0 && s == c->last_stream) {
        return 0;
    }
    c->last_stream = s;
    for (int i = 0; i < c->nstreams; i++) {
        if (c->streams[i] == s) {
            return 0;
        }
    }
    cudaStream_t *v = PyMem_Realloc(c->streams, (size_t)(c->nstreams + 1) * sizeof *v);
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    v[c->nstreams++] = s;
    c->streams = v;
    return 0;
}

/* ---------------- NCCL's marks without a watch (pyccl.h: PYCCL_LEAD_EVERY) ---------------- */

/* After k NCCL calls on c (no watch; c's lock held), one call outside a
 * group or a pyccl.group()'s calls at its end: when the count passes a
 * multiple of PYCCL_LEAD_EVERY, records a mark, an event after their work on
 * s (not while s is captured: the record would be a node of the graph), and
 * returns the event of the mark PYCCL_LEAD_MARKS back for the caller to wait
 * for, this thread counted in c->lead_waiters (NULL: nothing to wait for).
 * A mark that cannot be had (no event, a CUDA error) is left out. */
static cudaEvent_t
lead_mark(const pyccl_api *a, pyccl_comm *c, cudaStream_t s, unsigned k)
{
    const unsigned long long before = c->ncalls;
    c->ncalls += k;
    if (before / PYCCL_LEAD_EVERY == c->ncalls / PYCCL_LEAD_EVERY) {
        return NULL;
    }
    enum { RING = PYCCL_LEAD_MARKS + 1 };
    cudaEvent_t back = NULL;
    cudaError_t e = cudaSuccess;
    /* the device made current for the handles that name the current
     * device's stream (0, cudaStreamLegacy, cudaStreamPerThread) and to make
     * the events */
    int prev = -1;
    const int enter = (uintptr_t)s <= 2 || c->lead == NULL;
    if (enter && (e = pyccl_device_enter(a, c->device, &prev)) != cudaSuccess) {
        a->cudaGetLastError();
        return NULL;
    }
    if (pyccl_stream_captured(a, s)) {
        goto out;
    }
    if (c->lead == NULL) {
        cudaEvent_t *v = PyMem_RawCalloc(RING, sizeof *v);
        int made = 0;
        while (v != NULL && made < RING &&
               (e = a->cudaEventCreateWithFlags(&v[made], cudaEventDisableTiming)) == cudaSuccess) {
            made++;
        }
        if (made < RING) {
            for (int i = 0; i < made; i++) {
                a->cudaEventDestroy(v[i]);
            }
            PyMem_RawFree(v);
            goto out;
        }
        c->lead = v;
        c->nlead = 0;
    }
    if ((e = a->cudaEventRecord(c->lead[c->nlead % RING], s)) != cudaSuccess) {
        goto out;
    }
    if (c->nlead >= PYCCL_LEAD_MARKS) {
        back = c->lead[(c->nlead - PYCCL_LEAD_MARKS) % RING];
        __atomic_add_fetch(&c->lead_waiters, 1, __ATOMIC_ACQ_REL);
    }
    c->nlead++;
out:
    if (e != cudaSuccess) {
        a->cudaGetLastError();
    }
    if (enter) {
        pyccl_device_leave(a, c->device, prev);
    }
    return back;
}

/* Wait (in wt: the GIL released, a signal looked at between pauses; no
 * lock held) until the mark `ev` of c was reached, or abort() or a failure
 * of c (its record) ended the handle, whose work then ends too.  0, or -1
 * with the signal handler's exception. */
static int
lead_wait(const pyccl_api *a, waiter *wt, pyccl_comm *c, cudaEvent_t ev)
{
    int rc = 0;
    for (;;) {
        if (__atomic_load_n(&c->watch, __ATOMIC_ACQUIRE) != NULL) {
            break;
        }
        cudaError_t e = a->cudaEventQuery(ev);
        if (e != cudaErrorNotReady) {
            if (e != cudaSuccess) {
                a->cudaGetLastError(); /* the next call meets it */
            }
            break;
        }
        if (waiter_pause(wt) < 0) {
            rc = -1;
            break;
        }
    }
    /* the events are not read again: pyccl_lead_free may free them now */
    __atomic_sub_fetch(&c->lead_waiters, 1, __ATOMIC_ACQ_REL);
    return rc;
}

void
pyccl_watch_kernels(pyccl_comm *c, int *word)
{
    pyccl_lock(&c->mu, PYCCL_LOCK_COMM);
    if (c->watch != NULL) {
        c->watch->kernel_word = word;
    }
    pyccl_unlock(&c->mu);
}

int
pyccl_watch_launched(pyccl_state *st, const char *op, pyccl_comm *c, cudaStream_t s)
{
    /* how far the host runs ahead of the kernels is bounded for every
     * communicator (ar.c's marks): only the stream and the failure here */
    __atomic_store_n(&c->watch->kernel_op, op, __ATOMIC_RELAXED);
    if (note_stream(c, s) < 0) {
        return -1;
    }
    return pyccl_watch_check(st, op, c);
}

/* c may take the call: what pyccl_comm_alive raises otherwise (`me`: this
 * process's id). */
static int
usable(const pyccl_comm *c, pid_t me)
{
    return pyccl_comm_usable(c, me) && (c->watch == NULL || !failed_kind(c->watch));
}

static void
watch_set_free(watch_set *g)
{
    if (g->ws != g->ws_small) {
        PyMem_Free(g->ws);
        PyMem_Free(g->owners);
    }
    if (g->rows != g->rows_small) {
        PyMem_Free(g->rows);
    }
}

/* -1 with MemoryError.  The first communicator that is not usable (its
 * watch failed already, destroyed, not ready, a fork's copy) is noted
 * (g->bad), for the call to raise at its end as the door's begin would
 * (pyccl_call_run leaves the check to this); the streams of the others
 * without a watch are noted for wait(). */
static int
watch_set_fill(watch_set *g, pyccl_state *st, const char *op, const pyccl_task *tasks,
               Py_ssize_t n, pyccl_comm *const *comms, Py_ssize_t ncomms)
{
    g->n = 0;
    g->ws = g->ws_small;
    g->owners = g->owners_small;
    g->rows = g->rows_small;
    g->nrows = n;
    g->bad = NULL;
    if (n > 8) {
        g->rows = PyMem_Calloc((size_t)n, sizeof *g->rows);
        if (g->rows == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (ncomms > 8) {
        g->ws = PyMem_Calloc((size_t)ncomms, sizeof *g->ws);
        g->owners = PyMem_Calloc((size_t)ncomms, sizeof *g->owners);
        if (g->ws == NULL || g->owners == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    const pid_t me = ncomms > 0 ? pyccl_pid() : 0;
    for (Py_ssize_t i = 0; i < ncomms; i++) {
        pyccl_comm *c = comms[i];
        struct pyccl_watch *w = c->watch;
        if (g->bad == NULL && !usable(c, me)) {
            g->bad = c;
        }
        if (w == NULL) {
            /* for wait(): the streams its work went to */
            for (Py_ssize_t k = 0; g->bad == NULL && k < n; k++) {
                if (tasks[k].comm == c->comm && note_stream(c, tasks[k].stream) < 0) {
                    return -1;
                }
            }
            continue;
        }
        int seen = 0;
        for (int j = 0; j < g->n; j++) {
            seen |= g->ws[j] == w;
        }
        if (!seen) {
            g->ws[g->n++] = w;
        }
    }
    /* one lock order for every thread */
    qsort(g->ws, (size_t)g->n, sizeof *g->ws, cmp_ptr);
    for (int j = 0; j < g->n; j++) {
        for (Py_ssize_t i = 0; i < ncomms; i++) {
            if (comms[i]->watch == g->ws[j]) {
                g->owners[j] = comms[i];
                break;
            }
        }
    }
    /* Each row's watch, by its handle: with every communicator usable (else
     * nothing is enqueued), a watched one's handle is never replaced, only
     * cleared when it fails (then the call raises), and differs from every
     * other's. */
    for (Py_ssize_t i = 0; i < n; i++) {
        g->rows[i].j = -1;
        g->rows[i].stream = tasks[i].stream;
        for (int j = 0; j < g->n; j++) {
            if (tasks[i].comm == g->owners[j]->comm) {
                g->rows[i].j = j;
                break;
            }
        }
    }
    return 0;
}

/* What came of a call under the watch, raised at one place at its end. */
typedef struct {
    int refused;    /* the open group holds communicators without a timeout */
    int got;        /* acquire_all: 0 locked, 1 ws[which] failed, -1 interrupted */
    int polled;     /* 1: the deadline of ws[which] passed; -1: interrupted */
    int which;
    ncclResult_t r; /* the NCCL calls' (ncclInProgress polled to its end) */
    int lead;       /* waiting for NCCL's mark without a watch: -1 interrupted */
    pyccl_comm *other; /* in another thread's open group: nothing enqueued */
    cudaError_t rec_err;
    char last[PYCCL_LAST_ERROR_SIZE];
} timed_outcome;

/* The calls were made and every watch is well. */
static int
all_well(const watch_set *g, const timed_outcome *o)
{
    int ok = g->bad == NULL && o->other == NULL && !o->refused && o->got == 0 && o->polled == 0 &&
             o->lead == 0 && o->r == ncclSuccess && o->rec_err == cudaSuccess;
    for (int j = 0; ok && j < g->n; j++) {
        ok = !failed_kind(g->ws[j]);
    }
    return ok;
}

/* The watch whose failure the call raises: the one that failed first
 * (acquiring, or from `which` on after the calls), or -1. */
static int
first_failed(watch_set *g, const timed_outcome *o)
{
    if (o->got == 1) {
        return o->which;
    }
    if (o->refused || o->got < 0) {
        return -1;
    }
    int first = -1;
    for (int k = 0; k < g->n; k++) {
        int j = (k + o->which) % g->n; /* the one that failed first, first */
        if (o->polled < 0 || failed_kind(g->ws[j])) {
            first = first < 0 ? j : first;
        }
    }
    /* interrupted mid-call, every handle aborted: the signal handler's
     * exception is the one raised */
    return o->polled < 0 ? -1 : first;
}

/* The call did not go well: raise why (-1), the first failure first. */
static int
raise_outcome(pyccl_state *st, const char *op, watch_set *g, const timed_outcome *o)
{
    if (g->bad != NULL) {
        /* found before anything was enqueued (at the first look, or under
         * the locks for one that abort() ended meanwhile): raises */
        (void)pyccl_comm_alive(st, op, g->bad);
        return -1;
    }
    if (o->other != NULL) {
        return pyccl_raise_other_group(op, o->other);
    }
    int failed = first_failed(g, o);
    if (failed >= 0) {
        return raise_failure(st, op, g->ws[failed]);
    }
    if (o->refused) {
        return pyccl_raise_mixed_group(st, op);
    }
    if (o->got < 0 || o->polled < 0 || o->lead < 0) {
        return -1; /* the signal handler's exception */
    }
    if (o->r != ncclSuccess) {
        pyccl_raise_nccl(st, op, o->r, o->last);
        return -1;
    }
    pyccl_raise_cuda(st, op, "cudaEventRecord", o->rec_err);
    return -1;
}

/* Whether c had a watch at the enqueue's first look (watch_set_fill): the
 * watched ones are locked by acquire_all, the others by each_plain, whatever
 * became of c->watch since (abort() gives a communicator without a timeout
 * its record under the lock that each_plain may be waiting for). */
static int
watched_at_fill(const watch_set *g, const pyccl_comm *c)
{
    for (int j = 0; j < g->n; j++) {
        if (g->owners[j] == c) {
            return 1;
        }
    }
    return 0;
}

/* Inside pyccl.group(): remember each watched communicator's streams for
 * the group's end (which the watch then covers), and count the NCCL calls
 * on each other one (its marks, made at the group's end).  -1 with
 * MemoryError. */
static int
add_to_group(const char *op, watch_set *g, const pyccl_task *tasks, Py_ssize_t n,
             pyccl_comm *const *comms, Py_ssize_t ncomms)
{
    for (int j = 0; j < g->n; j++) {
        for (Py_ssize_t i = 0; i < g->nrows; i++) {
            if (g->rows[i].j == j &&
                pyccl_group_note_work(g->owners[j], g->rows[i].stream, op) < 0) {
                return -1;
            }
        }
    }
    for (Py_ssize_t i = 0; i < ncomms; i++) {
        pyccl_comm *c = comms[i];
        int seen = watched_at_fill(g, c);
        for (Py_ssize_t k = 0; k < i && !seen; k++) {
            seen = comms[k] == c;
        }
        unsigned calls = 0;
        cudaStream_t s = NULL;
        for (Py_ssize_t t = 0; !seen && t < n; t++) {
            if (tasks[t].coll != PYCCL_LAUNCHED && tasks[t].comm == c->comm) {
                calls++;
                s = tasks[t].stream;
            }
        }
        if (calls > 0) {
            pyccl_group_note_calls(c, s, calls);
        }
    }
    return 0;
}

/* The next communicator of cs after `after` in address order that had no
 * watch (each once, however often cs repeats it). */
static pyccl_comm *
next_plain(const watch_set *g, pyccl_comm *const *cs, Py_ssize_t n, uintptr_t after)
{
    pyccl_comm *next = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t p = (uintptr_t)cs[i];
        if (p > after && (next == NULL || p < (uintptr_t)next) && !watched_at_fill(g, cs[i])) {
            next = cs[i];
        }
    }
    return next;
}

/* Lock (or unlock) each communicator of cs that had no watch, in address
 * order (after the watched ones, locked by acquire_all: the one order of
 * csrc/locks.h), so that two calls over the same set never deadlock.  One
 * that abort() ended since is locked too: any call on it now finds it
 * failed and locks nothing. */
static void
each_plain(const watch_set *g, pyccl_comm *const *cs, Py_ssize_t n, int lock)
{
    if (n == 1) { /* the Communicator methods: no search */
        if (g->n == 0) {
            lock ? pyccl_lock(&cs[0]->mu, PYCCL_LOCK_COMM) : pyccl_unlock(&cs[0]->mu);
        }
        return;
    }
    for (pyccl_comm *c = next_plain(g, cs, n, 0); c != NULL; c = next_plain(g, cs, n, (uintptr_t)c)) {
        lock ? pyccl_lock(&c->mu, PYCCL_LOCK_COMM) : pyccl_unlock(&c->mu);
    }
}

/* A communicator of cs that had no watch at the enqueue's first look and
 * has been ended since (abort() from another thread: its call in flight
 * does not stop abort(), which waits only for the lock), looked at again
 * with the locks of each_plain held; NULL when none was. */
static pyccl_comm *
plain_gone(const watch_set *g, pyccl_comm *const *cs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        pyccl_comm *c = cs[i];
        if (!watched_at_fill(g, c) && (c->watch != NULL || c->comm == NULL)) {
            return c;
        }
    }
    return NULL;
}

/* Only rows of kernels already launched, on communicators without a watch:
 * nothing to lock or call (their streams are noted). */
static int
launched_only(const watch_set *g, const pyccl_task *tasks, Py_ssize_t n)
{
    if (g->n > 0 || g->bad != NULL) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (tasks[i].coll != PYCCL_LAUNCHED) {
            return 0;
        }
    }
    return 1;
}

int
pyccl_enqueue(pyccl_state *st, const char *op, const pyccl_task *tasks, Py_ssize_t n,
              int redop, const pyccl_premul *premul, PyThread_type_lock serialize,
              pyccl_comm *const *comms, Py_ssize_t ncomms)
{
    const pyccl_api *a = &st->api;
    int in_group = pyccl_group_depth() > 0;
    timed_outcome o = {.r = ncclSuccess, .rec_err = cudaSuccess};
    cudaEvent_t lead = NULL;
    watch_set g;
    /* the communicators first, then this thread's open group (refused
     * before anything is enqueued: a group holds one kind, watched or not) */
    if (watch_set_fill(&g, st, op, tasks, n, comms, ncomms) < 0 ||
        (g.bad == NULL && !launched_only(&g, tasks, n) &&
         (o.refused = pyccl_group_join(comms, ncomms, g.n > 0)) < 0)) {
        watch_set_free(&g);
        return -1;
    }
    if (launched_only(&g, tasks, n)) {
        watch_set_free(&g);
        return 0;
    }
    struct pyccl_watch **ws = g.ws;
    if (!o.refused && g.bad == NULL) {
        waiter wt;
        waiter_start(&wt, 1);
        if (serialize != NULL) {
            /* taken without the GIL: a holder may be waiting for the GIL */
            PyThread_acquire_lock(serialize, WAIT_LOCK);
        }
        o.got = acquire_all(&wt, ws, g.n, !in_group, &o.which);
        if (o.got == 0) {
            /* one NCCL call, outside any group, is all a claim may end */
            const int claimable = n == 1 && premul == NULL && !in_group;
            for (int j = 0; j < g.n; j++) {
                call_begin(ws[j], claimable);
            }
            /* then the communicators without a watch (one thread at a time
             * in NCCL; with watched ones in the same call NCCL refuses the
             * group, but only at its end) */
            each_plain(&g, comms, ncomms, 1);
            pyccl_comm *gone = plain_gone(&g, comms, ncomms);
            for (Py_ssize_t i = 0; gone == NULL && o.other == NULL && i < ncomms; i++) {
                o.other = pyccl_group_others(comms[i]) ? comms[i] : NULL;
            }
            if (gone == NULL && o.other == NULL) {
                o.r = pyccl_enqueue_calls(a, tasks, n, redop, premul, o.last, sizeof o.last);
                if (o.r == ncclSuccess && !in_group && g.n == 0 && ncomms == 1) {
                    /* one communicator without a watch (its methods) */
                    lead = lead_mark(a, comms[0], tasks[n - 1].stream, 1);
                }
            }
            each_plain(&g, comms, ncomms, 0);
            for (int j = 0; j < g.n; j++) {
                call_end(ws[j], op);
            }
            if (gone != NULL || o.other != NULL) {
                /* nothing enqueued: raised at the end as the door would */
                g.bad = gone;
                for (int j = 0; j < g.n; j++) {
                    pyccl_unlock(ws[j]->mu);
                }
            }
            else if (in_group) {
                /* NCCL launches nothing before the group's end */
                o.r = o.r == ncclInProgress ? ncclSuccess : o.r;
                for (int j = 0; j < g.n; j++) {
                    pyccl_unlock(ws[j]->mu);
                }
            }
            else {
                if (o.r == ncclInProgress) {
                    o.polled = poll_in_progress(a, &wt, ws, g.n, &o.r, &o.which);
                }
                o.rec_err = settle_watches(a, op, &g, o.r, o.polled, o.last, &o.which);
            }
        }
        if (serialize != NULL) {
            PyThread_release_lock(serialize);
        }
        if (lead != NULL) {
            o.lead = lead_wait(a, &wt, comms[0], lead);
            if (o.lead == 0 && comms[0]->watch != NULL) {
                g.bad = comms[0]; /* aborted or failed meanwhile: raised */
            }
        }
        waiter_finish(&wt);
    }
    int rc = all_well(&g, &o) ? (in_group ? add_to_group(op, &g, tasks, n, comms, ncomms) : 0)
                              : raise_outcome(st, op, &g, &o);
    watch_set_free(&g);
    return rc;
}

/* The watch of a group entry's work, or NULL (an entry that only counts
 * its communicator in the group). */
static struct pyccl_watch *
work_watch(const pyccl_group_entry *e)
{
    return e->work ? ((pyccl_comm *)e->comm)->watch : NULL;
}

/* The group's end on its watched communicators: poll and track their
 * work.  -1 with an exception. */
static int
watched_group_end(pyccl_state *st, ncclResult_t r, const pyccl_group_entry *g, Py_ssize_t n)
{
    int interrupted = 0, any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        any |= work_watch(&g[i]) != NULL;
    }
    if (!any) {
        return 0;
    }
    const pyccl_api *a = &st->api;
    cudaError_t rec_err = cudaSuccess;
    waiter wt;
    waiter_start(&wt, 1);
    double t0 = pyccl_now_s();
    for (Py_ssize_t i = 0; i < n; i++) {
        struct pyccl_watch *w = work_watch(&g[i]);
        int first = w != NULL;
        for (Py_ssize_t k = 0; first && k < i; k++) {
            first &= work_watch(&g[k]) != w;
        }
        if (!first) {
            continue;
        }
        pyccl_lock(w->mu, PYCCL_LOCK_COMM);
        if (*w->comm != NULL && r == ncclInProgress) {
            /* NCCL launches the group in its own thread: poll until done,
             * busy keeping the watchdog and other threads off meanwhile */
            w->busy++;
            ncclResult_t e = ncclSuccess;
            int p = interrupted ? 2 : poll_watch(&wt, w, t0 + w->timeout, &e);
            if (p == 0 && e != ncclSuccess) {
                fail_nccl(w, g[i].op, e);
            }
            else if (p == 1) {
                fail_timeout(w, g[i].op, "its peers");
            }
            interrupted |= p == -1;
            w->busy--;
            if (interrupted) {
                fail_interrupted(w, g[i].op);
            }
        }
        else if (*w->comm != NULL && r != ncclSuccess) {
            /* the group failed: in non-blocking mode that may leave the
             * communicator in error, and then it is unusable */
            ncclResult_t e = ncclSuccess;
            a->ncclCommGetAsyncError(*w->comm, &e);
            if (e != ncclSuccess && e != ncclInProgress) {
                fail_nccl(w, g[i].op, e);
            }
        }
        for (Py_ssize_t k = i; k < n && rec_err == cudaSuccess; k++) {
            if (work_watch(&g[k]) == w && *w->comm != NULL &&
                (r == ncclSuccess || r == ncclInProgress)) {
                call_begin(w, 1);
                rec_err = watch_record(w, g[k].stream, g[k].op);
                if (call_end(w, g[k].op)) {
                    rec_err = cudaSuccess;
                }
            }
        }
        pyccl_unlock(w->mu);
    }
    waiter_finish(&wt);
    int rc = interrupted ? -1 : 0; /* KeyboardInterrupt is set */
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        struct pyccl_watch *w = work_watch(&g[i]);
        if (w != NULL && failed_kind(w)) {
            rc = raise_failure(st, g[i].op, w);
        }
    }
    if (rc == 0 && rec_err != cudaSuccess) {
        pyccl_raise_cuda(st, "group end", "cudaEventRecord", rec_err);
        rc = -1;
    }
    return rc;
}

/* The group's end on its communicators without a watch, after NCCL took it
 * (r ncclSuccess): NCCL's marks (each one's calls in the group counted, the
 * mark after the work on its last call's stream), each under its lock; then
 * they leave the group (abort() refuses a communicator counted in one) and
 * the marks PYCCL_LEAD_MARKS back are waited for without locks or the GIL,
 * as after a call outside a group.  -1 with an exception (an abort() or a
 * failure that ended a mark's wait, or the signal handler's). */
static int
plain_group_end(pyccl_state *st, pyccl_group_entry *g, Py_ssize_t n)
{
    const pyccl_api *a = &st->api;
    int any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        any |= g[i].counted && g[i].calls > 0;
    }
    if (!any) {
        return 0;
    }
    waiter wt;
    int waits = 0;
    waiter_start(&wt, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        pyccl_comm *c = (pyccl_comm *)g[i].comm;
        if (g[i].counted && g[i].calls > 0) {
            pyccl_lock(&c->mu, PYCCL_LOCK_COMM);
            if (c->watch == NULL && c->comm != NULL) {
                g[i].lead = lead_mark(a, c, g[i].stream, g[i].calls);
                waits |= g[i].lead != NULL;
            }
            pyccl_unlock(&c->mu);
        }
    }
    waiter_finish(&wt);
    if (!waits) {
        return 0;
    }
    pyccl_group_leave(g, n);
    pyccl_comm *bad = NULL;
    int rc = 0;
    waiter_start(&wt, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        pyccl_comm *c = (pyccl_comm *)g[i].comm;
        if (g[i].lead == NULL) {
            continue;
        }
        if (rc == 0 && bad == NULL) {
            rc = lead_wait(a, &wt, c, g[i].lead);
            bad = rc == 0 && c->watch != NULL ? c : NULL;
        }
        else {
            __atomic_sub_fetch(&c->lead_waiters, 1, __ATOMIC_ACQ_REL); /* not waited for */
        }
        g[i].lead = NULL;
    }
    waiter_finish(&wt);
    if (bad != NULL) {
        (void)pyccl_comm_alive(st, "group end", bad); /* aborted or failed meanwhile */
        rc = -1;
    }
    return rc; /* -1: KeyboardInterrupt is set */
}

int
pyccl_watch_group_end(pyccl_state *st, ncclResult_t r, pyccl_group_entry *g, Py_ssize_t n)
{
    if (watched_group_end(st, r, g, n) < 0) {
        return -1;
    }
    return r == ncclSuccess ? plain_group_end(st, g, n) : 0;
}
