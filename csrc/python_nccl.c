/* The _nccl_* bindings behind pyccl.nccl, with torch._C's names and argument
 * order: parse -> validate (torch's checks and texts, in torch's order) ->
 * enqueue (enqueue.c).  Unlike torch: root is honoured by broadcast, sizes of
 * all_gather/reduce_scatter scale by the communicator's rank count, fp8 is
 * reduced natively, bool is never reduced as bytes, and NCCL errors raise
 * NcclError instead of terminating the process. */
#include "communicator.h"
#include "ar.h"
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "tensor.h"
#include "loader.h"
#include "args.h"
#include "errors.h"

#include <string.h>

static pyccl_state *
get_state(PyObject *module)
{
    return pyccl_state_ready(PyModule_GetState(module));
}

/* A collection of tensors (any iterable but a tensor), as a private tuple:
 * the checks run user code (a tensor-like's properties), which may change
 * the caller's list, and the tuple keeps every item alive for the call. */
static PyObject *
tensor_seq(pyccl_state *st, PyObject *obj, const char *op, const char *what)
{
    PyObject *seq;
    if (pyccl_is_tensor(st, obj) ||
        (seq = PySequence_Tuple(obj)) == NULL) {
        PyErr_Clear();
        if (strcmp(what, "inputs") == 0) {
            PyErr_SetString(PyExc_TypeError,
                            "Inputs should be a collection of tensors");
        }
        else {
            PyErr_Format(PyExc_TypeError,
                         "%s: %s should be a collection of tensors, got %.200s",
                         op, what, Py_TYPE(obj)->tp_name);
        }
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!pyccl_is_tensor(st, item)) {
            PyErr_Format(PyExc_TypeError, "expected Tensor at %zd (got %.200s)",
                         i, Py_TYPE(item)->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
    }
    return seq;
}

/* None, or a sequence of exactly n items, as a tuple: a snapshot whose items
 * stay alive while the GIL is released, whatever happens to the caller's
 * list meanwhile. */
static PyObject *
optional_seq(PyObject *obj, Py_ssize_t n, const char *op, const char *what,
             const char *count_msg)
{
    if (obj == Py_None) {
        return Py_NewRef(Py_None);
    }
    PyObject *seq = PyTuple_Check(obj) ? Py_NewRef(obj) : PySequence_Tuple(obj);
    if (seq == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: %s must be a sequence or None, got %.200s", op, what,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_SetString(PyExc_RuntimeError, count_msg);
        Py_DECREF(seq);
        return NULL;
    }
    return seq;
}

/* What a call looks like once its arguments are parsed. */
typedef struct {
    pyccl_coll coll;
    const char *op;
    int reduces;        /* reduction collective: needs a reducible dtype */
    int out_mult_is_n;  /* all_gather: output = input x N */
    int in_mult_is_n;   /* reduce_scatter: input = output x N */
} coll_desc;

/* inputs[i] and outputs[i] may share memory only in NCCL's in-place form:
 * the same buffer, or (all_gather / reduce_scatter) the small side exactly
 * at this rank's slot of the big side.  torch does not check this. */
static int
check_in_place(const char *op, const coll_desc *d, Py_ssize_t i, int rank,
               const pyccl_tensor *in, const pyccl_tensor *out)
{
    char in_what[32], out_what[32], slot[48] = "";
    PyOS_snprintf(in_what, sizeof in_what, "inputs[%zd]", i);
    PyOS_snprintf(out_what, sizeof out_what, "outputs[%zd]", i);
    if (d->out_mult_is_n || d->in_mult_is_n) {
        PyOS_snprintf(slot, sizeof slot, "rank %d's slot of it", rank);
    }
    /* rank < N and the big side holds N x the small one's bytes (checked
     * before), so these products fit */
    if (d->out_mult_is_n) {
        return pyccl_check_overlap(op, in_what, in, out_what, out,
                                   (int64_t)rank * in->nbytes, slot);
    }
    if (d->in_mult_is_n) {
        return pyccl_check_overlap(op, out_what, out, in_what, in,
                                   (int64_t)rank * out->nbytes, slot);
    }
    return pyccl_check_overlap(op, out_what, out, in_what, in, 0,
                               "the same memory");
}

/* One _nccl_* call while it is checked and enqueued: what the steps below
 * read, and what the end of the call releases. */
typedef struct {
    pyccl_state *st;
    const coll_desc *d;
    const char *op;
    /* private tuples (see tensor_seq, optional_seq); outputs NULL: in place,
     * or reduce's single output (outputs_obj) */
    PyObject *inputs, *outputs, *streams, *comms;
    PyObject *outputs_obj;
    PyObject *ref_dtype;  /* the dtype every tensor must have */
    Py_ssize_t n;         /* number of inputs: one per local device */
    int have_comms;       /* comms given (else the clique of the devices) */
    int has_root, root, redop, nranks;
    /* per-index state in one block: input and output descriptors, devices,
     * tasks */
    void *block;
    pyccl_tensor *tin, *tout;
    pyccl_task *tasks;
    int *devices;
    Py_ssize_t root_idx;  /* the local index that is reduce's root; -1: none */
    int type;             /* ncclDataType_t */
    size_t count;
} nccl_call;

static pyccl_comm *
call_comm(const nccl_call *x, Py_ssize_t i)
{
    return (pyccl_comm *)PySequence_Fast_GET_ITEM(x->comms, i);
}

/* The sequences, in torch's order of checks; comms live and sized. */
static int
read_sequences(nccl_call *x, PyObject *inputs_obj, PyObject *streams_obj,
               PyObject *comms_obj)
{
    pyccl_state *st = x->st;
    const char *op = x->op;
    x->inputs = tensor_seq(st, inputs_obj, op, "inputs");
    if (x->inputs == NULL) {
        return -1;
    }
    Py_ssize_t n = x->n = PySequence_Fast_GET_SIZE(x->inputs);
    PyObject *outputs_obj = x->outputs_obj;
    int single_output = x->d->coll == PYCCL_REDUCE;
    if (!single_output && outputs_obj != NULL && outputs_obj != Py_None) {
        x->outputs = tensor_seq(st, outputs_obj, op, "outputs");
        if (x->outputs == NULL) {
            return -1;
        }
    }
    else if (single_output && outputs_obj != Py_None &&
             !pyccl_is_tensor(st, outputs_obj)) {
        PyErr_Format(PyExc_TypeError, "%s: output must be a Tensor or None, "
                     "got %.200s", op, Py_TYPE(outputs_obj)->tp_name);
        return -1;
    }
    x->streams = optional_seq(streams_obj, n, op, "streams",
                              "number of streams is not equal to number of inputs");
    if (x->streams == NULL) {
        return -1;
    }
    x->comms = optional_seq(comms_obj, n, op, "comms",
                            "number of communicators is not equal to number of inputs");
    if (x->comms == NULL) {
        return -1;
    }
    x->have_comms = x->comms != Py_None;
    for (Py_ssize_t i = 0; x->have_comms && i < n; i++) {
        PyObject *c = PySequence_Fast_GET_ITEM(x->comms, i);
        if (!pyccl_is_comm(st, c)) {
            PyErr_Format(PyExc_TypeError,
                         "%s: comms[%zd] must be a pyccl Communicator (from "
                         "init_rank), got %.200s",
                         op, i, Py_TYPE(c)->tp_name);
            return -1;
        }
        if (pyccl_comm_alive(st, op, (pyccl_comm *)c) < 0 ||
            pyccl_comm_refresh(st, op, (pyccl_comm *)c) < 0) {
            return -1;
        }
    }
    if (n == 0) {
        PyErr_SetString(PyExc_RuntimeError, "input sequence can't be empty");
        return -1;
    }
    if (x->outputs != NULL && PySequence_Fast_GET_SIZE(x->outputs) != n) {
        PyErr_Format(PyExc_RuntimeError,
                     "inputs and outputs sequences have to be of the same "
                     "length, but got input of length %zd and output of "
                     "length %zd",
                     n, PySequence_Fast_GET_SIZE(x->outputs));
        return -1;
    }
    return 0;
}

/* op= and root= (NULL: the collective has none). */
static int
read_op_and_root(nccl_call *x, PyObject *redop_obj, PyObject *root_obj)
{
    const char *op = x->op;
    if (redop_obj != NULL) {
        /* With user communicators, ints past AVG may be ops the user made
         * on them (premul_sum); NCCL checks those. */
        if (pyccl_read_redop(x->st, op, redop_obj,
                             x->have_comms ? PYCCL_OP_ANY_INT : 0, &x->redop,
                             NULL) < 0) {
            return -1;
        }
    }
    x->nranks = x->have_comms ? call_comm(x, 0)->size : (int)x->n;
    if (x->d->coll == PYCCL_REDUCE_SCATTER) {
        x->redop = pyccl_reduce_scatter_op(x->redop, x->nranks);
    }
    x->has_root = root_obj != NULL;
    if (root_obj != NULL) {
        if (pyccl_read_int(op, "root", root_obj, &x->root) < 0) {
            return -1;
        }
        if (x->root < 0 || x->root >= x->nranks) {
            PyErr_SetString(PyExc_RuntimeError, "invalid root");
            return -1;
        }
    }
    return 0;
}

/* inputs[i] and, when given, outputs[i]: dtype, sizes, devices, overlap. */
static int
read_pair(nccl_call *x, Py_ssize_t i)
{
    pyccl_state *st = x->st;
    const char *op = x->op;
    pyccl_tensor *tin = x->tin, *tout = x->tout;
    PyObject *in = PySequence_Fast_GET_ITEM(x->inputs, i);
    char what[32];
    PyOS_snprintf(what, sizeof what, "inputs[%zd]", i);
    if (pyccl_check_tensor(st, op, what, in, &x->ref_dtype, &tin[i]) < 0) {
        return -1;
    }
    if (tin[i].numel != tin[0].numel) {
        PyErr_SetString(PyExc_RuntimeError,
                        "all inputs must have the same number of elements");
        return -1;
    }
    int rank_i = x->have_comms ? call_comm(x, i)->rank : (int)i;
    int size_i = x->have_comms ? call_comm(x, i)->size : (int)x->n;
    if (x->has_root && rank_i == x->root) {
        x->root_idx = i;
    }
    if (x->outputs != NULL) {
        PyObject *out = PySequence_Fast_GET_ITEM(x->outputs, i);
        PyOS_snprintf(what, sizeof what, "outputs[%zd]", i);
        if (pyccl_check_tensor(st, op, what, out, &x->ref_dtype, &tout[i]) < 0) {
            return -1;
        }
        if (tout[i].device != tin[i].device) {
            PyErr_SetString(PyExc_RuntimeError,
                            "input and output must be on the same device");
            return -1;
        }
        /* torch's rule, output * out_mult == input * in_mult, with N the
         * communicator's rank count (torch uses len(inputs)). */
        int64_t lhs, rhs;
        PyOS_snprintf(what, sizeof what, "outputs[%zd]", i);
        if (pyccl_mul_size(op, what, tout[i].numel,
                           x->d->in_mult_is_n ? size_i : 1, "the world size",
                           &lhs) < 0 ||
            pyccl_mul_size(op, "inputs[0]", tin[0].numel,
                           x->d->out_mult_is_n ? size_i : 1, "the world size",
                           &rhs) < 0) {
            return -1;
        }
        if (lhs != rhs) {
            PyErr_SetString(PyExc_RuntimeError,
                            "output must be of size input_size * "
                            "size_multiplier");
            return -1;
        }
        if (check_in_place(op, x->d, i, rank_i, &tin[i], &tout[i]) < 0) {
            return -1;
        }
    }
    else {
        tout[i] = tin[i]; /* in place */
    }
    for (Py_ssize_t j = 0; j < i; j++) {
        if (x->devices[j] == tin[i].device) {
            PyErr_SetString(PyExc_RuntimeError,
                            "inputs must be on unique devices");
            return -1;
        }
    }
    x->devices[i] = tin[i].device;
    if (x->have_comms) {
        pyccl_comm *c = call_comm(x, i);
        if (c->device != tin[i].device) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: inputs[%zd] is on cuda:%d but comms[%zd] "
                         "(rank %d) is on cuda:%d",
                         op, i, tin[i].device, i, c->rank, c->device);
            return -1;
        }
    }
    return 0;
}

/* reduce: one output, written on the root only; None = in place. */
static int
read_reduce_output(nccl_call *x)
{
    const char *op = x->op;
    Py_ssize_t root_idx = x->root_idx;
    if (x->outputs_obj == Py_None) {
        return 0;
    }
    pyccl_tensor o;
    if (pyccl_check_tensor(x->st, op, "output", x->outputs_obj, &x->ref_dtype,
                           &o) < 0) {
        return -1;
    }
    if (root_idx < 0) {
        return 0;
    }
    if (o.device != x->tin[root_idx].device) {
        PyErr_SetString(PyExc_RuntimeError,
                        "input and output must be on the same "
                        "device");
        return -1;
    }
    if (o.numel != x->tin[0].numel) {
        PyErr_SetString(PyExc_RuntimeError,
                        "output must be of size input_size * "
                        "size_multiplier");
        return -1;
    }
    char in_what[32];
    PyOS_snprintf(in_what, sizeof in_what, "inputs[%zd]", root_idx);
    if (pyccl_check_overlap(op, "output", &o, in_what, &x->tin[root_idx], 0,
                            "the same memory") < 0) {
        return -1;
    }
    x->tout[root_idx] = o;
    return 0;
}

/* Every tensor, into the per-index block. */
static int
read_tensors(nccl_call *x)
{
    Py_ssize_t n = x->n;
    size_t sz = (size_t)n * (2 * sizeof(pyccl_tensor) + sizeof(int) +
                             sizeof(pyccl_task));
    x->block = PyMem_Calloc(1, sz);
    if (x->block == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    x->tin = x->block;
    x->tout = x->tin + n;
    x->tasks = (pyccl_task *)(x->tout + n);
    x->devices = (int *)(x->tasks + n);
    x->root_idx = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (read_pair(x, i) < 0) {
            return -1;
        }
    }
    if (x->d->coll == PYCCL_REDUCE) {
        return read_reduce_output(x);
    }
    return 0;
}

/* NCCL's type and count for the call, and each index's stream. */
static int
read_type_and_streams(nccl_call *x)
{
    pyccl_state *st = x->st;
    const char *op = x->op;
    const pyccl_tensor *tin = x->tin;
    if (pyccl_load(st, op) < 0) {
        return -1;
    }
    if (x->d->reduces) {
        x->type = pyccl_reduce_type(st, op, NULL, &tin[0]);
        if (x->type < 0) {
            return -1;
        }
        x->count = (size_t)(x->d->in_mult_is_n ? x->tout[0].numel : tin[0].numel);
    }
    else {
        pyccl_move_type(st, &tin[0], &x->type, &x->count, (size_t)tin[0].numel);
    }
    for (Py_ssize_t i = 0; i < x->n; i++) {
        PyObject *s = x->streams == Py_None
                          ? Py_None
                          : PySequence_Fast_GET_ITEM(x->streams, i);
        char what[32];
        PyOS_snprintf(what, sizeof what, "streams[%zd]", i);
        /* nothing to move: check the streams given, ask CUDA for none */
        if (x->count == 0 && s == Py_None) {
            continue;
        }
        if (pyccl_stream(st, op, what, s, tin[i].device, "its tensor",
                         &x->tasks[i].stream) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Without comms: the devices, read from user code, are in range. */
static int
check_devices(nccl_call *x)
{
    int ndev = 0;
    cudaError_t ce = x->st->api.cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess) {
        x->st->api.cudaGetLastError();
        ndev = 0;
    }
    for (Py_ssize_t i = 0; i < x->n; i++) {
        if (x->devices[i] >= ndev) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: inputs[%zd] is on cuda:%d but this process "
                         "has %d CUDA device%s",
                         x->op, i, x->devices[i], ndev, ndev == 1 ? "" : "s");
            return -1;
        }
    }
    return 0;
}

/* The tasks, on the given communicators or the devices' clique, enqueued. */
static int
enqueue_call(nccl_call *x)
{
    pyccl_state *st = x->st;
    const char *op = x->op;
    Py_ssize_t n = x->n;
    int have_comms = x->have_comms;
    pyccl_task *tasks = x->tasks;
    /* The last user code (tensor-likes' attributes, streams) has run: a
     * communicator it destroyed or aborted is reported here, not by NCCL. */
    for (Py_ssize_t i = 0; have_comms && i < n; i++) {
        if (pyccl_comm_alive(st, op, call_comm(x, i)) < 0) {
            return -1;
        }
    }
    /* Zero elements: NCCL would do nothing, so neither a clique nor a GPU is
     * needed (and every rank sees the same count, so every rank skips). */
    if (x->count == 0) {
        return 0;
    }
    if (!have_comms && check_devices(x) < 0) {
        return -1;
    }
    PyObject *clique = NULL;
    if (!have_comms) {
        clique = pyccl_clique(st, op, x->devices, n);
        if (clique == NULL) {
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        pyccl_comm *c = have_comms ? call_comm(x, i)
                                   : (pyccl_comm *)PyTuple_GET_ITEM(clique, i);
        tasks[i].coll = x->d->coll;
        tasks[i].comm = c->comm;
        tasks[i].send = x->tin[i].ptr;
        tasks[i].recv = x->tout[i].ptr;
        tasks[i].count = x->count;
        tasks[i].type = x->type;
        tasks[i].peer = x->root;
    }
    /* Two threads on one clique would interleave their groups differently
     * on each device and deadlock: clique calls are serialized. */
    pyccl_comm *const *comms =
        have_comms ? (pyccl_comm *const *)PySequence_Fast_ITEMS(x->comms) : NULL;
    Py_ssize_t ncomms = have_comms ? n : 0;
    /* user communicators: begun (another thread's destroy() refuses) */
    if (pyccl_call_begin_all(st, op, comms, ncomms) < 0) {
        return -1;
    }
    int rc = pyccl_call_submit(st, op, tasks, n, x->redop, NULL,
                               have_comms ? NULL : pyccl_clique_call_lock(st), comms, ncomms);
    pyccl_call_end_all(comms, ncomms);
    return rc;
}

/* One _nccl_* collective: parse -> validate (torch's order) -> enqueue. */
static PyObject *
collective(PyObject *module, const coll_desc *d, PyObject *inputs_obj,
           PyObject *outputs_obj, PyObject *root_obj, PyObject *redop_obj,
           PyObject *streams_obj, PyObject *comms_obj)
{
    if ((d->out_mult_is_n || d->in_mult_is_n) && outputs_obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s: outputs is required", d->op);
        return NULL;
    }
    nccl_call x = {.d = d, .op = d->op, .outputs_obj = outputs_obj};
    x.st = get_state(module);
    if (x.st == NULL) {
        return NULL;
    }
    int rc = -1;
    if (read_sequences(&x, inputs_obj, streams_obj, comms_obj) == 0 &&
        read_op_and_root(&x, redop_obj, root_obj) == 0 &&
        read_tensors(&x) == 0 &&
        read_type_and_streams(&x) == 0) {
        rc = enqueue_call(&x);
    }
    PyMem_Free(x.block);
    Py_XDECREF(x.ref_dtype);
    Py_XDECREF(x.inputs);
    Py_XDECREF(x.outputs);
    Py_XDECREF(x.streams);
    Py_XDECREF(x.comms);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

static const coll_desc ALL_REDUCE = {PYCCL_ALL_REDUCE, "all_reduce", 1, 0, 0};
static const coll_desc REDUCE = {PYCCL_REDUCE, "reduce", 1, 0, 0};
static const coll_desc BROADCAST = {PYCCL_BROADCAST, "broadcast", 0, 0, 0};
static const coll_desc ALL_GATHER = {PYCCL_ALL_GATHER, "all_gather", 0, 1, 0};
static const coll_desc REDUCE_SCATTER = {PYCCL_REDUCE_SCATTER, "reduce_scatter",
                                         1, 0, 1};

/* _nccl_all_reduce(inputs, outputs, op, streams, comms) */
static PyObject *
nccl_all_reduce(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (pyccl_check_nargs("_nccl_all_reduce", nargs, 5) < 0) {
        return NULL;
    }
    return collective(m, &ALL_REDUCE, args[0], args[1], NULL, args[2],
                      args[3], args[4]);
}

/* _nccl_reduce(inputs, output, root, op, streams, comms) */
static PyObject *
nccl_reduce(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (pyccl_check_nargs("_nccl_reduce", nargs, 6) < 0) {
        return NULL;
    }
    return collective(m, &REDUCE, args[0], args[1], args[2], args[3], args[4],
                      args[5]);
}

/* _nccl_broadcast(inputs, root, streams, comms) */
static PyObject *
nccl_broadcast(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (pyccl_check_nargs("_nccl_broadcast", nargs, 4) < 0) {
        return NULL;
    }
    return collective(m, &BROADCAST, args[0], NULL, args[1], NULL, args[2],
                      args[3]);
}

/* _nccl_all_gather(inputs, outputs, streams, comms) */
static PyObject *
nccl_all_gather(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (pyccl_check_nargs("_nccl_all_gather", nargs, 4) < 0) {
        return NULL;
    }
    return collective(m, &ALL_GATHER, args[0], args[1], NULL, NULL, args[2],
                      args[3]);
}

/* _nccl_reduce_scatter(inputs, outputs, op, streams, comms) */
static PyObject *
nccl_reduce_scatter(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (pyccl_check_nargs("_nccl_reduce_scatter", nargs, 5) < 0) {
        return NULL;
    }
    return collective(m, &REDUCE_SCATTER, args[0], args[1], NULL, args[2],
                      args[3], args[4]);
}

static PyObject *
nccl_version(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    pyccl_state *st = PyModule_GetState(m);
    int v = pyccl_nccl_version(st, "version");
    return v < 0 ? NULL : PyLong_FromLong(v);
}

static PyObject *
nccl_version_suffix(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    pyccl_state *st = PyModule_GetState(m);
    int v = pyccl_nccl_version(st, "version");
    if (v < 0) {
        return NULL;
    }
    /* NCCL reports its suffix only at compile time: trust it only when the
     * loaded library is the version pyccl was built against. */
    return PyBytes_FromString(v == NCCL_VERSION_CODE ? NCCL_SUFFIX : "");
}

static PyObject *
nccl_unique_id(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    pyccl_state *st = PyModule_GetState(m);
    if (pyccl_load(st, "unique_id") < 0) {
        return NULL;
    }
    ncclUniqueId id;
    ncclResult_t r;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    const pyccl_api *a = &st->api;
    Py_BEGIN_ALLOW_THREADS
    r = a->ncclGetUniqueId(&id);
    pyccl_nccl_failed(a, r, NULL, last, sizeof last);
    Py_END_ALLOW_THREADS
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, "unique_id", r, last);
        return NULL;
    }
    return PyBytes_FromStringAndSize(id.internal, NCCL_UNIQUE_ID_BYTES);
}

/* _nccl_init_rank(nranks, unique_id, rank) */
static PyObject *
nccl_init_rank(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (pyccl_check_nargs("_nccl_init_rank", nargs, 3) < 0) {
        return NULL;
    }
    pyccl_state *st = PyModule_GetState(m);
    return pyccl_init_rank(st, args[0], args[1], args[2]);
}

/* _nccl_init_ranks(world_size, unique_id, ranks, devices) -> [Communicator] */
static PyObject *
nccl_init_ranks(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (pyccl_check_nargs("_nccl_init_ranks", nargs, 4) < 0) {
        return NULL;
    }
    pyccl_state *st = PyModule_GetState(m);
    return pyccl_init_ranks(st, args[0], args[1], args[2], args[3]);
}

/* _nccl_group_start() / _nccl_group_end(): pyccl.group()'s two halves. */
static PyObject *
nccl_group(PyObject *m, int start)
{
    pyccl_state *st = PyModule_GetState(m);
    const char *op = start ? "group" : "group end";
    if (pyccl_load(st, op) < 0) {
        return NULL;
    }
    if (!start && pyccl_group_depth() == 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "group end: no pyccl.group() is open on this thread");
        return NULL;
    }
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    int outermost = 0;
    ncclResult_t r = pyccl_group_call(st, start, last, sizeof last, &outermost);
    if (outermost) {
        pyccl_resolve_pending_splits(st);
        /* communicators with a timeout: poll and track the group's work
         * (ncclInProgress is how a non-blocking group ends); then every
         * communicator used in the group leaves it */
        Py_ssize_t n = 0;
        pyccl_group_entry *used = pyccl_group_take(&n);
        int rc = pyccl_watch_group_end(st, r, used, n);
        pyccl_group_release(used, n, 1);
        if (rc < 0) {
            return NULL;
        }
        r = r == ncclInProgress ? ncclSuccess : r;
    }
    if (r != ncclSuccess) {
        pyccl_raise_nccl(st, op, r, last);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
nccl_group_start(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    return nccl_group(m, 1);
}

static PyObject *
nccl_group_end(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    return nccl_group(m, 0);
}

static PyObject *
ar_built(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(pyccl_ar_built());
}

/* The device, stream (a cudaStream_t as an int) and calls of a timing aid
 * (args[0..2]); NULL with an exception, else the module's state. */
static pyccl_state *
read_timing_args(PyObject *m, const char *op, PyObject *const *args, int *device, void **stream,
                 int *calls)
{
    if (pyccl_read_int(op, "device", args[0], device) < 0 ||
        pyccl_read_int(op, "calls", args[2], calls) < 0) {
        return NULL;
    }
    if (!PyLong_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s: stream must be an int (a cudaStream_t), got %.200s", op,
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    *stream = PyLong_AsVoidPtr(args[1]);
    if (*stream == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (*calls < 1) {
        PyErr_Format(PyExc_ValueError, "%s: calls must be at least 1, got %d", op, *calls);
        return NULL;
    }
    pyccl_state *st = get_state(m);
    int ndev = 0;
    if (st == NULL || pyccl_gpu_count(st, op, &ndev) < 0) {
        return NULL;
    }
    if (*device < 0 || *device >= ndev) {
        PyErr_Format(PyExc_ValueError, "%s: device must be 0 to %d (the GPUs there are), got %d",
                     op, ndev - 1, *device);
        return NULL;
    }
    return st;
}

/* _ar_launch_floor(device, stream, calls, pdl) -> float: host microseconds
 * per launch of an empty kernel with the own kernels' parameter block,
 * `calls` back to back on `stream` (a cudaStream_t as an int), the way the
 * own kernels launch (pdl: with programmatic dependent launch). */
static PyObject *
ar_launch_floor(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    const char *op = "_ar_launch_floor";
    int device, calls, pdl;
    void *stream;
    pyccl_state *st;
    if (pyccl_check_nargs(op, nargs, 4) < 0 ||
        (st = read_timing_args(m, op, args, &device, &stream, &calls)) == NULL ||
        (pdl = PyObject_IsTrue(args[3])) < 0) {
        return NULL;
    }
    double us = pyccl_ar_launch_floor(st, op, device, (cudaStream_t)stream, calls, pdl);
    return us < 0 ? NULL : PyFloat_FromDouble(us);
}

/* _watch_costs(device, stream, calls) -> {name: float}: host microseconds
 * per call of what a call on a communicator with a timeout adds (the
 * benchmark's --host-breakdown), each `calls` times back to back in C. */
static PyObject *
watch_costs(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    const char *op = "_watch_costs";
    int device, calls;
    void *stream;
    pyccl_state *st;
    double us[PYCCL_WATCH_COSTS];
    if (pyccl_check_nargs(op, nargs, 3) < 0 ||
        (st = read_timing_args(m, op, args, &device, &stream, &calls)) == NULL ||
        pyccl_watch_costs(st, op, device, (cudaStream_t)stream, calls, us) < 0) {
        return NULL;
    }
    PyObject *d = PyDict_New();
    for (int k = 0; d != NULL && k < PYCCL_WATCH_COSTS; k++) {
        PyObject *v = PyFloat_FromDouble(us[k]);
        if (v == NULL || PyDict_SetItemString(d, pyccl_watch_cost_names[k], v) < 0) {
            Py_XDECREF(v);
            Py_CLEAR(d);
            break;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *
ar_fatbin(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    const unsigned char *image;
    size_t n = pyccl_ar_image(&image);
    if (n == 0) {
        Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize((const char *)image, (Py_ssize_t)n);
}

PyMethodDef pyccl_nccl_methods[] = {
    {"_nccl_init_ranks", (PyCFunction)(void (*)(void))nccl_init_ranks,
     METH_FASTCALL,
     "_nccl_init_ranks(world_size, unique_id, ranks, devices) -> [Communicator]"},
    {"_nccl_group_start", nccl_group_start, METH_NOARGS, "ncclGroupStart()"},
    {"_nccl_group_end", nccl_group_end, METH_NOARGS, "ncclGroupEnd()"},
    {"_ar_built", ar_built, METH_NOARGS,
     "Whether pyccl's own all-reduce kernels were compiled in (nvcc at build time)."},
    {"_ar_launch_floor", (PyCFunction)(void (*)(void))ar_launch_floor, METH_FASTCALL,
     "_ar_launch_floor(device, stream, calls, pdl) -> float: host us per launch of an empty "
     "kernel with the own kernels' parameter block, as they launch (the benchmark's floor)."},
    {"_watch_costs", (PyCFunction)(void (*)(void))watch_costs, METH_FASTCALL,
     "_watch_costs(device, stream, calls) -> {name: float}: host us per call of what a call on a "
     "communicator with a timeout adds, each measured back to back in C (--host-breakdown)."},
    {"_ar_fatbin", ar_fatbin, METH_NOARGS,
     "The own all-reduce kernels' fatbin as compiled in (bytes), or None (tests/_ar_sim.py)."},
    {"_nccl_version", nccl_version, METH_NOARGS,
     "NCCL version code of the loaded library (e.g. 22809)."},
    {"_nccl_version_suffix", nccl_version_suffix, METH_NOARGS,
     "NCCL version suffix as bytes."},
    {"_nccl_unique_id", nccl_unique_id, METH_NOARGS,
     "A fresh ncclUniqueId as 128 bytes."},
    {"_nccl_init_rank", (PyCFunction)(void (*)(void))nccl_init_rank,
     METH_FASTCALL, "_nccl_init_rank(nranks, unique_id, rank) -> Communicator"},
    {"_nccl_all_reduce", (PyCFunction)(void (*)(void))nccl_all_reduce,
     METH_FASTCALL, "_nccl_all_reduce(inputs, outputs, op, streams, comms)"},
    {"_nccl_reduce", (PyCFunction)(void (*)(void))nccl_reduce, METH_FASTCALL,
     "_nccl_reduce(inputs, output, root, op, streams, comms)"},
    {"_nccl_broadcast", (PyCFunction)(void (*)(void))nccl_broadcast,
     METH_FASTCALL, "_nccl_broadcast(inputs, root, streams, comms)"},
    {"_nccl_all_gather", (PyCFunction)(void (*)(void))nccl_all_gather,
     METH_FASTCALL, "_nccl_all_gather(inputs, outputs, streams, comms)"},
    {"_nccl_reduce_scatter", (PyCFunction)(void (*)(void))nccl_reduce_scatter,
     METH_FASTCALL, "_nccl_reduce_scatter(inputs, outputs, op, streams, comms)"},
    {NULL, NULL, 0, NULL},
};
