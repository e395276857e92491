/* The other calls of a communicator with timeout= (its enqueue and a
 * group's end are watch_enqueue.c's): waiting for a communicator's work
 * (comm.wait(), barrier()), and for one without a timeout the streams it was
 * used on; the NCCL calls of pyccl's own kernels' set-up and release, held
 * under the watch (their launches are rows of the one enqueue). */
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

/* ---------------- waiting for the work ---------------- */

/* Until the work enqueued on w so far finished, or `limit` seconds (the
 * communicator's own deadline still applies inside); `limit` 0: until the
 * work made no progress (no call of it finished) for the communicator's
 * timeout, however long the whole takes.  0; 1 when w failed (nothing
 * raised: the caller raises it); -1 with an exception. */
int
wait_work(pyccl_state *st, const char *op, struct pyccl_watch *w, double limit,
          int interruptible)
{
    int status = 0; /* 1 failed, 2 limit passed, -1 interrupted */
    const char *head_op = op;
    const int stall = limit <= 0.0;
    limit = stall ? w->timeout : limit;
    double start = pyccl_now_s();
    waiter wt;
    waiter_start(&wt, interruptible);
    pyccl_lock(w->mu, PYCCL_LOCK_COMM);
    uint64_t target = w->seq, retired = w->retired;
    for (;;) {
        if (w->failed) {
            status = 1;
            break;
        }
        if (w->nq > 0) {
            const char *bad_op = NULL;
            int prev;
            pyccl_device_enter(w->api, w->device, &prev);
            cudaError_t e = watch_retire(w, &bad_op);
            pyccl_device_leave(w->api, w->device, prev);
            if (e != cudaSuccess) {
                fail_cuda(w, bad_op, e);
                status = 1;
                break;
            }
        }
        if (stall && w->retired != retired) {
            /* progress, found here or by the watchdog meanwhile */
            retired = w->retired;
            start = pyccl_now_s();
        }
        if (w->nq == 0 || w->q[0].seq > target) {
            break;
        }
        double now = pyccl_now_s();
        int late = watch_overdue(w, now);
        if (late >= 0 && !w->busy && !in_group_of(w)) {
            /* its own deadline: what the watchdog is about to do */
            fail_timeout(w, w->q[late].op, "its peers");
            status = 1;
            break;
        }
        if (now - start > limit) {
            head_op = w->q[0].op;
            status = 2;
            break;
        }
        pyccl_unlock(w->mu);
        int sig = waiter_pause(&wt);
        pyccl_lock(w->mu, PYCCL_LOCK_COMM);
        if (sig < 0) {
            status = -1;
            break;
        }
    }
    pyccl_unlock(w->mu);
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

static int wait_stream_list(pyccl_state *st, const char *op, pyccl_comm *c,
                            cudaStream_t *from, int n, double limit);

int
pyccl_watch_wait(pyccl_state *st, const char *op, pyccl_comm *c,
                 double limit)
{
    struct pyccl_watch *w = c->watch;
    int rc = wait_work(st, op, w, limit, 1);
    if (rc == 0 && c->nstreams > 0) {
        /* pyccl's own kernels (no events: their streams), which end by
         * the timeout at the latest; then whether one of them gave up */
        rc = wait_stream_list(st, op, c, c->streams, c->nstreams, limit);
        if (rc == 0) {
            lock_watch(w);
            watch_kernels_gave_up(w);
            pyccl_unlock(w->mu);
        }
    }
    return rc < 0 ? rc : wait_end(st, op, c);
}

/* An abort() of another thread ends the work before it marks the
 * communicator (the own kernels' stop word first, then NCCL's abort, whose
 * teardown takes long after the kernels it ended returned): a wait that
 * found the work done while such an abort is under way waits for it to
 * finish, then raises "has been aborted" when it did, as it would have had
 * the mark come first.  Signals are looked at meanwhile. */
int
wait_end(pyccl_state *st, const char *op, pyccl_comm *c)
{
    if (__atomic_load_n(&c->aborting, __ATOMIC_ACQUIRE) > 0) {
        waiter wt;
        int sig = 0;
        waiter_start(&wt, 1);
        while (sig == 0 && __atomic_load_n(&c->aborting, __ATOMIC_ACQUIRE) > 0) {
            sig = waiter_pause(&wt);
        }
        waiter_finish(&wt);
        if (sig < 0) {
            return -1;
        }
    }
    return pyccl_watch_check(st, op, c);
}

/* wait() of a communicator without timeout (and of the own kernels of one
 * with): an event recorded now on each stream it was used on covers its work
 * there (and whatever came before it).  `limit` 0: no limit. */

int
wait_streams(pyccl_state *st, const char *op, pyccl_comm *c, double limit)
{
    return wait_stream_list(st, op, c, c->streams, c->nstreams, limit);
}

int
pyccl_comm_drain(pyccl_state *st, const char *op, pyccl_comm *c)
{
    if (c->watch == NULL) {
        return wait_streams(st, op, c, 0.0);
    }
    if (failed_kind(c->watch)) {
        return 0; /* its work was stopped with it */
    }
    return pyccl_watch_wait(st, op, c, 0.0);
}

int
pyccl_wait_stream(pyccl_state *st, const char *op, pyccl_comm *c, cudaStream_t s)
{
    if (c->watch != NULL) {
        /* like any call on it: bounded, interruptible */
        return pyccl_watch_wait(st, op, c, 0.0);
    }
    if (wait_stream_list(st, op, c, &s, 1, 0.0) < 0) {
        return -1;
    }
    /* abort() from another thread ended the work, and the wait: it did
     * not finish, and the call says why, as a watched one's does */
    return wait_end(st, op, c);
}

/* The work on streams[0..n) so far done (an event each, polled with the GIL
 * released, KeyboardInterrupt between polls); limit > 0: NcclTimeoutError
 * after it, nothing aborted. */
static int
wait_stream_list(pyccl_state *st, const char *op, pyccl_comm *c, cudaStream_t *from,
                 int n, double limit)
{
    const pyccl_api *a = &st->api;
    int status = 0; /* 1 limit passed, -1 interrupted */
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
    memcpy(streams, from, (size_t)n * sizeof *streams);
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

/* For a caller that talks to NCCL without the GIL between waits that
 * another thread's abort() or the watchdog may end (the own kernels' set-up,
 * ar.c): take the lock that abort() and the watchdog take before they
 * touch the handle (c's own without a timeout, the watch's with one) and
 * give the handle.  NULL, with nothing held, once the communicator was
 * aborted, failed or destroyed, or while a pyccl.group() open on another
 * thread holds it (*other).  The lock is held for one NCCL call and
 * its completion poll, never across a wait on peers. */
static pthread_mutex_t *
hold(pyccl_comm *c, ncclComm_t *comm, int *other)
{
    *comm = NULL;
    pyccl_lock(&c->mu, PYCCL_LOCK_COMM);
    struct pyccl_watch *w = c->watch; /* changes from NULL only under c->mu */
    if (w == NULL) {
        if (c->comm == NULL) {
            pyccl_unlock(&c->mu);
            return NULL;
        }
    }
    else if (w->timeout <= 0 || failed_kind(w) || *w->comm == NULL || w->closing) {
        /* aborted, failed or being destroyed (a record without a timeout:
         * an aborted communicator's) */
        pyccl_unlock(&c->mu);
        return NULL;
    }
    if ((*other = pyccl_group_others(c))) {
        /* as a call's enqueue: NCCL would work on c beside that group */
        pyccl_unlock(&c->mu);
        return NULL;
    }
    if (w == NULL) {
        *comm = c->comm;
        return &c->mu;
    }
    *comm = *w->comm;
    /* one call in NCCL, as an enqueue is: the watchdog claims it and aborts
     * the handle when it is stuck past the timeout and the grace */
    call_begin(w, 1);
    return &c->mu;
}

ncclResult_t
pyccl_comm_held_call(const pyccl_api *a, pyccl_comm *c, pyccl_task *t, int redop,
                     double deadline, char *last, size_t last_size, int *gone)
{
    int other = 0;
    pthread_mutex_t *held = hold(c, &t->comm, &other);
    if (held == NULL) {
        *gone = other ? PYCCL_HELD_OTHER : PYCCL_HELD_GONE;
        return ncclInvalidUsage;
    }
    *gone = PYCCL_HELD_MADE;
    /* no communicators to lock: the one lock is held */
    ncclResult_t r = pyccl_enqueue_calls(a, t, 1, redop, NULL, NULL, 0);
    struct pyccl_watch *w = c->watch;
    if (w != NULL && w->timeout > 0 && call_end(w, "all_reduce")) {
        /* the watchdog aborted the handle under the stuck call */
        pyccl_unlock(held);
        *gone = PYCCL_HELD_CLAIMED;
        return ncclInvalidUsage;
    }
    r = pyccl_nccl_settle(a, t->comm, r, deadline);
    if (r != ncclInProgress) {
        pyccl_nccl_failed(a, r, t->comm, last, last_size);
    }
    pyccl_unlock(held);
    return r;
}
