/* Argument readers (see args.h): one place reads a bounded int, a unique
 * id, or fast-call keywords, so every binding words the same mistake the same
 * way. */
#include "args.h"

#include <string.h>
#include <strings.h>

int
pyccl_parse_args(const char *op, PyObject *const *args, Py_ssize_t nargs,
                 PyObject *kwnames, const char *const *names, int nnames,
                 int npos, int nreq, PyObject **out)
{
    memset(out, 0, sizeof(PyObject *) * (size_t)nnames);
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError,
                     "%s() takes at most %d positional arguments (%zd given)",
                     op, npos, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = args[i];
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < nnames && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) {
            j++;
        }
        if (j == nnames) {
            PyErr_Format(PyExc_TypeError,
                         "%s() got an unexpected keyword argument '%U'", op, key);
            return -1;
        }
        if (out[j] != NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s() got multiple values for argument '%s'", op,
                         names[j]);
            return -1;
        }
        out[j] = args[nargs + k];
    }
    for (int j = 0; j < nreq; j++) {
        if (out[j] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'",
                         op, names[j]);
            return -1;
        }
    }
    return 0;
}

int
pyccl_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)",
                     name, want, nargs);
        return -1;
    }
    return 0;
}

int
pyccl_read_bounded(const char *op, const char *what, PyObject *obj, long lo,
                   long hi, int *out)
{
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int, got %.200s", op,
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow;
    long v = PyLong_AsLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow < 0 || (!overflow && v < lo)) {
        return PYCCL_BELOW;
    }
    if (overflow > 0 || v > hi) {
        return PYCCL_ABOVE;
    }
    *out = (int)v;
    return 0;
}

int
pyccl_read_int(const char *op, const char *what, PyObject *obj, int *out)
{
    int r = pyccl_read_bounded(op, what, obj, INT32_MIN, INT32_MAX, out);
    if (r > 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s=%S is out of range", op, what,
                     obj);
        return -1;
    }
    return r;
}

int
pyccl_read_unique_id(const char *op, int torch_text, PyObject *uid, ncclUniqueId *out)
{
    Py_buffer view;
    if (!PyObject_CheckBuffer(uid) || PyUnicode_Check(uid)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: unique_id must be bytes (from unique_id()), got %.200s",
                     op, Py_TYPE(uid)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(uid, &view, PyBUF_SIMPLE) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError)) {
            return -1; /* the object's own buffer export raised: keep that */
        }
        /* a strided view (memoryview(b)[::2]) has no single run of bytes */
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: unique_id must be bytes (from unique_id()), got a "
                     "non-contiguous %.200s",
                     op, Py_TYPE(uid)->tp_name);
        return -1;
    }
    if (view.len != NCCL_UNIQUE_ID_BYTES) {
        /* the drop-in: torch.cuda.nccl.init_rank's RuntimeError (a
         * TORCH_CHECK) and its words, without torch's SystemError on Python
         * >= 3.10; elsewhere a ValueError naming op and the argument */
        if (torch_text) {
            PyErr_Format(PyExc_RuntimeError,
                         "invalid unique_id (expected %d bytes, got %zd)",
                         NCCL_UNIQUE_ID_BYTES, view.len);
        }
        else {
            PyErr_Format(PyExc_ValueError,
                         "%s: unique_id has %zd bytes, expected %d (from "
                         "unique_id())",
                         op, view.len, NCCL_UNIQUE_ID_BYTES);
        }
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy(out->internal, view.buf, NCCL_UNIQUE_ID_BYTES);
    PyBuffer_Release(&view);
    return 0;
}

/* ---- reduction ops ---- */

/* NCCL's op for each name, in NCCL's order; torch.distributed spells PROD
 * as PRODUCT. */
static const char *const op_names[] = {"sum", "prod", "max", "min", "avg"};
static const char *const torch_op_names[] = {"SUM", "PRODUCT", "MAX", "MIN", "AVG"};

/* The reduction-op reader's part of the module state: torch.distributed's
 * ReduceOp and ReduceOp.RedOpType, found once torch.distributed is loaded,
 * and NCCL's op for each RedOpType value (read by name then; -1: none). */
struct pyccl_redops {
    PyObject *ReduceOp, *RedOpType;
    signed char torch_ops[16];
    PyObject *s_premul;          /* "premul_scalar", interned */
    PyObject *s_c10d;            /* "torch._C._distributed_c10d", interned */
};

int
pyccl_redops_state_init(pyccl_state *st)
{
    struct pyccl_redops *r = st->redops = PyMem_Calloc(1, sizeof *r);
    if (r == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    r->s_premul = PyUnicode_InternFromString("premul_scalar");
    r->s_c10d = PyUnicode_InternFromString("torch._C._distributed_c10d");
    return r->s_premul != NULL && r->s_c10d != NULL ? 0 : -1;
}

int
pyccl_redops_state_traverse(pyccl_state *st, visitproc visit, void *arg)
{
    if (st->redops != NULL) {
        Py_VISIT(st->redops->ReduceOp);
        Py_VISIT(st->redops->RedOpType);
    }
    return 0;
}

void
pyccl_redops_state_clear(pyccl_state *st)
{
    if (st->redops != NULL) {
        Py_CLEAR(st->redops->ReduceOp);
        Py_CLEAR(st->redops->RedOpType);
        Py_CLEAR(st->redops->s_premul);
        Py_CLEAR(st->redops->s_c10d);
    }
}

void
pyccl_redops_state_free(pyccl_state *st)
{
    pyccl_redops_state_clear(st);
    PyMem_Free(st->redops);
    st->redops = NULL;
}

/* torch.distributed's ReduceOp and ReduceOp.RedOpType, found (not imported)
 * once torch.distributed has been imported: before that no object can be
 * one.  Borrowed from the state, which keeps them, with NCCL's op for each
 * RedOpType value: its members are read by name here, once (a pybind enum's
 * name costs microseconds a read, its value a tenth of one). */
static int
torch_op_types(pyccl_state *st, PyObject **reduce_op, PyObject **red_op_type)
{
    *reduce_op = *red_op_type = NULL;
    if (st->redops->ReduceOp == NULL) {
        PyObject *mod = PyImport_GetModule(st->redops->s_c10d);
        if (mod == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
        PyObject *ro = PyObject_GetAttrString(mod, "ReduceOp");
        Py_DECREF(mod);
        PyObject *rt = ro ? PyObject_GetAttrString(ro, "RedOpType") : NULL;
        if (rt == NULL || !PyType_Check(ro) || !PyType_Check(rt)) {
            Py_XDECREF(ro);
            Py_XDECREF(rt);
            PyErr_Clear(); /* a torch without them: nothing is a ReduceOp */
            return 0;
        }
        memset(st->redops->torch_ops, -1, sizeof st->redops->torch_ops);
        for (int i = 0; i <= ncclAvg; i++) {
            PyObject *member = PyObject_GetAttrString(rt, torch_op_names[i]);
            Py_ssize_t v = member ? PyNumber_AsSsize_t(member, NULL) : -1;
            Py_XDECREF(member);
            if (v == -1 && PyErr_Occurred()) {
                PyErr_Clear(); /* a member this torch lacks: read by name */
                continue;
            }
            if (v >= 0 && v < (Py_ssize_t)sizeof st->redops->torch_ops) {
                st->redops->torch_ops[v] = (signed char)i;
            }
        }
        st->redops->ReduceOp = ro;
        st->redops->RedOpType = rt;
    }
    *reduce_op = st->redops->ReduceOp;
    *red_op_type = st->redops->RedOpType;
    return 0;
}

static const char *
accepted_ops(int flags)
{
    return (flags & PYCCL_OP_PREMUL)
               ? "SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, their names as strings "
                 "('sum', ...), a torch.distributed.ReduceOp, or "
                 "pyccl.premul_sum(x)"
               : "SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, their names as strings "
                 "('sum', ...), or a torch.distributed.ReduceOp";
}

/* A torch ReduceOp / RedOpType: NCCL's op for its value (the table made
 * from the names), else its name for the message. */
static int
read_torch_op(pyccl_state *st, const char *op, PyObject *obj, PyObject *red_op_type,
              int flags, int *redop)
{
    PyObject *kind = Py_NewRef(obj);
    if (!PyObject_TypeCheck(kind, (PyTypeObject *)red_op_type)) {
        Py_SETREF(kind, PyObject_GetAttrString(obj, "op"));
        if (kind == NULL) {
            return -1;
        }
    }
    PyObject *value = PyNumber_Index(kind);
    Py_ssize_t v = value ? PyNumber_AsSsize_t(value, NULL) : -1;
    Py_XDECREF(value);
    PyErr_Clear(); /* no value: the name says */
    if (v >= 0 && v < (Py_ssize_t)sizeof st->redops->torch_ops && st->redops->torch_ops[v] >= 0) {
        Py_DECREF(kind);
        *redop = st->redops->torch_ops[v];
        return 0;
    }
    PyObject *name = PyObject_GetAttrString(kind, "name");
    Py_DECREF(kind);
    if (name == NULL) {
        return -1;
    }
    const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (text == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s: op=%R has no readable name", op, obj);
        }
        Py_DECREF(name);
        return -1;
    }
    for (int i = 0; i <= ncclAvg; i++) {
        if (strcmp(text, torch_op_names[i]) == 0) {
            Py_DECREF(name);
            *redop = i;
            return 0;
        }
    }
    if (strcmp(text, "PREMUL_SUM") == 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: op=ReduceOp.PREMUL_SUM is not taken here%s", op,
                     (flags & PYCCL_OP_PREMUL) ? "; pass pyccl.premul_sum(x)" : "");
    }
    else {
        PyErr_Format(PyExc_ValueError,
                     "%s: op=ReduceOp.%s has no NCCL reduction (%s)", op, text,
                     accepted_ops(flags));
    }
    Py_DECREF(name);
    return -1;
}

int
pyccl_read_redop(pyccl_state *st, const char *op, PyObject *obj, int flags,
                 int *redop, PyObject **scalar)
{
    if (PyLong_Check(obj) && !PyBool_Check(obj)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        /* With the drop-in's own communicators, ints past AVG may be ops the
         * user made on them (ncclRedOpCreatePreMulSum); NCCL checks those. */
        long hi = (flags & PYCCL_OP_ANY_INT) ? INT32_MAX : ncclAvg;
        if (overflow || v < 0 || v > hi) {
            PyErr_Format(PyExc_ValueError, "%s: op=%S is not a reduction op (%s)",
                         op, obj, accepted_ops(flags));
            return -1;
        }
        *redop = (int)v;
        return 0;
    }
    if (PyUnicode_Check(obj)) {
        Py_ssize_t n;
        const char *text = PyUnicode_AsUTF8AndSize(obj, &n);
        if (text == NULL) {
            return -1;
        }
        for (int i = 0; i <= ncclAvg; i++) {
            if ((size_t)n == strlen(op_names[i]) &&
                strncasecmp(text, op_names[i], (size_t)n) == 0) {
                *redop = i;
                return 0;
            }
        }
        PyErr_Format(PyExc_ValueError, "%s: op=%R is not a reduction op (%s)", op,
                     obj, accepted_ops(flags));
        return -1;
    }
    PyObject *reduce_op, *red_op_type;
    if (torch_op_types(st, &reduce_op, &red_op_type) < 0) {
        return -1;
    }
    if (reduce_op != NULL && (PyObject_TypeCheck(obj, (PyTypeObject *)red_op_type) ||
                              PyObject_TypeCheck(obj, (PyTypeObject *)reduce_op))) {
        return read_torch_op(st, op, obj, red_op_type, flags, redop);
    }
    if (scalar != NULL) {
        if (PyObject_GetOptionalAttr(obj, st->redops->s_premul, scalar) < 0) {
            return -1;
        }
        if (*scalar != NULL) {
            return 1;
        }
    }
    PyErr_Format(PyExc_TypeError, "%s: op must be a reduction op (%s), got %.200s", op,
                 accepted_ops(flags), Py_TYPE(obj)->tp_name);
    return -1;
}

/* ---- devices ---- */

static int
bad_device(const char *op, const char *what, PyObject *shown)
{
    PyErr_Format(PyExc_ValueError, "%s: %s must be a CUDA device ('cuda:N'), got %R",
                 op, what, shown);
    return -1;
}

/* "cuda" (-1: the current device) or "cuda:N" (N digits only). */
static int
read_device_text(const char *op, const char *what, PyObject *obj, int *device)
{
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(obj, &n);
    if (text == NULL) {
        return -1;
    }
    if ((size_t)n != strlen(text) || strncmp(text, "cuda", 4) != 0 ||
        (n > 4 && (text[4] != ':' || n == 5))) {
        return bad_device(op, what, obj);
    }
    long long v = n == 4 ? -1 : 0;
    for (const char *p = text + 5; n > 4 && *p; p++) {
        if (*p < '0' || *p > '9') {
            return bad_device(op, what, obj);
        }
        v = v > INT32_MAX ? v : v * 10 + (*p - '0');
    }
    if (v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: %s=%R is out of range", op, what, obj);
        return -1;
    }
    *device = (int)v;
    return 0;
}

/* A torch.device: "cuda" type, its index or -1; 1 when obj is none. */
static int
read_torch_device(const char *op, const char *what, PyObject *obj, int *device)
{
    PyObject *torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");
    PyObject *cls = torch ? PyObject_GetAttrString(torch, "device") : NULL;
    if (cls == NULL) {
        PyErr_Clear(); /* no torch (or one without torch.device) loaded */
        return 1;
    }
    int is = PyType_Check(cls) && PyObject_TypeCheck(obj, (PyTypeObject *)cls);
    Py_DECREF(cls);
    if (!is) {
        return 1;
    }
    PyObject *type = PyObject_GetAttrString(obj, "type");
    PyObject *index = type ? PyObject_GetAttrString(obj, "index") : NULL;
    int rc = -1;
    if (index == NULL) {
        goto done;
    }
    if (!PyUnicode_Check(type) || PyUnicode_CompareWithASCIIString(type, "cuda") != 0) {
        PyObject *text = PyObject_Str(obj);
        if (text != NULL) {
            bad_device(op, what, text);
            Py_DECREF(text);
        }
        goto done;
    }
    *device = -1;
    rc = index == Py_None ? 0 : pyccl_read_int(op, what, index, device);
done:
    Py_XDECREF(type);
    Py_XDECREF(index);
    return rc;
}

int
pyccl_read_device(const char *op, const char *what, PyObject *obj, int *device)
{
    if (obj == NULL || obj == Py_None) {
        *device = -1;
        return 0;
    }
    if (PyLong_Check(obj) && !PyBool_Check(obj)) {
        if (pyccl_read_int(op, what, obj, device) < 0) {
            return -1;
        }
        if (*device < 0) {
            PyErr_Format(PyExc_ValueError, "%s: %s must be >= 0, got %d", op, what,
                         *device);
            return -1;
        }
        return 0;
    }
    if (PyUnicode_Check(obj)) {
        return read_device_text(op, what, obj, device);
    }
    int r = read_torch_device(op, what, obj, device);
    if (r <= 0) {
        return r;
    }
    PyErr_Format(PyExc_TypeError,
                 "%s: %s must be an int, 'cuda:N' or a CUDA torch.device, got %.200s",
                 op, what, Py_TYPE(obj)->tp_name);
    return -1;
}

int
pyccl_read_timeout(const char *op, PyObject *obj, double *out)
{
    *out = 0.0;
    if (obj == NULL || obj == Py_None) {
        return 0;
    }
    PyObject *secs = NULL; /* a datetime.timedelta's total_seconds(), as torch takes */
    if (!PyBool_Check(obj) && !PyFloat_Check(obj) && !PyLong_Check(obj)) {
        PyObject *dt = PyImport_ImportModule("datetime");
        PyObject *td = dt != NULL ? PyObject_GetAttrString(dt, "timedelta") : NULL;
        int is_td = td != NULL ? PyObject_IsInstance(obj, td) : -1;
        Py_XDECREF(td);
        Py_XDECREF(dt);
        if (is_td < 0) {
            return -1;
        }
        if (is_td) {
            secs = PyObject_CallMethod(obj, "total_seconds", NULL);
            if (secs == NULL) {
                return -1;
            }
        }
    }
    if (secs == NULL && (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj)))) {
        PyErr_Format(PyExc_TypeError,
                     "%s: timeout must be a number of seconds (int or float), "
                     "a datetime.timedelta or None, got %.200s",
                     op, Py_TYPE(obj)->tp_name);
        return -1;
    }
    double v = PyFloat_AsDouble(secs != NULL ? secs : obj);
    Py_XDECREF(secs);
    if (v == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        v = Py_HUGE_VAL;
    }
    if (!(v > 0.0) || !Py_IS_FINITE(v)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: timeout must be a finite number of seconds > 0, got %R",
                     op, obj);
        return -1;
    }
    *out = v;
    return 0;
}
