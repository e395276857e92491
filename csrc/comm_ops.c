/* The collective methods of pyccl.Communicator (the per-rank API), and the
 * reading and checking that every method shares (comm_ops.h).
 *
 * Each method: parse (fast call, keywords by name) -> read the arrays (a CUDA
 * torch.Tensor, or __cuda_array_interface__) -> check them against this
 * communicator (device, dtype, sizes, ranks) -> pyccl_task rows ->
 * pyccl_enqueue (timeouts.h).  Collectives with per-peer buffers (list outputs here;
 * all_to_all, gather, scatter in comm_p2p.c) become one NCCL group of
 * broadcast/reduce or send/recv rows, so they stay zero-copy.  split() is
 * comm_split.c's. */
#include "comm_ops.h"
#include "communicator.h"
#include "ar.h"
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "tensor.h"
#include "args.h"
#include "errors.h"

#include <limits.h>
#include <string.h>

/* ---------------- shared reading and checks (comm_ops.h) ---------------- */

int
ops_ctx_init(call_ctx *x, PyObject *self, const char *op)
{
    x->op = op;
    x->c = (pyccl_comm *)self;
    x->st = pyccl_state_of_type(Py_TYPE(self));
    if (x->st == NULL || pyccl_comm_alive(x->st, op, x->c) < 0 ||
        pyccl_comm_refresh(x->st, op, x->c) < 0) {
        return -1;
    }
    return 0;
}

/* Read an array that must live on this communicator's device. */
int
ops_read_on_comm(call_ctx *x, const char *what, PyObject *obj, pyccl_tensor *t)
{
    if (pyccl_read_array(x->st, x->op, what, obj, t) < 0) {
        return -1;
    }
    if (t->device < 0) { /* empty CUDA-array-interface array: no pointer */
        t->device = x->c->device;
    }
    if (t->device != x->c->device) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s is on cuda:%d but the communicator (rank %d) is "
                     "on cuda:%d",
                     x->op, what, t->device, x->c->rank, x->c->device);
        return -1;
    }
    return 0;
}

int
ops_same_dtype(call_ctx *x, const char *what, const pyccl_tensor *t,
           const char *ref_what, const pyccl_tensor *ref)
{
    /* table rows when known: a dtype this torch lacks has no object */
    int same = t->dtype >= 0 || ref->dtype >= 0
                   ? t->dtype == ref->dtype
                   : t->itemsize == ref->itemsize &&
                         strcmp(t->dtype_name, ref->dtype_name) == 0;
    if (!same) {
        PyObject *a = pyccl_dtype_name(t), *b = pyccl_dtype_name(ref);
        if (a != NULL && b != NULL) {
            PyErr_Format(PyExc_TypeError, "%s: %s has dtype %U but %s has %U",
                         x->op, what, a, ref_what, b);
        }
        Py_XDECREF(a);
        Py_XDECREF(b);
        return -1;
    }
    return 0;
}

int
ops_numel_is(call_ctx *x, const char *what, const pyccl_tensor *t,
             int64_t want, const char *why)
{
    if (t->numel != want) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s has %lld elements, expected %lld (%s)", x->op,
                     what, (long long)t->numel, (long long)want, why);
        return -1;
    }
    return 0;
}

/* out= and tensor: the same buffer (in place) or apart. */
static int
same_or_apart(call_ctx *x, const pyccl_tensor *out, const pyccl_tensor *t)
{
    return pyccl_check_overlap(x->op, "out", out, "tensor", t, 0,
                               "the same memory");
}

/* The small side of all_gather (input) / reduce_scatter (output) against the
 * big side: one array (small exactly at this rank's slot, or apart), or a
 * list (small is list[rank] itself, or apart from every item). */
static int
slot_or_apart(call_ctx *x, const char *small_what, const pyccl_tensor *small,
              const char *big_what, const pyccl_tensor *big,
              const pyccl_tensor *list)
{
    char what[64], tail[160];
    int me = x->c->rank;
    if (list == NULL) {
        PyOS_snprintf(tail, sizeof tail, "rank %d's slot of it", me);
        /* big holds size x small's elements (checked): this fits */
        return pyccl_check_overlap(x->op, small_what, small, big_what, big,
                                   (int64_t)me * small->nbytes, tail);
    }
    for (int r = 0; r < x->c->size; r++) {
        PyOS_snprintf(what, sizeof what, "%s[%d]", big_what, r);
        PyOS_snprintf(tail, sizeof tail, "only %s[%d] may share memory with "
                      "%s (in place)", big_what, me, small_what);
        if (pyccl_check_overlap(x->op, small_what, small, what, &list[r],
                                r == me ? 0 : -1,
                                r == me ? "the same memory" : tail) < 0) {
            return -1;
        }
    }
    return 0;
}

int
ops_read_rank(call_ctx *x, const char *what, PyObject *obj, int *out)
{
    int r = pyccl_read_bounded(x->op, what, obj, 0, x->c->size - 1, out);
    if (r > 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s=%S is out of range for a communicator of size %d "
                     "(ranks are 0..%d)",
                     x->op, what, obj, x->c->size, x->c->size - 1);
        return -1;
    }
    return r;
}

int
ops_stream(call_ctx *x, PyObject *stream, cudaStream_t *out)
{
    /* the owner is named only when a given stream is on another device; the
     * usual stream=None path skips the formatting (it runs on every call) */
    char owner[48] = "";
    if (stream != NULL && stream != Py_None) {
        PyOS_snprintf(owner, sizeof owner, "the communicator (rank %d)", x->c->rank);
    }
    return pyccl_stream(x->st, x->op, "stream", stream, x->c->device, owner, out);
}

/* IEEE half and bfloat16 from float, round to nearest even. */
static uint16_t
float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) { /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0));
    }
    if (mag >= 0x477ff000u) { /* rounds past the largest half */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (mag < 0x38800000u) { /* subnormal half or zero */
        float a;
        memcpy(&a, &mag, 4);
        /* 2^-24 is the subnormal step: adding 0.5 (2^-1) aligns the bits */
        a += 0.5f;
        uint32_t r;
        memcpy(&r, &a, 4);
        return (uint16_t)(sign | (r - 0x3f000000u));
    }
    uint32_t odd = (mag >> 13) & 1u;
    mag += 0xc8000fffu + odd; /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (mag >> 13));
}

static uint16_t
float_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((x >> 16) | 0x40u); /* quiet nan */
    }
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* An op argument: any spelling pyccl_read_redop takes, or a
 * pyccl.premul_sum(scalar), checked here and kept in x->premul (*made set,
 * *redop -1): the enqueue makes it into an NCCL op for this comm and dtype,
 * under the communicator's lock, and destroys it after enqueueing. */
static int
read_op(call_ctx *x, PyObject *obj, const pyccl_tensor *t, int type,
        int *redop, int *made)
{
    *made = 0;
    if (obj == NULL) {
        *redop = ncclSum;
        return 0;
    }
    PyObject *scalar = NULL;
    int got = pyccl_read_redop(x->st, x->op, obj, PYCCL_OP_PREMUL, redop, &scalar);
    if (got <= 0) {
        return got;
    }
    /* pyccl.premul_sum made the scalar a float; an object of the user's own
     * with a premul_scalar attribute may hold anything */
    double v = PyFloat_AsDouble(scalar);
    if (v == -1.0 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyObject *bits = PyLong_Check(scalar) ? PyObject_CallMethod(scalar, "bit_length", NULL)
                                                  : NULL;
            if (bits != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "%s: op.premul_scalar is an int of %S bits, too large for a float",
                             x->op, bits);
                Py_DECREF(bits);
            }
            else if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError,
                             "%s: op.premul_scalar (a %.200s) is too large for a float", x->op,
                             Py_TYPE(scalar)->tp_name);
            }
        }
        else if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: op.premul_scalar must be a real number, got %.200s",
                         x->op, Py_TYPE(scalar)->tp_name);
        }
        Py_DECREF(scalar);
        return -1;
    }
    Py_DECREF(scalar);
    /* An integer dtype is scaled by an integer: a fraction, NaN or a value
     * out of the dtype's range would be truncated (or undefined in C). */
    long long lo = 0;
    unsigned long long hi = 0;
    double end = 0; /* 2^bits (unsigned) or 2^(bits-1): exact doubles */
    switch (type) {
    case ncclInt8: lo = INT8_MIN; hi = INT8_MAX; end = 128.0; break;
    case ncclUint8: hi = UINT8_MAX; end = 256.0; break;
    case ncclInt32: lo = INT32_MIN; hi = INT32_MAX; end = 2147483648.0; break;
    case ncclUint32: hi = UINT32_MAX; end = 4294967296.0; break;
    case ncclInt64: lo = INT64_MIN; hi = INT64_MAX; end = 9223372036854775808.0; break;
    case ncclUint64: hi = UINT64_MAX; end = 18446744073709551616.0; break;
    default: break;
    }
    if (end > 0 &&
        !(v >= (double)lo && v < end &&
          (type == ncclUint64 ? (double)(uint64_t)v : (double)(int64_t)v) == v)) {
        PyObject *name = pyccl_dtype_name(t);
        if (name != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %R needs a whole-number scalar from %lld to %llu "
                         "for %U", x->op, obj, lo, hi, name);
            Py_DECREF(name);
        }
        return -1;
    }
    union {
        double f64;
        float f32;
        uint16_t u16;
        int8_t i8;
        uint8_t u8;
        int32_t i32;
        uint32_t u32;
        int64_t i64;
        uint64_t u64;
    } buf;
    switch (type) {
    case ncclFloat64: buf.f64 = v; break;
    case ncclFloat32: buf.f32 = (float)v; break;
    case ncclFloat16: buf.u16 = float_to_half((float)v); break;
    case ncclBfloat16: buf.u16 = float_to_bf16((float)v); break;
    case ncclInt8: buf.i8 = (int8_t)v; break;
    case ncclUint8: buf.u8 = (uint8_t)v; break;
    case ncclInt32: buf.i32 = (int32_t)v; break;
    case ncclUint32: buf.u32 = (uint32_t)v; break;
    case ncclInt64: buf.i64 = (int64_t)v; break;
    case ncclUint64: buf.u64 = (uint64_t)v; break;
    default:
        PyObject *name = pyccl_dtype_name(t);
        if (name != NULL) {
            PyErr_Format(PyExc_TypeError, "%s: premul_sum does not support %U",
                         x->op, name);
            Py_DECREF(name);
        }
        return -1;
    }
    if (x->st->api.ncclRedOpCreatePreMulSum == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: premul_sum needs NCCL >= 2.11", x->op);
        return -1;
    }
    /* made into an NCCL op by the enqueue, under the communicator's lock */
    x->premul.type = type;
    memcpy(x->premul.scalar, &buf, sizeof buf);
    *redop = -1;
    *made = 1;
    return 0;
}

PyObject *
ops_finish(call_ctx *x, const pyccl_task *tasks, Py_ssize_t n, int redop,
           int made)
{
    if (n == 0) {
        Py_RETURN_NONE; /* nothing to move: NCCL is not called */
    }
    /* The last user code (array attributes, stream, op) has run: the call
     * begins now, so a communicator that code destroyed or aborted is
     * reported, not used.  The tasks hold c->comm as it was when they were
     * made, after that code. */
    if (pyccl_call_run(x->st, x->op, x->c, tasks, n, redop, made ? &x->premul : NULL) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

void
ops_task(pyccl_task *t, pyccl_coll coll, const void *send, void *recv,
         size_t count, int type, int peer, call_ctx *x, cudaStream_t s)
{
    t->coll = coll;
    t->send = send;
    t->recv = recv;
    t->count = count;
    t->type = type;
    t->peer = peer;
    t->comm = x->c->comm;
    t->stream = s;
}

/* A list/tuple of exactly `size` arrays like `ref` (same dtype, `numel`
 * elements each), or NULL-with-no-error when obj is not a list/tuple.  It is
 * read from a private tuple (*keep, which the caller releases after the
 * enqueue): the arrays' attributes are user code, which may change the
 * caller's list, and the tuple keeps every array alive for the call. */
pyccl_tensor *
ops_read_list(call_ctx *x, const char *what, PyObject *obj,
              const pyccl_tensor *ref, const char *ref_what, int64_t numel,
              PyObject **keep)
{
    *keep = NULL;
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(obj);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (n != x->c->size) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s has %zd tensors, expected %d (one per rank)",
                     x->op, what, n, x->c->size);
        Py_DECREF(seq);
        return NULL;
    }
    pyccl_tensor *ts = PyMem_Calloc((size_t)n, sizeof(pyccl_tensor));
    if (ts == NULL) {
        PyErr_NoMemory();
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char name[64];
        PyOS_snprintf(name, sizeof name, "%s[%zd]", what, i);
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (ops_read_on_comm(x, name, item, &ts[i]) < 0 ||
            ops_same_dtype(x, name, &ts[i], ref_what, ref) < 0 ||
            ops_numel_is(x, name, &ts[i], numel, "one chunk per rank") < 0) {
            PyMem_Free(ts);
            Py_DECREF(seq);
            return NULL;
        }
    }
    *keep = seq;
    return ts;
}

/* ---------------- the methods ---------------- */

/* all_reduce(tensor, op=SUM, *, out=None, stream=None, algo=None) */
PyObject *
pyccl_comm_all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames)
{
    static const char *const names[] = {"tensor", "op", "out", "stream", "algo"};
    PyObject *a[5];
    call_ctx x;
    pyccl_tensor t, o;
    cudaStream_t s;
    int type, redop, made;
    pyccl_algo algo;
    if (pyccl_parse_args("all_reduce", args, nargs, kwnames, names, 5, 2, 1, a) < 0 ||
        ops_ctx_init(&x, self, "all_reduce") < 0 ||
        ops_read_on_comm(&x, "tensor", a[0], &t) < 0) {
        return NULL;
    }
    o = t;
    if (a[2] != NULL && a[2] != Py_None &&
        (ops_read_on_comm(&x, "out", a[2], &o) < 0 ||
         ops_same_dtype(&x, "out", &o, "tensor", &t) < 0 ||
         ops_numel_is(&x, "out", &o, t.numel, "same as tensor") < 0 ||
         same_or_apart(&x, &o, &t) < 0)) {
        return NULL;
    }
    if ((type = pyccl_reduce_type(x.st, x.op, "tensor", &t)) < 0 ||
        ops_stream(&x, a[3], &s) < 0 ||
        pyccl_read_algo(x.op, a[4], 1, &algo) < 0 ||
        read_op(&x, a[1], &t, type, &redop, &made) < 0) {
        return NULL;
    }
    if (made && (algo == PYCCL_ALGO_ONESHOT || algo == PYCCL_ALGO_TWOSHOT)) {
        /* refused before anything is made */
        PyErr_Format(PyExc_ValueError,
                     "all_reduce: algo='%s' supports SUM, MAX and MIN, not premul_sum",
                     algo == PYCCL_ALGO_ONESHOT ? "oneshot" : "twoshot");
        return NULL;
    }
    if (t.numel == 0) {
        Py_RETURN_NONE; /* nothing to move: NCCL is not called */
    }
    pyccl_task tk;
    ops_task(&tk, PYCCL_ALL_REDUCE, t.ptr, o.ptr, (size_t)t.numel, type, 0, &x, s);
    /* one call: begun after the last user code, own kernels or NCCL, ended */
    if (pyccl_call_begin(x.st, x.op, x.c) < 0) {
        return NULL;
    }
    /* premul_sum ops are NCCL's */
    int rc = made ? 0 : pyccl_ar_all_reduce(x.st, x.c, x.op, algo, &t, &o, redop, s);
    if (rc == 0) {
        rc = pyccl_call_submit(x.st, x.op, &tk, 1, redop, made ? &x.premul : NULL, NULL,
                               &x.c, 1);
    }
    pyccl_call_end(x.c);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

/* broadcast(tensor, root, *, out=None, stream=None) and
 * reduce(tensor, root, op=SUM, *, out=None, stream=None) */
static PyObject *
rooted(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
       PyObject *kwnames, int is_reduce)
{
    static const char *const bnames[] = {"tensor", "root", "out", "stream"};
    static const char *const rnames[] = {"tensor", "root", "op", "out", "stream"};
    const char *op = is_reduce ? "reduce" : "broadcast";
    PyObject *a[5];
    PyObject *outobj, *streamobj, *opobj = NULL;
    call_ctx x;
    pyccl_tensor t, o;
    cudaStream_t s;
    int root, type, redop = 0, made = 0;
    size_t count;
    if (is_reduce) {
        if (pyccl_parse_args(op, args, nargs, kwnames, rnames, 5, 3, 2, a) < 0) {
            return NULL;
        }
        opobj = a[2];
        outobj = a[3];
        streamobj = a[4];
    }
    else {
        if (pyccl_parse_args(op, args, nargs, kwnames, bnames, 4, 2, 2, a) < 0) {
            return NULL;
        }
        outobj = a[2];
        streamobj = a[3];
    }
    if (ops_ctx_init(&x, self, op) < 0 || ops_read_on_comm(&x, "tensor", a[0], &t) < 0 ||
        ops_read_rank(&x, "root", a[1], &root) < 0) {
        return NULL;
    }
    o = t;
    if (outobj != NULL && outobj != Py_None &&
        (ops_read_on_comm(&x, "out", outobj, &o) < 0 ||
         ops_same_dtype(&x, "out", &o, "tensor", &t) < 0 ||
         ops_numel_is(&x, "out", &o, t.numel, "same as tensor") < 0 ||
         same_or_apart(&x, &o, &t) < 0)) {
        return NULL;
    }
    if (is_reduce) {
        if ((type = pyccl_reduce_type(x.st, op, "tensor", &t)) < 0) {
            return NULL;
        }
        count = (size_t)t.numel;
    }
    else {
        pyccl_move_type(x.st, &t, &type, &count, (size_t)t.numel);
    }
    if (ops_stream(&x, streamobj, &s) < 0 ||
        (is_reduce && read_op(&x, opobj, &t, type, &redop, &made) < 0)) {
        return NULL;
    }
    pyccl_task tk;
    ops_task(&tk, is_reduce ? PYCCL_REDUCE : PYCCL_BROADCAST, t.ptr, o.ptr, count,
         type, root, &x, s);
    return ops_finish(&x, &tk, count > 0, redop, made);
}

PyObject *
pyccl_comm_broadcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames)
{
    return rooted(self, args, nargs, kwnames, 0);
}

PyObject *
pyccl_comm_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames)
{
    return rooted(self, args, nargs, kwnames, 1);
}

/* The list forms of all_gather and reduce_scatter: one rooted collective a
 * rank r as a group, with list[r] on one side and `mine` on the other
 * (BROADCAST from mine into list[r], REDUCE of list[r] into mine). */
static PyObject *
per_rank(call_ctx *x, pyccl_coll coll, void *mine, const pyccl_tensor *list, size_t count,
         int type, cudaStream_t s, int redop, int made)
{
    pyccl_task *tasks = PyMem_Calloc((size_t)x->c->size, sizeof(pyccl_task));
    if (tasks == NULL) {
        return PyErr_NoMemory();
    }
    for (int r = 0; r < x->c->size; r++) {
        int out = coll == PYCCL_BROADCAST;
        ops_task(&tasks[r], coll, out ? mine : list[r].ptr, out ? list[r].ptr : mine, count,
                 type, r, x, s);
    }
    PyObject *res = ops_finish(x, tasks, count > 0 ? x->c->size : 0, redop, made);
    PyMem_Free(tasks);
    return res;
}

/* One all_gather or reduce_scatter task (rs): pyccl's own kernel where
 * algo='oneshot' asks for it, else NCCL's, as ops_finish. */
static PyObject *
gather_scatter_finish(call_ctx *x, pyccl_task *tk, pyccl_algo algo, const pyccl_tensor *in,
                      const pyccl_tensor *out, int redop, int made, int rs, cudaStream_t s)
{
    if (algo != PYCCL_ALGO_ONESHOT) {
        return ops_finish(x, tk, tk->count > 0, redop, made);
    }
    if (tk->count == 0) {
        Py_RETURN_NONE; /* nothing to move */
    }
    /* one call: begun after the last user code, the own kernel or NCCL, ended */
    if (pyccl_call_begin(x->st, x->op, x->c) < 0) {
        return NULL;
    }
    int rc = pyccl_ar_gather_scatter(x->st, x->c, x->op, algo, in, out, redop, rs, s);
    if (rc == 0) {
        rc = pyccl_call_submit(x->st, x->op, tk, 1, redop, made ? &x->premul : NULL, NULL,
                               &x->c, 1);
    }
    pyccl_call_end(x->c);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

/* all_gather(input, output, *, stream=None, algo=None): output is one array
 * of size x input elements, or a list of size arrays (a group of
 * broadcasts); algo='oneshot' asks for pyccl's kernel (one output array). */
PyObject *
pyccl_comm_all_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames)
{
    static const char *const names[] = {"input", "output", "stream", "algo"};
    PyObject *a[4], *res = NULL, *keep = NULL;
    call_ctx x;
    pyccl_tensor in, out, *list = NULL;
    cudaStream_t s;
    int type;
    size_t count;
    int64_t whole;
    pyccl_algo algo;
    if (pyccl_parse_args("all_gather", args, nargs, kwnames, names, 4, 2, 2, a) < 0 ||
        ops_ctx_init(&x, self, "all_gather") < 0 ||
        ops_read_on_comm(&x, "input", a[0], &in) < 0 ||
        ops_stream(&x, a[2], &s) < 0 ||
        pyccl_read_algo(x.op, a[3], 0, &algo) < 0) {
        return NULL;
    }
    pyccl_move_type(x.st, &in, &type, &count, (size_t)in.numel);
    list = ops_read_list(&x, "output", a[1], &in, "input", in.numel, &keep);
    if (list == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (list != NULL && algo == PYCCL_ALGO_ONESHOT) {
        PyErr_SetString(PyExc_ValueError,
                        "all_gather: algo='oneshot' needs one output tensor, not a list");
        goto done;
    }
    if (list == NULL) {
        if (ops_read_on_comm(&x, "output", a[1], &out) < 0 ||
            ops_same_dtype(&x, "output", &out, "input", &in) < 0 ||
            pyccl_mul_size(x.op, "input", in.numel, x.c->size, "the world size",
                           &whole) < 0 ||
            ops_numel_is(&x, "output", &out, whole, "input size x world size") < 0 ||
            slot_or_apart(&x, "input", &in, "output", &out, NULL) < 0) {
            return NULL;
        }
        pyccl_task tk;
        ops_task(&tk, PYCCL_ALL_GATHER, in.ptr, out.ptr, count, type, 0, &x, s);
        return gather_scatter_finish(&x, &tk, algo, &in, &out, 0, 0, 0, s);
    }
    if (slot_or_apart(&x, "input", &in, "output", NULL, list) < 0) {
        goto done;
    }
    res = per_rank(&x, PYCCL_BROADCAST, in.ptr, list, count, type, s, 0, 0);
done:
    PyMem_Free(list);
    Py_XDECREF(keep);
    return res;
}

/* reduce_scatter(input, output, op=SUM, *, stream=None, algo=None): input
 * is one array of size x output elements, or a list of size arrays (a group
 * of reduces); algo='oneshot' asks for pyccl's kernel (one input array). */
PyObject *
pyccl_comm_reduce_scatter(PyObject *self, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"input", "output", "op", "stream", "algo"};
    PyObject *a[5], *res = NULL, *keep = NULL;
    call_ctx x;
    pyccl_tensor in, out, *list = NULL;
    cudaStream_t s;
    int type, redop, made = 0;
    int64_t whole;
    pyccl_algo algo;
    if (pyccl_parse_args("reduce_scatter", args, nargs, kwnames, names, 5, 3, 2, a) < 0 ||
        ops_ctx_init(&x, self, "reduce_scatter") < 0 ||
        ops_read_on_comm(&x, "output", a[1], &out) < 0 ||
        ops_stream(&x, a[3], &s) < 0 ||
        pyccl_read_algo(x.op, a[4], 0, &algo) < 0) {
        return NULL;
    }
    list = ops_read_list(&x, "input", a[0], &out, "output", out.numel, &keep);
    if (list == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (list != NULL && algo == PYCCL_ALGO_ONESHOT) {
        PyErr_SetString(PyExc_ValueError,
                        "reduce_scatter: algo='oneshot' needs one input tensor, not a list");
        goto done;
    }
    if (list == NULL &&
        (ops_read_on_comm(&x, "input", a[0], &in) < 0 ||
         ops_same_dtype(&x, "output", &out, "input", &in) < 0 ||
         pyccl_mul_size(x.op, "output", out.numel, x.c->size, "the world size",
                        &whole) < 0 ||
         ops_numel_is(&x, "input", &in, whole, "output size x world size") < 0)) {
        goto done;
    }
    if (slot_or_apart(&x, "output", &out, "input", &in, list) < 0) {
        goto done;
    }
    if ((type = pyccl_reduce_type(x.st, x.op, "output", &out)) < 0 ||
        read_op(&x, a[2], &out, type, &redop, &made) < 0) {
        goto done;
    }
    if (made && algo == PYCCL_ALGO_ONESHOT) {
        /* refused before anything is made */
        PyErr_SetString(PyExc_ValueError,
                        "reduce_scatter: algo='oneshot' supports SUM, MAX and MIN, not premul_sum");
        goto done;
    }
    if (!made) {
        redop = pyccl_reduce_scatter_op(redop, x.c->size);
    }
    size_t count = (size_t)out.numel;
    if (list == NULL) {
        pyccl_task tk;
        ops_task(&tk, PYCCL_REDUCE_SCATTER, in.ptr, out.ptr, count, type, 0, &x, s);
        res = gather_scatter_finish(&x, &tk, algo, &in, &out, redop, made, 1, s);
        goto done;
    }
    res = per_rank(&x, PYCCL_REDUCE, out.ptr, list, count, type, s, redop, made);
done:
    PyMem_Free(list);
    Py_XDECREF(keep);
    return res;
}

/* barrier(*, stream=None): a one-element all-reduce on this communicator,
 * then wait for it on the host. */
PyObject *
pyccl_comm_barrier(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames)
{
    static const char *const names[] = {"stream"};
    PyObject *a[1];
    call_ctx x;
    cudaStream_t s;
    if (pyccl_parse_args("barrier", args, nargs, kwnames, names, 1, 0, 0, a) < 0 ||
        ops_ctx_init(&x, self, "barrier") < 0 || ops_stream(&x, a[0], &s) < 0) {
        return NULL;
    }
    if (pyccl_group_depth() > 0) {
        /* a group's work runs at its end: nothing to wait for yet */
        PyErr_SetString(PyExc_RuntimeError,
                        "barrier: cannot wait inside pyccl.group(); call it after the group ends");
        return NULL;
    }
    if (pyccl_call_begin(x.st, "barrier", x.c) < 0) { /* after the stream's code */
        return NULL;
    }
    const pyccl_api *api = &x.st->api;
    pyccl_comm *c = x.c;
    cudaError_t ce = cudaSuccess;
    if (c->scratch == NULL) {
        int prev;
        void *mem = NULL;
        Py_BEGIN_ALLOW_THREADS
        pyccl_device_enter(api, c->device, &prev);
        ce = api->cudaMalloc(&mem, sizeof(float));
        pyccl_device_leave(api, c->device, prev);
        Py_END_ALLOW_THREADS
        if (ce != cudaSuccess) {
            pyccl_call_end(c);
            pyccl_raise_cuda(x.st, "barrier", "cudaMalloc", ce);
            return NULL;
        }
        if (c->scratch == NULL) { /* another thread may have won the race */
            c->scratch = mem;
        }
        else {
            api->cudaFree(mem);
        }
    }
    pyccl_task tk;
    ops_task(&tk, PYCCL_ALL_REDUCE, c->scratch, c->scratch, 1, ncclFloat32, 0, &x, s);
    int rc = pyccl_call_submit(x.st, "barrier", &tk, 1, ncclSum, NULL, NULL, &c, 1);
    if (rc == 0) {
        rc = ops_wait_call(&x, s);
    }
    pyccl_call_end(c);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

int
ops_wait_call(call_ctx *x, cudaStream_t s)
{
    /* bounded by the communicator's timeout where it has one; Ctrl-C ends
     * it as it ends wait()'s (a stream synchronize could not be interrupted
     * while a peer is gone) */
    return pyccl_wait_stream(x->st, x->op, x->c, s);
}

/* flat.all_reduce through the method itself (its algo, timeout and checks
 * all apply): `a1` the op or NULL, `algo` or NULL.  0, or -1 raised. */
static int
all_reduce_flat(PyObject *self, PyObject *flat, PyObject *a1, PyObject *algo)
{
    PyObject *call[4] = {self, flat, a1, NULL};
    PyObject *kw = NULL;
    Py_ssize_t np = a1 ? 3 : 2;
    if (algo != NULL) {
        call[np] = algo;
        kw = Py_BuildValue("(s)", "algo");
        if (kw == NULL) {
            return -1;
        }
    }
    PyObject *name = PyUnicode_FromString("all_reduce");
    PyObject *r = NULL;
    if (name != NULL) {
        r = PyObject_VectorcallMethod(name, call, (size_t)np, kw);
        Py_DECREF(name);
    }
    Py_XDECREF(kw);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* all_reduce_coalesced(tensors, op=SUM, *, algo=None): pack, one collective,
 * unpack, all on the current stream.  With pyccl's kernels loaded on the
 * device, the pack and unpack are one launch of its copy kernel each (per
 * PYCCL_COPY_MAX tensors) into and out of a buffer made with
 * tensors[0].new_empty(total); without them, torch's (flatten_dense_tensors,
 * then _foreach_copy_ of unflatten_dense_tensors' views: in C++, but an
 * operator per tensor). */
PyObject *
pyccl_comm_all_reduce_coalesced(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    static const char *const names[] = {"tensors", "op", "algo"};
    const char *op = "all_reduce_coalesced";
    PyObject *a[3];
    call_ctx x;
    if (pyccl_parse_args(op, args, nargs, kwnames, names, 3, 2, 1, a) < 0 ||
        ops_ctx_init(&x, self, op) < 0) {
        return NULL;
    }
    if (!PyList_Check(a[0]) && !PyTuple_Check(a[0])) {
        PyErr_Format(PyExc_TypeError, "%s: tensors must be a list or tuple of tensors, got %.200s",
                     op, Py_TYPE(a[0])->tp_name);
        return NULL;
    }
    /* a private tuple: each tensor's own code may change the caller's list */
    PyObject *tensors = PySequence_Tuple(a[0]);
    if (tensors == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    if (n == 0) {
        Py_DECREF(tensors);
        Py_RETURN_NONE;
    }
    pyccl_tensor *ts = PyMem_Calloc((size_t)n, sizeof *ts), ft;
    PyObject *flatten, *unflatten, *copy, *flat = NULL, *parts = NULL, *r = NULL;
    long long total = 0;
    cudaStream_t s;
    if (ts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char name[64];
        PyOS_snprintf(name, sizeof name, "tensors[%zd]", i);
        PyObject *item = PyTuple_GET_ITEM(tensors, i);
        if (!pyccl_is_tensor(x.st, item)) {
            PyErr_Format(PyExc_TypeError, "%s: %s must be a torch.Tensor, got %.200s", op, name,
                         Py_TYPE(item)->tp_name);
            goto done;
        }
        if (ops_read_on_comm(&x, name, item, &ts[i]) < 0 ||
            (i && ops_same_dtype(&x, name, &ts[i], "tensors[0]", &ts[0]) < 0)) {
            goto done;
        }
        if (__builtin_add_overflow(total, (long long)ts[i].numel, &total)) {
            PyErr_Format(PyExc_ValueError, "%s: the tensors hold more than 2**63-1 elements together",
                         op);
            goto done;
        }
    }
    if (pyccl_reduce_type(x.st, op, "tensors[0]", &ts[0]) < 0) {
        goto done;
    }
    if (pyccl_ar_copy_usable(x.st, x.c->device)) {
        if ((flat = PyObject_CallMethod(ts[0].obj, "new_empty", "(L)", total)) == NULL ||
            ops_read_on_comm(&x, "the packed buffer", flat, &ft) < 0 ||
            pyccl_stream(x.st, op, "stream", NULL, x.c->device, "tensors", &s) < 0 ||
            pyccl_ar_copy_list(x.st, op, x.c->device, s, ft.ptr, ts, n, 1) < 0 ||
            all_reduce_flat(self, flat, a[1], a[2]) < 0 ||
            pyccl_ar_copy_list(x.st, op, x.c->device, s, ft.ptr, ts, n, 0) < 0) {
            goto done;
        }
        r = Py_NewRef(Py_None);
        goto done;
    }
    if (pyccl_torch_pack(x.st, &flatten, &unflatten, &copy) < 0 ||
        (flat = PyObject_CallOneArg(flatten, tensors)) == NULL ||
        all_reduce_flat(self, flat, a[1], a[2]) < 0 ||
        (parts = PyObject_CallFunctionObjArgs(unflatten, flat, tensors, NULL)) == NULL ||
        (r = PyObject_CallFunctionObjArgs(copy, tensors, parts, NULL)) == NULL) {
        goto done;
    }
    Py_SETREF(r, Py_NewRef(Py_None));
done:
    PyMem_Free(ts);
    Py_XDECREF(tensors);
    Py_XDECREF(flat);
    Py_XDECREF(parts);
    return r;
}
