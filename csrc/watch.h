/* What the files of the timeout machinery share (watchdog.c, watch_fail.c, watch_state.c,
 * watch_calls.c, watch_enqueue.c, watch_life.c), and no other file includes: the watch of a communicator,
 * the watchdog, waits with the GIL released, failing.  Hidden from other
 * shared objects: these names are this extension's own. */
#ifndef PYCCL_WATCH_H
#define PYCCL_WATCH_H

#include "timeouts.h"
#include "errors.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#pragma GCC visibility push(hidden)

#define PYCCL_WATCH_PERIOD_NS 10000000L /* the watchdog's look every 10 ms */
#define PYCCL_SIGNAL_PERIOD 0.02        /* s between signal checks in waits */
#define PYCCL_STUCK_GRACE 1.0           /* s past the timeout for a call stuck in NCCL */

/* Monotonic nanoseconds: when a call that may block began (call_begin). */
static inline int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct {
    cudaEvent_t ev;
    cudaStream_t stream; /* where it was recorded */
    /* Where its deadline counts from (monotonic s): when it was recorded,
     * moved on to when the event ahead of it on its stream was seen
     * finished (its work cannot have started before: watch_retire). */
    double t;
    const char *op;  /* the call it follows (a string literal) */
    uint64_t seq;
    int seen, done;  /* watch_retire's marks */
} pending_event;

struct pyccl_watch {
    /* The communicator's lock (its `mu`): one lock per communicator, with or
     * without a watch.  A watch lives no longer than its communicator (freed
     * by destroy(), or leaked with it at exit and in a forked child). */
    pthread_mutex_t *mu;
    struct pyccl_watch *next; /* in the watchdog's list, under its mutex */
    const pyccl_api *api;
    /* The communicator's handle (its `comm`): stored once, read and cleared
     * through here under mu (atomically where a claim aborts it without
     * mu); NULL once aborted, failed or destroyed. */
    ncclComm_t *comm;
    ncclComm_t closing_comm;  /* destroy(): the handle, moved here (comm points here) */
    /* A failed communicator's handle, revoked (ncclCommRevoke: its work
     * stopped, the handle kept) where the loaded NCCL has the call, so that
     * shrink() can make a communicator of the ranks left; aborted when the
     * watch is freed.  NULL: none (aborted at once). */
    ncclComm_t revoked;
    int revoke_result;        /* what ncclCommRevoke returned (-1: not called) */
    int keep_failed;          /* revoke rather than abort (PYCCL_KEEP_FAILED, default 1) */
    /* NCCL's config.blocking of the handle.  A blocking handle is never
     * touched while a thread is inside an NCCL call on it: NCCL's abort
     * would free it under that call (a non-blocking handle's abort joins
     * NCCL's own thread first).  So a call stuck on the host there (a launch
     * behind a full queue) is not claimed: it returns when NCCL does. */
    int blocking;
    int device, rank, size;
    double timeout;           /* 0: a record of a failed communicator only */
    pyccl_secs_text timeout_text; /* as messages write it (pyccl_secs) */
    int registered;
    int busy;                 /* a thread polls an NCCL call in progress */
    /* The communicator's group count (its `in_group`: pyccl.group()s not
     * ended that hold work of it), read here without the GIL. */
    const int *in_group;
    int closing;              /* destroy() is finalizing it */
    /* A thread is inside an NCCL/CUDA call on it (under mu) since this
     * (monotonic ns); 0: none; -1: the watchdog gave up on that call and
     * aborted the handle (see force_abort). */
    int64_t call_since;
    int claimable;            /* the call of call_since may be claimed (call_begin) */
    pending_event *q;         /* unfinished events, oldest first */
    int *idx;                 /* watch_retire's scratch: capq of them */
    int nq, capq;
    cudaEvent_t *pool;        /* finished events, for reuse */
    int npool, cappool;
    uint64_t seq;             /* seq of the last event recorded */
    uint64_t retired;         /* events found finished so far (by any thread) */
    /* pyccl's own kernels on the communicator, once set up: their host word
     * (1 when a kernel gave up waiting for peers, 2 their stop word) and the
     * op of the last call that launched them.  A kernel's waits are bounded
     * by the timeout, so no event follows it: the watchdog reads the word at
     * each look.  The word is set and cleared (before it is freed) under mu. */
    volatile int *kernel_word;
    const char *kernel_op;
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

typedef struct {
    PyThreadState *ts;
    double next_signals;
    unsigned spins;
    int interruptible;
} waiter;

/* Around an NCCL/CUDA call that may block, under w->mu.  `claimable`: the
 * call is one NCCL or CUDA call outside any NCCL group, which abort() or the
 * watchdog may end by aborting the handle under it.  A call made of several
 * (an NCCL group, a premul_sum op made and destroyed around it, a call
 * joining a pyccl.group()) is never claimed: the handle would be gone
 * between its calls, or be left in this thread's NCCL group. */
void call_begin(struct pyccl_watch *w, int claimable);
/* abort(), finding w's lock held: when the holder is inside an NCCL/CUDA
 * call (call_begin), claim that call and abort the handle without the lock,
 * so the call returns (its call_end finds the communicator aborted).  1 when
 * claimed.  Without the GIL. */
int watch_claim_call(struct pyccl_watch *w);
int call_end(struct pyccl_watch *w, const char *op);
void watch_fail(struct pyccl_watch *w, int kind, int code, const char *fmt, ...);
/* Destroy every event of w, pending or pooled (the communicator is gone or failed). */
void drop_events(struct pyccl_watch *w);
/* An NCCL or CUDA error code from the work: the watch failed with it. */
void fail_cuda(struct pyccl_watch *w, const char *op, cudaError_t e);
void fail_nccl(struct pyccl_watch *w, const char *op, ncclResult_t e);
void fail_interrupted(struct pyccl_watch *w, const char *op);
void fail_timeout(struct pyccl_watch *w, const char *op, const char *waiting_for);
int failed_kind(const struct pyccl_watch *w);
/* pyccl.group()s not ended that hold work of w's communicator. */
int in_group_of(const struct pyccl_watch *w);
void free_watch(struct pyccl_watch *w);
void lock_watch(struct pyccl_watch *w);
/* c's watch (its lock and handle are c's), not yet registered. */
struct pyccl_watch * new_watch(pyccl_state *st, pyccl_comm *c, double timeout);
/* c (without timeout) failed as `kind` for `reason`: its handle aborted, a
 * record of the failure as its watch.  For abort() the wait for a thread
 * inside NCCL on c (c's lock) looks at signals between pauses.  -1 with
 * MemoryError, a signal handler's exception (nothing changed), or, for
 * abort(), RuntimeError when a pyccl.group() of another thread took c
 * meanwhile. */
int mark_untimed(pyccl_state *st, pyccl_comm *c, int kind, const char *reason, int abort);
/* c fails as `kind` for `reason` (the whole message), GIL held, nothing
 * raised: its watch failed, or a record made for a communicator without
 * one (no memory for it: c stays as it was).  The first failure stays. */
void fail_comm(pyccl_state *st, pyccl_comm *c, int kind, const char *reason);
int raise_failure(pyccl_state *st, const char *op, struct pyccl_watch *w);
cudaError_t watch_record(struct pyccl_watch *w, cudaStream_t s, const char *op);
/* Drop w's finished events (back to its pool); cudaSuccess or the first
 * real error of cudaEventQuery, *bad_op the call that event followed.  The
 * comm's device must be current. */
cudaError_t watch_retire(struct pyccl_watch *w, const char **bad_op);
/* The one place that decides that a watched communicator's work timed out
 * (the watchdog's look and a wait's own): the unfinished event whose work
 * has had the timeout to run by `now` (index into w->q; its deadline counts
 * as pending_event.t says), or -1. */
int watch_overdue(const struct pyccl_watch *w, double now);
/* Under w->mu: 1 when one of pyccl's own kernels on w's communicator gave up
 * waiting for its peers (their word says so: the kernel decided, after the
 * timeout, in its own wait), and w is failed now with the timeout's message,
 * as watch_overdue's caller fails it; else 0. */
int watch_kernels_gave_up(struct pyccl_watch *w);
pyccl_state * watch_state_of(PyObject *self);
/* Add w to the watchdog's list, starting its thread on first use; -1 with
 * RuntimeError when it cannot start. */
int register_watch(pyccl_state *st, const char *op, struct pyccl_watch *w);
void unregister_watch(pyccl_state *st, struct pyccl_watch *w);
void waiter_finish(waiter *wt);
int waiter_pause(waiter *wt);
/* w->mu held (released while pausing, held again on return), w->busy raised
 * by the caller: poll w's communicator until it is not ncclInProgress.  0
 * done (*res its state), 1 the deadline passed, -1 interrupted, 2 the handle
 * went away meanwhile (aborted). */
int poll_watch(waiter *wt, struct pyccl_watch *w, double deadline, ncclResult_t *res);
void waiter_start(waiter *wt, int interruptible);
int acquire_all(waiter *wt, struct pyccl_watch **ws, int n, int need_room, int *which);
int wait_streams(pyccl_state *st, const char *op, pyccl_comm *c, double limit);
/* The work a wait looked at is done: whether an abort() ended it. */
int wait_end(pyccl_state *st, const char *op, pyccl_comm *c);
int wait_work(pyccl_state *st, const char *op, struct pyccl_watch *w, double limit, int interruptible);

#pragma GCC visibility pop

#endif
