/* What every layer of pyccl._C shares, and that calls nothing of the
 * project's: the Python and NCCL compatibility shims, the monotonic clock,
 * the table type of the loaded NCCL/CUDA calls, the dtype row, the module
 * state (what every layer shares, and a pointer to each layer's own part,
 * whose type only its owner defines), a tensor as read, the communicator
 * object and its life states, the rows of a collective's NCCL calls and the
 * kinds of failure.  Every header of the project includes it.  It declares
 * no function of the project: each layer's header declares what that layer
 * offers (docs/ARCHITECTURE.md, "C (`csrc/`), in layers"). */
#ifndef PYCCL_H
#define PYCCL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* Monotonic seconds: the clock of every deadline in pyccl (libc only, so
 * any layer may use it). */
static inline double
pyccl_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Python 3.9-3.12 spellings of calls this code uses in their 3.13 form. */
#if PY_VERSION_HEX < 0x030D0000
#define Py_IsFinalizing() _Py_IsFinalizing()
static inline int
PyDict_GetItemRef(PyObject *d, PyObject *k, PyObject **out)
{
    *out = PyDict_GetItemWithError(d, k);
    if (*out != NULL) {
        Py_INCREF(*out);
        return 1;
    }
    return PyErr_Occurred() ? -1 : 0;
}
#endif
#if PY_VERSION_HEX < 0x030D0000
#define PyObject_GetOptionalAttr(o, n, r) _PyObject_LookupAttr((o), (n), (r))
#endif
#if PY_VERSION_HEX < 0x030C0000
static inline PyObject *
PyErr_GetRaisedException(void)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v != NULL && tb != NULL) {
        PyException_SetTraceback(v, tb);
    }
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}
static inline void
PyErr_SetRaisedException(PyObject *exc)
{
    if (exc == NULL) {
        PyErr_Restore(NULL, NULL, NULL);
        return;
    }
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc,
                  PyException_GetTraceback(exc));
}
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_T_LONGLONG T_LONGLONG
#define Py_T_INT T_INT
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_READONLY READONLY
#endif

/* Types and enum values only: no NCCL or CUDA symbol is linked.  The
 * functions are reached through pyccl_api, filled by dlopen/dlsym from the
 * libraries torch already loaded (see loader.c). */
#include <nccl.h>

/* Built against an older nccl.h: the prototypes of the registration calls
 * (resolved at run time like every call, NULL on a library without them). */
#if NCCL_VERSION_CODE < 21900
ncclResult_t ncclMemAlloc(void **ptr, size_t size);
ncclResult_t ncclMemFree(void *ptr);
ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle);
ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle);
#endif
#if NCCL_VERSION_CODE < 22700
typedef struct ncclWindow_vidmem *ncclWindow_t;
#define NCCL_WIN_COLL_SYMMETRIC 0x01
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size,
                                    ncclWindow_t *win, int winFlags);
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
#define NCCL_SHRINK_DEFAULT 0x00
#define NCCL_SHRINK_ABORT 0x01
ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                            ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags);
#endif
#if NCCL_VERSION_CODE < 22800
ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags);
#endif

/* NCCL calls pyccl resolves; a missing one means the library is too old. */
#define PYCCL_NCCL_REQUIRED(X)                                              \
    X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRank)                \
    X(ncclCommInitAll) X(ncclCommDestroy) X(ncclCommAbort) X(ncclCommCount) \
    X(ncclCommCuDevice) X(ncclCommUserRank) X(ncclGetErrorString)           \
    X(ncclGroupStart) X(ncclGroupEnd) X(ncclAllReduce) X(ncclReduce)        \
    X(ncclBroadcast) X(ncclAllGather) X(ncclReduceScatter) X(ncclSend)      \
    X(ncclRecv)
/* Newer calls: NULL when the loaded NCCL predates them; checked at use. */
#define PYCCL_NCCL_OPTIONAL(X)                                              \
    X(ncclGetLastError) X(ncclCommGetAsyncError) X(ncclCommSplit)           \
    X(ncclRedOpCreatePreMulSum) X(ncclRedOpDestroy)                         \
    X(ncclCommInitRankConfig) X(ncclCommFinalize)                          \
    X(ncclMemAlloc) X(ncclMemFree) X(ncclCommRegister)                      \
    X(ncclCommDeregister) X(ncclCommWindowRegister)                         \
    X(ncclCommWindowDeregister) X(ncclCommShrink) X(ncclCommRevoke)
#define PYCCL_CUDART_REQUIRED(X)                                            \
    X(cudaGetDevice) X(cudaSetDevice) X(cudaGetDeviceCount)                 \
    X(cudaGetErrorString) X(cudaGetLastError) X(cudaStreamSynchronize)      \
    X(cudaDeviceSynchronize) X(cudaPointerGetAttributes) X(cudaMalloc)      \
    X(cudaFree) X(cudaEventCreateWithFlags) X(cudaEventRecord)              \
    X(cudaEventQuery) X(cudaEventDestroy) X(cudaStreamIsCapturing)          \
    X(cudaThreadExchangeStreamCaptureMode)
/* For pyccl's own all-reduce (ar.c); NULL turns it off with a reason. */
#define PYCCL_CUDART_OPTIONAL(X)                                            \
    X(cudaIpcGetMemHandle) X(cudaIpcOpenMemHandle) X(cudaIpcCloseMemHandle) \
    X(cudaMemset) X(cudaMemcpy) X(cudaHostAlloc) X(cudaFreeHost)            \
    X(cudaDeviceGetPCIBusId) X(cudaDeviceGetByPCIBusId)                     \
    X(cudaDeviceCanAccessPeer) X(cudaStreamWaitEvent) X(cudaStreamQuery)

#define PYCCL_DECLARE_FN(name) __typeof__(name) *name;
typedef struct {
    int loaded;
    int nccl_version;          /* ncclGetVersion() of the loaded library */
    void *nccl_handle;
    void *cudart_handle;
    PYCCL_NCCL_REQUIRED(PYCCL_DECLARE_FN)
    PYCCL_NCCL_OPTIONAL(PYCCL_DECLARE_FN)
    PYCCL_CUDART_REQUIRED(PYCCL_DECLARE_FN)
    PYCCL_CUDART_OPTIONAL(PYCCL_DECLARE_FN)
} pyccl_api;
#undef PYCCL_DECLARE_FN

/* One row per torch dtype pyccl knows.  nccl < 0: NCCL has no such type
 * (the bytes can still be moved by broadcast/all_gather). */
typedef struct {
    const char *attr;        /* torch.<attr> */
    const char *scalar_name; /* c10 ScalarType name, as torch's errors print it */
    int nccl;                /* ncclDataType_t or -1 */
    int itemsize;
    int min_nccl_version;    /* loaded NCCL must be at least this to use .nccl */
} pyccl_dtype_info;

#define PYCCL_NDTYPES 21

/* The state each layer keeps for itself, reached through the module state
 * below and defined only by its owner: the torch reader's torch objects and
 * interned names (tensor.c), torch.distributed's op types (args.c), the
 * library candidates (loader.c), the comms=None cliques and their locks
 * (clique.c), the communicators' names and pending splits (communicator.c),
 * the watchdog (watch.h, the timeouts layer's own header).  The owner makes,
 * visits, clears and frees its part: module.c calls its
 * pyccl_<part>_state_init/traverse/clear/free (the watchdog is made on first
 * use, and pyccl_watchdog_free frees it).  A part stays allocated from the
 * exec slot to m_free, its objects NULL once m_clear ran. */
struct pyccl_torch;
struct pyccl_redops;
struct pyccl_libs;
struct pyccl_cliques;
struct pyccl_comms;
struct pyccl_watchdog;

/* The module state: only what every layer shares.  tests/test_layers_cpu.py
 * keeps it small and each part's members to its owner's layer. */
typedef struct {
    /* exception types (errors.c raises them; module.c makes them) */
    PyObject *NcclError;
    PyObject *CudaError;
    PyObject *NcclTimeoutError;  /* subclass of NcclError and TimeoutError */
    /* heap types */
    PyObject *CommunicatorType;
    PyObject *NcclBufferType;    /* memory.c: what pyccl.empty wraps */
    PyObject *RegistrationType;  /* registration.c: comm.register()'s handle */
    /* NCCL/CUDA entry points, filled on first GPU use (loader.c): every
     * layer calls through them, so they are here, one load away */
    pyccl_api api;
    int exiting;                 /* set at interpreter exit: leak, never destroy */
    /* the layers' own parts (above) */
    struct pyccl_torch *torch;       /* tensor.c */
    struct pyccl_redops *redops;     /* args.c */
    struct pyccl_libs *libs;         /* loader.c */
    struct pyccl_cliques *cliques;   /* clique.c */
    struct pyccl_comms *comms;       /* communicator.c */
    struct pyccl_watchdog *watchdog; /* the timeouts layer: started on first use */
} pyccl_state;

/* One array as read and checked by the reader (tensor.c), the only code that
 * reads a tensor's attributes: numel >= 0, numel * itemsize fits in int64,
 * device in 0..INT_MAX, data pointer non-null when there are bytes and not
 * wrapping the address space, itemsize that of a known dtype.  Nothing in it
 * refers to the dtype object: a `dtype` property may return a fresh object
 * each time, so what is needed of an unknown dtype is copied. */
typedef struct {
    PyObject *obj;     /* borrowed: the caller keeps it alive for the call */
    char *ptr;
    int64_t numel;
    int64_t nbytes;    /* numel * itemsize, overflow-checked */
    int64_t rows;      /* dim 0 of a __cuda_array_interface__ array; -1: unknown */
    int device;
    int dtype;         /* row of pyccl_dtype_table, or -1 */
    int itemsize;
    char dtype_name[64]; /* str(dtype) of a dtype not in the table ("" else) */
} pyccl_tensor;

/* ---- the communicator object (communicator.c makes it) ---- */
/* c->life (call.h says the states) */
enum {
    PYCCL_LIFE_USABLE = 0,
    PYCCL_LIFE_DESTROYING,
    PYCCL_LIFE_GONE,
};
/* How far the host may run ahead of the GPU work of a communicator whose peer
 * died unseen (its kernels, NCCL's or pyccl's, then wait for ever; without a
 * bound the host fills the CUDA launch queue, and a launch blocks there,
 * holding the communicator's lock or the GIL, so that neither abort() from
 * another thread nor Ctrl-C could end it): every PYCCL_LEAD_EVERY-th call (own
 * kernels: launch) leaves a mark behind its work, and it waits, with the GIL
 * and the locks released, for the mark PYCCL_LEAD_MARKS back to be reached:
 * at most PYCCL_LEAD_EVERY x PYCCL_LEAD_MARKS calls ahead.  The own kernels'
 * marks: ar_setup.h; NCCL's, on communicators without a timeout (those with
 * one have an event per call, at most PYCCL_MAX_PENDING unfinished, timeouts.h):
 * pyccl_comm's `lead`. */
#define PYCCL_LEAD_EVERY 16
#define PYCCL_LEAD_MARKS 16

typedef struct {
    PyObject_HEAD
    ncclComm_t comm;     /* the one NCCL handle; NULL once destroyed, aborted or failed */
    int rank;
    int size;
    int device;
    void *scratch;       /* barrier()'s device word, allocated on first use */
    /* The door's (call.c, the only writer): calls between begin and end,
     * and its life (PYCCL_LIFE_*); in_group: pyccl.group()s not ended that
     * hold work of it (enqueue.c, the only writer, as a call joins the
     * group); abort_asked: abort() came while destroy() ran; aborting:
     * abort()s between the door's yes and their end, read without the GIL
     * by a wait whose work such an abort may have ended (watch_calls.c). */
    int inflight;
    int in_group;
    int life;
    int abort_asked;
    int aborting;
    int pending;         /* split inside pyccl.group(): NCCL writes `comm` at the group's end */
    pid_t pid;           /* the process that made it: a child made by fork() inherits a copy
                          * of it (locks a parent's thread held included) it cannot use */
    PyObject *weakreflist;
    PyObject *name;      /* str, made on first read of .name; NULL before */
    /* Created with timeout= (or failed/aborted): the watchdog's record of it
     * (watchdog.c), which uses `comm` and `mu` above, this communicator's
     * one handle and one lock.  NULL otherwise, and then nothing below costs
     * anything per call. */
    struct pyccl_watch *watch;
    double timeout;      /* seconds, 0 for none; kept after destroy() */
    /* NCCL's config.blocking of `comm` (1 without a timeout; with one, the
     * user's choice: 0 bounds every host-side NCCL call too, at NCCL's cost
     * of a thread per launch) */
    int blocking;
    /* Without a watch: the streams it was used on, for wait() (which records
     * an event on each then).  last_stream makes noting one a compare. */
    cudaStream_t last_stream;
    cudaStream_t *streams;   /* PyMem_Malloc'd */
    int nstreams;
    /* Without a watch, NCCL's marks (watch_enqueue.c, under `mu`): the
     * calls counted (a pyccl.group()'s at its end); every PYCCL_LEAD_EVERY-th
     * records an event of `lead` (a ring of PYCCL_LEAD_MARKS + 1, made at the
     * first mark, PyMem_RawMalloc'd) and waits for the one PYCCL_LEAD_MARKS back,
     * counted in lead_waiters meanwhile (the events are freed only when none
     * waits: pyccl_lead_free). */
    unsigned long long ncalls;
    cudaEvent_t *lead;
    unsigned long long nlead;
    int lead_waiters;
    struct pyccl_ar *ar; /* own all-reduce state (ar.c), NULL until first use */
    /* The communicator's one lock, with or without a watch (the watch's `mu`
     * points here), held around every NCCL call on its handle: NCCL
     * communicators are not thread-safe.  Taken with the GIL released
     * (pyccl_comm_lock waits without it), so no GIL holder ever blocks on
     * it; `watch` changes from NULL only under it (abort).  Its place in
     * the lock order: locks.h. */
    pthread_mutex_t mu;
    int setups;          /* own-kernel set-ups in flight (counted in inflight too):
                          * abort() does not wait for them (they hold `mu` per NCCL call) */
    /* register()/register_window() handles still open (reg_list.c):
     * a list through the handles, which each hold a reference to c */
    struct pyccl_reg *regs;
} pyccl_comm;

/* ---- a collective's NCCL calls, as rows (enqueue.c runs them) ---- */
typedef enum {
    PYCCL_ALL_REDUCE,
    PYCCL_REDUCE,
    PYCCL_BROADCAST,
    PYCCL_ALL_GATHER,
    PYCCL_REDUCE_SCATTER,
    PYCCL_SEND,
    PYCCL_RECV,
    /* pyccl's own kernel, launched on `stream` already: nothing for NCCL to
     * do; the row has its work tracked like an NCCL call's (ar.c) */
    PYCCL_LAUNCHED,
} pyccl_coll;

/* A premul_sum reduction as read from the arguments (its scalar in the
 * tensor's type): the enqueue makes NCCL's op on the tasks' communicator,
 * under its lock, and destroys it once the calls given it returned. */
typedef struct {
    int type;
    unsigned char scalar[8];
} pyccl_premul;

typedef struct {
    pyccl_coll coll;
    const void *send;
    void *recv;
    size_t count;        /* NCCL's count argument for this collective */
    int type;            /* ncclDataType_t */
    int peer;            /* root or peer rank */
    ncclComm_t comm;
    cudaStream_t stream;
} pyccl_task;

/* The op to give ncclReduceScatter for `redop` on `nranks` ranks.  NCCL
 * 2.28.9 leaves the last elements of a one-rank ReduceScatter with ncclAvg
 * unwritten from 2^20 elements on (seen on H100: 3 of 2^20+3 float32, 4 of
 * 2^20+4; torch.cuda.nccl alike); over one rank the average is the sum, which
 * it gets right. */
static inline int
pyccl_reduce_scatter_op(int redop, int nranks)
{
    return redop == ncclAvg && nranks == 1 ? ncclSum : redop;
}

/* How a communicator failed (pyccl_failure_exception picks the type). */
enum {
    PYCCL_FAIL_NONE = 0,
    PYCCL_FAIL_TIMEOUT, /* NcclTimeoutError */
    PYCCL_FAIL_NCCL,    /* NcclError: NCCL reported an asynchronous error */
    PYCCL_FAIL_CUDA,    /* CudaError: the tracked work failed on the GPU */
    PYCCL_FAIL_ABORTED, /* RuntimeError: abort(), or interrupted mid-call */
};

#endif /* PYCCL_H */
