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

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int
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
cudaError_t
watch_retire(struct pyccl_watch *w, int all, const char **bad_op)
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
    int prev;
    pyccl_device_enter(a, w->device, &prev);
    for (int i = 0; i < w->nq; i++) {
        a->cudaEventDestroy(w->q[i].ev);
    }
    for (int i = 0; i < w->npool; i++) {
        a->cudaEventDestroy(w->pool[i]);
    }
    pyccl_device_leave(a, w->device, prev);
    w->nq = w->npool = 0;
}

/* Record an event on s after the work just enqueued there.  Not while s is
 * being captured into a CUDA graph: the event would become a graph node. */
cudaError_t
watch_record(struct pyccl_watch *w, cudaStream_t s, const char *op)
{
    const pyccl_api *a = w->api;
    cudaError_t e;
    cudaEvent_t ev = NULL;
    /* Stream 0 is the current device's legacy stream. */
    int prev;
    pyccl_device_enter(a, w->device, &prev);
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
        w->q[w->nq].t = pyccl_now_s();
        w->q[w->nq].op = op;
        w->q[w->nq].seq = ++w->seq;
        w->nq++;
    }
out:
    pyccl_device_leave(a, w->device, prev);
    return e;
}

/* ---------------- failing (under w->mu) ---------------- */

/* Mark w failed first (so threads waiting on it raise at once), then abort
 * the NCCL communicator: its abort flag ends the kernels that wait for
 * peers.  Idempotent: the first failure wins. */
void
watch_fail(struct pyccl_watch *w, int kind, int code, const char *fmt, ...)
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
        /* A timeout or an error (not abort()): revoked where NCCL can, which
         * stops its work as an abort does but keeps the handle for shrink() */
        ncclResult_t rv = (ncclResult_t)-1;
        if (kind != PYCCL_FAIL_ABORTED && w->api->ncclCommRevoke != NULL && w->keep_failed) {
            rv = w->api->ncclCommRevoke(comm, 0); /* non-blocking: ncclInProgress */
        }
        w->revoke_result = rv;
        if (rv == ncclSuccess || rv == ncclInProgress) {
            w->revoked = comm;
        }
        else {
            w->api->ncclCommAbort(comm);
        }
    }
    drop_events(w);
}

/* Around an NCCL/CUDA call that may block (a launch, an event record),
 * under w->mu.  call_end: 0, or 1 when the watchdog gave up on the call
 * meanwhile and aborted the handle (then w is failed, its handle gone). */
void
call_begin(struct pyccl_watch *w)
{
    __atomic_store_n(&w->call_since, now_ns(), __ATOMIC_RELEASE);
}

int
call_end(struct pyccl_watch *w, const char *op)
{
    int64_t mine = __atomic_load_n(&w->call_since, __ATOMIC_ACQUIRE);
    if (mine > 0 && __atomic_compare_exchange_n(&w->call_since, &mine, 0, 0,
                                                __ATOMIC_ACQ_REL,
                                                __ATOMIC_ACQUIRE)) {
        return 0;
    }
    /* claimed: -1 by the watchdog, -2 by abort(), which aborted the handle */
    const int by_abort = mine == -2;
    __atomic_store_n(&w->call_since, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&w->comm, NULL, __ATOMIC_RELEASE);
    if (by_abort) {
        watch_fail(w, PYCCL_FAIL_ABORTED, 0, "the communicator (rank %d of %d) has been aborted",
                   w->rank, w->size);
        return 1;
    }
    watch_fail(w, PYCCL_FAIL_TIMEOUT, 0,
         "%s: rank %d of %d timed out after %s s waiting for its peers (the "
         "call itself was stuck in NCCL or CUDA, e.g. behind a full launch "
         "queue); the communicator was aborted",
         op, w->rank, w->size, pyccl_secs(w->timeout).s);
    return 1;
}

int
watch_claim_call(struct pyccl_watch *w)
{
    int64_t since = __atomic_load_n(&w->call_since, __ATOMIC_ACQUIRE);
    ncclComm_t comm = __atomic_load_n(&w->comm, __ATOMIC_ACQUIRE);
    if (since > 0 && comm != NULL &&
        __atomic_compare_exchange_n(&w->call_since, &since, -2, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        w->api->ncclCommAbort(comm);
        return 1;
    }
    return 0;
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

void
fail_timeout(struct pyccl_watch *w, const char *op, const char *waiting_for)
{
    watch_fail(w, PYCCL_FAIL_TIMEOUT, 0,
         "%s: rank %d of %d timed out after %s s waiting for %s; the "
         "communicator was aborted",
         op, w->rank, w->size, pyccl_secs(w->timeout).s, waiting_for);
}

static void
fail_error(struct pyccl_watch *w, const char *op, int cuda, int code)
{
    watch_fail(w, cuda ? PYCCL_FAIL_CUDA : PYCCL_FAIL_NCCL, code,
         "%s: rank %d of %d: %s error %d (%s) while its work ran; the "
         "communicator was aborted",
         op, w->rank, w->size, cuda ? "CUDA" : "NCCL", code,
         cuda ? w->api->cudaGetErrorString((cudaError_t)code)
              : w->api->ncclGetErrorString((ncclResult_t)code));
}

void
fail_cuda(struct pyccl_watch *w, const char *op, cudaError_t e)
{
    fail_error(w, op, 1, (int)e);
}

void
fail_nccl(struct pyccl_watch *w, const char *op, ncclResult_t e)
{
    fail_error(w, op, 0, (int)e);
}

void
fail_interrupted(struct pyccl_watch *w, const char *op)
{
    watch_fail(w, PYCCL_FAIL_ABORTED, 0,
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
    cudaError_t e = watch_retire(w, 1, &bad_op);
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
        double now = pyccl_now_s();
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
void
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

struct pyccl_watch *
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
    w->revoke_result = -1;
    const char *keep = getenv("PYCCL_KEEP_FAILED");
    w->keep_failed = keep == NULL || strcmp(keep, "0") != 0;
    return w;
}

void
free_watch(struct pyccl_watch *w)
{
    if (w->revoked != NULL) {
        w->api->ncclCommAbort(w->revoked);
        w->revoked = NULL;
    }
    drop_events(w);
    pthread_mutex_destroy(&w->mu);
    PyMem_RawFree(w->q);
    PyMem_RawFree(w->pool);
    PyMem_RawFree(w);
}

/* ---------------- waiting with the GIL released ---------------- */


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
    return pyccl_raise_unusable(op, c);
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

/* Lock w, the GIL released while waiting for it. */
void
lock_watch(struct pyccl_watch *w)
{
    pyccl_lock_released(&w->mu);
}

int
pyccl_comm_enter(pyccl_state *st, const char *op, pyccl_comm *c)
{
    (void)op;
    if (c->watch == NULL) {
        pyccl_comm_lock(c); /* abort() cannot change watch while it is held */
        return 0;
    }
    lock_watch(c->watch); /* the caller's call is begun: destroy() waits */
    if (failed_kind(c->watch)) {
        pthread_mutex_unlock(&c->watch->mu);
        return pyccl_watch_check(st, op, c);
    }
    return 0;
}

void
pyccl_comm_leave(pyccl_comm *c)
{
    if (c->watch != NULL) {
        pthread_mutex_unlock(&c->watch->mu);
    }
    else {
        pthread_mutex_unlock(&c->mu);
    }
}

/* ---------------- creation ---------------- */

/* Poll comm (GIL released, in a waiter) until NCCL's call on it is done.
 * 0: done, *res is its result; 1: deadline passed; -1: interrupted. */
int
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
poll_watch(waiter *wt, struct pyccl_watch *w, double deadline, ncclResult_t *res)
{
    for (;;) {
        if (w->comm == NULL) {
            return 2; /* aborted meanwhile (abort() from a signal handler) */
        }
        ncclResult_t e = ncclSuccess;
        w->api->ncclCommGetAsyncError(w->comm, &e);
        if (e != ncclInProgress) {
            *res = e;
            return 0;
        }
        if (pyccl_now_s() > deadline) {
            return 1;
        }
        pthread_mutex_unlock(&w->mu);
        int sig = waiter_pause(wt);
        pthread_mutex_lock(&w->mu);
        if (sig < 0) {
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
            int prev;
            pyccl_device_enter(w->api, w->device, &prev);
            watch_retire(w, 1, &bad_op);
            pyccl_device_leave(w->api, w->device, prev);
            if (w->nq > 0) {
                watch_fail(w, PYCCL_FAIL_ABORTED, 0,
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
