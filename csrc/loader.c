/* Finding NCCL and the CUDA runtime at first GPU use.
 *
 * pyccl links neither: importing pyccl._C must work on a machine with no GPU,
 * driver or NCCL, and a process must hold exactly one NCCL (the one torch
 * loaded, so pyccl.nccl.version() == torch.cuda.nccl.version() and
 * communicators are interchangeable with torch's library state).  So the
 * libraries already in the process are taken first (RTLD_NOLOAD); only when
 * torch did not load them are the candidate paths from pyccl/_libs.py tried. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dlinfo */
#endif
#include "loader.h"

#include <dlfcn.h>
#include <link.h>
#include <stdlib.h>
#include <string.h>

static const char *const nccl_sonames[] = {"libnccl.so.2", "libnccl.so", NULL};
static const char *const cudart_sonames[] = {
    "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", NULL};

/* The loader's part of the module state: where to look for the libraries
 * when torch has not loaded them (pyccl/_libs.py computes these). */
struct pyccl_libs {
    PyObject *nccl_candidates;   /* list of str: where to look for libnccl */
    PyObject *cudart_candidates; /* list of str: where to look for libcudart */
};

int
pyccl_libs_state_init(pyccl_state *st)
{
    struct pyccl_libs *l = st->libs = PyMem_Calloc(1, sizeof *l);
    if (l == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    l->nccl_candidates = PyList_New(0);
    l->cudart_candidates = PyList_New(0);
    return l->nccl_candidates != NULL && l->cudart_candidates != NULL ? 0 : -1;
}

void
pyccl_libs_state_clear(pyccl_state *st)
{
    if (st->libs != NULL) {
        Py_CLEAR(st->libs->nccl_candidates);
        Py_CLEAR(st->libs->cudart_candidates);
    }
}

void
pyccl_libs_state_free(pyccl_state *st)
{
    pyccl_libs_state_clear(st);
    PyMem_Free(st->libs);
    st->libs = NULL;
}

int
pyccl_set_library_candidates(pyccl_state *st, PyObject *nccl_paths, PyObject *cudart_paths)
{
    Py_XSETREF(st->libs->nccl_candidates, PyList_GetSlice(nccl_paths, 0, PY_SSIZE_T_MAX));
    Py_XSETREF(st->libs->cudart_candidates,
               PyList_GetSlice(cudart_paths, 0, PY_SSIZE_T_MAX));
    if (st->libs->nccl_candidates == NULL || st->libs->cudart_candidates == NULL) {
        return -1;
    }
    return 0;
}

/* dlopen the first library found: loaded sonames, then the candidate paths,
 * then the sonames through the loader's search path.  Errors accumulate in
 * `tried` (a list of str) for the message. */
/* dlopen one library, or note why not in `tried` (a list of str). */
static void *
try_open(const char *name, PyObject *tried, int *failed)
{
    /* RTLD_GLOBAL: a later torch import must find this same copy. */
    void *h = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (h == NULL) {
        PyObject *msg = PyUnicode_FromString(dlerror());
        if (msg == NULL || PyList_Append(tried, msg) < 0) {
            *failed = 1;
        }
        Py_XDECREF(msg);
    }
    return h;
}

/* dlopen the first library found: loaded sonames, then the candidate paths,
 * then the sonames through the loader's search path.  Errors accumulate in
 * `tried` for the message. */
static void *
open_first(const char *const *sonames, PyObject *candidates, PyObject *tried)
{
    void *h = NULL;
    int failed = 0;
    for (const char *const *s = sonames; *s && !h; s++) {
        h = dlopen(*s, RTLD_NOW | RTLD_NOLOAD);
    }
    Py_ssize_t n = candidates ? PyList_GET_SIZE(candidates) : 0;
    for (Py_ssize_t i = 0; i < n && !h && !failed; i++) {
        const char *path = PyUnicode_AsUTF8(PyList_GET_ITEM(candidates, i));
        if (path == NULL) {
            return NULL;
        }
        h = try_open(path, tried, &failed);
    }
    for (const char *const *s = sonames; *s && !h && !failed; s++) {
        h = try_open(*s, tried, &failed);
    }
    return h;
}

/* Where open_first looked, for the message: the sonames among the libraries
 * already loaded, the candidate paths, then the loader's search path. */
static int
raise_not_found(const char *op, const char *what, const char *const *sonames,
                PyObject *candidates, const char *hint, PyObject *tried)
{
    if (PyErr_Occurred()) {
        return -1;
    }
    PyObject *sep = PyUnicode_FromString("; ");
    PyObject *joined = sep ? PyUnicode_Join(sep, tried) : NULL;
    PyObject *comma = PyUnicode_FromString(", ");
    PyObject *paths = NULL;
    if (comma != NULL && candidates != NULL && PyList_GET_SIZE(candidates) > 0) {
        paths = PyUnicode_Join(comma, candidates);
    }
    else if (comma != NULL) {
        paths = PyUnicode_FromString("none");
    }
    Py_XDECREF(sep);
    Py_XDECREF(comma);
    if (joined == NULL || paths == NULL) {
        Py_XDECREF(joined);
        Py_XDECREF(paths);
        return -1;
    }
    char names[128] = "";
    for (const char *const *n = sonames; *n; n++) {
        size_t used = strlen(names);
        PyOS_snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", *n);
    }
    const char *ld = getenv("LD_LIBRARY_PATH");
    PyErr_Format(PyExc_RuntimeError,
                 "%s: cannot load %s (%s). Looked for %s among the libraries "
                 "already loaded (torch's), at the candidate paths (%U), then "
                 "through the dynamic loader's search path (LD_LIBRARY_PATH=%s, "
                 "ld.so.cache). Tried: %U",
                 op, what, hint, names, paths, ld && *ld ? ld : "unset", joined);
    Py_DECREF(joined);
    Py_DECREF(paths);
    return -1;
}

/* The file a dlopen handle came from, for messages ("?" when unknown). */
static const char *
handle_path(void *h)
{
    struct link_map *lm = NULL;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm != NULL && lm->l_name && lm->l_name[0]) {
        return lm->l_name;
    }
    return "?";
}

int
pyccl_load(pyccl_state *st, const char *op)
{
    pyccl_api *a = &st->api;
    if (a->loaded) {
        return 0;
    }
    PyObject *tried = PyList_New(0);
    if (tried == NULL) {
        return -1;
    }
    void *nccl = open_first(nccl_sonames, st->libs->nccl_candidates, tried);
    if (nccl == NULL) {
        raise_not_found(op, "NCCL", nccl_sonames, st->libs->nccl_candidates,
                        "install nvidia-nccl-cu13 or set PYCCL_NCCL_LIBRARY",
                        tried);
        goto error;
    }
    void *cudart = open_first(cudart_sonames, st->libs->cudart_candidates, tried);
    if (cudart == NULL) {
        raise_not_found(op, "the CUDA runtime", cudart_sonames, st->libs->cudart_candidates,
                        "install torch with CUDA, nvidia-cuda-runtime, or set "
                        "PYCCL_CUDART_LIBRARY",
                        tried);
        goto error;
    }
    /* Resolve into a local table and publish it whole, so a failure leaves
     * st->api untouched and the next call tries again.  Every NCCL since 2.3
     * has ncclGetVersion and every CUDA runtime cudaGetDeviceCount: a library
     * without them is not what it was taken for (a wrong PYCCL_NCCL_LIBRARY),
     * which is a different fix from a too old NCCL. */
    pyccl_api t;
    memset(&t, 0, sizeof t);
    int version = 0;
    *(void **)(&t.ncclGetVersion) = dlsym(nccl, "ncclGetVersion");
    if (t.ncclGetVersion == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: %s is not NCCL: it has no ncclGetVersion (set "
                     "PYCCL_NCCL_LIBRARY to a libnccl.so.2, or unset it)",
                     op, handle_path(nccl));
        goto error;
    }
    if (dlsym(cudart, "cudaGetDeviceCount") == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: %s is not the CUDA runtime: it has no cudaGetDeviceCount "
                     "(set PYCCL_CUDART_LIBRARY to a libcudart.so, or unset it)",
                     op, handle_path(cudart));
        goto error;
    }
    ncclResult_t r = t.ncclGetVersion(&version);
    if (r != ncclSuccess) {
        PyErr_Format(PyExc_RuntimeError, "%s: ncclGetVersion of %s failed (%d)", op,
                     handle_path(nccl), (int)r);
        goto error;
    }
    /* codes since 2.9: major * 10000 + minor * 100 + patch; before, * 1000 */
    int major = version >= 10000 ? version / 10000 : version / 1000;
    int minor = version >= 10000 ? version / 100 % 100 : version / 100 % 10;
    int patch = version % 100;
#define PYCCL_RESOLVE(name, handle, required)                            \
    *(void **)(&t.name) = dlsym(handle, #name);                               \
    if (required && t.name == NULL) {                                         \
        if (handle == nccl) {                                                 \
            PyErr_Format(PyExc_RuntimeError,                                  \
                         "%s: the NCCL at %s (%d.%d.%d) lacks %s; pyccl "     \
                         "needs NCCL >= 2.7",                                 \
                         op, handle_path(handle), major, minor, patch, #name); \
        }                                                                     \
        else {                                                                \
            PyErr_Format(PyExc_RuntimeError,                                  \
                         "%s: the CUDA runtime at %s lacks %s (too old for "  \
                         "pyccl)", op, handle_path(handle), #name);           \
        }                                                                     \
        goto error;                                                           \
    }
#define PYCCL_NCCL_REQ(name) PYCCL_RESOLVE(name, nccl, 1)
#define PYCCL_NCCL_OPT(name) PYCCL_RESOLVE(name, nccl, 0)
#define PYCCL_CUDART_REQ(name) PYCCL_RESOLVE(name, cudart, 1)
#define PYCCL_CUDART_OPT(name) PYCCL_RESOLVE(name, cudart, 0)
    PYCCL_NCCL_REQUIRED(PYCCL_NCCL_REQ)
    PYCCL_NCCL_OPTIONAL(PYCCL_NCCL_OPT)
    PYCCL_CUDART_REQUIRED(PYCCL_CUDART_REQ)
    PYCCL_CUDART_OPTIONAL(PYCCL_CUDART_OPT)
#undef PYCCL_CUDART_OPT
#undef PYCCL_NCCL_REQ
#undef PYCCL_NCCL_OPT
#undef PYCCL_CUDART_REQ
#undef PYCCL_RESOLVE
    t.nccl_version = version;
    t.nccl_handle = nccl;
    t.cudart_handle = cudart;
    t.loaded = 1;
    *a = t;
    Py_DECREF(tried);
    return 0;
error:
    Py_DECREF(tried);
    return -1;
}

int
pyccl_nccl_version(pyccl_state *st, const char *op)
{
    if (pyccl_load(st, op) < 0) {
        return -1;
    }
    return st->api.nccl_version;
}

int
pyccl_gpu_count(pyccl_state *st, const char *op, int *ndev)
{
    if (pyccl_load(st, op) < 0) {
        return -1;
    }
    const pyccl_api *a = &st->api;
    *ndev = 0;
    cudaError_t ce = a->cudaGetDeviceCount(ndev);
    if (ce != cudaSuccess || *ndev == 0) {
        a->cudaGetLastError(); /* clear the sticky-free error */
        PyErr_Format(st->CudaError, "%s: no CUDA GPU is available (cudaGetDeviceCount: %s)", op,
                     ce != cudaSuccess ? a->cudaGetErrorString(ce) : "0 devices");
        return -1;
    }
    return 0;
}

int
pyccl_need_nccl(pyccl_state *st, const char *op, const void *fn,
                const char *call, const char *needed)
{
    if (fn != NULL) {
        return 0;
    }
    /* codes since 2.9: major * 10000 + minor * 100 + patch */
    int v = st->api.nccl_version;
    PyErr_Format(PyExc_RuntimeError,
                 "%s: needs NCCL >= %s for %s; the loaded NCCL is %d.%d.%d", op,
                 needed, call, v / 10000, v / 100 % 100, v % 100);
    return -1;
}
