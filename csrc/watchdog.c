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
 * and the caller, once released, only marks the communicator failed.
 *
 * This file: a watch (its events, failing it, the watchdog thread, waits
 * with the GIL released) and the calls under it that an enqueue makes: the
 * door's one hook for a timed call (pyccl_enqueue_timed: its communicators
 * checked, the group joined, back-pressure, the NCCL calls, their
 * completion, an event, and what went wrong raised at one place) and the
 * end of a group holding such calls (an own kernel's launch is one of its
 * rows, PYCCL_LAUNCHED).  watch_calls.c has the other calls (waits, the own
 * kernels' set-up), watch_life.c creation, split, destroy, abort. */
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
call_begin(struct pyccl_watch *w, int claimable)
{
    __atomic_store_n(&w->claimable, claimable, __ATOMIC_RELAXED);
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
         op, w->rank, w->size, w->timeout_text.s);
    return 1;
}

int
watch_claim_call(struct pyccl_watch *w)
{
    int64_t since = __atomic_load_n(&w->call_since, __ATOMIC_ACQUIRE);
    ncclComm_t comm = __atomic_load_n(&w->comm, __ATOMIC_ACQUIRE);
    if (w->blocking || !__atomic_load_n(&w->claimable, __ATOMIC_RELAXED)) {
        return 0; /* see struct pyccl_watch and call_begin: the caller waits for the lock */
    }
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
    if (w->blocking || !__atomic_load_n(&w->claimable, __ATOMIC_RELAXED)) {
        return; /* see struct pyccl_watch and call_begin */
    }
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
         op, w->rank, w->size, w->timeout_text.s, waiting_for);
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
int
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

/* c fails as `kind` for `reason` (the whole message), GIL held, nothing
 * raised: its watch failed, or a record made for a communicator without
 * one (no memory for it: c stays as it was).  The first failure stays. */
static void fail_comm(pyccl_state *st, pyccl_comm *c, int kind, const char *reason);

int
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

static void
fail_comm(pyccl_state *st, pyccl_comm *c, int kind, const char *reason)
{
    struct pyccl_watch *w = c->watch;
    if (w == NULL) {
        if (mark_untimed(st, c, kind, reason) < 0) {
            PyErr_Clear();
        }
        return;
    }
    lock_watch(w);
    Py_BEGIN_ALLOW_THREADS
    watch_fail(w, kind, 0, "%s", reason);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&w->mu);
    c->comm = NULL;
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
    PyObject *secs = NULL; /* a datetime.timedelta's total_seconds(), as torch takes */
    if (!PyBool_Check(obj) && !PyFloat_Check(obj) && !PyLong_Check(obj)) {
        PyObject *dt = PyImport_ImportModule("datetime");
        PyObject *td = dt != NULL ? PyObject_GetAttrString(dt, "timedelta") : NULL;
        int is_td = td != NULL ? PyObject_IsInstance(obj, td) : -1;
        Py_XDECREF(td);
        Py_XDECREF(dt);
        if (is_td < 0) {
            return -1;
        }
        if (is_td) {
            secs = PyObject_CallMethod(obj, "total_seconds", NULL);
            if (secs == NULL) {
                return -1;
            }
        }
    }
    if (secs == NULL && (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj)))) {
        PyErr_Format(PyExc_TypeError,
                     "%s: timeout must be a number of seconds (int or float), "
                     "a datetime.timedelta or None, got %.200s",
                     op, Py_TYPE(obj)->tp_name);
        return -1;
    }
    double v = PyFloat_AsDouble(secs != NULL ? secs : obj);
    Py_XDECREF(secs);
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
    if (pyccl_raise_forked(op, c) < 0) {
        return -1; /* nothing of it read: a parent's thread may hold its locks */
    }
    pyccl_watch_reap(st); /* a group whose thread ended fails its communicators */
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

/* Lock w, the GIL released only while waiting for it (as
 * pyccl_lock_released does, spelled out here so that the watch's own lock
 * stays within the watch). */
void
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
        if (c->watch == NULL && c->comm != NULL) {
            return 0;
        }
        /* abort() (or destroy()) ended the handle while this thread waited
         * for the lock: nothing for NCCL, and the lock taken is the one left */
        pthread_mutex_unlock(&c->mu);
        return c->watch != NULL ? pyccl_watch_check(st, op, c) : pyccl_raise_unusable(op, c);
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

/* ---------------- polling an NCCL call in progress ---------------- */

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

/* ---------------- calls under the watch: the enqueue, a group's end ---------------- */

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

/* As enqueue.c's list (pyccl_group_reap): a thread that ends with its group
 * open hands its entries over at its end; pyccl_watch_reap takes the
 * watches out of the group and fails the communicators. */
typedef struct lost_entries {
    group_entry *g;
    int n;
    struct lost_entries *next;
} lost_entries;
static pthread_key_t tl_key;
static pthread_once_t tl_key_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t tl_lost_mu = PTHREAD_MUTEX_INITIALIZER;
static lost_entries *tl_lost;
static int tl_lost_any;

static void
tl_thread_end(void *unused)
{
    (void)unused;
    if (tl_group_n == 0) {
        return;
    }
    lost_entries *e = malloc(sizeof *e);
    if (e == NULL) {
        return;
    }
    e->g = tl_group;
    e->n = tl_group_n;
    tl_group = NULL;
    tl_group_n = tl_group_cap = 0;
    pthread_mutex_lock(&tl_lost_mu);
    e->next = tl_lost;
    tl_lost = e;
    __atomic_store_n(&tl_lost_any, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&tl_lost_mu);
}

static void
make_tl_key(void)
{
    (void)pthread_key_create(&tl_key, tl_thread_end);
}

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
    if (__atomic_load_n(&tl_lost_any, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&tl_lost_mu);
        lost_entries *all = tl_lost;
        tl_lost = NULL;
        __atomic_store_n(&tl_lost_any, 0, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&tl_lost_mu);
        while (all != NULL) {
            lost_entries *e = all;
            all = e->next;
            for (int i = 0; i < e->n; i++) {
                struct pyccl_watch *w = e->g[i].w;
                int first = 1; /* counted once per watch in its group */
                for (int k = 0; k < i; k++) {
                    first &= e->g[k].w != w;
                }
                if (first) {
                    lock_watch(w);
                    w->in_group -= w->in_group > 0;
                    pthread_mutex_unlock(&w->mu);
                }
            }
            for (int i = 0; i < e->n; i++) {
                Py_DECREF(e->g[i].comm);
            }
            PyMem_RawFree(e->g);
            free(e);
        }
    }
    pyccl_group_reap(fail_lost, st);
}

int
group_has(struct pyccl_watch *w)
{
    for (int i = 0; i < tl_group_n; i++) {
        if (tl_group[i].w == w) {
            return 1;
        }
    }
    return 0;
}

int
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
    if (tl_group_n == 0) { /* handed over if the thread ends first */
        pthread_once(&tl_key_once, make_tl_key);
        pthread_setspecific(tl_key, (void *)1);
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

/* The distinct watches of a call's communicators, in lock order, each with
 * the communicator it came from and whether this call is the first of the
 * thread's open group on it; and for each of the call's rows, the watch
 * (index into ws, -1: none) whose handle it runs on and its stream: what the
 * watch records its events after. */
typedef struct {
    struct pyccl_watch *ws_small[8], **ws;
    pyccl_comm *owners_small[8], **owners;
    int fresh_small[8], *fresh;
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
        pthread_mutex_unlock(&w->mu);
    }
    return rec_err;
}

static void
watch_set_free(watch_set *g)
{
    if (g->ws != g->ws_small) {
        PyMem_Free(g->ws);
        PyMem_Free(g->owners);
        PyMem_Free(g->fresh);
    }
    if (g->rows != g->rows_small) {
        PyMem_Free(g->rows);
    }
}

/* -1 with MemoryError.  The first communicator whose watch failed already,
 * or that is not usable, is noted (g->bad), for the call to raise at its
 * end as the door's begin would (pyccl_call_run leaves the check to this). */
static int
watch_set_fill(watch_set *g, pyccl_state *st, const char *op, const pyccl_task *tasks,
               Py_ssize_t n, pyccl_comm *const *comms, Py_ssize_t ncomms, int in_group)
{
    g->n = 0;
    g->ws = g->ws_small;
    g->owners = g->owners_small;
    g->fresh = g->fresh_small;
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
        /* a watched communicator's handle goes only when it fails or is
         * destroyed: no other state to look at */
        if (g->bad == NULL && (failed_kind(w) || comms[i]->life != PYCCL_LIFE_USABLE)) {
            g->bad = comms[i];
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
    /* Each row's watch, by its handle: with every communicator usable (else
     * nothing is enqueued), a watched one's handle is its watch's (never
     * replaced, only cleared when it fails) and differs from every other's. */
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
    cudaError_t rec_err;
    char last[PYCCL_LAST_ERROR_SIZE];
} timed_outcome;

/* The calls were made and every watch is well. */
static int
all_well(const watch_set *g, const timed_outcome *o)
{
    int ok = g->bad == NULL && !o->refused && o->got == 0 && o->polled == 0 &&
             o->r == ncclSuccess && o->rec_err == cudaSuccess;
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
    if (g->bad != NULL) {
        /* found before anything was enqueued, the GIL held since: raises */
        (void)pyccl_comm_alive(st, op, g->bad);
        return -1;
    }
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
add_to_group(const char *op, watch_set *g)
{
    int rc = 0;
    for (int j = 0; j < g->n; j++) {
        for (Py_ssize_t i = 0; i < g->nrows; i++) {
            if (g->rows[i].j == j &&
                group_add((PyObject *)g->owners[j], g->ws[j], g->rows[i].stream, op) < 0) {
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
    if (watch_set_fill(&g, st, op, tasks, n, comms, ncomms, in_group) < 0 ||
        (g.bad == NULL && (o.refused = pyccl_group_join(comms, ncomms, 1)) < 0)) {
        watch_set_free(&g);
        return -1;
    }
    struct pyccl_watch **ws = g.ws;
    if (!o.refused && g.bad == NULL) {
        waiter wt;
        waiter_start(&wt, 1);
        o.got = acquire_all(&wt, ws, g.n, !in_group, &o.which);
        if (o.got == 0) {
            /* one NCCL call, outside any group, is all a claim may end */
            const int claimable = n == 1 && premul == NULL && !in_group;
            for (int j = 0; j < g.n; j++) {
                call_begin(ws[j], claimable);
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
                o.rec_err = settle_watches(a, op, &g, o.r, o.polled, o.last, &o.which);
            }
        }
        waiter_finish(&wt);
    }
    int rc = all_well(&g, &o) ? (in_group ? add_to_group(op, &g) : 0)
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
                call_begin(w, 1);
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
