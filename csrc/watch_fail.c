/* Failing a watched communicator (under its watch's lock, w->mu): the first
 * failure is recorded and the handle revoked (kept for shrink()) or aborted;
 * and the calls that may block inside NCCL or CUDA (call_begin/call_end),
 * which abort() or the watchdog may claim, aborting the handle under them
 * (watchdog.c's thread, watch_life.c's abort()).  The messages of a timeout,
 * an error of the work and an interrupted wait are written here; a failed or
 * freed watch's events are destroyed here (drop_events). */
#include "timeouts.h"
#include "watch.h"
#include "tensor.h"

#include <stdarg.h>
#include <stdio.h>

/* Destroy every event (the communicator is gone). */
void
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
    if (w->kernel_word != NULL) {
        /* the own kernels that wait for peers give up at once */
        *w->kernel_word = 2;
    }
    ncclComm_t comm = *w->comm;
    __atomic_store_n(w->comm, NULL, __ATOMIC_RELEASE);
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
    __atomic_store_n(w->comm, NULL, __ATOMIC_RELEASE);
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
    ncclComm_t comm = __atomic_load_n(w->comm, __ATOMIC_ACQUIRE);
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
