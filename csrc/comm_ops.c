/* The collective methods of pyccl.Communicator (the per-rank API).
 *
 * Each method: parse (fast call, keywords by name) -> read the arrays (a CUDA
 * torch.Tensor, or __cuda_array_interface__) -> check them against this
 * communicator (device, dtype, sizes, ranks) -> pyccl_task rows ->
 * pyccl_enqueue.  Collectives with per-peer buffers (list outputs,
 * all_to_all, gather, scatter) become one NCCL group of broadcast/reduce or
 * send/recv rows, so they stay zero-copy. */
#include "pyccl.h"
#include "args.h"

#include <limits.h>
#include <string.h>

/* ---------------- argument parsing ---------------- */

/* ---------------- shared checks ---------------- */

typedef struct {
    pyccl_state *st;
    pyccl_comm *c;
    const char *op;
} call_ctx;

static int
ctx_init(call_ctx *x, PyObject *self, const char *op)
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
static int
read_on_comm(call_ctx *x, const char *what, PyObject *obj, pyccl_tensor *t)
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

static int
same_dtype(call_ctx *x, const char *what, const pyccl_tensor *t,
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

static int
numel_is(call_ctx *x, const char *what, const pyccl_tensor *t, int64_t want,
         const char *why)
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

static int
read_rank(call_ctx *x, const char *what, PyObject *obj, int *out)
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

static int
get_stream(call_ctx *x, PyObject *stream, cudaStream_t *out)
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

/* An op argument: an int (SUM..AVG, or an op NCCL knows on this comm), or a
 * pyccl.premul_sum(scalar), made into an NCCL op for this comm and dtype.
 * *made is set when the caller must ncclRedOpDestroy it after enqueueing. */
static int
read_op(call_ctx *x, PyObject *obj, const pyccl_tensor *t, int type,
        int *redop, int *made)
{
    *made = 0;
    if (obj == NULL) {
        *redop = ncclSum;
        return 0;
    }
    if (PyLong_Check(obj) && !PyBool_Check(obj)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow || v < 0 || v > ncclAvg) {
            PyErr_Format(PyExc_ValueError,
                         "%s: op=%S is not a reduction op (SUM=0, PROD=1, "
                         "MAX=2, MIN=3, AVG=4, or pyccl.premul_sum(x))",
                         x->op, obj);
            return -1;
        }
        *redop = (int)v;
        return 0;
    }
    PyObject *scalar;
    if (PyObject_GetOptionalAttr(obj, x->st->s_premul, &scalar) < 0) {
        return -1;
    }
    if (scalar == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "%s: op must be pyccl.SUM/PROD/MAX/MIN/AVG or "
                     "pyccl.premul_sum(x), got %.200s",
                     x->op, Py_TYPE(obj)->tp_name);
        return -1;
    }
    double v = PyFloat_AsDouble(scalar);
    Py_DECREF(scalar);
    if (v == -1.0 && PyErr_Occurred()) {
        return -1;
    }
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
    ncclRedOp_t op;
    /* the scalar's own code may have destroyed the communicator; with a
     * timeout: not while the watchdog may abort the handle */
    if (pyccl_comm_alive(x->st, x->op, x->c) < 0 ||
        pyccl_comm_enter(x->st, x->op, x->c) < 0) {
        return -1;
    }
    ncclResult_t r = x->st->api.ncclRedOpCreatePreMulSum(
        &op, &buf, (ncclDataType_t)type, ncclScalarHostImmediate, x->c->comm);
    pyccl_comm_leave(x->c);
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    if (pyccl_nccl_failed(&x->st->api, r, x->c->comm, last, sizeof last)) {
        pyccl_raise_nccl(x->st, x->op, r, last);
        return -1;
    }
    *redop = (int)op;
    *made = 1;
    return 0;
}

/* ncclRedOpDestroy of a premul_sum op made for this call (NCCL allows it
 * once the call that used it returned); not on an aborted handle. */
static void
destroy_op(call_ctx *x, int redop)
{
    PyObject *exc = PyErr_GetRaisedException();
    if (pyccl_comm_enter(x->st, x->op, x->c) == 0) {
        if (x->c->comm != NULL) {
            x->st->api.ncclRedOpDestroy((ncclRedOp_t)redop, x->c->comm);
        }
        pyccl_comm_leave(x->c);
    }
    PyErr_Clear();
    PyErr_SetRaisedException(exc);
}

static PyObject *
finish(call_ctx *x, const pyccl_task *tasks, Py_ssize_t n, int redop, int made)
{
    int rc = 0;
    /* The last user code (array attributes, stream, op) has run: a
     * communicator it destroyed or aborted is reported here, not by NCCL.
     * The tasks hold c->comm as it was when they were made, after that code. */
    if (n > 0 && pyccl_comm_alive(x->st, x->op, x->c) < 0) {
        if (made) {
            destroy_op(x, redop);
        }
        return NULL;
    }
    if (n > 0) {
        x->c->inflight++; /* another thread's destroy() must wait for this */
        if (x->c->watch != NULL) {
            rc = pyccl_enqueue_timed(x->st, x->op, tasks, n, redop, &x->c, 1);
        }
        else if ((rc = pyccl_comm_note_stream(x->c, tasks[0].stream)) == 0) {
            rc = pyccl_enqueue(x->st, x->op, tasks, n, redop, NULL, &x->c, 1);
        }
        x->c->inflight--;
    }
    if (made) {
        destroy_op(x, redop);
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static void
task(pyccl_task *t, pyccl_coll coll, const void *send, void *recv,
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
static pyccl_tensor *
read_list(call_ctx *x, const char *what, PyObject *obj,
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
        if (read_on_comm(x, name, item, &ts[i]) < 0 ||
            same_dtype(x, name, &ts[i], ref_what, ref) < 0 ||
            numel_is(x, name, &ts[i], numel, "one chunk per rank") < 0) {
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
        ctx_init(&x, self, "all_reduce") < 0 ||
        read_on_comm(&x, "tensor", a[0], &t) < 0) {
        return NULL;
    }
    o = t;
    if (a[2] != NULL && a[2] != Py_None &&
        (read_on_comm(&x, "out", a[2], &o) < 0 ||
         same_dtype(&x, "out", &o, "tensor", &t) < 0 ||
         numel_is(&x, "out", &o, t.numel, "same as tensor") < 0 ||
         same_or_apart(&x, &o, &t) < 0)) {
        return NULL;
    }
    if ((type = pyccl_reduce_type(x.st, x.op, &t)) < 0 ||
        get_stream(&x, a[3], &s) < 0 ||
        pyccl_read_algo(x.op, a[4], &algo) < 0 ||
        read_op(&x, a[1], &t, type, &redop, &made) < 0) {
        return NULL;
    }
    if (!made) { /* premul_sum ops are NCCL's */
        int done = pyccl_fastar_all_reduce(x.st, x.c, x.op, algo, &t, &o, redop, s);
        if (done != 0) {
            return done < 0 ? NULL : Py_NewRef(Py_None);
        }
    } else if (algo == PYCCL_ALGO_ONESHOT || algo == PYCCL_ALGO_TWOSHOT) {
        x.st->api.ncclRedOpDestroy((ncclRedOp_t)redop, x.c->comm);
        PyErr_Format(PyExc_ValueError,
                     "all_reduce: algo='%s' supports SUM, MAX and MIN, not premul_sum",
                     algo == PYCCL_ALGO_ONESHOT ? "oneshot" : "twoshot");
        return NULL;
    }
    pyccl_task tk;
    task(&tk, PYCCL_ALL_REDUCE, t.ptr, o.ptr, (size_t)t.numel, type, 0, &x, s);
    return finish(&x, &tk, t.numel > 0, redop, made);
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
    if (ctx_init(&x, self, op) < 0 || read_on_comm(&x, "tensor", a[0], &t) < 0 ||
        read_rank(&x, "root", a[1], &root) < 0) {
        return NULL;
    }
    o = t;
    if (outobj != NULL && outobj != Py_None &&
        (read_on_comm(&x, "out", outobj, &o) < 0 ||
         same_dtype(&x, "out", &o, "tensor", &t) < 0 ||
         numel_is(&x, "out", &o, t.numel, "same as tensor") < 0 ||
         same_or_apart(&x, &o, &t) < 0)) {
        return NULL;
    }
    if (is_reduce) {
        if ((type = pyccl_reduce_type(x.st, op, &t)) < 0) {
            return NULL;
        }
        count = (size_t)t.numel;
    }
    else {
        pyccl_move_type(x.st, &t, &type, &count, (size_t)t.numel);
    }
    if (get_stream(&x, streamobj, &s) < 0 ||
        (is_reduce && read_op(&x, opobj, &t, type, &redop, &made) < 0)) {
        return NULL;
    }
    pyccl_task tk;
    task(&tk, is_reduce ? PYCCL_REDUCE : PYCCL_BROADCAST, t.ptr, o.ptr, count,
         type, root, &x, s);
    return finish(&x, &tk, count > 0, redop, made);
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

/* all_gather(input, output, *, stream=None): output is one array of size x
 * input elements, or a list of size arrays (a group of broadcasts). */
PyObject *
pyccl_comm_all_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames)
{
    static const char *const names[] = {"input", "output", "stream"};
    PyObject *a[3], *res = NULL, *keep = NULL;
    call_ctx x;
    pyccl_tensor in, out, *list = NULL;
    pyccl_task *tasks = NULL;
    cudaStream_t s;
    int type;
    size_t count;
    int64_t whole;
    if (pyccl_parse_args("all_gather", args, nargs, kwnames, names, 3, 2, 2, a) < 0 ||
        ctx_init(&x, self, "all_gather") < 0 ||
        read_on_comm(&x, "input", a[0], &in) < 0 ||
        get_stream(&x, a[2], &s) < 0) {
        return NULL;
    }
    pyccl_move_type(x.st, &in, &type, &count, (size_t)in.numel);
    list = read_list(&x, "output", a[1], &in, "input", in.numel, &keep);
    if (list == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (list == NULL) {
        if (read_on_comm(&x, "output", a[1], &out) < 0 ||
            same_dtype(&x, "output", &out, "input", &in) < 0 ||
            pyccl_mul_size(x.op, "input", in.numel, x.c->size, "the world size",
                           &whole) < 0 ||
            numel_is(&x, "output", &out, whole, "input size x world size") < 0 ||
            slot_or_apart(&x, "input", &in, "output", &out, NULL) < 0) {
            return NULL;
        }
        pyccl_task tk;
        task(&tk, PYCCL_ALL_GATHER, in.ptr, out.ptr, count, type, 0, &x, s);
        return finish(&x, &tk, count > 0, 0, 0);
    }
    if (slot_or_apart(&x, "input", &in, "output", NULL, list) < 0) {
        goto done;
    }
    tasks = PyMem_Calloc((size_t)x.c->size, sizeof(pyccl_task));
    if (tasks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int r = 0; r < x.c->size; r++) {
        task(&tasks[r], PYCCL_BROADCAST, in.ptr, list[r].ptr, count, type, r,
             &x, s);
    }
    res = finish(&x, tasks, count > 0 ? x.c->size : 0, 0, 0);
done:
    PyMem_Free(tasks);
    PyMem_Free(list);
    Py_XDECREF(keep);
    return res;
}

/* reduce_scatter(input, output, op=SUM, *, stream=None): input is one array
 * of size x output elements, or a list of size arrays (a group of reduces). */
PyObject *
pyccl_comm_reduce_scatter(PyObject *self, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"input", "output", "op", "stream"};
    PyObject *a[4], *res = NULL, *keep = NULL;
    call_ctx x;
    pyccl_tensor in, out, *list = NULL;
    pyccl_task *tasks = NULL;
    cudaStream_t s;
    int type, redop, made = 0;
    int64_t whole;
    if (pyccl_parse_args("reduce_scatter", args, nargs, kwnames, names, 4, 3, 2, a) < 0 ||
        ctx_init(&x, self, "reduce_scatter") < 0 ||
        read_on_comm(&x, "output", a[1], &out) < 0 ||
        get_stream(&x, a[3], &s) < 0) {
        return NULL;
    }
    list = read_list(&x, "input", a[0], &out, "output", out.numel, &keep);
    if (list == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (list == NULL &&
        (read_on_comm(&x, "input", a[0], &in) < 0 ||
         same_dtype(&x, "output", &out, "input", &in) < 0 ||
         pyccl_mul_size(x.op, "output", out.numel, x.c->size, "the world size",
                        &whole) < 0 ||
         numel_is(&x, "input", &in, whole, "output size x world size") < 0)) {
        goto done;
    }
    if (slot_or_apart(&x, "output", &out, "input", &in, list) < 0) {
        goto done;
    }
    if ((type = pyccl_reduce_type(x.st, x.op, &out)) < 0 ||
        read_op(&x, a[2], &out, type, &redop, &made) < 0) {
        goto done;
    }
    size_t count = (size_t)out.numel;
    if (list == NULL) {
        pyccl_task tk;
        task(&tk, PYCCL_REDUCE_SCATTER, in.ptr, out.ptr, count, type, 0, &x, s);
        res = finish(&x, &tk, count > 0, redop, made);
        made = 0;
        goto done;
    }
    tasks = PyMem_Calloc((size_t)x.c->size, sizeof(pyccl_task));
    if (tasks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int r = 0; r < x.c->size; r++) {
        task(&tasks[r], PYCCL_REDUCE, list[r].ptr, out.ptr, count, type, r, &x,
             s);
    }
    res = finish(&x, tasks, count > 0 ? x.c->size : 0, redop, made);
    made = 0;
done:
    if (made) {
        destroy_op(&x, redop);
    }
    PyMem_Free(tasks);
    PyMem_Free(list);
    Py_XDECREF(keep);
    return res;
}

/* send(tensor, peer, *, stream=None) / recv(tensor, peer, *, stream=None) */
static PyObject *
p2p(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
    pyccl_coll coll)
{
    static const char *const names[] = {"tensor", "peer", "stream"};
    const char *op = coll == PYCCL_SEND ? "send" : "recv";
    PyObject *a[3];
    call_ctx x;
    pyccl_tensor t;
    cudaStream_t s;
    int peer, type;
    size_t count;
    if (pyccl_parse_args(op, args, nargs, kwnames, names, 3, 2, 2, a) < 0 ||
        ctx_init(&x, self, op) < 0 || read_on_comm(&x, "tensor", a[0], &t) < 0 ||
        read_rank(&x, "peer", a[1], &peer) < 0 || get_stream(&x, a[2], &s) < 0) {
        return NULL;
    }
    pyccl_move_type(x.st, &t, &type, &count, (size_t)t.numel);
    pyccl_task tk;
    task(&tk, coll, t.ptr, t.ptr, count, type, peer, &x, s);
    return finish(&x, &tk, count > 0, 0, 0);
}

PyObject *
pyccl_comm_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                PyObject *kwnames)
{
    return p2p(self, args, nargs, kwnames, PYCCL_SEND);
}

PyObject *
pyccl_comm_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                PyObject *kwnames)
{
    return p2p(self, args, nargs, kwnames, PYCCL_RECV);
}

/* Per-peer chunks of one side of all_to_all/gather/scatter: either a list of
 * size arrays of `chunk` elements, or one array of size x chunk. */
typedef struct {
    pyccl_tensor whole;
    pyccl_tensor *list;
    PyObject *keep;      /* the list's private tuple, released after the call */
} chunks;

static int
read_chunks(call_ctx *x, const char *what, PyObject *obj,
            const pyccl_tensor *ref, const char *ref_what, int64_t chunk,
            chunks *out)
{
    out->list = read_list(x, what, obj, ref, ref_what, chunk, &out->keep);
    if (out->list != NULL) {
        return 0;
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    int64_t whole;
    if (read_on_comm(x, what, obj, &out->whole) < 0 ||
        same_dtype(x, what, &out->whole, ref_what, ref) < 0 ||
        pyccl_mul_size(x->op, ref_what, chunk, x->c->size, "the world size",
                       &whole) < 0 ||
        numel_is(x, what, &out->whole, whole, "one chunk per rank") < 0) {
        return -1;
    }
    return 0;
}

static char *
chunk_ptr(const chunks *c, int r, size_t chunk_bytes)
{
    return c->list ? c->list[r].ptr : c->whole.ptr + (size_t)r * chunk_bytes;
}

/* all_to_all(input, output, *, stream=None): equal chunks; each side is one
 * array of size x chunk elements or a list of size arrays. */
PyObject *
pyccl_comm_all_to_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames)
{
    static const char *const names[] = {"input", "output", "stream"};
    PyObject *a[3], *res = NULL, *inobj = NULL;
    call_ctx x;
    chunks in = {0}, out = {0};
    pyccl_task *tasks = NULL;
    cudaStream_t s;
    if (pyccl_parse_args("all_to_all", args, nargs, kwnames, names, 3, 2, 2, a) < 0 ||
        ctx_init(&x, self, "all_to_all") < 0 || get_stream(&x, a[2], &s) < 0) {
        return NULL;
    }
    /* The chunk size comes from the input: its first list item, or 1/size of
     * the whole array. */
    pyccl_tensor first;
    int64_t chunk;
    if (PyList_Check(a[0]) || PyTuple_Check(a[0])) {
        /* a private tuple: reading input[0] runs user code that may change
         * the list (read_list takes this tuple as it is) */
        if ((inobj = PySequence_Tuple(a[0])) == NULL) {
            return NULL;
        }
        if (PyTuple_GET_SIZE(inobj) == 0) {
            PyErr_Format(PyExc_ValueError,
                         "all_to_all: input has 0 tensors, expected %d (one "
                         "per rank)", x.c->size);
            goto done;
        }
        if (read_on_comm(&x, "input[0]", PyTuple_GET_ITEM(inobj, 0),
                         &first) < 0) {
            goto done;
        }
        chunk = first.numel;
    }
    else {
        inobj = Py_NewRef(a[0]);
        if (read_on_comm(&x, "input", a[0], &first) < 0) {
            goto done;
        }
        if (first.numel % x.c->size != 0) {
            PyErr_Format(PyExc_ValueError,
                         "all_to_all: input has %lld elements, not a multiple "
                         "of the world size %d",
                         (long long)first.numel, x.c->size);
            goto done;
        }
        chunk = first.numel / x.c->size;
    }
    if (read_chunks(&x, "input", inobj, &first, "input", chunk, &in) < 0 ||
        read_chunks(&x, "output", a[1], &first, "input", chunk, &out) < 0) {
        goto done;
    }
    int type;
    size_t count;
    pyccl_move_type(x.st, &first, &type, &count, (size_t)chunk);
    size_t bytes = (size_t)chunk * (size_t)first.itemsize; /* <= first.nbytes */
    tasks = PyMem_Calloc(2 * (size_t)x.c->size, sizeof(pyccl_task));
    if (tasks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int r = 0; r < x.c->size; r++) {
        task(&tasks[2 * r], PYCCL_SEND, chunk_ptr(&in, r, bytes), NULL, count,
             type, r, &x, s);
        task(&tasks[2 * r + 1], PYCCL_RECV, NULL, chunk_ptr(&out, r, bytes),
             count, type, r, &x, s);
    }
    /* always a group: every send must be matched by its recv concurrently */
    res = finish(&x, tasks, count > 0 ? 2 * x.c->size : 0, 0, 0);
done:
    PyMem_Free(tasks);
    PyMem_Free(in.list);
    PyMem_Free(out.list);
    Py_XDECREF(in.keep);
    Py_XDECREF(out.keep);
    Py_XDECREF(inobj);
    return res;
}

static int
read_splits(call_ctx *x, const char *what, PyObject *obj, int64_t rows,
            int64_t **out)
{
    int64_t *v = PyMem_Calloc((size_t)x->c->size, sizeof(int64_t));
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (obj == NULL || obj == Py_None) {
        if (rows % x->c->size != 0) {
            PyErr_Format(PyExc_ValueError,
                         "all_to_all_single: %s is None but dim 0 (%lld) is "
                         "not a multiple of the world size %d",
                         what, (long long)rows, x->c->size);
            PyMem_Free(v);
            return -1;
        }
        for (int r = 0; r < x->c->size; r++) {
            v[r] = rows / x->c->size;
        }
        *out = v;
        return 0;
    }
    PyObject *seq = PySequence_Tuple(obj);
    if (seq == NULL || PySequence_Fast_GET_SIZE(seq) != x->c->size) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError,
                     "all_to_all_single: %s must be a list of %d row counts",
                     what, x->c->size);
        Py_XDECREF(seq);
        PyMem_Free(v);
        return -1;
    }
    int64_t total = 0;
    for (int r = 0; r < x->c->size; r++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, r);
        if (!PyLong_Check(item) || PyBool_Check(item)) {
            PyErr_Format(PyExc_TypeError,
                         "all_to_all_single: %s[%d] must be an int, got %.200s",
                         what, r, Py_TYPE(item)->tp_name);
            Py_DECREF(seq);
            PyMem_Free(v);
            return -1;
        }
        int overflow;
        long long n = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (n == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyMem_Free(v);
            return -1;
        }
        if (overflow > 0) {
            n = LLONG_MAX; /* more than any dim 0: reported below */
        }
        if (n < 0 || overflow < 0) {
            PyErr_Format(PyExc_ValueError,
                         "all_to_all_single: %s[%d]=%S is negative", what, r, item);
            Py_DECREF(seq);
            PyMem_Free(v);
            return -1;
        }
        if (n > rows - total) { /* also keeps the sum from overflowing */
            PyErr_Format(PyExc_ValueError,
                         "all_to_all_single: %s sum to more than the %lld rows "
                         "of dim 0", what, (long long)rows);
            Py_DECREF(seq);
            PyMem_Free(v);
            return -1;
        }
        v[r] = n;
        total += n;
    }
    Py_DECREF(seq);
    if (total != rows) {
        PyErr_Format(PyExc_ValueError,
                     "all_to_all_single: %s sum to %lld rows but dim 0 has %lld",
                     what, (long long)total, (long long)rows);
        PyMem_Free(v);
        return -1;
    }
    *out = v;
    return 0;
}

/* The rows (dim 0) of an all_to_all_single side: the reader's, for a
 * __cuda_array_interface__ array, else len(); 0 when there are no elements.
 * The elements must split into that many equal rows. */
static int
dim0(call_ctx *x, const char *what, PyObject *obj, const pyccl_tensor *t,
     int64_t *rows)
{
    if (t->numel == 0) {
        *rows = 0;
        return 0;
    }
    int64_t r = t->rows;
    if (r < 0) {
        Py_ssize_t n = PyObject_Size(obj);
        if (n < 0) {
            return -1;
        }
        r = n;
    }
    if (r == 0 || t->numel % r != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s has %lld elements, which do not make %lld rows "
                     "(dim 0) of equal size",
                     x->op, what, (long long)t->numel, (long long)r);
        return -1;
    }
    *rows = r;
    return 0;
}

/* all_to_all_single(input, output, input_splits=None, output_splits=None, *,
 * stream=None): splits count dim-0 rows, as in torch.distributed. */
PyObject *
pyccl_comm_all_to_all_single(PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"input", "output", "input_splits",
                                        "output_splits", "stream"};
    PyObject *a[5], *res = NULL;
    call_ctx x;
    pyccl_tensor in, out;
    pyccl_task *tasks = NULL;
    int64_t *isp = NULL, *osp = NULL;
    cudaStream_t s;
    if (pyccl_parse_args("all_to_all_single", args, nargs, kwnames, names, 5, 4, 2, a) < 0 ||
        ctx_init(&x, self, "all_to_all_single") < 0 ||
        read_on_comm(&x, "input", a[0], &in) < 0 ||
        read_on_comm(&x, "output", a[1], &out) < 0 ||
        same_dtype(&x, "output", &out, "input", &in) < 0 ||
        get_stream(&x, a[4], &s) < 0) {
        return NULL;
    }
    int64_t in_rows, out_rows;
    if (dim0(&x, "input", a[0], &in, &in_rows) < 0 ||
        dim0(&x, "output", a[1], &out, &out_rows) < 0) {
        return NULL;
    }
    int64_t in_row = in_rows ? in.numel / in_rows : 0;
    int64_t out_row = out_rows ? out.numel / out_rows : 0;
    if (in_rows && out_rows && in_row != out_row) {
        PyErr_Format(PyExc_ValueError,
                     "all_to_all_single: input rows have %lld elements but "
                     "output rows have %lld",
                     (long long)in_row, (long long)out_row);
        return NULL;
    }
    int64_t row = in_row ? in_row : out_row;
    if (read_splits(&x, "input_splits", a[2], in_rows, &isp) < 0 ||
        read_splits(&x, "output_splits", a[3], out_rows, &osp) < 0) {
        goto done;
    }
    int type;
    size_t unit;
    pyccl_move_type(x.st, &in, &type, &unit, 1);
    tasks = PyMem_Calloc(2 * (size_t)x.c->size, sizeof(pyccl_task));
    if (tasks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t ioff = 0, ooff = 0, n = 0;
    size_t rowbytes = (size_t)row * (size_t)in.itemsize;
    for (int r = 0; r < x.c->size; r++) {
        /* zero-row exchanges are left out on both sides alike */
        if (isp[r] > 0) {
            task(&tasks[n++], PYCCL_SEND, in.ptr + ioff, NULL,
                 (size_t)(isp[r] * row) * unit, type, r, &x, s);
        }
        if (osp[r] > 0) {
            task(&tasks[n++], PYCCL_RECV, NULL, out.ptr + ooff,
                 (size_t)(osp[r] * row) * unit, type, r, &x, s);
        }
        ioff += (size_t)isp[r] * rowbytes;
        ooff += (size_t)osp[r] * rowbytes;
    }
    res = finish(&x, tasks, (Py_ssize_t)n, 0, 0);
done:
    PyMem_Free(tasks);
    PyMem_Free(isp);
    PyMem_Free(osp);
    return res;
}

/* gather(tensor, outputs, root, *, stream=None) and
 * scatter(inputs, tensor, root, *, stream=None): the root's side is a list of
 * size arrays or one array of size x tensor; other ranks may pass None. */
static PyObject *
gather_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames, int is_gather)
{
    static const char *const gnames[] = {"tensor", "outputs", "root", "stream"};
    static const char *const snames[] = {"inputs", "tensor", "root", "stream"};
    const char *op = is_gather ? "gather" : "scatter";
    PyObject *a[4], *res = NULL;
    call_ctx x;
    pyccl_tensor t;
    chunks many = {0};
    pyccl_task *tasks = NULL;
    cudaStream_t s;
    int root;
    PyObject *tobj, *manyobj;
    const char *many_what = is_gather ? "outputs" : "inputs";
    if (pyccl_parse_args(op, args, nargs, kwnames, is_gather ? gnames : snames, 4, 3,
                   3, a) < 0 ||
        ctx_init(&x, self, op) < 0) {
        return NULL;
    }
    tobj = is_gather ? a[0] : a[1];
    manyobj = is_gather ? a[1] : a[0];
    if (read_on_comm(&x, "tensor", tobj, &t) < 0 ||
        read_rank(&x, "root", a[2], &root) < 0 || get_stream(&x, a[3], &s) < 0) {
        return NULL;
    }
    int am_root = x.c->rank == root;
    if (am_root) {
        if (manyobj == Py_None) {
            PyErr_Format(PyExc_ValueError, "%s: %s is required on the root "
                         "(rank %d)", op, many_what, root);
            return NULL;
        }
        if (read_chunks(&x, many_what, manyobj, &t, "tensor", t.numel, &many) < 0) {
            return NULL;
        }
    }
    int type;
    size_t count;
    pyccl_move_type(x.st, &t, &type, &count, (size_t)t.numel);
    size_t bytes = (size_t)t.nbytes;
    tasks = PyMem_Calloc((size_t)x.c->size + 1, sizeof(pyccl_task));
    if (tasks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = 0;
    pyccl_coll mine = is_gather ? PYCCL_SEND : PYCCL_RECV;
    pyccl_coll roots = is_gather ? PYCCL_RECV : PYCCL_SEND;
    /* every rank, the root too, sends to (gather) / receives from (scatter)
     * the root; the root also talks to every rank */
    task(&tasks[n++], mine, t.ptr, t.ptr, count, type, root, &x, s);
    for (int r = 0; am_root && r < x.c->size; r++) {
        char *p = chunk_ptr(&many, r, bytes);
        task(&tasks[n++], roots, p, p, count, type, r, &x, s);
    }
    res = finish(&x, tasks, count > 0 ? n : 0, 0, 0);
done:
    PyMem_Free(tasks);
    PyMem_Free(many.list);
    Py_XDECREF(many.keep);
    return res;
}

PyObject *
pyccl_comm_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames)
{
    return gather_scatter(self, args, nargs, kwnames, 1);
}

PyObject *
pyccl_comm_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames)
{
    return gather_scatter(self, args, nargs, kwnames, 0);
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
        ctx_init(&x, self, "barrier") < 0 || get_stream(&x, a[0], &s) < 0 ||
        pyccl_comm_alive(x.st, "barrier", x.c) < 0) { /* after the stream's code */
        return NULL;
    }
    const pyccl_api *api = &x.st->api;
    pyccl_comm *c = x.c;
    cudaError_t ce = cudaSuccess;
    if (c->scratch == NULL) {
        int prev = -1;
        void *mem = NULL;
        Py_BEGIN_ALLOW_THREADS
        api->cudaGetDevice(&prev);
        api->cudaSetDevice(c->device);
        ce = api->cudaMalloc(&mem, sizeof(float));
        api->cudaSetDevice(prev);
        Py_END_ALLOW_THREADS
        if (ce != cudaSuccess) {
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
    task(&tk, PYCCL_ALL_REDUCE, c->scratch, c->scratch, 1, ncclFloat32, 0, &x, s);
    if (c->watch != NULL) {
        /* enqueue and wait like any call on it: bounded, interruptible */
        c->inflight++;
        int rc = pyccl_enqueue_timed(x.st, "barrier", &tk, 1, ncclSum, &c, 1);
        c->inflight--;
        if (rc < 0 || pyccl_watch_wait(x.st, "barrier", c,
                                       pyccl_comm_timeout(c)) < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    c->inflight++;
    int rc = pyccl_enqueue(x.st, "barrier", &tk, 1, ncclSum, NULL, &c, 1);
    c->inflight--;
    if (rc < 0) {
        return NULL;
    }
    /* The legacy default stream (0) means the current device's: make that
     * the communicator's device while waiting. */
    Py_BEGIN_ALLOW_THREADS
    int prev = -1;
    api->cudaGetDevice(&prev);
    api->cudaSetDevice(c->device);
    ce = api->cudaStreamSynchronize(s);
    api->cudaSetDevice(prev);
    Py_END_ALLOW_THREADS
    if (ce != cudaSuccess) {
        pyccl_raise_cuda(x.st, "barrier", "cudaStreamSynchronize", ce);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* split(color, key=None) -> Communicator or None (color < 0: not a member). */
PyObject *
pyccl_comm_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                 PyObject *kwnames)
{
    static const char *const names[] = {"color", "key"};
    PyObject *a[2];
    call_ctx x;
    int color, key;
    if (pyccl_parse_args("split", args, nargs, kwnames, names, 2, 2, 1, a) < 0 ||
        ctx_init(&x, self, "split") < 0) {
        return NULL;
    }
    int rc = pyccl_read_bounded("split", "color", a[0], 0, INT32_MAX, &color);
    if (rc < 0) {
        return NULL;
    }
    if (rc == PYCCL_ABOVE) {
        PyErr_Format(PyExc_ValueError, "split: color=%S is out of range", a[0]);
        return NULL;
    }
    if (rc == PYCCL_BELOW) {
        color = NCCL_SPLIT_NOCOLOR; /* any negative color: not a member */
    }
    key = x.c->rank;
    if (a[1] != NULL && a[1] != Py_None &&
        pyccl_read_int("split", "key", a[1], &key) < 0) {
        return NULL;
    }
    const pyccl_api *api = &x.st->api;
    if (api->ncclCommSplit == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "split: needs NCCL >= 2.18");
        return NULL;
    }
    if (x.c->watch != NULL) {
        return pyccl_watch_split(x.st, x.c, color, key); /* the child too */
    }
    if (pyccl_group_depth() > 0) {
        /* NCCL writes the child's handle when the group ends, so it goes
         * straight into a Communicator kept alive until then. */
        static ncclComm_t not_member; /* color < 0: NCCL writes NULL here */
        PyObject *child = NULL;
        ncclComm_t *slot = &not_member;
        if (color >= 0) {
            child = pyccl_comm_new(x.st, NULL, -1, 0, x.c->device);
            if (child == NULL || pyccl_add_pending_split(x.st, child) < 0) {
                Py_XDECREF(child);
                return NULL;
            }
            ((pyccl_comm *)child)->pending = 1;
            slot = &((pyccl_comm *)child)->comm;
        }
        char last[PYCCL_LAST_ERROR_SIZE] = "";
        pyccl_comm_lock(x.c); /* a short call: no GIL release around it */
        ncclResult_t r = api->ncclCommSplit(x.c->comm, color, key, slot, NULL);
        pyccl_nccl_failed(api, r, x.c->comm, last, sizeof last);
        pthread_mutex_unlock(&x.c->mu);
        if (r != ncclSuccess) {
            Py_XDECREF(child); /* stays pending until the group ends */
            pyccl_raise_nccl(x.st, "split", r, last);
            return NULL;
        }
        if (child == NULL) {
            Py_RETURN_NONE;
        }
        return child;
    }
    ncclComm_t nc = NULL;
    ncclResult_t r;
    int rank = -1, size = 0;
    char last[PYCCL_LAST_ERROR_SIZE] = "";
    x.c->inflight++;
    Py_BEGIN_ALLOW_THREADS
    pyccl_comms_lock(&x.c, 1);
    r = api->ncclCommSplit(x.c->comm, color, key, &nc, NULL);
    if (r == ncclSuccess && nc != NULL) {
        r = api->ncclCommUserRank(nc, &rank);
        if (r == ncclSuccess) {
            r = api->ncclCommCount(nc, &size);
        }
    }
    pyccl_nccl_failed(api, r, x.c->comm, last, sizeof last);
    pyccl_comms_unlock(&x.c, 1);
    Py_END_ALLOW_THREADS
    x.c->inflight--;
    if (r != ncclSuccess) {
        pyccl_raise_nccl(x.st, "split", r, last);
        return NULL;
    }
    if (nc == NULL) {
        Py_RETURN_NONE;
    }
    return pyccl_comm_new(x.st, nc, rank, size, x.c->device);
}

/* all_reduce_coalesced(tensors, op=SUM, *, algo=None): pack, one collective,
 * unpack.  The pack and unpack are torch's kernels (torch.cat and
 * torch._foreach_copy_, one launch each for up to ~100 tensors), on the
 * current stream, which is also where the collective goes. */
PyObject *
pyccl_comm_all_reduce_coalesced(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    static const char *const names[] = {"tensors", "op", "algo"};
    const char *op = "all_reduce_coalesced";
    PyObject *a[3];
    call_ctx x;
    if (pyccl_parse_args(op, args, nargs, kwnames, names, 3, 2, 1, a) < 0 ||
        ctx_init(&x, self, op) < 0) {
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
    pyccl_tensor first, t;
    PyObject *flats = PyList_New(n), *sizes = PyList_New(n);
    PyObject *torch = NULL, *flat = NULL, *parts = NULL, *r = NULL;
    if (flats == NULL || sizes == NULL) {
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
        if (read_on_comm(&x, name, item, i ? &t : &first) < 0 ||
            (i && same_dtype(&x, name, &t, "tensors[0]", &first) < 0)) {
            goto done;
        }
        PyObject *v = PyObject_CallMethod(item, "view", "i", -1);
        PyObject *numel = PyLong_FromLongLong(i ? t.numel : first.numel);
        if (v == NULL || numel == NULL) {
            Py_XDECREF(v);
            Py_XDECREF(numel);
            goto done;
        }
        PyList_SET_ITEM(flats, i, v);
        PyList_SET_ITEM(sizes, i, numel);
    }
    if (pyccl_reduce_type(x.st, op, &first) < 0 || (torch = PyImport_ImportModule("torch")) == NULL ||
        (flat = PyObject_CallMethod(torch, "cat", "O", flats)) == NULL) {
        goto done;
    }
    {
        PyObject *call[4] = {self, flat, a[1] ? a[1] : NULL, NULL};
        PyObject *kw = NULL;
        Py_ssize_t np = a[1] ? 3 : 2;
        if (a[2] != NULL) {
            call[np] = a[2];
            kw = Py_BuildValue("(s)", "algo");
            if (kw == NULL) {
                goto done;
            }
        }
        PyObject *name = PyUnicode_FromString("all_reduce");
        if (name == NULL) {
            Py_XDECREF(kw);
            goto done;
        }
        r = PyObject_VectorcallMethod(name, call, (size_t)np, kw);
        Py_DECREF(name);
        Py_XDECREF(kw);
        if (r == NULL) {
            goto done;
        }
        Py_CLEAR(r);
    }
    if ((parts = PyObject_CallMethod(flat, "split", "O", sizes)) == NULL ||
        (r = PyObject_CallMethod(torch, "_foreach_copy_", "OO", flats, parts)) == NULL) {
        goto done;
    }
    Py_CLEAR(r);
    r = Py_NewRef(Py_None);
done:
    Py_XDECREF(tensors);
    Py_XDECREF(flats);
    Py_XDECREF(sizes);
    Py_XDECREF(torch);
    Py_XDECREF(flat);
    Py_XDECREF(parts);
    return r;
}
