/* Argument readers of pyccl._C: positional/keyword parsing for the fast-call
 * methods and bindings, bounded ints, the unique id.  Each raises TypeError /
 * ValueError naming the operation and the argument, with the value seen.
 * (pyccl_read_algo lives in ar.c, beside the algorithms it names.)  Hidden visibility: calls from the other
 * files of the extension are direct, as a static function's would be. */
#ifndef PYCCL_ARGS_H
#define PYCCL_ARGS_H

#include "pyccl.h"

#pragma GCC visibility push(hidden)

/* METH_FASTCALL | METH_KEYWORDS arguments into out[0..nnames): names[0..npos)
 * may be positional, the rest keyword-only; the first nreq are required.
 * out[i] is a borrowed reference or NULL.  TypeError as Python's own
 * ("<op>() got an unexpected keyword argument 'x'"). */
int pyccl_parse_args(const char *op, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames, const char *const *names, int nnames,
                     int npos, int nreq, PyObject **out);
/* METH_FASTCALL with exactly `want` positional arguments. */
int pyccl_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want);

/* An int (bool refused) in lo..hi into *out: 0.  -1 with TypeError
 * "<op>: <what> must be an int, got <type>" (or the error of reading it).
 * PYCCL_BELOW / PYCCL_ABOVE, no exception set, for an int outside lo..hi:
 * the caller's message says what the range is. */
enum { PYCCL_BELOW = 1, PYCCL_ABOVE = 2 };
int pyccl_read_bounded(const char *op, const char *what, PyObject *obj,
                       long lo, long hi, int *out);
/* An int argument that fits in C int: TypeError / ValueError naming op and what. */
int pyccl_read_int(const char *op, const char *what, PyObject *obj, int *out);
/* A reduction op in any of its spellings, for every API (Communicator
 * methods, the torch.cuda.nccl drop-in, pyccl.ops, the torch.distributed
 * backend): an int SUM..AVG (the fast path), a name as a string in any case
 * ("sum", "PROD"), or torch.distributed's ReduceOp / ReduceOp.RedOpType (read
 * by name through Python: no libtorch).  0 with *redop set.  With `scalar`
 * non-NULL pyccl.premul_sum(x) is taken too: 1 with *scalar a new reference
 * to x, for the caller to make the op.  Flags: PYCCL_OP_PREMUL (the message
 * lists premul_sum), PYCCL_OP_ANY_INT (ints past AVG pass: the drop-in's
 * ops made on the user's communicators).  -1 with ValueError / TypeError
 * naming op, "op" and the value. */
enum { PYCCL_OP_PREMUL = 1, PYCCL_OP_ANY_INT = 2 };
int pyccl_read_redop(pyccl_state *st, const char *op, PyObject *obj, int flags,
                     int *redop, PyObject **scalar);
/* st->redops, the op reader's part of the module state (defined in args.c):
 * made (-1 with an exception), visited, cleared, freed by module.c. */
int pyccl_redops_state_init(pyccl_state *st);
int pyccl_redops_state_traverse(pyccl_state *st, visitproc visit, void *arg);
void pyccl_redops_state_clear(pyccl_state *st);
void pyccl_redops_state_free(pyccl_state *st);
/* A device argument `what`: an int >= 0, "cuda:N", "cuda", a torch.device
 * of type cuda, or None.  *device is the index, -1 for the current device
 * (None, "cuda", torch.device("cuda")).  -1 with TypeError / ValueError
 * naming op and what. */
int pyccl_read_device(const char *op, const char *what, PyObject *obj, int *device);
/* A unique id as bytes (any contiguous buffer but str) of
 * NCCL_UNIQUE_ID_BYTES; a wrong length is ValueError "<op>: unique_id has N
 * bytes, expected 128 (...)", or where torch_text is set (the drop-in keeps
 * torch.cuda.nccl's) RuntimeError "invalid unique_id (...)"; any other
 * object TypeError naming op. */
int pyccl_read_unique_id(const char *op, int torch_text, PyObject *uid, ncclUniqueId *out);

/* A timeout: None -> 0; an int or float > 0, or a datetime.timedelta ->
 * seconds; else TypeError/ValueError naming op and "timeout". */
int pyccl_read_timeout(const char *op, PyObject *obj, double *out);

#pragma GCC visibility pop

#endif /* PYCCL_ARGS_H */
