/* The type layer: what communicator.c (the Communicator type: creation,
 * lifetime, its method table) and clique.c (several ranks in one process)
 * offer, in one header for the layer.
 *
 * It also declares the methods that the type's table names and the layer
 * above defines (comm_ops.c, comm_p2p.c, comm_split.c, registration.c): the
 * type names them without calling them, so the type states the entries and
 * the method files, which include this header, fill them.  (wait() and
 * get_async_error() are the timeouts layer's, in timeouts.h.) */
#ifndef PYCCL_COMMUNICATOR_H
#define PYCCL_COMMUNICATOR_H

#include "pyccl.h"

/* ---- communicator.c ---- */
extern PyType_Spec pyccl_comm_spec;
int pyccl_is_comm(pyccl_state *st, PyObject *obj);
PyObject *pyccl_comm_new(pyccl_state *st, ncclComm_t comm, int rank, int size,
                         int device);
PyObject *pyccl_init_rank(pyccl_state *st, PyObject *nranks, PyObject *uid,
                          PyObject *rank);
/* Keep a communicator split inside a group alive until the group ends. */
int pyccl_add_pending_split(pyccl_state *st, PyObject *comm);
/* The outermost group of this thread ended: its splits are ready. */
void pyccl_resolve_pending_splits(pyccl_state *st);
/* _communicator(name): the live Communicator whose .name is the str `name`
 * (a new reference), or None. */
PyObject *pyccl_comm_by_name(pyccl_state *st, PyObject *name);
/* st->comms, communicator.c's part of the module state (names, pending
 * splits): made (-1 with an exception), visited, cleared, freed by module.c. */
int pyccl_comms_state_init(pyccl_state *st);
int pyccl_comms_state_traverse(pyccl_state *st, visitproc visit, void *arg);
void pyccl_comms_state_clear(pyccl_state *st);
void pyccl_comms_state_free(pyccl_state *st);

/* ---- clique.c: several ranks in one process ---- */
/* Borrowed tuple of n communicators over `devices`, created once. */
PyObject *pyccl_clique(pyccl_state *st, const char *op, const int *devices,
                       Py_ssize_t n);
/* _nccl_init_ranks: one rank per local device, in one NCCL group. */
PyObject *pyccl_init_ranks(pyccl_state *st, PyObject *nranks, PyObject *uid,
                           PyObject *ranks, PyObject *devices);
/* The lock that serializes enqueueing on any clique (python_nccl.c). */
PyThread_type_lock pyccl_clique_call_lock(pyccl_state *st);
/* st->cliques, clique.c's part of the module state (the cache and its
 * locks): made (-1 with an exception), visited, cleared, freed by module.c. */
int pyccl_cliques_state_init(pyccl_state *st);
int pyccl_cliques_state_traverse(pyccl_state *st, visitproc visit, void *arg);
void pyccl_cliques_state_clear(pyccl_state *st);
void pyccl_cliques_state_free(pyccl_state *st);

/* ---- the methods the type's table names (METH_FASTCALL | METH_KEYWORDS),
 * defined by the method files ---- */
/* comm_ops.c: one buffer per rank, one NCCL collective (or pyccl's own
 * all-reduce), plus barrier and all_reduce_coalesced */
PyObject *pyccl_comm_all_reduce(PyObject *self, PyObject *const *args,
                                Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_broadcast(PyObject *self, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_reduce(PyObject *self, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_all_gather(PyObject *self, PyObject *const *args,
                                Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_reduce_scatter(PyObject *self, PyObject *const *args,
                                    Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_barrier(PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_all_reduce_coalesced(PyObject *self, PyObject *const *args,
                                          Py_ssize_t nargs, PyObject *kwnames);
/* comm_p2p.c: per-peer buffers, as groups of send/recv */
PyObject *pyccl_comm_send(PyObject *self, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_recv(PyObject *self, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_all_to_all(PyObject *self, PyObject *const *args,
                                Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_all_to_all_single(PyObject *self, PyObject *const *args,
                                       Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_gather(PyObject *self, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_scatter(PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames);
/* comm_split.c */
PyObject *pyccl_comm_split(PyObject *self, PyObject *const *args,
                           Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyccl_comm_shrink(PyObject *self, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames);
/* registration.c (METH_O) */
PyObject *pyccl_comm_register(PyObject *self, PyObject *tensor);
PyObject *pyccl_comm_register_window(PyObject *self, PyObject *tensor);

#endif /* PYCCL_COMMUNICATOR_H */
