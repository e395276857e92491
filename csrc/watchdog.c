/* Communicators created with timeout=: bounded waits, a watchdog, abort.
 *
 * Without a timeout pyccl uses NCCL's blocking communicators and adds nothing
 * per call.  With one, the communicator is NCCL non-blocking (blocking = 0):
 *
 * - Every NCCL call on it (init, enqueue, group end, split, finalize)
 *   returns at once, maybe with ncclInProgress; pyccl then polls
 *   ncclCommGetAsyncError, GIL released, until it is done or the timeout
 *   passed (then ncclCommAbort and NcclTimeoutError).
 * - A collective returns as soon as it is enqueued, as always; after it a
 *   CUDA event is recorded on its stream (not while the stream is being
 *   captured into a CUDA graph: graph replays are not watched; inside
 *   pyccl.group() the events are recorded when the outermost group ends).
 * - One watchdog thread per process (a pthread; it never takes the GIL)
 *   looks at every watched communicator every 10 ms: when its oldest
 *   unfinished event is older than the timeout, or NCCL reports an
 *   asynchronous error, it marks the communicator failed and calls
 *   ncclCommAbort, whose abort flag makes the stuck NCCL kernels return, so
 *   the stream (and a host blocked on it) moves on.  The next call on the
 *   communicator, or comm.wait(), raises the failure.
 *
 * Locking.  Each watch has a mutex, held only for short sections that
 * never block on peers and never take the GIL: a Python thread acquires it
 * with the GIL released, so no thread can hold the GIL while waiting for it.
 * NCCL forbids two threads in one communicator, so the watchdog (trylock)
 * never touches a communicator that a thread is using: one whose lock is
 * held, one `busy` (a thread polls an NCCL call in progress; that thread
 * enforces the deadline itself) or one `in_group` (enqueued on inside a
 * pyccl.group() that has not ended: NCCL uses it at the group's end).
 * Waits (room for another event, comm.wait(), polls) release the lock while
 * sleeping and take the GIL every 20 ms for PyErr_CheckSignals, so ^C
 * interrupts them.  Interrupting an NCCL call in progress aborts the
 * communicator (NCCL cannot leave one half done).
 *
 * Back-pressure: a communicator holds at most PYCCL_MAX_PENDING unfinished
 * events; the next enqueue waits for room.  So the host never runs far
 * ahead of a stuck GPU into NCCL's or CUDA's own blocking queues, where no
 * lock could be released for the watchdog.  Other work can still fill the
 * stream's launch queue behind a stuck kernel, so an NCCL launch or event
 * record may block while its lock is held: when such a call has been stuck
 * for the timeout plus PYCCL_STUCK_GRACE, the watchdog claims it and aborts
 * the handle without the lock (the abort is what lets the call return),
 * and the caller, once released, only marks the communicator failed. */
#include "pyccl.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PYCCL_MAX_PENDING 64
#define PYCCL_WATCH_PERIOD_NS 10000000L /* the watchdog's look every 10 ms */
#define PYCCL_SIGNAL_PERIOD 0.02        /* s between signal checks in waits */
#define PYCCL_STUCK_GRACE 1.0           /* s past the timeout for a call stuck in NCCL */

typedef struct {
    cudaEvent_t ev;
    double t;        /* when it was recorded (monotonic s) */
    const char *op;  /* the call it follows (a string literal) */
    uint64_t seq;
} pending_event;

struct pyccl_watch {
    pthread_mutex_t mu;
    struct pyccl_watch *next; /* in the watchdog's list, under its mutex */
    const pyccl_api *api;
    ncclComm_t comm;          /* NULL once aborted or destroyed */
    int device, rank, size;
    double timeout;           /* 0: a record of a failed communicator only */
    int registered;
    int busy;                 /* a thread polls an NCCL call in progress */
    int in_group;             /* threads with it in an open pyccl.group() */
    int closing;              /* destroy() is finalizing it */
    /* A thread is inside an NCCL/CUDA call on it (under mu) since this
     * (monotonic ns); 0: none; -1: the watchdog gave up on that call and
     * aborted the handle (see force_abort). */
    int64_t call_since;
    pending_event *q;         /* unfinished events, oldest first */
    int nq, capq;
    cudaEvent_t *pool;        /* finished events, for reuse */
    int npool, cappool;
    uint64_t seq;             /* seq of the last event recorded */
    /* The failure: reason and code are written once, under mu, before
     * `failed` is published (release); readers load it with acquire. */
    int failed;
    int code;
    char reason[512];
};

struct pyccl_watchdog {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    pthread_t thread;
    pid_t pid;          /* a forked child has no such thread (and maybe a
                         * copy of a held lock): it must not touch this */
    int started;
    int stop;
    const pyccl_api *api;
    struct pyccl_watch *head;
};

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Make `dev` current for a moment; returns the device to go back to. */
static int
dev_enter(const pyccl_api *a, int dev)
{
    int prev = -1;
    if (a->cudaGetDevice(&prev) != cudaSuccess) {
        a->cudaGetLastError();
        prev = -1;
    }
    if (prev != dev) {
        a->cudaSetDevice(dev);
    }
    return prev;
}

static void
dev_leave(const pyccl_api *a, int dev, int prev)
{
    if (prev >= 0 && prev != dev) {
        a->cudaSetDevice(prev);
    }
}

static int
failed_kind(const struct pyccl_watch *w)
{
    return __atomic_load_n(&w->failed, __ATOMIC_ACQUIRE);
}

/* ---------------- events (under w->mu) ---------------- */

static void
pool_put(struct pyccl_watch *w, cudaEvent_t ev)
{
    if (w->npool == w->cappool) {
        int cap = w->cappool ? 2 * w->cappool : 16;
        cudaEvent_t *p = PyMem_RawRealloc(w->pool, (size_t)cap * sizeof *p);
        if (p == NULL) {
            w->api->cudaEventDestroy(ev);
            return;
        }
        w->pool = p;
        w->cappool = cap;
    }
    w->pool[w->npool++] = ev;
}

/* Drop the finished events: all of them (`all`), or the finished ones at
 * the head only (the cheap in-order case of the enqueue path).  Returns
 * cudaSuccess or the first real error of cudaEventQuery, with *bad_op the
 * call that event followed.  The comm's device must be current. */
static cudaError_t
retire(struct pyccl_watch *w, int all, const char **bad_op)
{
    const pyccl_api *a = w->api;
    cudaError_t bad = cudaSuccess;
    int k = 0, i = 0, not_ready = 0;
    /* Relaxed: a query must not invalidate a CUDA graph capture that this
     * thread (or, in global mode, any thread) has going on. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    a->cudaThreadExchangeStreamCaptureMode(&mode);
    for (; i < w->nq; i++) {
        cudaError_t e = a->cudaEventQuery(w->q[i].ev);
        if (e == cudaSuccess) {
            pool_put(w, w->q[i].ev);
            continue;
        }
        if (e == cudaErrorNotReady) {
            not_ready = 1;
        }
        else if (bad == cudaSuccess) {
            bad = e;
            *bad_op = w->q[i].op;
        }
        w->q[k++] = w->q[i];
        if (!all) {
            i++;
            break;
        }
    }
    for (; i < w->nq; i++) {
        w->q[k++] = w->q[i];
    }
    w->nq = k;
    a->cudaThreadExchangeStreamCaptureMode(&mode);
    if (not_ready) {
        /* cudaErrorNotReady is kept as the thread's last error: clear it, or
         * torch's next launch check would report it. */
        a->cudaGetLastError();
    }
    return bad;
}

/* Destroy every event (the communicator is gone). */
static void
drop_events(struct pyccl_watch *w)
{
    const pyccl_api *a = w->api;
    if (w->nq == 0 && w->npool == 0) {
        return;
    }
    int prev = dev_enter(a, w->device);
    for (int i = 0; i < w->nq; i++) {
        a->cudaEventDestroy(w->q[i].ev);
    }
    for (int i = 0; i < w->npool; i++) {
        a->cudaEventDestroy(w->pool[i]);
    }
    dev_leave(a, w->device, prev);
    w->nq = w->npool = 0;
}

/* Record an event on s after the work just enqueued there.  Not while s is
 * being captured into a CUDA graph: the event would become a graph node. */
static cudaError_t
record(struct pyccl_watch *w, cudaStream_t s, const char *op)
{
    const pyccl_api *a = w->api;
    cudaError_t e;
    cudaEvent_t ev = NULL;
    /* Stream 0 is the current device's legacy stream. */
    int prev = dev_enter(a, w->device);
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (a->cudaStreamIsCapturing(s, &cs) != cudaSuccess) {
        /* Another thread captures in global mode: treat as capturing. */
        a->cudaGetLastError();
        e = cudaSuccess;
        goto out;
    }
    if (cs != cudaStreamCaptureStatusNone) {
        e = cudaSuccess;
        goto out;
    }
    if (w->nq == w->capq) {
        int cap = w->capq ? 2 * w->capq : 2 * PYCCL_MAX_PENDING;
        pending_event *q = PyMem_RawRealloc(w->q, (size_t)cap * sizeof *q);
        if (q == NULL) {
            e = cudaErrorMemoryAllocation;
            goto out;
        }
        w->q = q;
        w->capq = cap;
    }
    if (w->npool > 0) {
        ev = w->pool[--w->npool];
        e = cudaSuccess;
    }
    else {
        e = a->cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    }
    if (e == cudaSuccess) {
        e = a->cudaEventRecord(ev, s);
        if (e != cudaSuccess) {
            a->cudaEventDestroy(ev);
        }
    }
    if (e == cudaSuccess) {
        w->q[w->nq].ev = ev;
        w->q[w->nq].t = now_s();
        w->q[w->nq].op = op;
        w->q[w->nq].seq = ++w->seq;
        w->nq++;
    }
out:
    dev_leave(a, w->device, prev);
    return e;
}

/* ---------------- failing (under w->mu) ---------------- */

/* Mark w failed first (so threads waiting on it raise at once), then abort
 * the NCCL communicator: its abort flag ends the kernels that wait for
 * peers.  Idempotent: the first failure wins. */
static void
fail(struct pyccl_watch *w, int kind, int code, const char *fmt, ...)
{
    if (w->failed) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->reason, sizeof w->reason, fmt, ap);
    va_end(ap);
    w->code = code;
    __atomic_store_n(&w->failed, kind, __ATOMIC_RELEASE);
    ncclComm_t comm = w->comm;
    __atomic_store_n(&w->comm, NULL, __ATOMIC_RELEASE);
    if (comm != NULL) {
        w->api->ncclCommAbort(comm);
    }
    drop_events(w);
}

/* Around an NCCL/CUDA call that may block (a launch, an event record),
 * under w->mu.  call_end: 0, or 1 when the watchdog gave up on the call
 * meanwhile and aborted the handle (then w is failed, its handle gone). */
static void
call_begin(struct pyccl_watch *w)
{
    __atomic_store_n(&w->call_since, now_ns(), __ATOMIC_RELEASE);
}

static int
call_end(struct pyccl_watch *w, const char *op)
{
    int64_t mine = __atomic_load_n(&w->call_since, __ATOMIC_ACQUIRE);
    if (mine > 0 && __atomic_compare_exchange_n(&w->call_since, &mine, 0, 0,
                                                __ATOMIC_ACQ_REL,
                                                __ATOMIC_ACQUIRE)) {
        return 0;
    }
    __atomic_store_n(&w->call_since, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&w->comm, NULL, __ATOMIC_RELEASE); /* the watchdog aborted it */
    char t[32];
    pyccl_fmt_seconds(t, sizeof t, w->timeout);
    fail(w, PYCCL_FAIL_TIMEOUT, 0,
         "%s: rank %d of %d timed out after %s s waiting for its peers (the "
         "call itself was stuck in NCCL or CUDA, e.g. behind a full launch "
         "queue); the communicator was aborted",
         op, w->rank, w->size, t);
    return 1;
}

/* The watchdog, on a communicator whose lock is held: if the holder has
 * been stuck inside one call for the timeout plus the grace, claim the call
 * and abort the handle (its abort flag ends the kernels the call waits
 * behind).  The holder does not touch the handle while in the call, and
 * finds out in call_end. */
static void
force_abort(struct pyccl_watch *w, int64_t now)
{
    int64_t since = __atomic_load_n(&w->call_since, __ATOMIC_ACQUIRE);
    if (since <= 0 ||
        (double)(now - since) * 1e-9 <= w->timeout + PYCCL_STUCK_GRACE) {
        return;
    }
    ncclComm_t comm = __atomic_load_n(&w->comm, __ATOMIC_ACQUIRE);
    if (__atomic_compare_exchange_n(&w->call_since, &since, -1, 0,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) &&
        comm != NULL) {
        w->api->ncclCommAbort(comm);
    }
}

static void
fail_timeout(struct pyccl_watch *w, const char *op, const char *waiting_for)
{
    char t[32];
    pyccl_fmt_seconds(t, sizeof t, w->timeout);
    fail(w, PYCCL_FAIL_TIMEOUT, 0,
         "%s: rank %d of %d timed out after %s s waiting for %s; the "
         "communicator was aborted",
         op, w->rank, w->size, t, waiting_for);
}

static void
fail_nccl(struct pyccl_watch *w, const char *op, ncclResult_t e)
{
    fail(w, PYCCL_FAIL_NCCL, (int)e,
         "%s: rank %d of %d: NCCL error %d (%s) while its work ran; the "
         "communicator was aborted",
         op, w->rank, w->size, (int)e, w->api->ncclGetErrorString(e));
}

static void
fail_cuda(struct pyccl_watch *w, const char *op, cudaError_t e)
{
    fail(w, PYCCL_FAIL_CUDA, (int)e,
         "%s: rank %d of %d: CUDA error %d (%s) while its work ran; the "
         "communicator was aborted",
         op, w->rank, w->size, (int)e, w->api->cudaGetErrorString(e));
}

static void
fail_interrupted(struct pyccl_watch *w, const char *op)
{
    fail(w, PYCCL_FAIL_ABORTED, 0,
         "%s: rank %d of %d was interrupted while NCCL was still working on "
         "the call; the communicator was aborted",
         op, w->rank, w->size);
}

/* The watchdog's look at one communicator nobody is using (its device is
 * current). */
static void
check(struct pyccl_watch *w, double now)
{
    const char *bad_op = "a collective";
    cudaError_t e = retire(w, 1, &bad_op);
    if (e != cudaSuccess) {
        fail_cuda(w, bad_op, e);
        return;
    }
    if (w->nq > 0 && now - w->q[0].t > w->timeout) {
        fail_timeout(w, w->q[0].op, "its peers");
        return;
    }
    ncclResult_t ae = ncclSuccess;
    if (w->api->ncclCommGetAsyncError(w->comm, &ae) == ncclSuccess &&
        ae != ncclSuccess && ae != ncclInProgress) {
        fail_nccl(w, w->nq > 0 ? w->q[0].op : "watchdog", ae);
    }
}

/* ---------------- the watchdog thread ---------------- */

static void *
watchdog_main(void *arg)
{
    struct pyccl_watchdog *wd = arg;
    const pyccl_api *a = wd->api;
    int device = -1;
    pthread_mutex_lock(&wd->mu);
    while (!wd->stop) {
        double now = now_s();
        for (struct pyccl_watch *w = wd->head; w != NULL; w = w->next) {
            if (pthread_mutex_trylock(&w->mu) != 0) {
                force_abort(w, now_ns()); /* in use: unless stuck, next round */
                continue;
            }
            if (!w->failed && w->comm != NULL && !w->busy && !w->in_group &&
                !w->closing) {
                /* Only ever the devices of watched communicators: going
                 * "back" to device 0 would give a process that does not use
                 * it a CUDA context there. */
                if (device != w->device) {
                    a->cudaSetDevice(w->device);
                    device = w->device;
                }
                check(w, now);
            }
            pthread_mutex_unlock(&w->mu);
        }
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += PYCCL_WATCH_PERIOD_NS;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&wd->cond, &wd->mu, &until);
    }
    pthread_mutex_unlock(&wd->mu);
    return NULL;
}

/* The watchdog of this process, or NULL (none yet, or the parent's). */
static struct pyccl_watchdog *
live_watchdog(pyccl_state *st)
{
    struct pyccl_watchdog *wd = st->watchdog;
    return wd != NULL && wd->pid == getpid() ? wd : NULL;
}

/* The process's watchdog, created (not started) on first use; a forked
 * child leaves its parent's alone and makes its own. */
static struct pyccl_watchdog *
get_watchdog(pyccl_state *st)
{
    if (live_watchdog(st) != NULL) {
        return st->watchdog;
    }
    struct pyccl_watchdog *wd = PyMem_RawCalloc(1, sizeof *wd);
    if (wd == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&wd->mu, NULL);
    pthread_cond_init(&wd->cond, &ca);
    pthread_condattr_destroy(&ca);
    wd->api = &st->api;
    wd->pid = getpid();
    st->watchdog = wd;
    return wd;
}

/* Add w to the watchdog's list, starting its thread on first use. */
static int
register_watch(pyccl_state *st, const char *op, struct pyccl_watch *w)
{
    struct pyccl_watchdog *wd = get_watchdog(st);
    if (wd == NULL) {
        return -1;
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&wd->mu);
    if (!wd->started && !wd->stop) {
        /* Signals go to the other threads: Python handles them in the main
         * one, and the watchdog's sleeps need no interrupting. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        err = pthread_create(&wd->thread, NULL, watchdog_main, wd);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        wd->started = err == 0;
    }
    if (err == 0) {
        w->next = wd->head;
        wd->head = w;
        w->registered = 1;
    }
    pthread_mutex_unlock(&wd->mu);
    Py_END_ALLOW_THREADS
    if (err != 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: cannot start pyccl's watchdog thread (%s)", op,
                     strerror(err));
        return -1;
    }
    return 0;
}

/* Take w off the watchdog's list: the watchdog never sees it again. */
static void
unregister_watch(pyccl_state *st, struct pyccl_watch *w)
{
    struct pyccl_watchdog *wd = live_watchdog(st);
    if (!w->registered || wd == NULL) {
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&wd->mu);
    for (struct pyccl_watch **p = &wd->head; *p != NULL; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    pthread_mutex_unlock(&wd->mu);
    Py_END_ALLOW_THREADS
    w->registered = 0;
}

static struct pyccl_watch *
new_watch(pyccl_state *st, pyccl_comm *c, ncclComm_t comm, double timeout)
{
    struct pyccl_watch *w = PyMem_RawCalloc(1, sizeof *w);
    if (w == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    pthread_mutex_init(&w->mu, NULL);
    w->api = &st->api;
    w->comm = comm;
    w->device = c->device;
    w->rank = c->rank;
    w->size = c->size;
    w->timeout = timeout;
    return w;
}

static void
free_watch(struct pyccl_watch *w)
{
    drop_events(w);
    pthread_mutex_destroy(&w->mu);
    PyMem_RawFree(w->q);
    PyMem_RawFree(w->pool);
    PyMem_RawFree(w);
}

/* ---------------- waiting with the GIL released ---------------- */

typedef struct {
    PyThreadState *ts;
    double next_signals;
    unsigned spins;
    int interruptible;
} waiter;

static void
waiter_start(waiter *wt, int interruptible)
{
    wt->spins = 0;
    wt->interruptible = interruptible;
    wt->next_signals = now_s() + PYCCL_SIGNAL_PERIOD;
    wt->ts = PyEval_SaveThread();
}

static void
waiter_finish(waiter *wt)
{
    PyEval_RestoreThread(wt->ts);
}

/* Sleep a little, longer the longer the wait (collectives often end within
 * microseconds); every 20 ms take the GIL for PyErr_CheckSignals.  -1 when
 * a signal handler raised (the exception stays set for waiter_finish).
 * Never called with a watch's lock held. */
static int
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
    double now = now_s();
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

/* ---------------- Python-facing helpers ---------------- */

static pyccl_state *
state_of(PyObject *self)
{
    return pyccl_state_of_type(Py_TYPE(self));
}

static int
raise_failure(pyccl_state *st, const char *op, struct pyccl_watch *w)
{
    PyObject *exc = pyccl_failure_exception(st, op, failed_kind(w), w->code,
                                            w->reason, w->timeout);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return -1;
}

double
pyccl_comm_timeout(const pyccl_comm *c)
{
    return c->timeout;
}

int
pyccl_read_timeout(const char *op, PyObject *obj, double *out)
{
    *out = 0.0;
    if (obj == NULL || obj == Py_None) {
        return 0;
    }
    if (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj))) {
        PyErr_Format(PyExc_TypeError,
                     "%s: timeout must be a number of seconds (int or float) "
                     "or None, got %.200s",
                     op, Py_TYPE(obj)->tp_name);
        return -1;
    }
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        v = Py_HUGE_VAL;
    }
    if (!(v > 0.0) || !Py_IS_FINITE(v)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: timeout must be a finite number of seconds > 0, got %R",
                     op, obj);
        return -1;
    }
    *out = v;
    return 0;
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
    c->comm = NULL; /* aborted: nothing may use the handle any more */
    return raise_failure(st, op, w);
}

int
pyccl_comm_alive(pyccl_state *st, const char *op, pyccl_comm *c)
{
    if (c->watch != NULL && pyccl_watch_check(st, op, c) < 0) {
        return -1; /* timed out or aborted */
    }
    if (c->pending) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: the communicator is not ready: it was created inside "
                     "pyccl.group(), which has not ended yet", op);
        return -1;
    }
    if (c->comm == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: the communicator (rank %d of %d) has been destroyed",
                     op, c->rank, c->size);
        return -1;
    }
    return 0;
}

/* Lock w, the GIL released while waiting for it. */
static void
lock_watch(struct pyccl_watch *w)
{
    if (pthread_mutex_trylock(&w->mu) == 0) {
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->mu);
    Py_END_ALLOW_THREADS
}

int
pyccl_comm_enter(pyccl_state *st, const char *op, pyccl_comm *c)
{
    (void)op;
    if (c->watch == NULL) {
        pyccl_comm_lock(c); /* abort() cannot change watch while it is held */
        return 0;
    }
    c->inflight++; /* destroy() waits for pyccl_comm_leave */
    lock_watch(c->watch);
    if (failed_kind(c->watch)) {
        pthread_mutex_unlock(&c->watch->mu);
        c->inflight--;
        return pyccl_watch_check(st, op, c);
    }
    return 0;
}

void
pyccl_comm_leave(pyccl_comm *c)
{
    if (c->watch != NULL) {
        pthread_mutex_unlock(&c->watch->mu);
        c->inflight--;
    }
    else {
        pthread_mutex_unlock(&c->mu);
    }
}

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
        if (now_s() > deadline) {
            return 1;
        }
        if (waiter_pause(wt) < 0) {
            return -1;
        }
    }
}

int
pyccl_watch_init(pyccl_state *st, const char *op, ncclComm_t *out, int nranks,
                 const ncclUniqueId *uid, int rank, int device, double timeout)
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
    config.blocking = 0;
    ncclComm_t comm = NULL;
    ncclResult_t r, res = ncclSuccess;
    cudaError_t ce;
    char last[512] = "";
    int polled = 0;
    waiter wt;
    double deadline = now_s() + timeout;
    waiter_start(&wt, 1);
    int prev = -1;
    a->cudaGetDevice(&prev);
    ce = a->cudaSetDevice(device);
    if (ce == cudaSuccess) {
        /* NCCL's init thread keeps the device current at this call. */
        r = a->ncclCommInitRankConfig(&comm, nranks, *uid, rank, &config);
        a->cudaSetDevice(prev);
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
        char t[32];
        pyccl_fmt_seconds(t, sizeof t, timeout);
        char reason[400];
        snprintf(reason, sizeof reason,
                 "rank %d of %d timed out after %s s waiting for its peers to "
                 "join (every rank must call it with the same unique_id and "
                 "world_size); the communicator was aborted",
                 rank, nranks, t);
        PyObject *exc = pyccl_failure_exception(st, op, PYCCL_FAIL_TIMEOUT, 0,
                                                reason, timeout);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return -1;
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
    struct pyccl_watch *w = new_watch(st, c, c->comm, timeout);
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
static int
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
                int prev = dev_enter(w->api, w->device);
                cudaError_t e = retire(w, w->nq >= PYCCL_MAX_PENDING, &bad_op);
                dev_leave(w->api, w->device, prev);
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

int
pyccl_enqueue_timed(pyccl_state *st, const char *op, const pyccl_task *tasks,
                    Py_ssize_t n, int redop, pyccl_comm *const *comms,
                    Py_ssize_t ncomms)
{
    const pyccl_api *a = &st->api;
    struct pyccl_watch *ws_small[8], **ws = ws_small;
    pyccl_comm *owners_small[8], **owners = owners_small;
    int nw = 0, rc = -1, in_group = pyccl_group_depth() > 0;
    int *fresh = NULL, fresh_small[8];
    if (ncomms > 8) {
        ws = PyMem_Calloc((size_t)ncomms, sizeof *ws);
        owners = PyMem_Calloc((size_t)ncomms, sizeof *owners);
        fresh = PyMem_Calloc((size_t)ncomms, sizeof *fresh);
        if (ws == NULL || owners == NULL || fresh == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    else {
        fresh = fresh_small;
    }
    for (Py_ssize_t i = 0; i < ncomms; i++) {
        struct pyccl_watch *w = comms[i]->watch;
        int seen = 0;
        for (int j = 0; j < nw; j++) {
            seen |= ws[j] == w;
        }
        if (w == NULL || seen) {
            continue;
        }
        if (pyccl_watch_check(st, op, comms[i]) < 0) {
            goto done;
        }
        ws[nw++] = w;
    }
    /* one lock order for every thread */
    qsort(ws, (size_t)nw, sizeof *ws, cmp_ptr);
    for (int j = 0; j < nw; j++) {
        for (Py_ssize_t i = 0; i < ncomms; i++) {
            if (comms[i]->watch == ws[j]) {
                owners[j] = comms[i];
                break;
            }
        }
        fresh[j] = in_group && !group_has(ws[j]);
    }
    ncclResult_t r = ncclSuccess;
    char last[512] = "";
    int which = 0, got;
    int polled = 0; /* 1: deadline passed on ws[which]; -1: interrupted */
    cudaError_t rec_err = cudaSuccess;
    waiter wt;
    waiter_start(&wt, 1);
    got = acquire_all(&wt, ws, nw, !in_group, &which);
    if (got == 0) {
        for (int j = 0; j < nw; j++) {
            call_begin(ws[j]);
        }
        /* communicators without a watch in the same call (NCCL refuses
         * the group, but only at its end) */
        pyccl_comms_lock(comms, ncomms);
        r = pyccl_enqueue_calls(a, tasks, n, redop, last, sizeof last);
        pyccl_comms_unlock(comms, ncomms);
        for (int j = 0; j < nw; j++) {
            call_end(ws[j], op);
        }
        if (in_group) {
            /* NCCL launches nothing before the group's end */
            r = r == ncclInProgress ? ncclSuccess : r;
            for (int j = 0; j < nw; j++) {
                ws[j]->in_group += r == ncclSuccess && fresh[j] && !ws[j]->failed;
                pthread_mutex_unlock(&ws[j]->mu);
            }
        }
        else {
            if (r == ncclInProgress) {
                /* NCCL finishes the call in its own thread (the first call
                 * to a peer connects to it): poll until done.  Busy keeps
                 * other threads and the watchdog off meanwhile. */
                for (int j = 0; j < nw; j++) {
                    ws[j]->busy++;
                    pthread_mutex_unlock(&ws[j]->mu);
                }
                double t0 = now_s();
                for (int j = 0; j < nw && polled == 0; j++) {
                    struct pyccl_watch *w = ws[j];
                    for (;;) {
                        ncclResult_t e = ncclSuccess;
                        pthread_mutex_lock(&w->mu);
                        if (w->comm == NULL) { /* abort()ed from a handler */
                            pthread_mutex_unlock(&w->mu);
                            break;
                        }
                        a->ncclCommGetAsyncError(w->comm, &e);
                        pthread_mutex_unlock(&w->mu);
                        if (e != ncclInProgress) {
                            if (e != ncclSuccess && r == ncclInProgress) {
                                r = e;
                                which = j;
                            }
                            break;
                        }
                        if (now_s() > t0 + w->timeout) {
                            polled = 1;
                            which = j;
                            break;
                        }
                        if (waiter_pause(&wt) < 0) {
                            polled = -1;
                            break;
                        }
                    }
                }
                for (int j = 0; j < nw; j++) {
                    pthread_mutex_lock(&ws[j]->mu);
                    ws[j]->busy--;
                }
                if (r == ncclInProgress) {
                    r = ncclSuccess;
                }
            }
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
                        which = j;
                        fail(w, PYCCL_FAIL_NCCL, (int)e,
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
                            rec_err = record(w, tasks[i].stream, op);
                            if (call_end(w, op)) {
                                rec_err = cudaSuccess;
                                break;
                            }
                        }
                    }
                }
                pthread_mutex_unlock(&w->mu);
            }
        }
    }
    waiter_finish(&wt);
    if (got == 1) {
        raise_failure(st, op, ws[which]);
        owners[which]->comm = NULL;
        goto done;
    }
    if (got < 0 || polled < 0) {
        for (int j = 0; got == 0 && j < nw; j++) {
            owners[j]->comm = NULL; /* aborted: interrupted mid-call */
        }
        goto done; /* the signal handler's exception */
    }
    int raised = 0;
    for (int k = 0; k < nw; k++) {
        int j = (k + which) % nw; /* the one that failed first, first */
        if (failed_kind(ws[j])) {
            owners[j]->comm = NULL;
            if (!raised) {
                raised = 1;
                raise_failure(st, op, ws[j]);
            }
        }
    }
    if (raised) {
        goto done;
    }
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, op, r, last);
        goto done;
    }
    if (rec_err != cudaSuccess) {
        pyccl_raise_cuda(st, op, "cudaEventRecord", rec_err);
        goto done;
    }
    rc = 0;
    for (int j = 0; in_group && j < nw; j++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (tasks[i].comm == owners[j]->comm &&
                group_add((PyObject *)owners[j], ws[j], tasks[i].stream, op) < 0) {
                rc = -1;
            }
        }
        if (fresh[j] && !group_has(ws[j])) {
            /* out of memory before the entry went in: undo the count */
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&ws[j]->mu);
            ws[j]->in_group--;
            pthread_mutex_unlock(&ws[j]->mu);
            Py_END_ALLOW_THREADS
        }
    }
done:
    if (ws != ws_small) {
        PyMem_Free(ws);
        PyMem_Free(owners);
        PyMem_Free(fresh);
    }
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
    for (int i = 0; i < n; i++) {
        ((pyccl_comm *)g[i].comm)->inflight++; /* destroy() waits */
    }
    waiter wt;
    waiter_start(&wt, 1);
    double t0 = now_s();
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
            while (w->comm != NULL && !interrupted) {
                ncclResult_t e = ncclSuccess;
                a->ncclCommGetAsyncError(w->comm, &e);
                if (e != ncclInProgress) {
                    if (e != ncclSuccess) {
                        fail_nccl(w, g[i].op, e);
                    }
                    break;
                }
                if (now_s() > t0 + w->timeout) {
                    fail_timeout(w, g[i].op, "its peers");
                    break;
                }
                pthread_mutex_unlock(&w->mu);
                interrupted = waiter_pause(&wt) < 0;
                pthread_mutex_lock(&w->mu);
            }
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
                rec_err = record(w, g[k].stream, g[k].op);
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
        ((pyccl_comm *)g[i].comm)->inflight--;
        Py_DECREF(g[i].comm);
    }
    PyMem_RawFree(g);
    return rc;
}

/* ---------------- waiting for the work ---------------- */

/* Until the work enqueued on w so far finished, or `limit` seconds (the
 * communicator's own deadline still applies inside).  0; 1 when w failed
 * (nothing raised: the caller raises it); -1 with an exception. */
static int
wait_work(pyccl_state *st, const char *op, struct pyccl_watch *w, double limit,
          int interruptible)
{
    int status = 0; /* 1 failed, 2 limit passed, -1 interrupted */
    const char *head_op = op;
    double start = now_s();
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
            int prev = dev_enter(w->api, w->device);
            cudaError_t e = retire(w, 1, &bad_op);
            dev_leave(w->api, w->device, prev);
            if (e != cudaSuccess) {
                fail_cuda(w, bad_op, e);
                status = 1;
                break;
            }
        }
        if (w->nq == 0 || w->q[0].seq > target) {
            break;
        }
        double now = now_s();
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
        char t[32], own[32];
        pyccl_fmt_seconds(t, sizeof t, limit);
        pyccl_fmt_seconds(own, sizeof own, w->timeout);
        char reason[400];
        snprintf(reason, sizeof reason,
                 "rank %d of %d: the work enqueued on the communicator (the "
                 "oldest unfinished: %s) did not finish within %s s; the "
                 "communicator's own timeout of %s s has not passed, so it was "
                 "not aborted",
                 w->rank, w->size, head_op, t, own);
        PyObject *exc = pyccl_failure_exception(st, op, PYCCL_FAIL_TIMEOUT, 0,
                                                reason, limit);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    return status;
}

int
pyccl_watch_wait(pyccl_state *st, const char *op, pyccl_comm *c,
                 double timeout)
{
    c->inflight++; /* destroy() waits for this */
    int rc = wait_work(st, op, c->watch, timeout, 1);
    c->inflight--;
    if (rc > 0) {
        return pyccl_watch_check(st, op, c);
    }
    return rc;
}

int
pyccl_comm_add_stream(pyccl_comm *c, cudaStream_t s)
{
    c->last_stream = s;
    for (int i = 0; i < c->nstreams; i++) {
        if (c->streams[i] == s) {
            return 0;
        }
    }
    cudaStream_t *v = PyMem_Realloc(c->streams,
                                    (size_t)(c->nstreams + 1) * sizeof *v);
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    v[c->nstreams++] = s;
    c->streams = v;
    return 0;
}

int
pyccl_comm_note_stream(pyccl_comm *c, cudaStream_t s)
{
    if (c->nstreams > 0 && s == c->last_stream) {
        return 0;
    }
    return pyccl_comm_add_stream(c, s);
}

/* wait() of a communicator without timeout: an event recorded now on each
 * stream it was used on covers its work there (and whatever came before
 * it).  `limit` 0: no limit. */
static int
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
    double start = now_s();
    waiter wt;
    /* no c->inflight: the handle is not used, and abort() from another
     * thread is how a wait on a communicator without timeout ends early */
    waiter_start(&wt, 1);
    int prev = dev_enter(a, device);
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
    dev_leave(a, device, prev);
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
        if (limit > 0 && now_s() - start > limit) {
            status = 1;
            break;
        }
        if (waiter_pause(&wt) < 0) {
            status = -1;
            break;
        }
    }
    prev = dev_enter(a, device);
    for (int i = 0; i < n; i++) {
        if (evs[i] != NULL) {
            a->cudaEventDestroy(evs[i]);
        }
    }
    dev_leave(a, device, prev);
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
        char t[32];
        pyccl_fmt_seconds(t, sizeof t, limit);
        char reason[300];
        snprintf(reason, sizeof reason,
                 "rank %d of %d: the work enqueued on the communicator did not "
                 "finish within %s s; it has no timeout of its own, so it was "
                 "not aborted",
                 c->rank, c->size, t);
        PyObject *exc = pyccl_failure_exception(st, op, PYCCL_FAIL_TIMEOUT, 0,
                                                reason, limit);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    return 0;
}

int
pyccl_comm_track(pyccl_state *st, const char *op, pyccl_comm *c,
                 cudaStream_t s)
{
    struct pyccl_watch *w = c->watch;
    if (w == NULL) {
        return pyccl_comm_note_stream(c, s);
    }
    if (pyccl_watch_check(st, op, c) < 0) {
        return -1;
    }
    if (pyccl_group_depth() > 0) {
        int fresh = !group_has(w);
        if (group_add((PyObject *)c, w, s, op) < 0) {
            return -1;
        }
        if (fresh) { /* the group's end counts it down once */
            c->inflight++;
            lock_watch(w);
            w->in_group++;
            pthread_mutex_unlock(&w->mu);
            c->inflight--;
        }
        return 0;
    }
    int which = 0;
    cudaError_t e = cudaSuccess;
    waiter wt;
    c->inflight++;
    waiter_start(&wt, 1);
    int got = acquire_all(&wt, &w, 1, 1, &which);
    if (got == 0) {
        call_begin(w);
        e = record(w, s, op);
        got = call_end(w, op); /* 1: failed meanwhile */
        pthread_mutex_unlock(&w->mu);
    }
    waiter_finish(&wt);
    c->inflight--;
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

/* ---------------- split, destroy, abort, errors ---------------- */

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
    c->inflight++; /* destroy() waits for this */
    waiter_start(&wt, 1);
    got = acquire_all(&wt, &w, 1, 0, &which);
    if (got == 0) {
        double deadline = now_s() + w->timeout;
        /* NULL config: the child is non-blocking like its parent */
        r = a->ncclCommSplit(w->comm, color, key, slot, NULL);
        if (r == ncclSuccess || r == ncclInProgress) {
            w->busy++;
            for (;;) {
                ncclResult_t e = ncclSuccess;
                a->ncclCommGetAsyncError(w->comm, &e);
                if (e != ncclInProgress) {
                    res = e;
                    break;
                }
                if (now_s() > deadline) {
                    polled = 1;
                    break;
                }
                pthread_mutex_unlock(&w->mu);
                int sig = waiter_pause(&wt);
                pthread_mutex_lock(&w->mu);
                if (sig < 0 || w->comm == NULL) {
                    polled = sig < 0 ? -1 : 2;
                    break;
                }
            }
            w->busy--;
        }
        else {
            res = r;
        }
        if (polled == 0 && res == ncclSuccess && *slot != NULL) {
            /* ready once the parent's job is: no GIL needed (w is locked) */
            ncclResult_t e = ncclSuccess;
            wt.interruptible = 0;
            polled = poll_comm(&wt, a, *slot, deadline, &e);
            wt.interruptible = 1;
            res = e;
            if (res == ncclSuccess && polled == 0) {
                res = a->ncclCommUserRank(*slot, &rank);
            }
            if (res == ncclSuccess && polled == 0) {
                res = a->ncclCommCount(*slot, &size);
            }
        }
        if (res != ncclSuccess && a->ncclGetLastError) {
            strncpy(last, a->ncclGetLastError(w->comm), sizeof last - 1);
        }
        if (polled == 1) {
            fail_timeout(w, "split", "its peers");
        }
        else if (polled < 0) {
            fail_interrupted(w, "split");
        }
        else if (res != ncclSuccess && w->comm != NULL) {
            ncclResult_t e = ncclSuccess;
            a->ncclCommGetAsyncError(w->comm, &e);
            if (e != ncclSuccess && e != ncclInProgress) {
                fail_nccl(w, "split", e);
            }
        }
        pthread_mutex_unlock(&w->mu);
        if (res != ncclSuccess && polled == 0 && *slot != NULL) {
            a->ncclCommAbort(*slot); /* the child is no use alone */
            *slot = NULL;
        }
    }
    waiter_finish(&wt);
    c->inflight--;
    if (got < 0 || polled < 0) {
        if (got == 0) {
            c->comm = NULL;
        }
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
    if (w->in_group > 0 || w->busy > 0) {
        pthread_mutex_unlock(&w->mu);
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
    pthread_mutex_unlock(&w->mu);
    /* From here on the Communicator looks destroyed to other threads (which
     * then never reach w), while this one finishes w off. */
    c->comm = NULL;
    c->watch = NULL;
    unregister_watch(st, w);
    int rc = 0;
    if (!failed_kind(w) && w->comm != NULL) {
        /* First the tracked work, then NCCL's finalize, each bounded by the
         * timeout: peers that are gone must not hang destroy(). */
        rc = wait_work(st, op, w, w->timeout, may_raise);
        if (rc == 0 && w->comm != NULL) {
            int polled = 0;
            ncclResult_t res = ncclSuccess;
            waiter wt;
            waiter_start(&wt, 0); /* a half-finalized comm cannot be left */
            pthread_mutex_lock(&w->mu);
            if (a->ncclCommFinalize != NULL) {
                ncclResult_t r = a->ncclCommFinalize(w->comm);
                if (r == ncclSuccess || r == ncclInProgress) {
                    polled = poll_comm(&wt, a, w->comm, now_s() + w->timeout,
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
                ncclComm_t comm = w->comm;
                w->comm = NULL;
                ncclResult_t r = a->ncclCommDestroy(comm);
                res = res != ncclSuccess ? res : r;
            }
            pthread_mutex_unlock(&w->mu);
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
            pthread_mutex_lock(&w->mu);
            fail_interrupted(w, op);
            pthread_mutex_unlock(&w->mu);
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

/* A record of a communicator without timeout that was aborted. */
static int
mark_untimed(pyccl_state *st, pyccl_comm *c, int kind, const char *reason)
{
    const pyccl_api *a = &st->api;
    struct pyccl_watch *w = new_watch(st, c, NULL, 0.0);
    if (w == NULL) {
        return -1;
    }
    snprintf(w->reason, sizeof w->reason, "%s", reason);
    w->failed = kind;
    /* Under c's lock: no other thread is inside NCCL on the handle (an
     * own-kernel set-up waits between its calls), and none uses it after. */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->mu);
    ncclComm_t comm = c->comm;
    c->comm = NULL;
    if (comm != NULL && a->loaded) {
        a->ncclCommAbort(comm);
    }
    c->watch = w;
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS
    return 0;
}

PyObject *
pyccl_comm_abort(PyObject *self, PyObject *Py_UNUSED(unused))
{
    pyccl_comm *c = (pyccl_comm *)self;
    pyccl_state *st = state_of(self);
    if (st == NULL) {
        return NULL;
    }
    if (c->pending) {
        PyErr_SetString(PyExc_RuntimeError,
                        "abort: the communicator is not ready: it was created "
                        "inside pyccl.group(), which has not ended yet");
        return NULL;
    }
    struct pyccl_watch *w = c->watch;
    if (w == NULL) {
        if (c->comm == NULL) {
            Py_RETURN_NONE; /* destroyed: nothing to abort */
        }
        if (c->inflight > 0) {
            PyErr_Format(PyExc_RuntimeError,
                         "abort: the communicator (rank %d of %d) is in use by "
                         "another thread; abort it once that call returned",
                         c->rank, c->size);
            return NULL;
        }
        char reason[128];
        snprintf(reason, sizeof reason,
                 "the communicator (rank %d of %d) has been aborted", c->rank,
                 c->size);
        if (mark_untimed(st, c, PYCCL_FAIL_ABORTED, reason) < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    c->inflight++; /* destroy() waits for this */
    lock_watch(w);
    if (w->in_group > 0) {
        pthread_mutex_unlock(&w->mu);
        c->inflight--;
        PyErr_Format(PyExc_RuntimeError,
                     "abort: the communicator (rank %d of %d) was used inside "
                     "a pyccl.group() that has not ended; end the group first",
                     c->rank, c->size);
        return NULL;
    }
    /* A thread polling it (busy) sees the abort and raises. */
    Py_BEGIN_ALLOW_THREADS
    fail(w, PYCCL_FAIL_ABORTED, 0,
         "the communicator (rank %d of %d) has been aborted", c->rank, c->size);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&w->mu);
    c->inflight--;
    c->comm = NULL;
    Py_RETURN_NONE;
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
    pyccl_state *st = state_of(self);
    if (st == NULL || pyccl_comm_alive(st, "wait", c) < 0) {
        return NULL;
    }
    if (c->watch == NULL) {
        /* no timeout of its own: without a limit, as long as it takes */
        if (wait_streams(st, "wait", c, limit) < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (limit == 0.0) {
        limit = c->watch->timeout;
    }
    if (pyccl_watch_wait(st, "wait", c, limit) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *
pyccl_comm_get_async_error(PyObject *self, PyObject *Py_UNUSED(unused))
{
    pyccl_comm *c = (pyccl_comm *)self;
    pyccl_state *st = state_of(self);
    if (st == NULL) {
        return NULL;
    }
    struct pyccl_watch *w = c->watch;
    if (w != NULL && failed_kind(w) && failed_kind(w) != PYCCL_FAIL_ABORTED) {
        c->comm = NULL;
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
        r = a->ncclCommGetAsyncError(c->comm, &e);
    }
    else {
        c->inflight++;
        lock_watch(w);
        if (w->comm != NULL && !w->busy && !w->in_group) {
            r = a->ncclCommGetAsyncError(w->comm, &e);
            if (r == ncclSuccess && e != ncclSuccess && e != ncclInProgress) {
                /* what the watchdog would do within 10 ms */
                Py_BEGIN_ALLOW_THREADS
                fail_nccl(w, "get_async_error", e);
                Py_END_ALLOW_THREADS
            }
        }
        pthread_mutex_unlock(&w->mu);
        c->inflight--;
        if (failed_kind(w)) {
            c->comm = NULL;
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

void
pyccl_comm_mark_failed(pyccl_comm *c, const char *reason)
{
    pyccl_state *st = PyType_GetModuleState(Py_TYPE(c));
    if (st == NULL) {
        return;
    }
    struct pyccl_watch *w = c->watch;
    if (w == NULL) {
        if (mark_untimed(st, c, PYCCL_FAIL_TIMEOUT, reason) < 0) {
            PyErr_Clear();
        }
        return;
    }
    c->inflight++;
    lock_watch(w);
    Py_BEGIN_ALLOW_THREADS
    fail(w, PYCCL_FAIL_TIMEOUT, 0, "%s", reason);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&w->mu);
    c->inflight--;
    c->comm = NULL;
}

/* ---------------- interpreter exit ---------------- */

static void
stop_thread(struct pyccl_watchdog *wd)
{
    pthread_mutex_lock(&wd->mu);
    int started = wd->started;
    wd->stop = 1;
    wd->started = 0;
    pthread_cond_signal(&wd->cond);
    pthread_mutex_unlock(&wd->mu);
    if (started) {
        pthread_join(wd->thread, NULL);
    }
}

void
pyccl_watchdog_at_exit(pyccl_state *st)
{
    struct pyccl_watchdog *wd = live_watchdog(st);
    if (wd == NULL) {
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    stop_thread(wd);
    /* A kernel waiting for a peer that is gone would keep the GPU busy past
     * this process: abort what has not finished.  The rest is left to the
     * process's end, as without timeout. */
    pthread_mutex_lock(&wd->mu);
    for (struct pyccl_watch *w = wd->head; w != NULL; w = w->next) {
        if (pthread_mutex_trylock(&w->mu) != 0) {
            continue; /* another thread is inside: leave it */
        }
        if (!w->failed && w->comm != NULL && !w->busy && !w->in_group &&
            !w->closing && w->nq > 0) {
            const char *bad_op = NULL;
            int prev = dev_enter(w->api, w->device);
            retire(w, 1, &bad_op);
            dev_leave(w->api, w->device, prev);
            if (w->nq > 0) {
                fail(w, PYCCL_FAIL_ABORTED, 0,
                     "%s: rank %d of %d: unfinished at interpreter exit; the "
                     "communicator was aborted",
                     w->q[0].op, w->rank, w->size);
            }
        }
        pthread_mutex_unlock(&w->mu);
    }
    pthread_mutex_unlock(&wd->mu);
    Py_END_ALLOW_THREADS
}

void
pyccl_watchdog_free(pyccl_state *st)
{
    struct pyccl_watchdog *wd = live_watchdog(st);
    if (wd == NULL) {
        return;
    }
    stop_thread(wd);
    /* Watches still listed belong to communicators leaked at exit, which
     * may look at the list when collected: keep it then. */
    if (wd->head == NULL) {
        pthread_cond_destroy(&wd->cond);
        pthread_mutex_destroy(&wd->mu);
        PyMem_RawFree(wd);
        st->watchdog = NULL;
    }
}
