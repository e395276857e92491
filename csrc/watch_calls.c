/* The calls of a communicator with timeout= (see watchdog.c): enqueue under
 * the watch (an event after each call, back-pressure), the end of a
 * pyccl.group() with watched communicators, waiting for a communicator's work
 * (comm.wait(), barrier()), and for one without a timeout the streams it was
 * used on. */
#include "timeouts.h"
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

/* ---------------- enqueue ---------------- */

/* This thread's pyccl.group(): the watched communicators enqueued on inside
 * it, with their streams, polled and tracked when the outermost group ends
 * (NCCL launches the work then).  Each entry holds a reference to its
 * Communicator, which keeps the watch alive. */
typedef struct {
    PyObject *comm;
    struct pyccl_watch *w;
    cudaStream_t stream;
    const char *op;
} group_entry;

static _Thread_local group_entry *tl_group;
static _Thread_local int tl_group_n, tl_group_cap;

static int
group_has(struct pyccl_watch *w)
{
    for (int i = 0; i < tl_group_n; i++) {
        if (tl_group[i].w == w) {
            return 1;
        }
    }
    return 0;
}

static int
group_add(PyObject *comm, struct pyccl_watch *w, cudaStream_t s,
          const char *op)
{
    for (int i = 0; i < tl_group_n; i++) {
        if (tl_group[i].w == w && tl_group[i].stream == s) {
            return 0;
        }
    }
    if (tl_group_n == tl_group_cap) {
        int cap = tl_group_cap ? 2 * tl_group_cap : 8;
        group_entry *g = PyMem_RawRealloc(tl_group, (size_t)cap * sizeof *g);
        if (g == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        tl_group = g;
        tl_group_cap = cap;
    }
    tl_group[tl_group_n].comm = Py_NewRef(comm);
    tl_group[tl_group_n].w = w;
    tl_group[tl_group_n].stream = s;
    tl_group[tl_group_n].op = op;
    tl_group_n++;
    return 0;
}

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
            pthread_mutex_lock(&w->mu);
            if (w->failed) {
                *which = i;
                break;
            }
            if (w->busy) {
                wait = 1;
                break;
            }
            if (need_room && w->nq >= 8) {
                /* keep the queue short: the finished head, in stream order */
                const char *bad_op = NULL;
                int prev;
                pyccl_device_enter(w->api, w->device, &prev);
                cudaError_t e = watch_retire(w, w->nq >= PYCCL_MAX_PENDING, &bad_op);
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
            pthread_mutex_unlock(&ws[j]->mu);
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
        pthread_mutex_unlock(&ws[j]->mu);
    }
    double t0 = pyccl_now_s();
    for (int j = 0; j < nw && polled == 0; j++) {
        struct pyccl_watch *w = ws[j];
        ncclResult_t e = ncclSuccess;
        pthread_mutex_lock(&w->mu);
        int p = poll_watch(wt, w, t0 + w->timeout, &e);
        pthread_mutex_unlock(&w->mu);
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
        pthread_mutex_lock(&ws[j]->mu);
        ws[j]->busy--;
    }
    if (*r == ncclInProgress) {
        *r = ncclSuccess;
    }
    return polled;
}

/* After the NCCL calls outside a group, every watch locked: fail each as
 * the outcome says (timeout, interrupt, NCCL error; *which the one NCCL
 * failed on), or record an event after its work on each of its streams;
 * then unlock it.  Returns the first event record's error. */
static cudaError_t
settle_watches(const pyccl_api *a, const char *op, const pyccl_task *tasks, Py_ssize_t n,
               struct pyccl_watch **ws, int nw, ncclResult_t r, int polled,
               const char *last, int *which)
{
    cudaError_t rec_err = cudaSuccess;
    for (int j = 0; j < nw; j++) {
        struct pyccl_watch *w = ws[j];
        if (polled > 0) {
            /* one NCCL group: the others cannot finish alone */
            fail_timeout(w, op, "its peers");
        }
        else if (polled < 0) {
            fail_interrupted(w, op);
        }
        else if (r != ncclSuccess && w->comm != NULL) {
            /* In non-blocking mode a failed call may leave the
             * communicator in error: then it is unusable. */
            ncclResult_t e = ncclSuccess;
            a->ncclCommGetAsyncError(w->comm, &e);
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
        else if (r == ncclSuccess && w->comm != NULL) {
            for (Py_ssize_t i = 0; i < n && rec_err == cudaSuccess; i++) {
                int dup = 0;
                if (tasks[i].comm != w->comm) {
                    continue;
                }
                for (Py_ssize_t k = 0; k < i; k++) {
                    dup |= tasks[k].comm == w->comm &&
                           tasks[k].stream == tasks[i].stream;
                }
                if (!dup) {
                    call_begin(w);
                    rec_err = watch_record(w, tasks[i].stream, op);
                    if (call_end(w, op)) {
                        rec_err = cudaSuccess;
                        break;
                    }
                }
            }
        }
        pthread_mutex_unlock(&w->mu);
    }
    return rec_err;
}

/* The distinct watches of a call's communicators, in lock order, each with
 * the communicator it came from and whether this call is the first of the
 * thread's open group on it. */
typedef struct {
    struct pyccl_watch *ws_small[8], **ws;
    pyccl_comm *owners_small[8], **owners;
    int fresh_small[8], *fresh;
    int n;
} watch_set;

static void
watch_set_free(watch_set *g)
{
    if (g->ws != g->ws_small) {
        PyMem_Free(g->ws);
        PyMem_Free(g->owners);
        PyMem_Free(g->fresh);
    }
}

/* -1 with an exception: out of memory, or a communicator with a watch
 * already failed (or not usable: pyccl_comm_alive). */
static int
watch_set_fill(watch_set *g, pyccl_state *st, const char *op, pyccl_comm *const *comms,
               Py_ssize_t ncomms, int in_group)
{
    g->n = 0;
    g->ws = g->ws_small;
    g->owners = g->owners_small;
    g->fresh = g->fresh_small;
    if (ncomms > 8) {
        g->ws = PyMem_Calloc((size_t)ncomms, sizeof *g->ws);
        g->owners = PyMem_Calloc((size_t)ncomms, sizeof *g->owners);
        g->fresh = PyMem_Calloc((size_t)ncomms, sizeof *g->fresh);
        if (g->ws == NULL || g->owners == NULL || g->fresh == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < ncomms; i++) {
        struct pyccl_watch *w = comms[i]->watch;
        int seen = 0;
        for (int j = 0; j < g->n; j++) {
            seen |= g->ws[j] == w;
        }
        if (w == NULL || seen) {
            continue;
        }
        /* its failure first, as the door's begin would say it */
        if (pyccl_comm_alive(st, op, comms[i]) < 0) {
            return -1;
        }
        g->ws[g->n++] = w;
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
        g->fresh[j] = in_group && !group_has(g->ws[j]);
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
    cudaError_t rec_err;
    char last[PYCCL_LAST_ERROR_SIZE];
} timed_outcome;

/* The calls were made and every watch is well. */
static int
all_well(const watch_set *g, const timed_outcome *o)
{
    int ok = !o->refused && o->got == 0 && o->polled == 0 && o->r == ncclSuccess &&
             o->rec_err == cudaSuccess;
    for (int j = 0; ok && j < g->n; j++) {
        ok = !failed_kind(g->ws[j]);
    }
    return ok;
}

/* The handles the watch aborted are forgotten (their communicators' comm
 * cleared); the watch whose failure the call raises: the one that failed
 * first (acquiring, or from `which` on after the calls), or -1. */
static int
forget_failed(watch_set *g, const timed_outcome *o)
{
    if (o->got == 1) {
        g->owners[o->which]->comm = NULL;
        return o->which;
    }
    if (o->refused || o->got < 0) {
        return -1;
    }
    int first = -1;
    for (int k = 0; k < g->n; k++) {
        int j = (k + o->which) % g->n; /* the one that failed first, first */
        if (o->polled < 0 || failed_kind(g->ws[j])) {
            g->owners[j]->comm = NULL;
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
    int failed = forget_failed(g, o);
    if (failed >= 0) {
        return raise_failure(st, op, g->ws[failed]);
    }
    if (o->refused) {
        return pyccl_raise_mixed_group(st, op);
    }
    if (o->got < 0 || o->polled < 0) {
        return -1; /* the signal handler's exception */
    }
    if (o->r != ncclSuccess) {
        pyccl_raise_nccl(st, op, o->r, o->last);
        return -1;
    }
    pyccl_raise_cuda(st, op, "cudaEventRecord", o->rec_err);
    return -1;
}

/* Inside pyccl.group(): remember each communicator's tasks for the group's
 * end (which the watch then covers).  -1 with MemoryError. */
static int
add_to_group(const char *op, watch_set *g, const pyccl_task *tasks, Py_ssize_t n)
{
    int rc = 0;
    for (int j = 0; j < g->n; j++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (tasks[i].comm == g->owners[j]->comm &&
                group_add((PyObject *)g->owners[j], g->ws[j], tasks[i].stream, op) < 0) {
                rc = -1;
            }
        }
        if (g->fresh[j] && !group_has(g->ws[j])) {
            /* out of memory before the entry went in: undo the count */
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&g->ws[j]->mu);
            g->ws[j]->in_group--;
            pthread_mutex_unlock(&g->ws[j]->mu);
            Py_END_ALLOW_THREADS
        }
    }
    return rc;
}

int
pyccl_enqueue_timed(pyccl_state *st, const char *op, const pyccl_task *tasks,
                    Py_ssize_t n, int redop, const pyccl_premul *premul,
                    pyccl_comm *const *comms, Py_ssize_t ncomms)
{
    const pyccl_api *a = &st->api;
    int in_group = pyccl_group_depth() > 0;
    timed_outcome o = {.r = ncclSuccess, .rec_err = cudaSuccess};
    watch_set g;
    /* the communicators first, then this thread's open group (refused
     * before anything is enqueued) */
    if (watch_set_fill(&g, st, op, comms, ncomms, in_group) < 0 ||
        (o.refused = pyccl_group_join(comms, ncomms, 1)) < 0) {
        watch_set_free(&g);
        return -1;
    }
    struct pyccl_watch **ws = g.ws;
    if (!o.refused) {
        waiter wt;
        waiter_start(&wt, 1);
        o.got = acquire_all(&wt, ws, g.n, !in_group, &o.which);
        if (o.got == 0) {
            for (int j = 0; j < g.n; j++) {
                call_begin(ws[j]);
            }
            /* communicators without a watch in the same call are locked too
             * (NCCL refuses the group, but only at its end) */
            o.r = pyccl_enqueue_calls(a, tasks, n, redop, premul, comms, ncomms, o.last,
                                      sizeof o.last);
            for (int j = 0; j < g.n; j++) {
                call_end(ws[j], op);
            }
            if (in_group) {
                /* NCCL launches nothing before the group's end */
                o.r = o.r == ncclInProgress ? ncclSuccess : o.r;
                for (int j = 0; j < g.n; j++) {
                    ws[j]->in_group += o.r == ncclSuccess && g.fresh[j] && !ws[j]->failed;
                    pthread_mutex_unlock(&ws[j]->mu);
                }
            }
            else {
                if (o.r == ncclInProgress) {
                    o.polled = poll_in_progress(a, &wt, ws, g.n, &o.r, &o.which);
                }
                o.rec_err = settle_watches(a, op, tasks, n, ws, g.n, o.r, o.polled, o.last,
                                           &o.which);
            }
        }
        waiter_finish(&wt);
    }
    int rc = all_well(&g, &o) ? (in_group ? add_to_group(op, &g, tasks, n) : 0)
                              : raise_outcome(st, op, &g, &o);
    watch_set_free(&g);
    return rc;
}

int
pyccl_watch_group_end(pyccl_state *st, ncclResult_t r)
{
    if (tl_group_n == 0) {
        return 0;
    }
    const pyccl_api *a = &st->api;
    int n = tl_group_n, interrupted = 0;
    group_entry *g = tl_group;
    cudaError_t rec_err = cudaSuccess;
    tl_group = NULL;
    tl_group_n = tl_group_cap = 0;
    waiter wt;
    waiter_start(&wt, 1);
    double t0 = pyccl_now_s();
    for (int i = 0; i < n; i++) {
        struct pyccl_watch *w = g[i].w;
        int first = 1;
        for (int k = 0; k < i; k++) {
            first &= g[k].w != w;
        }
        if (!first) {
            continue;
        }
        pthread_mutex_lock(&w->mu);
        if (w->comm != NULL && r == ncclInProgress) {
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
        else if (w->comm != NULL && r != ncclSuccess) {
            /* the group failed: in non-blocking mode that may leave the
             * communicator in error, and then it is unusable */
            ncclResult_t e = ncclSuccess;
            a->ncclCommGetAsyncError(w->comm, &e);
            if (e != ncclSuccess && e != ncclInProgress) {
                fail_nccl(w, g[i].op, e);
            }
        }
        for (int k = i; k < n && rec_err == cudaSuccess; k++) {
            if (g[k].w == w && w->comm != NULL &&
                (r == ncclSuccess || r == ncclInProgress)) {
                call_begin(w);
                rec_err = watch_record(w, g[k].stream, g[k].op);
                if (call_end(w, g[k].op)) {
                    rec_err = cudaSuccess;
                }
            }
        }
        w->in_group--;
        pthread_mutex_unlock(&w->mu);
    }
    waiter_finish(&wt);
    int rc = interrupted ? -1 : 0; /* KeyboardInterrupt is set */
    for (int i = 0; i < n; i++) {
        if (failed_kind(g[i].w)) {
            ((pyccl_comm *)g[i].comm)->comm = NULL;
            if (rc == 0) {
                rc = raise_failure(st, g[i].op, g[i].w);
            }
        }
    }
    if (rc == 0 && rec_err != cudaSuccess) {
        pyccl_raise_cuda(st, "group end", "cudaEventRecord", rec_err);
        rc = -1;
    }
    for (int i = 0; i < n; i++) {
        Py_DECREF(g[i].comm);
    }
    PyMem_RawFree(g);
    return rc;
}

/* ---------------- waiting for the work ---------------- */

/* Until the work enqueued on w so far finished, or `limit` seconds (the
 * communicator's own deadline still applies inside).  0; 1 when w failed
 * (nothing raised: the caller raises it); -1 with an exception. */
int
wait_work(pyccl_state *st, const char *op, struct pyccl_watch *w, double limit,
          int interruptible)
{
    int status = 0; /* 1 failed, 2 limit passed, -1 interrupted */
    const char *head_op = op;
    double start = pyccl_now_s();
    waiter wt;
    waiter_start(&wt, interruptible);
    pthread_mutex_lock(&w->mu);
    uint64_t target = w->seq;
    for (;;) {
        if (w->failed) {
            status = 1;
            break;
        }
        if (w->nq > 0) {
            const char *bad_op = NULL;
            int prev;
            pyccl_device_enter(w->api, w->device, &prev);
            cudaError_t e = watch_retire(w, 1, &bad_op);
            pyccl_device_leave(w->api, w->device, prev);
            if (e != cudaSuccess) {
                fail_cuda(w, bad_op, e);
                status = 1;
                break;
            }
        }
        if (w->nq == 0 || w->q[0].seq > target) {
            break;
        }
        double now = pyccl_now_s();
        if (now - w->q[0].t > w->timeout && !w->busy && !w->in_group) {
            /* its own deadline: what the watchdog is about to do */
            fail_timeout(w, w->q[0].op, "its peers");
            status = 1;
            break;
        }
        if (now - start > limit) {
            head_op = w->q[0].op;
            status = 2;
            break;
        }
        pthread_mutex_unlock(&w->mu);
        int sig = waiter_pause(&wt);
        pthread_mutex_lock(&w->mu);
        if (sig < 0) {
            status = -1;
            break;
        }
    }
    pthread_mutex_unlock(&w->mu);
    waiter_finish(&wt);
    if (status == 2) {
        return pyccl_raise_timeout(st, op, limit,
                                   "rank %d of %d: the work enqueued on the communicator (the "
                                   "oldest unfinished: %s) did not finish within %s s; the "
                                   "communicator's own timeout of %s s has not passed, so it "
                                   "was not aborted",
                                   w->rank, w->size, head_op, pyccl_secs(limit).s,
                                   pyccl_secs(w->timeout).s);
    }
    return status;
}

int
pyccl_watch_wait(pyccl_state *st, const char *op, pyccl_comm *c,
                 double timeout)
{
    int rc = wait_work(st, op, c->watch, timeout, 1);
    if (rc > 0) {
        return pyccl_watch_check(st, op, c);
    }
    return rc;
}

/* wait() of a communicator without timeout: an event recorded now on each
 * stream it was used on covers its work there (and whatever came before
 * it).  `limit` 0: no limit. */
int
wait_streams(pyccl_state *st, const char *op, pyccl_comm *c, double limit)
{
    const pyccl_api *a = &st->api;
    int n = c->nstreams, status = 0; /* 1 limit passed, -1 interrupted */
    cudaError_t e = cudaSuccess;
    const char *call = "cudaEventRecord";
    if (n == 0) {
        return 0;
    }
    /* a snapshot: another thread may add streams meanwhile */
    cudaStream_t *streams = PyMem_RawMalloc((size_t)n * sizeof *streams);
    cudaEvent_t *evs = PyMem_RawCalloc((size_t)n, sizeof *evs);
    if (streams == NULL || evs == NULL) {
        PyMem_RawFree(streams);
        PyMem_RawFree(evs);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(streams, c->streams, (size_t)n * sizeof *streams);
    int device = c->device;
    double start = pyccl_now_s();
    waiter wt;
    /* no c->inflight: the handle is not used, and abort() from another
     * thread is how a wait on a communicator without timeout ends early */
    waiter_start(&wt, 1);
    int prev;
    pyccl_device_enter(a, device, &prev);
    for (int i = 0; i < n && e == cudaSuccess; i++) {
        enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        if (a->cudaStreamIsCapturing(streams[i], &cs) != cudaSuccess ||
            cs != cudaStreamCaptureStatusNone) {
            a->cudaGetLastError();
            continue; /* captured work runs when the graph does */
        }
        e = a->cudaEventCreateWithFlags(&evs[i], cudaEventDisableTiming);
        if (e == cudaSuccess) {
            e = a->cudaEventRecord(evs[i], streams[i]);
        }
    }
    pyccl_device_leave(a, device, prev);
    while (e == cudaSuccess) {
        int left = 0;
        enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
        a->cudaThreadExchangeStreamCaptureMode(&mode);
        for (int i = 0; i < n && e == cudaSuccess; i++) {
            if (evs[i] == NULL) {
                continue;
            }
            cudaError_t q = a->cudaEventQuery(evs[i]);
            if (q == cudaErrorNotReady) {
                a->cudaGetLastError();
                left = 1;
            }
            else if (q != cudaSuccess) {
                e = q;
                call = "cudaEventQuery";
            }
        }
        a->cudaThreadExchangeStreamCaptureMode(&mode);
        if (!left || e != cudaSuccess) {
            break;
        }
        if (limit > 0 && pyccl_now_s() - start > limit) {
            status = 1;
            break;
        }
        if (waiter_pause(&wt) < 0) {
            status = -1;
            break;
        }
    }
    pyccl_device_enter(a, device, &prev);
    for (int i = 0; i < n; i++) {
        if (evs[i] != NULL) {
            a->cudaEventDestroy(evs[i]);
        }
    }
    pyccl_device_leave(a, device, prev);
    waiter_finish(&wt);
    PyMem_RawFree(streams);
    PyMem_RawFree(evs);
    if (status < 0) {
        return -1;
    }
    if (e != cudaSuccess) {
        pyccl_raise_cuda(st, op, call, e);
        return -1;
    }
    if (status > 0) {
        return pyccl_raise_timeout(st, op, limit,
                                   "rank %d of %d: the work enqueued on the communicator did "
                                   "not finish within %s s; it has no timeout of its own, so it "
                                   "was not aborted",
                                   c->rank, c->size, pyccl_secs(limit).s);
    }
    return 0;
}

int
pyccl_comm_track(pyccl_state *st, const char *op, pyccl_comm *c,
                 cudaStream_t s)
{
    struct pyccl_watch *w = c->watch; /* not NULL: the door (call.c) notes the others */
    if (pyccl_watch_check(st, op, c) < 0) {
        return -1;
    }
    if (pyccl_group_depth() > 0) {
        int fresh = !group_has(w);
        if (group_add((PyObject *)c, w, s, op) < 0) {
            return -1;
        }
        if (fresh) { /* the group's end counts it down once */
            lock_watch(w);
            w->in_group++;
            pthread_mutex_unlock(&w->mu);
        }
        return 0;
    }
    int which = 0;
    cudaError_t e = cudaSuccess;
    waiter wt;
    waiter_start(&wt, 1);
    int got = acquire_all(&wt, &w, 1, 1, &which);
    if (got == 0) {
        call_begin(w);
        e = watch_record(w, s, op);
        got = call_end(w, op); /* 1: failed meanwhile */
        pthread_mutex_unlock(&w->mu);
    }
    waiter_finish(&wt);
    if (got < 0) {
        return -1;
    }
    if (got > 0) {
        return pyccl_watch_check(st, op, c);
    }
    if (e != cudaSuccess) {
        pyccl_raise_cuda(st, op, "cudaEventRecord", e);
        return -1;
    }
    return 0;
}

/* For a caller that talks to NCCL without the GIL between waits that
 * another thread's abort() or the watchdog may end (the own kernels' set-up,
 * ar.c): take the lock that abort() and the watchdog take before they
 * touch the handle (c's own without a timeout, the watch's with one) and
 * give the handle.  NULL, with nothing held, once the communicator was
 * aborted, failed or destroyed.  The lock is held for one NCCL call and
 * its completion poll, never across a wait on peers. */
pthread_mutex_t *
pyccl_comm_hold(pyccl_comm *c, ncclComm_t *comm)
{
    *comm = NULL;
    pthread_mutex_lock(&c->mu);
    struct pyccl_watch *w = c->watch; /* changes from NULL only under c->mu */
    if (w == NULL) {
        if (c->comm != NULL) {
            *comm = c->comm;
            return &c->mu;
        }
        pthread_mutex_unlock(&c->mu);
        return NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (w->timeout <= 0) {
        return NULL; /* the record of an aborted communicator */
    }
    pthread_mutex_lock(&w->mu);
    if (failed_kind(w) || w->comm == NULL || w->closing) {
        pthread_mutex_unlock(&w->mu);
        return NULL;
    }
    *comm = w->comm;
    /* one call in NCCL, as an enqueue is: the watchdog claims it and aborts
     * the handle when it is stuck past the timeout and the grace */
    call_begin(w);
    return &w->mu;
}

int
pyccl_comm_held_done(pyccl_comm *c, pthread_mutex_t *held, const char *op)
{
    struct pyccl_watch *w = c->watch;
    if (w != NULL && held == &w->mu) {
        return call_end(w, op);
    }
    return 0;
}
