/* Several ranks of one job in one process: the clique cache behind
 * pyccl.nccl's comms=None (one communicator per device of an ordered device
 * tuple, created once) and _nccl_init_ranks (several ranks, one per local
 * device, created in one NCCL group). */
#include "communicator.h"
#include "loader.h"
#include "args.h"
#include "errors.h"
#include <string.h>

/* ---- the comms=None clique cache ---- */

/* The clique cache's part of the module state. */
struct pyccl_cliques {
    /* comms=None: one clique of communicators per ordered device tuple */
    PyObject *cliques;           /* dict: tuple of ints -> tuple of Communicator */
    /* the last clique used, to skip building a key on repeated calls */
    PyObject *last_clique;       /* borrowed from `cliques` */
    int last_devices[8];
    Py_ssize_t last_n;
    PyThread_type_lock clique_lock;      /* held while creating a clique */
    PyThread_type_lock clique_call_lock; /* held while enqueueing on any clique */
};

int
pyccl_cliques_state_init(pyccl_state *st)
{
    struct pyccl_cliques *q = st->cliques = PyMem_Calloc(1, sizeof *q);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if ((q->cliques = PyDict_New()) == NULL) {
        return -1;
    }
    q->clique_lock = PyThread_allocate_lock();
    q->clique_call_lock = PyThread_allocate_lock();
    if (q->clique_lock == NULL || q->clique_call_lock == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int
pyccl_cliques_state_traverse(pyccl_state *st, visitproc visit, void *arg)
{
    if (st->cliques != NULL) {
        Py_VISIT(st->cliques->cliques);
    }
    return 0;
}

void
pyccl_cliques_state_clear(pyccl_state *st)
{
    if (st->cliques != NULL) {
        st->cliques->last_clique = NULL;
        Py_CLEAR(st->cliques->cliques);
    }
}

void
pyccl_cliques_state_free(pyccl_state *st)
{
    struct pyccl_cliques *q = st->cliques;
    pyccl_cliques_state_clear(st);
    if (q == NULL) {
        return;
    }
    if (q->clique_lock != NULL) {
        PyThread_free_lock(q->clique_lock);
    }
    if (q->clique_call_lock != NULL) {
        PyThread_free_lock(q->clique_call_lock);
    }
    PyMem_Free(q);
    st->cliques = NULL;
}

PyThread_type_lock
pyccl_clique_call_lock(pyccl_state *st)
{
    return st->cliques->clique_call_lock;
}

static PyObject *
clique_key(const int *devices, Py_ssize_t n)
{
    PyObject *key = PyTuple_New(n);
    if (key == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyLong_FromLong(devices[i]);
        if (d == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, i, d);
    }
    return key;
}

/* comms[i] (rank ranks[i], or i when ranks is NULL, of nranks, on devices[i])
 * as Communicators in a new tuple or list; each handle wrapped is cleared in
 * comms[], and on failure (NULL) the others are destroyed. */
static PyObject *
wrap_comms(pyccl_state *st, ncclComm_t *comms, const int *ranks, int nranks,
           const int *devices, Py_ssize_t n, int as_list)
{
    PyObject *seq = as_list ? PyList_New(n) : PyTuple_New(n);
    for (Py_ssize_t i = 0; seq != NULL && i < n; i++) {
        PyObject *c =
            pyccl_comm_new(st, comms[i], ranks != NULL ? ranks[i] : (int)i, nranks, devices[i]);
        if (c == NULL) {
            Py_CLEAR(seq);
            break;
        }
        comms[i] = NULL; /* owned by c now */
        if (as_list) {
            PyList_SET_ITEM(seq, i, c);
        }
        else {
            PyTuple_SET_ITEM(seq, i, c);
        }
    }
    for (Py_ssize_t i = 0; seq == NULL && i < n; i++) {
        if (comms[i] != NULL) {
            st->api.ncclCommDestroy(comms[i]);
            comms[i] = NULL;
        }
    }
    return seq;
}

PyObject *
pyccl_clique(pyccl_state *st, const char *op, const int *devices,
             Py_ssize_t n)
{
    if (st->cliques->last_clique != NULL && n == st->cliques->last_n &&
        memcmp(devices, st->cliques->last_devices, (size_t)n * sizeof(int)) == 0) {
        return st->cliques->last_clique;
    }
    PyObject *key = clique_key(devices, n);
    PyObject *found = NULL, *tuple = NULL;
    ncclComm_t *comms = NULL;
    if (key == NULL) {
        return NULL;
    }
    if (PyDict_GetItemRef(st->cliques->cliques, key, &found) != 0) {
        goto done; /* found, or an error */
    }
    /* Another thread may be creating the same clique: one creator at a
     * time, and look again once the lock is held. */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(st->cliques->clique_lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
    if (PyDict_GetItemRef(st->cliques->cliques, key, &found) != 0) {
        goto unlock;
    }
    if (pyccl_load(st, op) < 0) {
        goto unlock;
    }
    comms = PyMem_RawCalloc((size_t)n, sizeof(ncclComm_t));
    if (comms == NULL) {
        PyErr_NoMemory();
        goto unlock;
    }
    ncclResult_t r;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    const pyccl_api *a = &st->api;
    Py_BEGIN_ALLOW_THREADS
    r = a->ncclCommInitAll(comms, (int)n, devices);
    pyccl_nccl_failed(a, r, NULL, last, sizeof last);
    Py_END_ALLOW_THREADS
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, op, r, last);
        goto unlock;
    }
    tuple = wrap_comms(st, comms, NULL, (int)n, devices, n, 0);
    if (tuple != NULL && PyDict_SetItem(st->cliques->cliques, key, tuple) == 0) {
        found = Py_NewRef(tuple);
    }
unlock:
    PyThread_release_lock(st->cliques->clique_lock);
done:
    if (comms != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (comms[i] != NULL) {
                st->api.ncclCommDestroy(comms[i]);
            }
        }
        PyMem_RawFree(comms);
    }
    Py_XDECREF(tuple);
    Py_DECREF(key);
    /* The dict keeps the tuple alive; hand back a borrowed reference. */
    if (found != NULL) {
        Py_DECREF(found);
        if (n <= (Py_ssize_t)(sizeof st->cliques->last_devices / sizeof(int))) {
            memcpy(st->cliques->last_devices, devices, (size_t)n * sizeof(int));
            st->cliques->last_n = n;
            st->cliques->last_clique = found;
        }
    }
    return found;
}

/* ranks[i] and devices[i] into rk[i] and dv[i]: ints, ranks distinct and
 * below nranks.  -1 with the exception naming the entry. */
static int
read_members(const char *op, PyObject *ranks, PyObject *devices, Py_ssize_t n, int nranks,
             int *rk, int *dv)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        char rname[32], dname[32];
        PyOS_snprintf(rname, sizeof rname, "ranks[%zd]", i);
        PyOS_snprintf(dname, sizeof dname, "devices[%zd]", i);
        if (pyccl_read_int(op, rname, PySequence_Fast_GET_ITEM(ranks, i), &rk[i]) < 0 ||
            pyccl_read_device(op, dname, PySequence_Fast_GET_ITEM(devices, i), &dv[i]) < 0) {
            return -1;
        }
        if (dv[i] < 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s must name its index ('cuda:N'), got %R", op, dname,
                         PySequence_Fast_GET_ITEM(devices, i));
            return -1;
        }
        for (Py_ssize_t j = 0; j < i; j++) {
            if (rk[j] == rk[i]) {
                PyErr_Format(PyExc_ValueError,
                             "%s: rank %d is listed twice (ranks[%zd] and "
                             "ranks[%zd])", op, rk[i], j, i);
                return -1;
            }
        }
        if (rk[i] < 0 || rk[i] >= nranks) {
            PyErr_Format(PyExc_ValueError,
                         "%s: ranks[%zd]=%d is out of range for world_size %d",
                         op, i, rk[i], nranks);
            return -1;
        }
    }
    return 0;
}

/* Without the GIL: rank rk[i] on device dv[i] into comms[i], all in one
 * NCCL group; NCCL's result (its last error copied into `last`). */
static ncclResult_t
init_group(const pyccl_api *a, ncclComm_t *comms, Py_ssize_t n, int nranks,
           const ncclUniqueId *uid, const int *rk, const int *dv, char *last, size_t last_size)
{
    int prev = -1;
    a->cudaGetDevice(&prev);
    ncclResult_t r = a->ncclGroupStart();
    for (Py_ssize_t i = 0; r == ncclSuccess && i < n; i++) {
        a->cudaSetDevice(dv[i]);
        r = a->ncclCommInitRank(&comms[i], nranks, *uid, rk[i]);
    }
    ncclResult_t r2 = a->ncclGroupEnd();
    if (r == ncclSuccess) {
        r = r2;
    }
    pyccl_nccl_failed(a, r, NULL, last, last_size);
    a->cudaSetDevice(prev);
    return r;
}

/* Several ranks of one job in this process, one per local device, created in
 * one NCCL group (NCCL requires that when one thread inits several ranks). */
PyObject *
pyccl_init_ranks(pyccl_state *st, PyObject *nranks_obj, PyObject *uid_obj,
                 PyObject *ranks_obj, PyObject *devices_obj)
{
    const char *op = "init_ranks";
    int nranks, ndev = 0;
    ncclUniqueId uid;
    PyObject *ranks = NULL, *devices = NULL, *list = NULL;
    int *rk = NULL, *dv = NULL;
    ncclComm_t *comms = NULL;
    if (pyccl_read_int(op, "world_size", nranks_obj, &nranks) < 0 ||
        pyccl_read_unique_id(op, 0, uid_obj, &uid) < 0) {
        return NULL;
    }
    ranks = PySequence_Fast(ranks_obj, "init_ranks: ranks must be a sequence of ints");
    devices = PySequence_Fast(devices_obj, "init_ranks: devices must be a sequence of ints");
    if (ranks == NULL || devices == NULL) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ranks);
    if (n == 0 || n != PySequence_Fast_GET_SIZE(devices)) {
        PyErr_Format(PyExc_ValueError,
                     "init_ranks: ranks and devices must be non-empty and of "
                     "one length, got %zd and %zd",
                     n, PySequence_Fast_GET_SIZE(devices));
        goto done;
    }
    rk = PyMem_Calloc((size_t)n, sizeof(int));
    dv = PyMem_Calloc((size_t)n, sizeof(int));
    comms = PyMem_RawCalloc((size_t)n, sizeof(ncclComm_t));
    if (rk == NULL || dv == NULL || comms == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (nranks < 1) {
        PyErr_Format(PyExc_ValueError, "%s: world_size must be >= 1, got %d",
                     op, nranks);
        goto done;
    }
    if (read_members(op, ranks, devices, n, nranks, rk, dv) < 0 ||
        pyccl_gpu_count(st, op, &ndev) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (dv[i] < 0 || dv[i] >= ndev) {
            PyErr_Format(PyExc_ValueError,
                         "%s: devices[%zd]=%d does not exist (this process "
                         "sees %d GPUs)", op, i, dv[i], ndev);
            goto done;
        }
    }
    ncclResult_t r;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    Py_BEGIN_ALLOW_THREADS
    r = init_group(&st->api, comms, n, nranks, &uid, rk, dv, last, sizeof last);
    Py_END_ALLOW_THREADS
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, op, r, last);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (comms[i] != NULL) {
                st->api.ncclCommDestroy(comms[i]);
            }
        }
        goto done;
    }
    list = wrap_comms(st, comms, rk, nranks, dv, n, 1);
done:
    PyMem_RawFree(comms);
    PyMem_Free(rk);
    PyMem_Free(dv);
    Py_XDECREF(ranks);
    Py_XDECREF(devices);
    return list;
}
