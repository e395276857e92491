/* What errors.c offers: every raise of the extension (NCCL's and CUDA's
 * errors, with ncclGetLastError's text copied on the thread that made the
 * call; a call refused with NCCL's code (a pyccl.group() mixing kinds of
 * communicators); a communicator not ready or destroyed; the exception of a
 * failed communicator, of kind PYCCL_FAIL_*, and the timeout messages) and
 * seconds as the messages print them.  A shared piece (the lowest layer):
 * one header per file there. */
#ifndef PYCCL_ERRORS_H
#define PYCCL_ERRORS_H

#include "pyccl.h"

/* Seconds for messages: "5.0", "0.25" (as Python prints a float), as
 * `pyccl_secs(t).s` inside a call's arguments (C11: the array lives to the
 * end of the full expression). */
typedef struct {
    char s[32];
} pyccl_secs_text;
pyccl_secs_text pyccl_secs(double s);
/* Room for ncclGetLastError's text, as the bindings keep it. */
#define PYCCL_LAST_ERROR_SIZE 512
/* An NCCL call returned r: when it failed, copy ncclGetLastError(comm)
 * (comm NULL for calls on none, e.g. init) into last[size] (left as is when
 * the library lacks the call).  No Python API: call it on the thread that made
 * the call, before the GIL is taken back, as NCCL keeps the text per thread
 * and the next call overwrites it.  Returns non-zero when r is a failure. */
int pyccl_nccl_failed(const pyccl_api *a, ncclResult_t r, ncclComm_t comm,
                      char *last, size_t size);
/* Raise NcclError for `res`; `last` is ncclGetLastError text or NULL. */
void pyccl_raise_nccl(pyccl_state *st, const char *op, ncclResult_t res,
                      const char *last);
/* NcclError (code ncclInvalidArgument, as NCCL would or might refuse it):
 * one pyccl.group() cannot mix communicators with and without a timeout,
 * and this call was not enqueued; -1. */
int pyccl_raise_mixed_group(pyccl_state *st, const char *op);
void pyccl_raise_cuda(pyccl_state *st, const char *op, const char *call,
                      cudaError_t err);
/* RuntimeError "<op>: the communicator is not ready: it was created inside
 * pyccl.group(), which has not ended yet"; always -1. */
int pyccl_raise_not_ready(const char *op);
/* This process's id, as getpid() gives it, without a system call: the door
 * asks on every call whether a communicator was made here (a fork()'s copy
 * must not be used).  Kept by a pthread_atfork child handler, which runs in
 * the child of every fork() (os.fork, multiprocessing's "fork" start method,
 * a library's fork()); pyccl_pid_init registers it, once per process, when
 * the module is loaded. */
pid_t pyccl_pid(void);
void pyccl_pid_init(void);
/* -1 with RuntimeError when c was made by another process (this one is a
 * child made by fork()): its locks and NCCL state are a copy no call may
 * touch; else 0. */
int pyccl_raise_forked(const char *op, const pyccl_comm *c);
/* c's own state (not its watch's): -1 raising RuntimeError when it is not
 * ready (above) or has been destroyed (also while destroy() runs), else 0. */
int pyccl_raise_unusable(const char *op, const pyccl_comm *c);
/* What pyccl_raise_unusable looks at, raising nothing: c was made by this
 * process (`me`: pyccl_pid()), is ready, and neither destroyed nor being
 * destroyed.  1 when usable. */
int pyccl_comm_usable(const pyccl_comm *c, pid_t me);
/* abort() refused: c holds work of a pyccl.group() that has not ended
 * (RuntimeError, "... end the group first"); always -1. */
int pyccl_raise_abort_in_group(const pyccl_comm *c);
/* RuntimeError: op's communicator c is in another thread's open
 * pyccl.group() (pyccl_group_others). */
int pyccl_raise_other_group(const char *op, const pyccl_comm *c);

/* The exception instance for a failed communicator (kind PYCCL_FAIL_*):
 * the message is `reason`, prefixed with "<op>: " unless it names op. */
PyObject *pyccl_failure_exception(pyccl_state *st, const char *op, int kind,
                                  int code, const char *reason,
                                  double timeout);
/* Raise that exception; always -1. */
int pyccl_raise_failure(pyccl_state *st, const char *op, int kind, int code,
                        const char *reason, double timeout);
/* pyccl_raise_failure(PYCCL_FAIL_TIMEOUT) after `limit` seconds, the reason
 * printed from fmt; always -1. */
int pyccl_raise_timeout(pyccl_state *st, const char *op, double limit,
                        const char *fmt, ...);

/* A note for the user (not an error): a record of the "pyccl" logger, so
 * users filter it as they do torch's (logging.getLogger("pyccl")); without
 * logging configured, Python prints WARNING and above on stderr.  Needs the
 * GIL; an exception being raised is kept; a failure of logging itself is
 * printed as unraisable, never raised. */
enum { PYCCL_LOG_INFO = 20, PYCCL_LOG_WARNING = 30 }; /* logging.INFO, .WARNING */
void pyccl_log(int level, const char *fmt, ...);

#endif /* PYCCL_ERRORS_H */
