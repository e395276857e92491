/* The enqueue layer (enqueue.c): the NCCL calls of a collective (the
 * pyccl_task rows of pyccl.h, one NCCL group for several), this thread's
 * pyccl.group() (its depth, the kind of communicators in it, the
 * communicators used in it), the per-communicator locks, polling a
 * non-blocking NCCL call.  Below the timeouts, above the
 * shared pieces. */
#ifndef PYCCL_ENQUEUE_H
#define PYCCL_ENQUEUE_H

#include "pyccl.h"

/* The NCCL calls of a call (timeouts.h's pyccl_enqueue), without the GIL and
 * raising nothing, the caller holding the locks of the tasks' communicators:
 * a premul_sum op made for the call when `premul` is not NULL (else
 * `redop`).  NCCL's result, with ncclGetLastError's text copied into `last`
 * on error (ncclInProgress is no error: a non-blocking communicator is still
 * working on the call). */
ncclResult_t pyccl_enqueue_calls(const pyccl_api *a, const pyccl_task *tasks, Py_ssize_t n,
                                 int redop, const pyccl_premul *premul, char *last,
                                 size_t last_size);
/* Without the GIL, after an NCCL call on comm returned r: on a non-blocking
 * communicator, poll ncclCommGetAsyncError until the call is done (its
 * result), or ncclInProgress once `deadline` (monotonic s, 0: none) passed. */
ncclResult_t pyccl_nccl_settle(const pyccl_api *a, ncclComm_t comm, ncclResult_t r,
                               double deadline);
/* c->mu with the GIL held: released while waiting for the lock. */
void pyccl_comm_lock(pyccl_comm *c);
/* Depth of pyccl.group() on the calling thread (NCCL groups are per thread). */
int pyccl_group_depth(void);
/* A call on `comms` (repeats allowed; NULL and 0 for a clique's), with
 * (timed = 1) or without a timeout, joins this thread's open pyccl.group(),
 * if one is open: each communicator noted in it (pyccl_group_note).  0; 1
 * refused, nothing noted, when the group already holds the other kind
 * (NCCL's non-blocking and blocking communicators, which one NCCL group
 * cannot mix; NCCL itself refuses only where a connection or launch job is
 * queued, so on some ranks and transports and not on others): the caller
 * raises pyccl_raise_mixed_group; -1 with MemoryError. */
int pyccl_group_join(pyccl_comm *const *comms, Py_ssize_t ncomms, int timed);
/* Whether c is in a pyccl.group() another thread has open (or one whose
 * thread ended with it open, until the door's next look fails c): NCCL
 * takes a communicator's calls from one thread's group at a time, and that
 * group's end works on c without c's lock.  Read under c's lock, after this
 * thread's call joined its own group: a group of another thread that takes
 * c later waits for the lock to enqueue into it, and ends after that.  Any
 * GIL state. */
int pyccl_group_others(const pyccl_comm *c);
/* What this thread's open pyccl.group() used: each communicator once
 * (`counted`: in c->in_group until the group's end; on one without a watch,
 * `calls` NCCL calls, the last on `stream`, for NCCL's marks at the group's
 * end, whose wait `lead` then is), and the work on a watched communicator
 * once per stream (`work`: op the first call's name), each entry with a
 * reference to its Communicator. */
typedef struct {
    PyObject *comm;
    cudaStream_t stream;
    const char *op;
    int counted, work;
    unsigned calls;
    cudaEvent_t lead;
} pyccl_group_entry;
/* c is used inside this thread's open pyccl.group() (NCCL takes it up at
 * the group's end): counted in c->in_group once until the group's end.
 * -1 with MemoryError. */
int pyccl_group_note(pyccl_comm *c);
/* k NCCL calls on c (noted already, without a watch) went inside the
 * group, the last to stream s: counted for NCCL's marks at its end. */
void pyccl_group_note_calls(pyccl_comm *c, cudaStream_t s, unsigned k);
/* Work of c (noted already) went to stream s inside the group: remembered
 * for the group's end (the timeouts layer records its event then).  -1
 * with MemoryError. */
int pyccl_group_note_work(pyccl_comm *c, cudaStream_t s, const char *op);
/* The outermost pyccl.group() of this thread ended: its list, taken out of
 * the thread (*n entries), for pyccl_group_release once settled. */
pyccl_group_entry *pyccl_group_take(Py_ssize_t *n);
/* With the GIL: a taken list's communicators leave the group
 * (c->in_group), their entries kept (with their references). */
void pyccl_group_leave(pyccl_group_entry *v, Py_ssize_t n);
/* Free a taken list: with `leave`, its communicators still counted leave
 * the group (c->in_group) first. */
void pyccl_group_release(pyccl_group_entry *v, Py_ssize_t n, int leave);
/* With the GIL: the communicators of pyccl.group()s whose thread ended
 * before the group did (their queued work never runs) leave those groups,
 * each handed to lost_one(c, arg) to be failed.  A load when there are
 * none. */
void pyccl_group_reap(void (*lost_one)(pyccl_comm *c, void *arg), void *arg);
/* ncclGroupStart (start) or ncclGroupEnd with the GIL released; NCCL's
 * result, with ncclGetLastError's text copied into `last` on error.
 * *outermost: this ended the thread's outermost group (even when failing:
 * NCCL leaves the group level then too). */
ncclResult_t pyccl_group_call(pyccl_state *st, int start, char *last,
                              size_t last_size, int *outermost);

#endif /* PYCCL_ENQUEUE_H */
