/* The timeouts layer: what watchdog.c, watch_fail.c, watch_state.c,
 * watch_calls.c, watch_enqueue.c and watch_life.c offer to the layers above,
 * in one header (one layer; a caller need not know which file defines a
 * call).  What the six share among themselves is watch.h.
 *
 * A communicator created with timeout= records a CUDA event on its stream
 * after each call's work (pyccl's own kernels bound their waits by the
 * timeout themselves and say when one gave up: no event), and one watchdog
 * thread per process aborts it
 * (ncclCommRevoke or ncclCommAbort, which also stop its stuck kernels) when
 * an unfinished call's work has had the timeout to run or NCCL reports an
 * asynchronous error; its handle is NCCL non-blocking (every host-side NCCL
 * call polled until done or its deadline) or blocking (blocking=True).  The
 * next call raises. */
#ifndef PYCCL_TIMEOUTS_H
#define PYCCL_TIMEOUTS_H

/* Unfinished calls a communicator with a timeout tracks at most (one CUDA
 * event each); the next call waits for room.  _C._MAX_PENDING. */
#define PYCCL_MAX_PENDING 256

#include "pyccl.h"
#include "enqueue.h"

/* c's timeout in seconds; 0 when it has none.  Safe without the GIL.  (For
 * pyccl's own kernels: the deadline of a spin-wait on peers.) */
double pyccl_comm_timeout(const pyccl_comm *c);
/* A call on c gives up, with the GIL held; always -1.  With `failure` (the
 * whole message, e.g. "all_reduce: rank 0 of 2 timed out after 5.0 s waiting
 * for its peers; the communicator was aborted"): c is aborted (its stuck
 * kernels return) and every later call on it raises NcclTimeoutError(failure)
 * (pyccl's own kernels, when one reports that it gave up; a registration's
 * NCCL call past the timeout).  Then c's failure is raised, or where c has
 * none (still usable), RuntimeError(otherwise). */
int pyccl_comm_give_up(pyccl_state *st, const char *op, pyccl_comm *c, const char *failure,
                       const char *otherwise);
/* c gives up for a timeout (`reason`, the whole message), GIL held, nothing
 * raised: `stop` (an own kernels' stop word, or NULL) set first, then c
 * aborted, and every later call on it raises NcclTimeoutError(reason).  The
 * first failure stays: an abort() or a timeout before this one is kept. */
void pyccl_comm_time_out(pyccl_state *st, pyccl_comm *c, int *stop, const char *reason);

/* Non-zero once c failed or was aborted (its handle is gone then).  Safe
 * without the GIL. */
int pyccl_comm_failed(const pyccl_comm *c);
/* The own kernels' set-up and release, without the GIL: the NCCL call of
 * row t (its comm filled in here with c's handle) made and settled under the
 * lock that abort() and the watchdog take before they touch the handle (c's
 * own without a timeout, the watch's with one, the call counted as in NCCL
 * there), so neither frees the handle under it; the wait for its kernel is
 * the caller's, outside that lock, where an abort can end it.  NCCL's result
 * (its last error in last[last_size]; ncclInProgress once `deadline`, 0 for
 * none, passed), or ncclInvalidUsage when c was gone or is in another
 * thread's open group: *gone says which. */
enum {
    PYCCL_HELD_MADE = 0, /* the call was made; its result returned */
    PYCCL_HELD_GONE,     /* aborted, failed or destroyed before: nothing sent */
    PYCCL_HELD_CLAIMED,  /* stuck past the timeout: the watchdog aborted the handle under it */
    PYCCL_HELD_OTHER,    /* in a pyccl.group() open on another thread: nothing sent */
};
ncclResult_t pyccl_comm_held_call(const pyccl_api *a, pyccl_comm *c, pyccl_task *t, int redop,
                                  double deadline, char *last, size_t last_size, int *gone);
/* -1 raising c's failure when it failed (then c->comm is cleared), else 0. */
int pyccl_watch_check(pyccl_state *st, const char *op, pyccl_comm *c);
/* pyccl's own kernels on c are set up (`word`: their host word, which a
 * kernel sets to 1 when it gave up waiting for peers after the timeout), or
 * about to be freed (NULL).  Without the GIL; takes c's lock.  On a
 * communicator with a timeout the watchdog reads the word at each look and
 * fails c when a kernel gave up; every failure of c sets it to 2 (the
 * kernels' stop word). */
void pyccl_watch_kernels(pyccl_comm *c, int *word);
/* Free c's NCCL marks (pyccl.h's `lead`), unless a call still waits for one
 * (then its destroy() or deallocation does): at abort, destroy() and
 * deallocation, when no other thread can record one (c's lock held, or no
 * call in flight).  Any GIL state. */
void pyccl_lead_free(const pyccl_api *a, pyccl_comm *c);
/* A call `op` on c, which has a watch, launched pyccl's own kernels on s
 * (GIL held): no event follows them (their waits on peers are bounded by the
 * timeout, and the watchdog reads their word); s is noted for wait().  0, or
 * -1 raising c's failure when it failed meanwhile (MemoryError). */
int pyccl_watch_launched(pyccl_state *st, const char *op, pyccl_comm *c, cudaStream_t s);
/* Wait, the GIL released and KeyboardInterrupt between looks, until
 * *done >= mark or *stop != 0: words in host memory that pyccl's own kernels
 * store (the last mark one ended with; gave up or told to stop).  *waiters
 * counts this thread meanwhile: the words' owner frees them once it is 0.
 * 0, or -1 with the signal handler's exception. */
int pyccl_wait_mark(const volatile unsigned long long *done, unsigned long long mark,
                    const volatile int *stop, int *waiters);
/* -1 raising c's failure (timed out, aborted: its watch's record, first), or
 * RuntimeError when c is not ready or destroyed (pyccl_raise_unusable). */
int pyccl_comm_alive(pyccl_state *st, const char *op, pyccl_comm *c);
/* Fill in rank and size of a communicator created inside a group (NCCL
 * knows them only once the group ended). */
int pyccl_comm_refresh(pyccl_state *st, const char *op, pyccl_comm *c);
/* ncclCommInitRankConfig on `device` with config.blocking = `blocking`:
 * non-blocking, polled until done, aborted and NcclTimeoutError after
 * `timeout` s, KeyboardInterrupt on ^C; blocking, one call with the GIL
 * released (NCCL gives no way to bound it: no handle exists until it
 * returns). */
int pyccl_watch_init(pyccl_state *st, const char *op, ncclComm_t *out,
                     int nranks, const ncclUniqueId *uid, int rank,
                     int device, double timeout, int blocking);
/* Give c (holding a non-blocking handle) its watch; aborts the handle and
 * returns -1 on failure. */
int pyccl_watch_attach(pyccl_state *st, const char *op, pyccl_comm *c,
                       double timeout);
/* The benchmark's --host-breakdown (_C._watch_costs): host microseconds per
 * call, each `calls` times back to back on `s` of `device`, of what a call
 * on a communicator with a timeout adds to one without (the device looked
 * up, the capture looked at, an event recorded; the watchdog's query of a
 * finished one; a clock read, a lock, the GIL let go and taken), in the
 * order of pyccl_watch_cost_names.  -1 with an exception (ValueError while
 * `s` is captured). */
#define PYCCL_WATCH_COSTS 7
extern const char *const pyccl_watch_cost_names[PYCCL_WATCH_COSTS];
int pyccl_watch_costs(pyccl_state *st, const char *op, int device, cudaStream_t s, int calls,
                      double us[PYCCL_WATCH_COSTS]);
/* The one enqueue of every call, with or without a timeout: `tasks` on
 * `comms` (their communicators, repeats allowed; NULL and 0 for a clique's,
 * which `serialize` covers).  Each communicator is checked first (failed,
 * not ready, destroyed, or a fork's copy: raised as pyccl_comm_alive would,
 * nothing enqueued), the streams of those without a watch noted for wait(),
 * then the call joins this thread's open pyccl.group() (pyccl_group_join),
 * then, the GIL released: `serialize` and every communicator's lock (room
 * for another event in each watch first), the NCCL calls (one NCCL group for
 * several rows), and for the watched ones their completion polled (a
 * non-blocking handle, outside a group) and an event recorded after them;
 * what went wrong is raised at one place.  Rows of a kernel already launched
 * (PYCCL_LAUNCHED) on communicators without a watch are noted only: nothing
 * to lock or call.  -1 with an exception. */
int pyccl_enqueue(pyccl_state *st, const char *op, const pyccl_task *tasks, Py_ssize_t n,
                  int redop, const pyccl_premul *premul, PyThread_type_lock serialize,
                  pyccl_comm *const *comms, Py_ssize_t ncomms);
/* The outermost pyccl.group() of this thread ended with NCCL result r,
 * `used` what it used (pyccl_group_take): poll and track the work of its
 * watched communicators; on the others NCCL's marks, as after a call outside
 * a group (they leave the group before its wait).  -1 with an exception. */
int pyccl_watch_group_end(pyccl_state *st, ncclResult_t r, pyccl_group_entry *used,
                          Py_ssize_t n);
/* split() of a communicator with a watch (outside any group): the child's
 * non-blocking handle (NULL when not a member), rank and size; the caller
 * makes the Communicator and gives it a watch.  -1 with an exception. */
int pyccl_watch_split(pyccl_state *st, pyccl_comm *c, int color, int key,
                      ncclComm_t *child, int *child_rank, int *child_size);
/* shrink() of a communicator with a watch (outside any group), also once
 * it failed (its revoked handle, NCCL_SHRINK_ABORT): the child's
 * non-blocking handle, rank and size, within the timeout.  -1 with an
 * exception (RuntimeError when the handle was aborted). */
int pyccl_watch_shrink(pyccl_state *st, pyccl_comm *c, int *exclude, int n,
                       ncclComm_t *child, int *child_rank, int *child_size);
/* barrier()'s wait: the work enqueued on stream s so far done, polled with
 * the GIL released, Ctrl-C (KeyboardInterrupt) between polls, as wait()
 * does: an event recorded on s now, or with a timeout the communicator's
 * own events (bounded by it).  -1 with an exception. */
int pyccl_wait_stream(pyccl_state *st, const char *op, pyccl_comm *c, cudaStream_t s);
/* The work enqueued on c so far done (what wait() waits for): with a
 * timeout, as long as each call's work finishes within it (c fails past
 * it); without, as long as it takes,
 * Ctrl-C between polls.  Nothing to wait for once c failed.  -1 with an
 * exception. */
int pyccl_comm_drain(pyccl_state *st, const char *op, pyccl_comm *c);
/* Until c's work so far finished (GIL released), or `limit` s (raised
 * without failing c); `limit` 0: none but c's timeout on each call's
 * work.  barrier() and wait(). */
int pyccl_watch_wait(pyccl_state *st, const char *op, pyccl_comm *c,
                     double limit);
/* Free c's watch, first finalizing the NCCL handle (bounded by the
 * timeout, aborted past it); -1 with NcclTimeoutError then, when
 * `may_raise`.  Leaves c->comm and c->watch NULL. */
int pyccl_watch_destroy(pyccl_state *st, const char *op, pyccl_comm *c,
                        int may_raise);
/* Take c's lock, with or without a watch, around an NCCL call that is no
 * collective (split, shrink, registration).  -1, the lock not held, raising
 * c's failure, or RuntimeError when another thread's open pyccl.group()
 * holds c (pyccl_group_others). */
int pyccl_comm_enter(pyccl_state *st, const char *op, pyccl_comm *c);
void pyccl_comm_leave(pyccl_comm *c);
/* Communicator.wait(timeout=None), .get_async_error() */
/* abort() once the door (call.c) allowed it: ncclCommAbort, or the
 * watch's failure; -1 with an exception. */
int pyccl_watch_abort(pyccl_state *st, pyccl_comm *c);
PyObject *pyccl_comm_wait(PyObject *self, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_get_async_error(PyObject *self, PyObject *unused);
/* The communicators of pyccl.group()s whose thread ended before its group
 * did leave those groups and are failed ("... that work never ran, and the
 * communicator was aborted"); the door calls it before its decisions.  With
 * the GIL; a load when there are none. */
void pyccl_watch_reap(pyccl_state *st);
/* Interpreter exit: stop the watchdog, and abort the watched communicators
 * whose work has not finished (their kernels would spin on forever). */
void pyccl_watchdog_at_exit(pyccl_state *st);
/* Module teardown: stop the watchdog thread if it still runs. */
void pyccl_watchdog_free(pyccl_state *st);

#endif /* PYCCL_TIMEOUTS_H */
