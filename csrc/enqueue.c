/* Enqueueing validated NCCL work.
 *
 * The bindings (python_nccl.c, the Communicator methods) turn Python
 * arguments into pyccl_task rows; this file is the one place that calls the
 * NCCL collectives.  Several rows go into one ncclGroupStart/End, as NCCL
 * requires when one thread drives several devices; the GIL is released for
 * exactly that region, and NCCL's own error text is copied out before the GIL
 * is taken back.  An error inside the group still ends the group, so NCCL's
 * group state stays balanced and the process stays usable. */
#include "enqueue.h"
#include "locks.h"
#include "errors.h"

#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

static ncclResult_t
enqueue_one(const pyccl_api *a, const pyccl_task *t, int redop)
{
    ncclDataType_t type = (ncclDataType_t)t->type;
    ncclRedOp_t op = (ncclRedOp_t)redop;
    switch (t->coll) {
    case PYCCL_ALL_REDUCE:
        return a->ncclAllReduce(t->send, t->recv, t->count, type, op, t->comm,
                                t->stream);
    case PYCCL_REDUCE:
        return a->ncclReduce(t->send, t->recv, t->count, type, op, t->peer,
                             t->comm, t->stream);
    case PYCCL_BROADCAST:
        return a->ncclBroadcast(t->send, t->recv, t->count, type, t->peer,
                                t->comm, t->stream);
    case PYCCL_ALL_GATHER:
        return a->ncclAllGather(t->send, t->recv, t->count, type, t->comm,
                                t->stream);
    case PYCCL_REDUCE_SCATTER:
        return a->ncclReduceScatter(t->send, t->recv, t->count, type, op,
                                    t->comm, t->stream);
    case PYCCL_SEND:
        return a->ncclSend(t->send, t->count, type, t->peer, t->comm,
                           t->stream);
    case PYCCL_RECV:
        return a->ncclRecv(t->recv, t->count, type, t->peer, t->comm,
                           t->stream);
    case PYCCL_LAUNCHED:
        return ncclSuccess;
    }
    return ncclInvalidArgument;
}

/* The rows as one NCCL group (no group for one row), a premul_sum op made for
 * them first when asked: NCCL's result, and in *failed the communicator of
 * the call that failed (NULL for the group's start). */
static ncclResult_t
nccl_calls(const pyccl_api *a, const pyccl_task *tasks, Py_ssize_t n, int redop,
           const pyccl_premul *premul, ncclComm_t *failed)
{
    ncclResult_t r = ncclSuccess, r2;
    ncclRedOp_t made = (ncclRedOp_t)0;
    *failed = tasks[0].comm;
    if (premul != NULL) {
        /* the tasks' one communicator, locked by the caller; NCCL lets the
         * op go as soon as the calls given it returned */
        r = a->ncclRedOpCreatePreMulSum(&made, (void *)premul->scalar,
                                        (ncclDataType_t)premul->type,
                                        ncclScalarHostImmediate, tasks[0].comm);
        if (r != ncclSuccess) {
            return r;
        }
        redop = (int)made;
    }
    if (n == 1) {
        r = enqueue_one(a, &tasks[0], redop);
    }
    else {
        *failed = NULL;
        r = a->ncclGroupStart();
        if (r == ncclSuccess) {
            for (Py_ssize_t i = 0; i < n; i++) {
                r = enqueue_one(a, &tasks[i], redop);
                if (r != ncclSuccess) {
                    *failed = tasks[i].comm;
                    break;
                }
            }
            /* Always close the group, even after a failed enqueue. */
            r2 = a->ncclGroupEnd();
            if (r == ncclSuccess) {
                r = r2;
                *failed = tasks[0].comm;
            }
        }
    }
    if (premul != NULL) {
        a->ncclRedOpDestroy(made, tasks[0].comm);
    }
    return r;
}

ncclResult_t
pyccl_enqueue_calls(const pyccl_api *a, const pyccl_task *tasks, Py_ssize_t n, int redop,
                    const pyccl_premul *premul, char *last, size_t last_size)
{
    ncclComm_t failed;
    ncclResult_t r = nccl_calls(a, tasks, n, redop, premul, &failed);
    /* NCCL keeps its text per thread: this one's next NCCL call is not made
     * yet.  ncclInProgress is no error: a non-blocking communicator is still
     * working on the call (the watch polls it). */
    if (r != ncclSuccess && r != ncclInProgress) {
        pyccl_nccl_failed(a, r, failed, last, last_size);
    }
    return r;
}

/* ---------------- this thread's pyccl.group() ----------------
 * NCCL's group state is per thread, and so is pyccl.group(): its depth, the
 * kind of the communicators in the open group (with a timeout or not; -1:
 * none yet), and one list of what was used in it: each communicator once,
 * with a reference (NCCL uses it at the group's end), counted in
 * c->in_group until then (the one group count: the door reads it to refuse
 * destroy() and abort(), the watchdog to leave the communicator alone); and
 * the work on watched communicators, once per stream, which the timeouts
 * layer tracks when the group ends. */
static _Thread_local int group_depth;
static _Thread_local int group_timed = -1;
static _Thread_local pyccl_group_entry *group_v;
static _Thread_local Py_ssize_t group_n, group_cap;

/* A thread that ends with its pyccl.group() open (its work queued, never
 * run) hands its list over, here: it goes on `lost` at the thread's end (a
 * pthread key's destructor, without the GIL), and the next entry of the
 * door that looks (pyccl_group_reap, with the GIL) takes the communicators
 * out of the group and has them failed.  Process-wide by nature, so kept in
 * statics, under lost_mu. */
typedef struct lost_group {
    pyccl_group_entry *v;
    Py_ssize_t n;
    struct lost_group *next;
} lost_group;
static pthread_key_t group_key;
static pthread_once_t group_key_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t lost_mu = PTHREAD_MUTEX_INITIALIZER;
static lost_group *lost;
static int lost_any;

static void
group_thread_end(void *unused)
{
    (void)unused;
    if (group_n == 0) {
        return;
    }
    lost_group *g = malloc(sizeof *g);
    if (g == NULL) {
        return; /* kept in the group for good: the communicators stay refused */
    }
    g->v = group_v;
    g->n = group_n;
    group_v = NULL;
    group_n = group_cap = 0;
    pyccl_lock(&lost_mu, PYCCL_LOCK_LOST);
    g->next = lost;
    lost = g;
    __atomic_store_n(&lost_any, 1, __ATOMIC_RELEASE);
    pyccl_unlock(&lost_mu);
}

static void
make_group_key(void)
{
    (void)pthread_key_create(&group_key, group_thread_end);
}

static void
in_group_add(pyccl_comm *c, int d)
{
    /* written with the GIL; the watchdog reads it without */
    __atomic_add_fetch(&c->in_group, d, __ATOMIC_RELEASE);
}

void
pyccl_group_reap(void (*lost_one)(pyccl_comm *c, void *arg), void *arg)
{
    if (!__atomic_load_n(&lost_any, __ATOMIC_ACQUIRE)) {
        return;
    }
    pyccl_lock(&lost_mu, PYCCL_LOCK_LOST);
    lost_group *all = lost;
    lost = NULL;
    __atomic_store_n(&lost_any, 0, __ATOMIC_RELEASE);
    pyccl_unlock(&lost_mu);
    while (all != NULL) {
        lost_group *g = all;
        all = g->next;
        for (Py_ssize_t i = 0; i < g->n; i++) {
            if (g->v[i].counted) {
                pyccl_comm *c = (pyccl_comm *)g->v[i].comm;
                /* failed while still counted in the group: lost_one may
                 * release the GIL, and destroy() must not free c's watch
                 * meanwhile */
                lost_one(c, arg);
                in_group_add(c, -1);
            }
        }
        pyccl_group_release(g->v, g->n, 0);
        free(g);
    }
}

int
pyccl_group_depth(void)
{
    return group_depth;
}

/* Room for one more entry; -1 with MemoryError. */
static int
group_room(void)
{
    if (group_n < group_cap) {
        return 0;
    }
    Py_ssize_t cap = group_cap ? 2 * group_cap : 8;
    pyccl_group_entry *v = PyMem_RawRealloc(group_v, (size_t)cap * sizeof *v);
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    group_v = v;
    group_cap = cap;
    return 0;
}

int
pyccl_group_note(pyccl_comm *c)
{
    for (Py_ssize_t i = 0; i < group_n; i++) {
        if (group_v[i].counted && group_v[i].comm == (PyObject *)c) {
            return 0;
        }
    }
    if (group_room() < 0) {
        return -1;
    }
    group_v[group_n++] = (pyccl_group_entry){.comm = Py_NewRef((PyObject *)c), .counted = 1};
    in_group_add(c, 1);
    return 0;
}

int
pyccl_group_note_work(pyccl_comm *c, cudaStream_t s, const char *op)
{
    for (Py_ssize_t i = 0; i < group_n; i++) {
        if (group_v[i].work && group_v[i].comm == (PyObject *)c && group_v[i].stream == s) {
            return 0;
        }
    }
    if (group_room() < 0) {
        return -1;
    }
    group_v[group_n++] = (pyccl_group_entry){
        .comm = Py_NewRef((PyObject *)c), .stream = s, .op = op, .work = 1};
    return 0;
}

void
pyccl_group_note_calls(pyccl_comm *c, cudaStream_t s, unsigned k)
{
    for (Py_ssize_t i = 0; i < group_n; i++) {
        if (group_v[i].counted && group_v[i].comm == (PyObject *)c) {
            group_v[i].calls += k;
            group_v[i].stream = s;
            return;
        }
    }
}

int
pyccl_group_others(const pyccl_comm *c)
{
    int mine = 0;
    for (Py_ssize_t i = 0; i < group_n && !mine; i++) {
        mine = group_v[i].counted && group_v[i].comm == (PyObject *)c;
    }
    return __atomic_load_n(&c->in_group, __ATOMIC_ACQUIRE) > mine;
}

int
pyccl_group_join(pyccl_comm *const *comms, Py_ssize_t ncomms, int timed)
{
    if (group_depth == 0) {
        return 0;
    }
    if (group_timed == -1) {
        group_timed = timed;
    }
    if (group_timed != timed) {
        return 1;
    }
    for (Py_ssize_t j = 0; j < ncomms; j++) {
        if (pyccl_group_note(comms[j]) < 0) {
            return -1;
        }
    }
    return 0;
}

pyccl_group_entry *
pyccl_group_take(Py_ssize_t *n)
{
    pyccl_group_entry *v = group_v;
    *n = group_n;
    group_v = NULL;
    group_n = group_cap = 0;
    return v;
}

void
pyccl_group_leave(pyccl_group_entry *v, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (v[i].counted) {
            in_group_add((pyccl_comm *)v[i].comm, -1);
            v[i].counted = 0;
        }
    }
}

void
pyccl_group_release(pyccl_group_entry *v, Py_ssize_t n, int leave)
{
    if (leave) {
        pyccl_group_leave(v, n);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(v[i].comm);
    }
    PyMem_RawFree(v);
}

/* ncclGroupStart (start) or ncclGroupEnd, GIL released around exactly
 * that call, the thread's depth following it. */
ncclResult_t
pyccl_group_call(pyccl_state *st, int start, char *last, size_t last_size,
                 int *outermost)
{
    ncclResult_t r;
    const pyccl_api *a = &st->api;
    *outermost = 0;
    /* the end of a group launches its work, and may block on peers */
    Py_BEGIN_ALLOW_THREADS
    r = start ? a->ncclGroupStart() : a->ncclGroupEnd();
    pyccl_nccl_failed(a, r, NULL, last, last_size);
    Py_END_ALLOW_THREADS
    if (start) {
        group_depth += r == ncclSuccess;
        if (group_depth == 1) { /* its end, if the thread's comes first */
            pthread_once(&group_key_once, make_group_key);
            pthread_setspecific(group_key, (void *)1);
        }
    }
    else {
        /* NCCL leaves the group level even when the end fails */
        *outermost = --group_depth == 0;
    }
    if (group_depth == 0) {
        group_timed = -1;
    }
    return r;
}

/* c->mu with the GIL held: released while waiting for the lock. */
void
pyccl_comm_lock(pyccl_comm *c)
{
    pyccl_lock_released(&c->mu, PYCCL_LOCK_COMM);
}

ncclResult_t
pyccl_nccl_settle(const pyccl_api *a, ncclComm_t comm, ncclResult_t r, double deadline)
{
    /* ncclSuccess is looked at too: NCCL 2.28.9's ncclCommWindowRegister on a
     * non-blocking communicator returns it with the state still ncclInProgress
     * (seen on an H100); on a blocking one the state is final, one call */
    while ((r == ncclInProgress || r == ncclSuccess) && a->ncclCommGetAsyncError != NULL) {
        ncclResult_t state = ncclSuccess;
        if (a->ncclCommGetAsyncError(comm, &state) != ncclSuccess) {
            return ncclInternalError;
        }
        if (state != ncclInProgress) {
            return state;
        }
        r = ncclInProgress;
        if (deadline > 0 && pyccl_now_s() > deadline) {
            return ncclInProgress;
        }
        usleep(20);
    }
    return r;
}
