/* The Communicator methods with a buffer per peer: send and recv, and the
 * collectives made of them (all_to_all, all_to_all_single, gather,
 * scatter), each one NCCL group of send/recv rows, so they stay zero-copy.
 * The reading and checking they share is comm_ops.c's (comm_ops.h). */
#include "comm_ops.h"
#include "communicator.h"
#include "tensor.h"
#include "args.h"

#include <limits.h>

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
        ops_ctx_init(&x, self, op) < 0 || ops_read_on_comm(&x, "tensor", a[0], &t) < 0 ||
        ops_read_rank(&x, "peer", a[1], &peer) < 0 || ops_stream(&x, a[2], &s) < 0) {
        return NULL;
    }
    pyccl_move_type(x.st, &t, &type, &count, (size_t)t.numel);
    pyccl_task tk;
    ops_task(&tk, coll, t.ptr, t.ptr, count, type, peer, &x, s);
    return ops_finish(&x, &tk, count > 0, 0, 0);
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
    out->list = ops_read_list(x, what, obj, ref, ref_what, chunk, &out->keep);
    if (out->list != NULL) {
        return 0;
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    int64_t whole;
    if (ops_read_on_comm(x, what, obj, &out->whole) < 0 ||
        ops_same_dtype(x, what, &out->whole, ref_what, ref) < 0 ||
        pyccl_mul_size(x->op, ref_what, chunk, x->c->size, "the world size",
                       &whole) < 0 ||
        ops_numel_is(x, what, &out->whole, whole, "one chunk per rank") < 0) {
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
        ops_ctx_init(&x, self, "all_to_all") < 0 || ops_stream(&x, a[2], &s) < 0) {
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
        if (ops_read_on_comm(&x, "input[0]", PyTuple_GET_ITEM(inobj, 0),
                         &first) < 0) {
            goto done;
        }
        chunk = first.numel;
    }
    else {
        inobj = Py_NewRef(a[0]);
        if (ops_read_on_comm(&x, "input", a[0], &first) < 0) {
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
        ops_task(&tasks[2 * r], PYCCL_SEND, chunk_ptr(&in, r, bytes), NULL, count,
             type, r, &x, s);
        ops_task(&tasks[2 * r + 1], PYCCL_RECV, NULL, chunk_ptr(&out, r, bytes),
             count, type, r, &x, s);
    }
    /* always a group: every send must be matched by its recv concurrently */
    res = ops_finish(&x, tasks, count > 0 ? 2 * x.c->size : 0, 0, 0);
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
        ops_ctx_init(&x, self, "all_to_all_single") < 0 ||
        ops_read_on_comm(&x, "input", a[0], &in) < 0 ||
        ops_read_on_comm(&x, "output", a[1], &out) < 0 ||
        ops_same_dtype(&x, "output", &out, "input", &in) < 0 ||
        ops_stream(&x, a[4], &s) < 0) {
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
            ops_task(&tasks[n++], PYCCL_SEND, in.ptr + ioff, NULL,
                 (size_t)(isp[r] * row) * unit, type, r, &x, s);
        }
        if (osp[r] > 0) {
            ops_task(&tasks[n++], PYCCL_RECV, NULL, out.ptr + ooff,
                 (size_t)(osp[r] * row) * unit, type, r, &x, s);
        }
        ioff += (size_t)isp[r] * rowbytes;
        ooff += (size_t)osp[r] * rowbytes;
    }
    res = ops_finish(&x, tasks, (Py_ssize_t)n, 0, 0);
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
        ops_ctx_init(&x, self, op) < 0) {
        return NULL;
    }
    tobj = is_gather ? a[0] : a[1];
    manyobj = is_gather ? a[1] : a[0];
    if (ops_read_on_comm(&x, "tensor", tobj, &t) < 0 ||
        ops_read_rank(&x, "root", a[2], &root) < 0 || ops_stream(&x, a[3], &s) < 0) {
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
    ops_task(&tasks[n++], mine, t.ptr, t.ptr, count, type, root, &x, s);
    for (int r = 0; am_root && r < x.c->size; r++) {
        char *p = chunk_ptr(&many, r, bytes);
        ops_task(&tasks[n++], roots, p, p, count, type, r, &x, s);
    }
    res = ops_finish(&x, tasks, count > 0 ? n : 0, 0, 0);
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
