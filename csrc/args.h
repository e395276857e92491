/* Argument readers of pyccl._C: positional/keyword parsing for the fast-call
 * methods and bindings, bounded ints, the unique id.  Each raises TypeError /
 * ValueError naming the operation and the argument, with the value seen.
 * (Two readers live elsewhere for now: pyccl_read_timeout in watchdog.c and
 * pyccl_read_algo in ar.c.)  Hidden visibility: calls from the other
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
/* A unique id as bytes (any buffer but str) of NCCL_UNIQUE_ID_BYTES. */
int pyccl_read_unique_id(const char *op, PyObject *uid, ncclUniqueId *out);

#pragma GCC visibility pop

#endif /* PYCCL_ARGS_H */
