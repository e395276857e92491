/* The registrations layer (reg_list.c): a registration's record, the list
 * of a communicator's open registrations (c->regs), the NCCL calls that make
 * and end one, and the end of them all when their communicator goes.  The
 * type (communicator.c) calls that end when a communicator is destroyed,
 * collected or aborted; registration.c, with the methods, makes the
 * registrations (register(), register_window()) and holds the
 * pyccl.Registration type over the record.  The calls between
 * registration.c and this layer are hidden from other shared objects, as
 * when they were one file's static functions. */
#ifndef PYCCL_REG_LIST_H
#define PYCCL_REG_LIST_H

#include "pyccl.h"

#pragma GCC visibility push(hidden)

/* A pyccl.Registration object (registration.c makes the type over it). */
struct pyccl_reg {
    PyObject_HEAD
    pyccl_comm *comm;        /* strong reference, kept until dealloc (messages) */
    PyObject *tensor;        /* strong reference while open */
    void *handle;            /* ncclCommRegister's handle or the ncclWindow_t */
    char *ptr;
    int64_t nbytes;
    int window;
    int open;
    int gone;                /* closed by its communicator: 1 destroyed, 2 aborted */
    struct pyccl_reg *next, *prev; /* in comm->regs while open */
};
typedef struct pyccl_reg pyccl_reg;

/* Put r, just made open, at the head of c->regs (newest first). */
void pyccl_reg_link(pyccl_comm *c, pyccl_reg *r);

/* One NCCL registration call with c entered and the GIL released: kind 0
 * register, 1 window register, 2 deregister, 3 window deregister.  -1 with
 * an exception (a time-out fails the communicator, as any call on it past
 * its timeout). */
int pyccl_reg_call(pyccl_state *st, const char *op, pyccl_comm *c, int kind, void *ptr,
                   size_t n, void **handle);

/* Who closes a registration (pyccl_reg_close's `who`). */
enum { PYCCL_CLOSE_BY_USER = 0, PYCCL_CLOSE_BY_COMM = 1, PYCCL_CLOSE_BY_DEALLOC = 2 };

/* Deregister r if its communicator can still take the call, mark it closed
 * either way; `forget`: mark it closed without calling NCCL.  -1 with an
 * exception when NCCL refused. */
int pyccl_reg_close(pyccl_state *st, pyccl_reg *r, int forget, int who);

#pragma GCC visibility pop

/* Before c's handle goes: deregister its open handles; `forget` 1 (exit) or
 * 2 (abort()): mark them closed without calling NCCL.  Errors are dropped:
 * the communicator goes either way. */
void pyccl_release_registrations(pyccl_state *st, pyccl_comm *c, int forget);

#endif /* PYCCL_REG_LIST_H */
