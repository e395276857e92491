/* What the method files of pyccl.Communicator (comm_ops.c, comm_p2p.c,
 * comm_split.c, registration.c) share: one call's context and the checks
 * every method words the same way.  The methods themselves are declared with
 * the type whose table names them (communicator.h). */
#ifndef PYCCL_COMM_OPS_H
#define PYCCL_COMM_OPS_H

#include "pyccl.h"

/* ---- shared by the method files (comm_ops.c defines them) ----
 * Hidden visibility: calls between these files are direct, as they were
 * when all of it was one file's static functions. */
#pragma GCC visibility push(hidden)

/* One method call: its module state, communicator and name (for messages). */
typedef struct {
    pyccl_state *st;
    pyccl_comm *c;
    const char *op;
    /* a premul_sum op argument as read (NCCL's op is made by the enqueue) */
    pyccl_premul premul;
} call_ctx;

int ops_ctx_init(call_ctx *x, PyObject *self, const char *op);
/* An array argument, on this communicator's device. */
int ops_read_on_comm(call_ctx *x, const char *what, PyObject *obj,
                     pyccl_tensor *t);
/* TypeError unless t has ref's dtype. */
int ops_same_dtype(call_ctx *x, const char *what, const pyccl_tensor *t,
                   const char *ref_what, const pyccl_tensor *ref);
/* ValueError unless t has `want` elements (`why` says why). */
int ops_numel_is(call_ctx *x, const char *what, const pyccl_tensor *t,
                 int64_t want, const char *why);
/* A rank of this communicator (root=, peer=). */
int ops_read_rank(call_ctx *x, const char *what, PyObject *obj, int *out);
/* stream= (None: torch's current stream of the communicator's device). */
int ops_stream(call_ctx *x, PyObject *stream, cudaStream_t *out);
/* Wait until the work just enqueued on x->c's stream s is done: under its
 * watch (bounded by its timeout, interruptible) when it has one, else
 * cudaStreamSynchronize on its device.  -1 with an exception. */
int ops_wait_call(call_ctx *x, cudaStream_t s);
/* The end of a method: the call run through the door (call.h: begun after
 * the user code of the arguments, submitted with x->premul when `made`,
 * ended); None, or NULL with an exception.  n == 0: None at once. */
PyObject *ops_finish(call_ctx *x, const pyccl_task *tasks, Py_ssize_t n,
                     int redop, int made);
void ops_task(pyccl_task *t, pyccl_coll coll, const void *send, void *recv,
              size_t count, int type, int peer, call_ctx *x, cudaStream_t s);
/* A list/tuple of `size` arrays like `ref`, read from a private tuple
 * (*keep, released by the caller after the enqueue); NULL with no error
 * when obj is not a list/tuple. */
pyccl_tensor *ops_read_list(call_ctx *x, const char *what, PyObject *obj,
                            const pyccl_tensor *ref, const char *ref_what,
                            int64_t numel, PyObject **keep);

#pragma GCC visibility pop

#endif /* PYCCL_COMM_OPS_H */
