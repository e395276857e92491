/* The watchdog: one thread per process that looks at every communicator
 * created with timeout= every 10 ms, the events it looks at, and failing a
 * communicator.
 *
 * Each call on a watched communicator records a CUDA event on its stream
 * after its work (not while the stream is captured into a CUDA graph:
 * replays are not watched; inside pyccl.group() when the outermost group
 * ends), but for pyccl's own kernels: their waits on peers give up after the
 * timeout by themselves, and the watchdog reads the word a kernel that gave
 * up sets (watch_kernels_gave_up).  When an unfinished event's work has had
 * the timeout to run (from its record, or from when the event ahead of it
 * on its stream was seen finished if that came later), or NCCL reports an
 * asynchronous error, the watchdog marks the communicator failed and ends
 * its handle (ncclCommRevoke where NCCL has it, so that
 * shrink() can use it, else ncclCommAbort); either makes stuck NCCL kernels
 * return, so the stream and a host blocked on it move on.  The next call, or
 * comm.wait(), raises the failure.  The handle is NCCL non-blocking by
 * default (every host-side NCCL call polled within the timeout, at NCCL's
 * cost of a thread per launch) or blocking (blocking=True, the "pyccl"
 * backend's: the calls cost what untimed ones do, the GPU work is watched).
 *
 * Locking.  A watch's mutex is held only for short sections that never
 * block on peers and never take the GIL (a Python thread takes it with the
 * GIL released).  The watchdog (trylock) never touches a communicator a
 * thread is using: locked, `busy` (a thread polls an NCCL call in progress
 * and enforces the deadline itself) or `in_group` (NCCL uses it at the
 * group's end).  The watchdog drops finished events (the calling thread
 * does only when PYCCL_MAX_PENDING are unfinished: a query costs the caller
 * more than the record).  A communicator holds at most PYCCL_MAX_PENDING
 * unfinished events (the next call waits for room), so the host never runs
 * far ahead of a stuck GPU into NCCL's or CUDA's blocking queues; an NCCL launch or
 * event record stuck behind other work for the timeout plus
 * PYCCL_STUCK_GRACE is claimed (call_begin) and its non-blocking handle
 * aborted without the lock, which lets the call return.
 *
 * watch_fail.c failing a watch (and the claim of a call stuck in NCCL or
 * CUDA), watch_state.c what the door asks of a watched communicator and the
 * waits with the GIL released, watch_enqueue.c the one enqueue (a watch a field of it) and a
 * group's end, watch_calls.c the waits for work and the own kernels'
 * set-up, watch_life.c creation, split, destroy, abort, watch_costs.c the
 * benchmark's timing of each step a timed call adds. */
#include "timeouts.h"
#include "locks.h"
#include "watch.h"
#include "enqueue.h"
#include "tensor.h"
#include "errors.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int
in_group_of(const struct pyccl_watch *w)
{
    return __atomic_load_n(w->in_group, __ATOMIC_ACQUIRE);
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

/* 1: ev finished; 0: not yet; -1: a real error (the first kept in *bad,
 * *bad_op the call it followed). */
static int
probe(const pyccl_api *a, const pending_event *p, int *not_ready, cudaError_t *bad,
      const char **bad_op)
{
    cudaError_t e = a->cudaEventQuery(p->ev);
    if (e == cudaSuccess) {
        return 1;
    }
    if (e == cudaErrorNotReady) {
        *not_ready = 1;
        return 0;
    }
    if (*bad == cudaSuccess) {
        *bad = e;
        *bad_op = p->op;
    }
    return -1;
}

/* The finished events of one stream, whose events are q[idx[0..m-1]] in
 * the order recorded: a prefix, since a stream runs its work in order.  Its
 * length, found with the newest event's query alone when all finished (the
 * usual case) and by bisection otherwise: each query costs the calling
 * thread about 1.5 us, so a long queue is never queried event by event.
 * -1 on a real error. */
static int
finished_prefix(const pyccl_api *a, const pending_event *q, const int *idx, int m,
                int *not_ready, cudaError_t *bad, const char **bad_op)
{
    int lo = 0, hi = m; /* idx[< lo] finished, idx[>= hi] not */
    int p = probe(a, &q[idx[m - 1]], not_ready, bad, bad_op);
    if (p < 0) {
        return -1;
    }
    if (p == 1) {
        return m;
    }
    hi = m - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        p = probe(a, &q[idx[mid]], not_ready, bad, bad_op);
        if (p < 0) {
            return -1;
        }
        lo = p == 1 ? mid + 1 : lo;
        hi = p == 1 ? hi : mid;
    }
    return lo;
}

cudaError_t
watch_retire(struct pyccl_watch *w, const char **bad_op)
{
    const pyccl_api *a = w->api;
    cudaError_t bad = cudaSuccess;
    int not_ready = 0;
    if (w->nq == 0) {
        return cudaSuccess;
    }
    /* Relaxed: a query must not invalidate a CUDA graph capture that this
     * thread (or, in global mode, any thread) has going on. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    a->cudaThreadExchangeStreamCaptureMode(&mode);
    const double now = pyccl_now_s();
    for (int i = 0; i < w->nq; i++) {
        w->q[i].seen = w->q[i].done = 0;
    }
    for (int first = 0; first < w->nq && bad == cudaSuccess; first++) {
        if (w->q[first].seen) {
            continue; /* its stream was looked at */
        }
        int m = 0;
        for (int i = first; i < w->nq; i++) {
            if (w->q[i].stream == w->q[first].stream) {
                w->q[i].seen = 1;
                w->idx[m++] = i;
            }
        }
        int k = finished_prefix(a, w->q, w->idx, m, &not_ready, &bad, bad_op);
        for (int j = 0; j < k; j++) {
            w->q[w->idx[j]].done = 1;
        }
        /* the rest of the stream's work started at the earliest when the
         * event ahead finished: their deadlines count from now at most */
        for (int j = k > 0 ? k : m; j < m; j++) {
            pending_event *p = &w->q[w->idx[j]];
            p->t = p->t < now ? now : p->t;
        }
    }
    int kept = 0;
    for (int i = 0; i < w->nq; i++) {
        if (w->q[i].done) {
            pool_put(w, w->q[i].ev);
        }
        else {
            w->q[kept++] = w->q[i];
        }
    }
    w->retired += (uint64_t)(w->nq - kept);
    w->nq = kept;
    a->cudaThreadExchangeStreamCaptureMode(&mode);
    if (not_ready) {
        /* cudaErrorNotReady is kept as the thread's last error: clear it, or
         * torch's next launch check would report it. */
        a->cudaGetLastError();
    }
    return bad;
}

int
watch_overdue(const struct pyccl_watch *w, double now)
{
    int due = -1; /* the unfinished event whose deadline comes first */
    for (int i = 0; i < w->nq; i++) {
        due = due < 0 || w->q[i].t < w->q[due].t ? i : due;
    }
    return due >= 0 && now - w->q[due].t > w->timeout ? due : -1;
}

int
watch_kernels_gave_up(struct pyccl_watch *w)
{
    if (w->kernel_word == NULL || *w->kernel_word != 1 || w->failed) {
        return 0;
    }
    const char *op = __atomic_load_n(&w->kernel_op, __ATOMIC_RELAXED);
    fail_timeout(w, op != NULL ? op : "all_reduce", "its peers in pyccl's all-reduce kernel");
    return 1;
}

/* Record an event on s after the work just enqueued there.  Not while s is
 * being captured into a CUDA graph: the event would become a graph node. */
cudaError_t
watch_record(struct pyccl_watch *w, cudaStream_t s, const char *op)
{
    const pyccl_api *a = w->api;
    cudaError_t e;
    cudaEvent_t ev = NULL;
    /* The device made current only where it matters: for the handles that
     * name the current device's stream (0, cudaStreamLegacy,
     * cudaStreamPerThread) and for a new event (made on the current
     * device); an event is recorded on any other stream of its device
     * whatever is current.  A cudaGetDevice saved per call. */
    int prev = -1;
    const int enter = (uintptr_t)s <= 2 || w->npool == 0;
    if (enter) {
        pyccl_device_enter(a, w->device, &prev);
    }
    if (pyccl_stream_captured(a, s)) {
        e = cudaSuccess;
        goto out;
    }
    if (w->nq == w->capq) {
        int cap = w->capq ? 2 * w->capq : 2 * PYCCL_MAX_PENDING;
        pending_event *q = PyMem_RawRealloc(w->q, (size_t)cap * sizeof *q);
        if (q != NULL) {
            w->q = q;
        }
        int *idx = q == NULL ? NULL : PyMem_RawRealloc(w->idx, (size_t)cap * sizeof *idx);
        if (idx == NULL) {
            e = cudaErrorMemoryAllocation;
            goto out;
        }
        w->idx = idx;
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
        w->q[w->nq].stream = s;
        w->q[w->nq].t = pyccl_now_s();
        w->q[w->nq].op = op;
        w->q[w->nq].seq = ++w->seq;
        w->nq++;
    }
out:
    if (enter) {
        pyccl_device_leave(a, w->device, prev);
    }
    return e;
}

/* ---------------- the watchdog's look (under w->mu) ---------------- */

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
    ncclComm_t comm = __atomic_load_n(w->comm, __ATOMIC_ACQUIRE);
    if (w->blocking || !__atomic_load_n(&w->claimable, __ATOMIC_RELAXED)) {
        return; /* see struct pyccl_watch and call_begin */
    }
    if (__atomic_compare_exchange_n(&w->call_since, &since, -1, 0,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) &&
        comm != NULL) {
        w->api->ncclCommAbort(comm);
    }
}

/* The watchdog's look at one communicator nobody is using (its device is
 * current). */
static void
check(struct pyccl_watch *w, double now)
{
    const char *bad_op = "a collective";
    cudaError_t e = watch_retire(w, &bad_op);
    if (e != cudaSuccess) {
        fail_cuda(w, bad_op, e);
        return;
    }
    int late = watch_overdue(w, now);
    if (late >= 0) {
        fail_timeout(w, w->q[late].op, "its peers");
        return;
    }
    ncclResult_t ae = ncclSuccess;
    if (w->api->ncclCommGetAsyncError(*w->comm, &ae) == ncclSuccess &&
        ae != ncclSuccess && ae != ncclInProgress) {
        fail_nccl(w, w->nq > 0 ? w->q[0].op : "watchdog", ae);
        return;
    }
    watch_kernels_gave_up(w);
}

/* ---------------- the watchdog thread ---------------- */

static void *
watchdog_main(void *arg)
{
    struct pyccl_watchdog *wd = arg;
    const pyccl_api *a = wd->api;
    int device = -1;
    pyccl_lock(&wd->mu, PYCCL_LOCK_WATCHDOG);
    while (!wd->stop) {
        double now = pyccl_now_s();
        for (struct pyccl_watch *w = wd->head; w != NULL; w = w->next) {
            if (pyccl_trylock(w->mu, PYCCL_LOCK_COMM) != 0) {
                force_abort(w, now_ns()); /* in use: unless stuck, next round */
                continue;
            }
            if (!w->failed && *w->comm != NULL && !w->busy && !in_group_of(w) &&
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
            pyccl_unlock(w->mu);
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
    pyccl_unlock(&wd->mu);
    return NULL;
}

/* The watchdog of this process, or NULL (none yet, or the parent's). */
static struct pyccl_watchdog *
live_watchdog(pyccl_state *st)
{
    struct pyccl_watchdog *wd = st->watchdog;
    return wd != NULL && wd->pid == pyccl_pid() ? wd : NULL;
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
    wd->pid = pyccl_pid();
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
    pyccl_lock(&wd->mu, PYCCL_LOCK_WATCHDOG);
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
    pyccl_unlock(&wd->mu);
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
    pyccl_lock(&wd->mu, PYCCL_LOCK_WATCHDOG);
    for (struct pyccl_watch **p = &wd->head; *p != NULL; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    pyccl_unlock(&wd->mu);
    Py_END_ALLOW_THREADS
    w->registered = 0;
}

struct pyccl_watch *
new_watch(pyccl_state *st, pyccl_comm *c, double timeout)
{
    struct pyccl_watch *w = PyMem_RawCalloc(1, sizeof *w);
    if (w == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    w->mu = &c->mu;
    w->api = &st->api;
    w->comm = &c->comm;
    w->in_group = &c->in_group;
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
    PyMem_RawFree(w->q);
    PyMem_RawFree(w->idx);
    PyMem_RawFree(w->pool);
    PyMem_RawFree(w);
}

/* ---------------- interpreter exit ---------------- */

static void
stop_thread(struct pyccl_watchdog *wd)
{
    pyccl_lock(&wd->mu, PYCCL_LOCK_WATCHDOG);
    int started = wd->started;
    wd->stop = 1;
    wd->started = 0;
    pthread_cond_signal(&wd->cond);
    pyccl_unlock(&wd->mu);
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
    pyccl_lock(&wd->mu, PYCCL_LOCK_WATCHDOG);
    for (struct pyccl_watch *w = wd->head; w != NULL; w = w->next) {
        if (pyccl_trylock(w->mu, PYCCL_LOCK_COMM) != 0) {
            continue; /* another thread is inside: leave it */
        }
        if (!w->failed && *w->comm != NULL && !w->busy && !in_group_of(w) &&
            !w->closing && w->nq > 0) {
            const char *bad_op = NULL;
            int prev;
            pyccl_device_enter(w->api, w->device, &prev);
            watch_retire(w, &bad_op);
            pyccl_device_leave(w->api, w->device, prev);
            if (w->nq > 0) {
                watch_fail(w, PYCCL_FAIL_ABORTED, 0,
                     "%s: rank %d of %d: unfinished at interpreter exit; the "
                     "communicator was aborted",
                     w->q[0].op, w->rank, w->size);
            }
        }
        pyccl_unlock(w->mu);
    }
    pyccl_unlock(&wd->mu);
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
