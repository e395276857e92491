/* The one door for using a communicator (call.c).
 *
 * Every use of a pyccl_comm's NCCL handle, own-kernel state, registrations
 * or watch goes through here: a call is begun once (the communicator is
 * usable, and counted in flight), submitted (NCCL rows or the own kernel's
 * launch, tracked alike), and ended once.  destroy() and abort() take their
 * decision here, with the GIL held and before any side effect, so every
 * other thread's entry sees it.
 *
 * A communicator's states (c->life and c->inflight, which only this file
 * writes, and c->in_group, which a call's submit counts as it joins the
 * thread's open pyccl.group(): enqueue.c):
 *   usable      calls begin;
 *   in a group  c->in_group > 0: enqueued on inside a pyccl.group() of some
 *               thread that has not ended (NCCL runs that work at the group's
 *               end): destroy() and abort() are refused;
 *   in use      c->inflight > 0: calls of other threads are between begin and
 *               end (the GIL may be released there): destroy() is refused,
 *               abort() ends the handle once no thread is inside NCCL on it
 *               (each such call looks again under c's lock and raises);
 *   destroying  destroy() decided: every entry refuses as destroyed, abort()
 *               only ends the own kernels' waits that destroy() may be in;
 *   gone        the handle is freed (destroyed, or its failure was raised).
 * Failed and aborted communicators are the watch's record (watchdog.c) or,
 * without a timeout, a watch made for the record (mark_untimed, watch_state.c). */
#ifndef PYCCL_CALL_H
#define PYCCL_CALL_H

#include "pyccl.h"

/* Begin a call on c, with the GIL held, after the last user code of the
 * call's arguments ran (a tensor's attributes or a stream's code may destroy
 * or abort c): -1 raising "<op>: ... destroyed" (or c's failure, or "not
 * ready") when c is not usable; else 0 and c counted in flight until
 * pyccl_call_end. */
int pyccl_call_begin(pyccl_state *st, const char *op, pyccl_comm *c);
void pyccl_call_end(pyccl_comm *c);
/* Count c in flight without the checks of begin: for abort(), wait() and
 * get_async_error(), which look at c's watch whatever its state (they
 * check it themselves); ended by pyccl_call_end. */
void pyccl_call_hold(pyccl_comm *c);
/* A wait on c's work (wait(), a registration's close) begins: counted in
 * flight where it reads c's watch (a communicator with a timeout), so that
 * destroy() waits for it; not where it reads only the streams noted, and
 * abort() from another thread is how such a wait ends early.  1 when counted (end
 * it with pyccl_call_end). */
int pyccl_call_hold_wait(pyccl_comm *c);
/* The same for the n communicators of one call (repeats allowed): all
 * begun, or none and -1. */
int pyccl_call_begin_all(pyccl_state *st, const char *op, pyccl_comm *const *cs,
                         Py_ssize_t n);
void pyccl_call_end_all(pyccl_comm *const *cs, Py_ssize_t n);

/* Own-kernel work of a begun call (never inside a pyccl.group()) was
 * launched on stream s: tracked as NCCL work is, a row of its own
 * (PYCCL_LAUNCHED) through the watch's enqueue with a timeout, the stream
 * noted for wait() without.  Or the own kernels gave up on the peers
 * (`gave_up`: the whole message, as pyccl_comm_time_out's reason; `stop`:
 * their stop word): c fails for that timeout, and the watch's enqueue
 * raises its failure (the first one, an abort() before say), nothing
 * tracked.  -1 with an exception; 0 when c has no failure to raise. */
int pyccl_call_track(pyccl_state *st, const char *op, pyccl_comm *c, cudaStream_t s,
                     int *stop, const char *gave_up);

/* Submit NCCL tasks of a begun call: on `comms` (their communicators,
 * repeats allowed; NULL and 0 for a clique's, which `serialize` covers),
 * through the one enqueue (timeouts.h's pyccl_enqueue: the communicators
 * checked, the streams of those without a timeout noted for wait(), the
 * watched ones tracked); inside a pyccl.group() it joins the group, each
 * communicator noted as in the group until its end.  `premul`: a
 * premul_sum op to make for the call (NULL: `redop`). */
int pyccl_call_submit(pyccl_state *st, const char *op, const pyccl_task *tasks,
                      Py_ssize_t n, int redop, const pyccl_premul *premul,
                      PyThread_type_lock serialize, pyccl_comm *const *comms,
                      Py_ssize_t ncomms);
/* One call on one communicator, whole: begin, submit, end (the enqueue
 * checks the communicator, first thing, as begin would).  -1 with an
 * exception. */
int pyccl_call_run(pyccl_state *st, const char *op, pyccl_comm *c, const pyccl_task *tasks,
                   Py_ssize_t n, int redop, const pyccl_premul *premul);

/* destroy(): 0 with c in the destroying state (nothing done yet), or -1
 * with RuntimeError when c is in use by another thread, used inside a
 * group that has not ended, or not ready.  `op` names the call. */
int pyccl_call_destroy_begin(pyccl_state *st, const char *op, pyccl_comm *c);
/* destroy() (or garbage collection) finished: c is gone. */
void pyccl_call_destroy_end(pyccl_comm *c);
/* abort(): -1 with RuntimeError when it must be refused (a group that has
 * not ended holds work of c; calls of other threads in flight do not stop
 * it, with or without a timeout); 1 when c is being destroyed (only
 * the own kernels' waits are to be ended); 2 in a child made by fork()
 * (c forgotten: nothing else to do); else 0.  Decided before any side
 * effect.  0 counts the abort in c->aborting until pyccl_call_abort_end. */
int pyccl_call_abort_check(pyccl_state *st, pyccl_comm *c);
/* The abort that pyccl_call_abort_check let through has finished, done or
 * refused. */
void pyccl_call_abort_end(pyccl_comm *c);

#endif /* PYCCL_CALL_H */
