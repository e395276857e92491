/* pyccl's own intra-node all-reduce: host side.
 *
 * The kernels (csrc/kernels/allreduce.cu) are compiled by setup.py into a
 * fatbin that is embedded here and loaded with the CUDA driver API, found the
 * same way as NCCL (dlopen, nothing linked).  This file
 *   - decides per call whether the own kernels run (algo=, dtype, op, size,
 *     group, capture);
 *   - sets up peer memory once per communicator, collectively, at the first
 *     all_reduce of a supported dtype and op, of any size (whether a call gets
 *     there depends only on arguments every rank passes alike, not on any
 *     rank's environment, so all ranks start the set-up together): a region
 *     per rank, CUDA IPC handles and every rank's settings exchanged by an
 *     NCCL all_gather on the communicator itself, peers mapped, a real
 *     write-then-read probe across every pair, and an agreement (NCCL MIN)
 *     so that either every rank uses the kernels or none does;
 *   - launches one kernel per call on the caller's stream (graph capture
 *     works: the kernels keep their epochs on the device).
 * Where anything is missing the reason is kept (comm.all_reduce_info) and
 * logged once, and NCCL does the work. */
#include "pyccl.h"
#include "kernels/fastar_abi.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef PYCCL_FATBIN_PATH
/* the fatbin setup.py compiled, placed in .rodata by the assembler */
__asm__(".section .rodata\n"
        ".balign 64\n"
        "pyccl_ar_fatbin:\n"
        ".incbin \"" PYCCL_FATBIN_PATH "\"\n"
        ".byte 0\n"
        ".previous\n");
extern const unsigned char pyccl_ar_fatbin[] __asm__("pyccl_ar_fatbin");
#endif

int
pyccl_fastar_built(void)
{
#ifdef PYCCL_FATBIN_PATH
    return 1;
#else
    return 0;
#endif
}

/* ---------------- the driver API, declared here (no cuda.h) ---------------- */

typedef int CUresult;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
/* cuLaunchKernelEx's configuration, as cuda.h (12.0 and later) lays it out */
typedef struct {
    int id;                      /* CUlaunchAttributeID */
    char pad[4];
    union {
        char pad[64];
        int i;
    } value;
} cu_launch_attr;
typedef struct {
    unsigned grid[3], block[3], shared_bytes;
    cudaStream_t stream;
    cu_launch_attr *attrs;
    unsigned nattrs;
} cu_launch_config;
_Static_assert(sizeof(cu_launch_attr) == 72, "CUlaunchAttribute is 72 bytes");
_Static_assert(sizeof(cu_launch_config) == 56, "CUlaunchConfig is 56 bytes");
#define CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
/* The driver table and the kernels loaded per device are process-wide (the
 * driver is): filled once, under load_mu, by the first set-up that needs
 * them, which runs without the GIL, so two set-ups on two threads may race. */
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int tried;
    char err[200];
    CUresult (*cuModuleLoadData)(CUmodule *, const void *);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, unsigned, cudaStream_t, void **,
                               void **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    /* optional: programmatic dependent launch (driver 12.0+, sm_90+) */
    CUresult (*cuLaunchKernelEx)(const cu_launch_config *, CUfunction, void **, void **);
    CUresult (*cuDeviceGet)(int *, int);
    CUresult (*cuDeviceGetAttribute)(int *, int, int);
} drv;

/* kernels: [0 one-shot LL, 1 one-shot, 2 two-shot][dtype][op], then the probe */
enum { K_F32, K_F16, K_BF16, K_I32, K_NTYPES };
enum { K_SUM, K_MAX, K_MIN, K_NOPS };
#define K_PROBE (3 * K_NTYPES * K_NOPS)
#define K_COUNT (K_PROBE + 1)
static const char *const type_names[K_NTYPES] = {"f32", "f16", "bf16", "i32"};
static const char *const op_names[K_NOPS] = {"sum", "max", "min"};

#define MAX_DEVICES 64
static struct {
    int state; /* 0 untried, 1 loaded, -1 failed */
    CUfunction fn[K_COUNT];
} devs[MAX_DEVICES];

/* Under load_mu. */
static int
load_driver(char *why, size_t n)
{
    if (!drv.tried) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (h == NULL) {
            h = dlopen("libcuda.so.1", RTLD_NOW);
        }
        if (h == NULL) {
            snprintf(drv.err, sizeof drv.err, "libcuda.so.1 not found: %s", dlerror());
        } else {
            *(void **)&drv.cuModuleLoadData = dlsym(h, "cuModuleLoadData");
            *(void **)&drv.cuModuleGetFunction = dlsym(h, "cuModuleGetFunction");
            *(void **)&drv.cuLaunchKernel = dlsym(h, "cuLaunchKernel");
            *(void **)&drv.cuGetErrorString = dlsym(h, "cuGetErrorString");
            *(void **)&drv.cuLaunchKernelEx = dlsym(h, "cuLaunchKernelEx");
            *(void **)&drv.cuDeviceGet = dlsym(h, "cuDeviceGet");
            *(void **)&drv.cuDeviceGetAttribute = dlsym(h, "cuDeviceGetAttribute");
            if (!drv.cuModuleLoadData || !drv.cuModuleGetFunction || !drv.cuLaunchKernel ||
                !drv.cuGetErrorString) {
                snprintf(drv.err, sizeof drv.err, "libcuda.so.1 lacks the module calls");
            }
        }
        drv.tried = 1; /* after every symbol: nobody sees a half-filled table */
    }
    if (drv.err[0]) {
        snprintf(why, n, "%s", drv.err);
        return -1;
    }
    return 0;
}

static const char *
cu_error(CUresult r)
{
    const char *s = NULL;
    if (drv.cuGetErrorString == NULL || drv.cuGetErrorString(r, &s) != 0 || s == NULL) {
        return "unknown CUDA driver error";
    }
    return s;
}

#ifdef PYCCL_FATBIN_PATH
static int load_kernels_locked(int device, char *why, size_t n);
#endif

/* The kernels of `device` (current), loaded once; -1 with `why`. */
static int
load_kernels(int device, char *why, size_t n)
{
#ifndef PYCCL_FATBIN_PATH
    (void)device;
    snprintf(why, n, "pyccl was built without nvcc, so its kernels are not compiled in");
    return -1;
#else
    if (device < 0 || device >= MAX_DEVICES) {
        snprintf(why, n, "device index %d is out of pyccl's range", device);
        return -1;
    }
    pthread_mutex_lock(&load_mu);
    int rc = load_kernels_locked(device, why, n);
    pthread_mutex_unlock(&load_mu);
    return rc;
#endif
}

#ifdef PYCCL_FATBIN_PATH
static int
load_kernels_locked(int device, char *why, size_t n)
{
    if (devs[device].state == 1) {
        return 0;
    }
    if (load_driver(why, n) < 0) {
        return -1;
    }
    CUmodule mod;
    CUresult r = drv.cuModuleLoadData(&mod, pyccl_ar_fatbin);
    if (r != 0) {
        snprintf(why, n, "loading the kernels on cuda:%d failed: %s (no code for this GPU?)",
                 device, cu_error(r));
        return -1;
    }
    for (int k = 0; k < K_COUNT; k++) {
        char name[64];
        if (k == K_PROBE) {
            snprintf(name, sizeof name, "pyccl_ar_probe");
        } else {
            snprintf(name, sizeof name, "pyccl_ar_%d_%s_%s", k / (K_NTYPES * K_NOPS),
                     type_names[(k / K_NOPS) % K_NTYPES], op_names[k % K_NOPS]);
        }
        r = drv.cuModuleGetFunction(&devs[device].fn[k], mod, name);
        if (r != 0) {
            snprintf(why, n, "kernel %s missing: %s", name, cu_error(r));
            return -1;
        }
    }
    devs[device].state = 1;
    return 0;
}
#endif

/* Whether `device` can overlap a kernel's launch with the previous kernel
 * on its stream (programmatic dependent launch: compute capability 9.0 and
 * a driver with cuLaunchKernelEx). */
static int
pdl_supported(int device)
{
    int dev, major = 0;
    return drv.cuLaunchKernelEx != NULL && drv.cuDeviceGet != NULL &&
           drv.cuDeviceGetAttribute != NULL && drv.cuDeviceGet(&dev, device) == 0 &&
           drv.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                    dev) == 0 &&
           major >= 9;
}

/* ---------------- per-communicator state ---------------- */

enum { FA_UNTRIED = 0, FA_READY = 1, FA_OFF = -1 };

typedef struct pyccl_fastar {
    int state;
    char reason[400];
    int logged;
    char *base;                         /* this rank's region (cudaMalloc) */
    char *peer[PYCCL_AR_MAX_RANKS];     /* every rank's region here; [rank] = base */
    int *host_err;                      /* pinned, device-visible */
    size_t half;
    size_t one_max, two_max;            /* auto thresholds, read once */
    size_t ll_max;                      /* one-shot sizes up to this use the LL kernel */
    int blocks, threads;
    int pdl;                            /* launch with programmatic stream serialization */
    cudaStream_t last_stream;           /* the stream of the previous launch */
    int launched;
    cudaEvent_t order;                  /* orders a launch after the previous one on another stream */
    int rank, nranks, device;
    double timeout;                     /* seconds a wait may take; 0 = forever */
    double kernel_timeout;              /* the kernels' deadline */
    unsigned skew_ns;                   /* PYCCL_AR_DEBUG_SKEW_NS (testing) */
    double deadline;                    /* the set-up's (monotonic s); 0: none */
    int gone;                           /* the set-up found the communicator aborted */
    char last[512];                     /* ncclGetLastError after a failed set-up call */
    pthread_mutex_t setup_mu;           /* one set-up at a time on a communicator */
    struct pyccl_fastar *prev, *next;   /* in the live list, under live_mu */
    int in_live;
} pyccl_fastar;

/* Every ready communicator's stop word, so that interpreter exit can release
 * kernels still waiting for peers.  A list (no limit on how many), changed
 * under live_mu: the set-up adds to it without the GIL. */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static pyccl_fastar *live_head;

static void
live_add(pyccl_fastar *f)
{
    pthread_mutex_lock(&live_mu);
    f->prev = NULL;
    f->next = live_head;
    if (live_head != NULL) {
        live_head->prev = f;
    }
    live_head = f;
    f->in_live = 1;
    pthread_mutex_unlock(&live_mu);
}

static void
live_remove(pyccl_fastar *f)
{
    pthread_mutex_lock(&live_mu);
    if (f->in_live) {
        if (f->prev != NULL) {
            f->prev->next = f->next;
        } else {
            live_head = f->next;
        }
        if (f->next != NULL) {
            f->next->prev = f->prev;
        }
        f->prev = f->next = NULL;
        f->in_live = 0;
    }
    pthread_mutex_unlock(&live_mu);
}

/* The kernels of c that wait for peers give up now (they poll this
 * host-mapped word); the communicator's own kernels are unusable afterwards. */
void
pyccl_fastar_stop(pyccl_comm *c)
{
    pyccl_fastar *f = c->fastar;
    if (f != NULL && f->host_err != NULL) {
        *(volatile int *)f->host_err = 2;
    }
}

void
pyccl_fastar_stop_all(void)
{
    pthread_mutex_lock(&live_mu);
    for (pyccl_fastar *f = live_head; f != NULL; f = f->next) {
        if (f->host_err != NULL) {
            *(volatile int *)f->host_err = 2;
        }
    }
    pthread_mutex_unlock(&live_mu);
}

static long
env_long(const char *name, long dflt, long lo, long hi)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') {
        return dflt;
    }
    char *end;
    long x = strtol(v, &end, 10);
    if (*end != '\0' || x < lo || x > hi) {
        return dflt;
    }
    return x;
}

static size_t
buffer_bytes(void)
{
    return (size_t)env_long("PYCCL_AR_BUFFER_MB", 16, 1, 4096) << 20;
}

/* Auto thresholds in bytes by world size, from the 2xH200 sweep in
 * docs/PERFORMANCE.md; PYCCL_AR_ONESHOT_MAX / PYCCL_AR_TWOSHOT_MAX (bytes)
 * override them.  Every rank must see the same values. */
static void
thresholds(int nranks, size_t *one, size_t *two)
{
    size_t cap = buffer_bytes();
    /* 2 ranks (measured): one-shot beats NCCL up to the whole buffer (8 MiB:
     * 36 vs 51 us) and two-shot never beats one-shot.  More ranks (not
     * measured yet): one-shot reads n-1 copies, so it stays on small sizes. */
    size_t o = nranks <= 2 ? cap : ((size_t)512 << 10);
    size_t t = nranks <= 2 ? cap : ((size_t)4 << 20);
    o = (size_t)env_long("PYCCL_AR_ONESHOT_MAX", (long)o, 0, 1L << 40);
    t = (size_t)env_long("PYCCL_AR_TWOSHOT_MAX", (long)t, 0, 1L << 40);
    *one = o < cap ? o : cap;
    *two = t < cap ? t : cap;
}

int
pyccl_read_algo(const char *op, PyObject *obj, pyccl_algo *out)
{
    static const char *const names[] = {"auto", "nccl", "oneshot", "twoshot"};
    *out = PYCCL_ALGO_AUTO;
    if (obj == NULL || obj == Py_None) {
        return 0;
    }
    if (PyUnicode_Check(obj)) {
        for (int i = 0; i < 4; i++) {
            if (PyUnicode_CompareWithASCIIString(obj, names[i]) == 0) {
                *out = (pyccl_algo)i;
                return 0;
            }
        }
        PyErr_Format(PyExc_ValueError,
                     "%s: algo must be 'auto', 'nccl', 'oneshot' or 'twoshot', got %R", op, obj);
        return -1;
    }
    PyErr_Format(PyExc_TypeError,
                 "%s: algo must be a str ('auto', 'nccl', 'oneshot' or 'twoshot'), got %.200s",
                 op, Py_TYPE(obj)->tp_name);
    return -1;
}

static const char *
algo_name(pyccl_algo a)
{
    return a == PYCCL_ALGO_ONESHOT ? "oneshot" : "twoshot";
}

static void
log_once(pyccl_fastar *f)
{
    if (f->logged || getenv("PYCCL_QUIET")) {
        return;
    }
    f->logged = 1;
    PySys_FormatStderr("pyccl: rank %d of %d uses NCCL for all_reduce: %s\n", f->rank,
                       f->nranks, f->reason);
}

static uint64_t
host_id(void)
{
    char buf[512] = "";
    gethostname(buf, 256);
    FILE *fp = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (fp != NULL) {
        size_t len = strlen(buf);
        if (fgets(buf + len, (int)(sizeof buf - len), fp) == NULL) {
            buf[len] = '\0';
        }
        fclose(fp);
    }
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (const char *p = buf; *p; p++) {
        h = (h ^ (unsigned char)*p) * 1099511628211ULL;
    }
    return h;
}

/* What each rank tells the others at set-up (NCCL all_gather of the bytes). */
typedef struct {
    cudaIpcMemHandle_t handle;
    char busid[32];
    uint64_t host;
    uint64_t half;
    uint64_t ll_max;
    uint64_t one_max, two_max; /* auto's thresholds: ranks that disagree would pick
                                  different kernels (or NCCL) for one call and hang */
    int32_t pid;
    int32_t ok;
    int32_t blocks;
    int32_t threads;
    uint32_t magic;
    char pad[256 - sizeof(cudaIpcMemHandle_t) - 32 - 40 - 20];
} fa_record;
_Static_assert(sizeof(fa_record) == 256, "fa_record: 256 bytes, the same on every rank");


static double
mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A communicator made with timeout= is NCCL's non-blocking kind: a call may
 * return ncclInProgress and finish later.  ncclInProgress back when the
 * deadline (monotonic s, 0: none) passed (the caller fails the
 * communicator: its peers did not come). */
static ncclResult_t
settle(const pyccl_api *a, ncclComm_t comm, ncclResult_t r, double deadline)
{
    while (r == ncclInProgress && a->ncclCommGetAsyncError) {
        if (a->ncclCommGetAsyncError(comm, &r) != ncclSuccess) {
            return ncclInternalError;
        }
        if (r == ncclInProgress) {
            if (deadline > 0 && mono() > deadline) {
                return ncclInProgress;
            }
            usleep(20);
        }
    }
    return r;
}

/* cudaStreamSynchronize, bounded by the set-up's deadline (a peer that
 * never comes leaves the NCCL kernel waiting): ncclInProgress past it. */
static ncclResult_t
sync_stream(const pyccl_api *a, cudaStream_t s, double deadline)
{
    if (deadline <= 0 || a->cudaStreamQuery == NULL) {
        return a->cudaStreamSynchronize(s) == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
    }
    for (;;) {
        cudaError_t e = a->cudaStreamQuery(s);
        if (e == cudaSuccess) {
            return ncclSuccess;
        }
        if (e != cudaErrorNotReady) {
            return ncclUnhandledCudaError;
        }
        if (mono() > deadline) {
            return ncclInProgress;
        }
        usleep(20);
    }
}

/* One NCCL collective of the set-up or of destroy's barrier (all_gather of
 * bytes, or all_reduce MIN of ints), made and settled under the lock that
 * abort() and the watchdog take before they touch the handle, so neither
 * frees it under the call; the wait for its kernel happens outside that
 * lock, where an abort can end it.  ncclInvalidUsage with f->gone set when
 * the communicator was aborted, failed or destroyed in between. */
static ncclResult_t
held_call(const pyccl_api *a, pyccl_fastar *f, pyccl_comm *c, int gather, const void *send,
          void *recv, size_t count, cudaStream_t s)
{
    ncclComm_t comm;
    pthread_mutex_t *held = pyccl_comm_hold(c, &comm);
    if (held == NULL) {
        f->gone = 1;
        return ncclInvalidUsage;
    }
    ncclResult_t r = gather ? a->ncclAllGather(send, recv, count, ncclUint8, comm, s)
                            : a->ncclAllReduce(send, recv, count, ncclInt32, ncclMin, comm, s);
    r = settle(a, comm, r, f->deadline);
    if (r != ncclSuccess && r != ncclInProgress && a->ncclGetLastError) {
        snprintf(f->last, sizeof f->last, "%s", a->ncclGetLastError(comm));
    }
    pthread_mutex_unlock(held);
    if (r == ncclSuccess) {
        r = sync_stream(a, s, f->deadline);
    }
    return r;
}

/* NCCL all_reduce(MIN) of one int through `dev` (a device int), synchronous.
 * Also the barrier of the set-up and of destroy. */
static ncclResult_t
agree(const pyccl_api *a, pyccl_fastar *f, pyccl_comm *c, int *dev, int *value, cudaStream_t s)
{
    if (a->cudaMemcpy(dev, value, sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess) {
        return ncclUnhandledCudaError;
    }
    ncclResult_t r = held_call(a, f, c, 0, dev, dev, 1, s);
    if (r != ncclSuccess) {
        return r;
    }
    if (a->cudaMemcpy(value, dev, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) {
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

/* Wait until the last kernel launched on f's region has finished (an event
 * after it, polled: unrelated work on the device is not waited for, as
 * cudaDeviceSynchronize would).  Its waits on peers end by themselves once
 * they arrived or the stop word is set. */
static void
wait_launched(const pyccl_api *a, pyccl_fastar *f)
{
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (!f->launched || f->order == NULL ||
        a->cudaStreamIsCapturing(f->last_stream, &cs) != cudaSuccess ||
        cs != cudaStreamCaptureStatusNone || /* a record would join the capture */
        a->cudaEventRecord(f->order, f->last_stream) != cudaSuccess) {
        a->cudaGetLastError();
        return;
    }
    while (a->cudaEventQuery(f->order) == cudaErrorNotReady) {
        usleep(20);
    }
    a->cudaGetLastError();
}

/* Close the peers' regions mapped here and free what no other process sees
 * (the event, the host word); this rank's region only with `free_base`, when
 * no peer can still have it mapped (before the exchange, or after a barrier
 * that follows every rank's close): freeing exported memory that an
 * importer still maps is undefined, so it is kept (leaked) otherwise. */
static void
free_local(const pyccl_api *a, pyccl_fastar *f, int free_base)
{
    for (int r = 0; r < PYCCL_AR_MAX_RANKS; r++) {
        if (r != f->rank && f->peer[r] != NULL && a->cudaIpcCloseMemHandle) {
            a->cudaIpcCloseMemHandle(f->peer[r]);
        }
        f->peer[r] = NULL;
    }
    if (f->order != NULL && a->cudaEventDestroy) {
        a->cudaEventDestroy(f->order);
    }
    f->order = NULL;
    if (f->base != NULL && free_base) {
        a->cudaFree(f->base);
    }
    f->base = NULL;
    if (f->host_err != NULL && a->cudaFreeHost) {
        a->cudaFreeHost(f->host_err);
    }
    f->host_err = NULL;
}

#define WHY(...) snprintf(f->reason, sizeof f->reason, __VA_ARGS__)

/* This rank's region, host word and ordering event; 0 when any failed
 * (with the reason; nothing kept then). */
static int
alloc_local(const pyccl_api *a, pyccl_fastar *f, size_t total, cudaIpcMemHandle_t *handle,
            char *busid, size_t busid_len)
{
    cudaError_t e = a->cudaMalloc((void **)&f->base, total);
    if (e == cudaSuccess) {
        /* all of it, the LL lines too: cudaMalloc often returns a destroyed
         * communicator's region, whose flags a new epoch 1 would accept */
        e = a->cudaMemset(f->base, 0, total);
    }
    if (e == cudaSuccess) {
        e = a->cudaIpcGetMemHandle(handle, f->base);
    }
    if (e == cudaSuccess) {
        e = a->cudaHostAlloc((void **)&f->host_err, sizeof(int), cudaHostAllocMapped);
    }
    if (e == cudaSuccess) {
        e = a->cudaDeviceGetPCIBusId(busid, (int)busid_len, f->device);
    }
    if (e == cudaSuccess && a->cudaEventCreateWithFlags) {
        e = a->cudaEventCreateWithFlags(&f->order, cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
        WHY("setting up %zu bytes of peer memory on cuda:%d failed: %s", total, f->device,
            a->cudaGetErrorString(e));
        a->cudaGetLastError();
        free_local(a, f, 1);
        return 0;
    }
    *f->host_err = 0;
    return 1;
}

/* Why rank p's record rules the kernels out for everyone (a reason written,
 * 0), or 1. */
static int
check_record(pyccl_fastar *f, const fa_record *all, const fa_record *mine, int p)
{
    const int me = f->rank;
    if (!all[p].ok) {
        WHY("rank %d cannot use them", p);
    } else if (all[p].host != mine->host) {
        WHY("rank %d is on another host", p);
    } else if (p != me && all[p].pid == mine->pid) {
        WHY("ranks %d and %d share a process (CUDA IPC works between processes)", me, p);
    } else if (p != me && strcmp(all[p].busid, mine->busid) == 0) {
        WHY("ranks %d and %d share GPU %s", me, p, mine->busid);
    } else if (all[p].half != all[0].half || all[p].ll_max != all[0].ll_max ||
               all[p].blocks != all[0].blocks || all[p].threads != all[0].threads) {
        WHY("ranks disagree on PYCCL_AR_BUFFER_MB / PYCCL_AR_LL_MAX / PYCCL_AR_BLOCKS / "
            "PYCCL_AR_THREADS");
    } else if (all[p].one_max != all[0].one_max || all[p].two_max != all[0].two_max) {
        WHY("ranks disagree on PYCCL_AR_ONESHOT_MAX / PYCCL_AR_TWOSHOT_MAX (rank %d: %llu / "
            "%llu bytes, rank 0: %llu / %llu)", p, (unsigned long long)all[p].one_max,
            (unsigned long long)all[p].two_max, (unsigned long long)all[0].one_max,
            (unsigned long long)all[0].two_max);
    } else {
        return 1;
    }
    return 0;
}

/* Map every peer's region (1), or say why not (0). */
static int
map_peers(const pyccl_api *a, pyccl_fastar *f, const fa_record *all)
{
    for (int p = 0; p < f->nranks; p++) {
        if (p == f->rank) {
            f->peer[p] = f->base;
            continue;
        }
        int pd = -1, can = 1;
        if (a->cudaDeviceGetByPCIBusId && a->cudaDeviceCanAccessPeer &&
            a->cudaDeviceGetByPCIBusId(&pd, all[p].busid) == cudaSuccess) {
            if (a->cudaDeviceCanAccessPeer(&can, f->device, pd) != cudaSuccess) {
                can = 0;
            }
        }
        a->cudaGetLastError(); /* a peer GPU this process does not see is fine */
        if (!can) {
            WHY("cuda:%d has no peer access to cuda:%d (rank %d)", f->device, pd, p);
            return 0;
        }
        void *ptr = NULL;
        cudaError_t e = a->cudaIpcOpenMemHandle(&ptr, all[p].handle,
                                                cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            WHY("mapping rank %d's memory failed: %s", p, a->cudaGetErrorString(e));
            a->cudaGetLastError();
            return 0;
        }
        f->peer[p] = ptr;
    }
    return 1;
}

/* The probe: stage 0 writes into every peer; the agreement is the barrier
 * before stage 1 reads back.  Returns the NCCL result of the agreements;
 * *ok says whether every rank's probe passed. */
static ncclResult_t
probe(const pyccl_api *a, pyccl_fastar *f, pyccl_comm *c, int *flag, uint32_t magic,
      cudaStream_t s, int *ok)
{
    pyccl_ar_params prm;
    memset(&prm, 0, sizeof prm);
    for (int p = 0; p < f->nranks; p++) {
        prm.base[p] = f->peer[p];
    }
    prm.out = flag + 4;
    prm.rank = f->rank;
    prm.nranks = f->nranks;
    prm.magic = magic;
    CUfunction fn = devs[f->device].fn[K_PROBE];
    int zero = 0, stage = 0;
    void *args[] = {&prm, &stage};
    int okp = 1;
    if (a->cudaMemcpy(flag + 4, &zero, sizeof zero, cudaMemcpyHostToDevice) != cudaSuccess ||
        drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, args, NULL) != 0 ||
        a->cudaStreamSynchronize(s) != cudaSuccess) {
        okp = 0;
    }
    ncclResult_t r = agree(a, f, c, flag, &okp, s);
    if (r != ncclSuccess) {
        return r;
    }
    int failed = 0;
    if (okp) {
        stage = 1;
        if (drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, args, NULL) != 0 ||
            a->cudaStreamSynchronize(s) != cudaSuccess ||
            a->cudaMemcpy(&failed, flag + 4, sizeof failed, cudaMemcpyDeviceToHost) !=
                cudaSuccess) {
            okp = 0;
            WHY("the peer-memory probe kernel failed");
        } else if (failed) {
            okp = 0;
            WHY("the write-then-read probe failed with peer mask 0x%x", failed);
        }
    } else {
        WHY("the peer-memory probe could not run on every rank");
    }
    a->cudaGetLastError();
    if ((r = agree(a, f, c, flag, &okp, s)) != ncclSuccess) {
        return r;
    }
    if (!okp && f->reason[0] == '\0') {
        WHY("the write-then-read probe failed on another rank");
    }
    *ok = okp;
    return ncclSuccess;
}

/* Collective.  Called without the GIL, current device = the comm's, f's
 * setup_mu held.  Returns the NCCL result of the exchange (a failure there
 * is the caller's error; f->gone: the communicator was aborted meanwhile);
 * f->state says whether the kernels are usable. */
static ncclResult_t
setup(const pyccl_api *a, pyccl_fastar *f, pyccl_comm *c, cudaStream_t s)
{
    const int n = f->nranks, me = f->rank;
    int ok = 1;
    fa_record mine;
    memset(&mine, 0, sizeof mine);
    const char *off = getenv("PYCCL_DISABLE_OWN_KERNELS");
    if (off != NULL && *off != '\0' && strcmp(off, "0") != 0) {
        ok = 0;
        WHY("PYCCL_DISABLE_OWN_KERNELS is set");
    } else if (n < 2 || n > PYCCL_AR_MAX_RANKS) {
        ok = 0;
        WHY("the own kernels serve 2 to %d ranks, this communicator has %d",
            PYCCL_AR_MAX_RANKS, n);
    } else if (load_kernels(f->device, f->reason, sizeof f->reason) < 0) {
        ok = 0;
    } else if (f->pdl && !pdl_supported(f->device)) {
        f->pdl = 0;
    }
    /* the exchange's scratch first: without it this rank could not join
     * the exchange, and its peers would wait for it */
    char *dev = NULL;
    const size_t scratch = (size_t)n * sizeof(fa_record) + 64;
    if (a->cudaMalloc((void **)&dev, scratch) != cudaSuccess) {
        a->cudaGetLastError();
        return ncclSystemError;
    }
    size_t total = PYCCL_AR_DATA_OFF + 2 * f->half + 2 * (size_t)n * 2 * f->ll_max;
    if (ok) {
        ok = alloc_local(a, f, total, &mine.handle, mine.busid, sizeof mine.busid);
    }
    mine.host = host_id();
    mine.half = f->half;
    mine.ll_max = f->ll_max;
    mine.one_max = f->one_max;
    mine.two_max = f->two_max;
    mine.pid = (int32_t)getpid();
    mine.ok = ok;
    mine.blocks = f->blocks;
    mine.threads = f->threads;
    mine.magic = (uint32_t)(host_id() ^ (uint64_t)getpid() * 2654435761u);

    /* exchange: n records + one int for agreements, in one scratch buffer */
    fa_record *all = NULL;
    ncclResult_t r = ncclSuccess;
    int exchanged = 0; /* peers may have this rank's handle from here on */
    int *flag = (int *)(dev + (size_t)n * sizeof(fa_record));
    if ((all = malloc((size_t)n * sizeof(fa_record))) == NULL) {
        r = ncclSystemError;
        goto out;
    }
    if (a->cudaMemcpy(dev + (size_t)me * sizeof(fa_record), &mine, sizeof mine,
                      cudaMemcpyHostToDevice) != cudaSuccess) {
        r = ncclUnhandledCudaError;
        goto out;
    }
    exchanged = 1;
    r = held_call(a, f, c, 1, dev + (size_t)me * sizeof(fa_record), dev, sizeof(fa_record), s);
    if (r != ncclSuccess) {
        goto out;
    }
    if (a->cudaMemcpy(all, dev, (size_t)n * sizeof(fa_record), cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
        r = ncclUnhandledCudaError;
        goto out;
    }
    for (int p = 0; p < n && ok; p++) {
        ok = check_record(f, all, &mine, p);
    }
    if (ok) {
        ok = map_peers(a, f, all);
    }
    /* everyone mapped everyone, or nobody goes on */
    if ((r = agree(a, f, c, flag, &ok, s)) != ncclSuccess) {
        goto out;
    }
    if (!ok) {
        if (f->reason[0] == '\0') {
            WHY("another rank could not map its peers");
        }
    } else if ((r = probe(a, f, c, flag, all[0].magic, s, &ok)) != ncclSuccess) {
        goto out;
    }
    if (!ok) {
        /* every rank (all know it is off now) closes its mappings, then a
         * barrier: no importer is left when the regions are freed */
        char *base = f->base;
        f->base = NULL;
        free_local(a, f, 0);
        int one = 1;
        if ((r = agree(a, f, c, flag, &one, s)) == ncclSuccess && base != NULL) {
            a->cudaFree(base);
        }
        /* when the barrier failed the region is kept (leaked) */
    }
out:
    if (r != ncclInProgress) { /* a timed-out NCCL kernel may still use it */
        a->cudaFree(dev);
    }
    free(all);
    if (r != ncclSuccess) {
        ok = 0;
        WHY(f->gone ? "the communicator was aborted during the set-up"
                    : "the set-up exchange failed");
    }
    if (ok) {
        f->state = FA_READY;
        f->reason[0] = '\0';
        live_add(f);
    } else {
        f->state = FA_OFF;
        /* once exchanged, a peer may have mapped this region (and on a time-out
         * an NCCL kernel of the exchange may still be queued): keep it */
        free_local(a, f, !exchanged);
    }
    return r;
}

static int
kernel_type(int dtype_row_nccl)
{
    switch (dtype_row_nccl) {
    case ncclFloat32: return K_F32;
    case ncclFloat16: return K_F16;
    case ncclBfloat16: return K_BF16;
    case ncclInt32: return K_I32;
    default: return -1;
    }
}

static int
kernel_op(int redop)
{
    return redop == ncclSum ? K_SUM : redop == ncclMax ? K_MAX : redop == ncclMin ? K_MIN : -1;
}

/* The settings of c's kernels, from the environment and c's timeout (every
 * rank must see the same values; the set-up checks the ones that matter). */
static void
read_settings(pyccl_fastar *f, const pyccl_comm *c)
{
    f->rank = c->rank;
    f->nranks = c->size;
    f->device = c->device;
    f->half = buffer_bytes();
    thresholds(c->size > 0 ? c->size : 2, &f->one_max, &f->two_max);
    f->ll_max = ((size_t)env_long("PYCCL_AR_LL_MAX", 256 << 10, 0, 1L << 24) + 15) & ~(size_t)15;
    f->blocks = (int)env_long("PYCCL_AR_BLOCKS", 64, 1, PYCCL_AR_MAX_BLOCKS);
    f->threads = (int)env_long("PYCCL_AR_THREADS", 512, 32, 512) & ~31;
    /* a wait on peers gives up after the communicator's timeout (or
     * PYCCL_AR_TIMEOUT seconds for one without) */
    const char *to = getenv("PYCCL_AR_TIMEOUT");
    const double ct = pyccl_comm_timeout(c);
    f->timeout = ct > 0 ? ct : to ? atof(to) : 0.0;
    /* with a watchdog, a second later than it: the watchdog fails the
     * communicator first, so a call that gave up is never mistaken for a
     * finished one */
    f->kernel_timeout = ct > 0 ? f->timeout + 1.0 : f->timeout;
    f->skew_ns = (unsigned)env_long("PYCCL_AR_DEBUG_SKEW_NS", 0, 0, 1000000);
    /* programmatic dependent launch: a rank-local choice (it changes when a
     * kernel is scheduled, not what it does), so ranks need not agree; the
     * set-up turns it off where the GPU or the driver lacks it */
    f->pdl = (int)env_long("PYCCL_AR_PDL", 1, 0, 1);
}

static pyccl_fastar *
fastar_of(pyccl_comm *c)
{
    if (c->fastar == NULL) {
        pyccl_fastar *f = PyMem_RawCalloc(1, sizeof *f);
        if (f == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        read_settings(f, c);
        pthread_mutex_init(&f->setup_mu, NULL);
        c->fastar = f;
    }
    return c->fastar;
}

/* Make `device` current on this thread (its primary context too, which the
 * driver-API launch needs); *prev gets the device to restore. */
static int
enter_device(const pyccl_api *a, int device, int *prev)
{
    static _Thread_local int bound = -1;
    if (a->cudaGetDevice(prev) != cudaSuccess) {
        return -1;
    }
    if (*prev != device || bound != device) {
        if (a->cudaSetDevice(device) != cudaSuccess) {
            return -1;
        }
        bound = device;
    }
    return 0;
}

/* The peers did not come within the timeout (`where`: during the set-up, or
 * in a kernel): the own kernels are off, the communicator is failed, and
 * the call raises (NcclTimeoutError, or RuntimeError if it was alive). */
static int
timed_out(pyccl_state *st, pyccl_comm *c, pyccl_fastar *f, const char *op, const char *where)
{
    char msg[400], t[32];
    pyccl_fmt_seconds(t, sizeof t, f->timeout);
    snprintf(msg, sizeof msg,
             "%s: rank %d of %d timed out after %s s waiting for its peers%s; the communicator "
             "was aborted",
             op, f->rank, f->nranks, t, where);
    f->state = FA_OFF;
    pyccl_fastar_stop(c);
    pyccl_comm_mark_failed(c, msg);
    if (pyccl_comm_alive(st, op, c) == 0) {
        PyErr_SetString(PyExc_RuntimeError, msg);
    }
    return -1;
}

int
pyccl_fastar_all_reduce(pyccl_state *st, pyccl_comm *c, const char *op, pyccl_algo algo,
                        const pyccl_tensor *t, const pyccl_tensor *o, int redop,
                        cudaStream_t s)
{
    if (algo == PYCCL_ALGO_NCCL || t->numel == 0) {
        return 0;
    }
    if (c->size < 2 || c->size > PYCCL_AR_MAX_RANKS) {
        if (algo != PYCCL_ALGO_AUTO) {
            PyErr_Format(PyExc_RuntimeError,
                         "%s: algo='%s' needs 2 to %d ranks, this communicator has %d", op,
                         algo_name(algo), PYCCL_AR_MAX_RANKS, c->size);
            return -1;
        }
        return 0; /* one rank: NCCL's copy is all there is to do; > 8: NCCL's */
    }
    const int forced = algo != PYCCL_ALGO_AUTO;
    const int kt = t->dtype >= 0 ? kernel_type(pyccl_dtype_table[t->dtype].nccl) : -1;
    const int ko = kernel_op(redop);
    const size_t nbytes = (size_t)t->numel * (size_t)t->itemsize;
    if (kt < 0 || ko < 0) {
        if (forced) {
            PyObject *name = pyccl_dtype_name(t);
            if (name != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "%s: algo='%s' supports float32, float16, bfloat16 and int32 "
                             "with SUM, MAX or MIN; got %U with op=%s",
                             op, algo_name(algo), name,
                             redop >= 0 && redop <= 4
                                 ? (const char *[]){"SUM", "PROD", "MAX", "MIN", "AVG"}[redop]
                                 : "?");
                Py_DECREF(name);
            }
            return -1;
        }
        return 0;
    }
    if (pyccl_group_depth() > 0) {
        if (forced) {
            PyErr_Format(PyExc_RuntimeError, "%s: algo='%s' cannot run inside pyccl.group()",
                         op, algo_name(algo));
            return -1;
        }
        return 0;
    }
    /* the struct is made (without any GPU work) on the first call that gets
     * here, so the settings from the environment are read once */
    pyccl_fastar *f = fastar_of(c);
    if (f == NULL) {
        return -1;
    }
    /* auto: NCCL above the thresholds.  The set-up still happens at the first
     * call of any size: it is collective, and the thresholds come from each
     * rank's environment, so starting it only under them could start it on
     * some ranks and not others (and the set-up is where ranks check that
     * they agree on them). */
    int nccl_sized = 0;
    if (!forced) {
        if (nbytes <= f->one_max) {
            algo = PYCCL_ALGO_ONESHOT;
        } else if (nbytes <= f->two_max) {
            algo = PYCCL_ALGO_TWOSHOT;
        } else {
            nccl_sized = 1;
            if (f->state != FA_UNTRIED) {
                return 0;
            }
        }
    }
    const pyccl_api *a = &st->api;
    if (f->state == FA_UNTRIED &&
        (!a->cudaIpcGetMemHandle || !a->cudaIpcOpenMemHandle || !a->cudaIpcCloseMemHandle ||
         !a->cudaMemset || !a->cudaMemcpy || !a->cudaHostAlloc || !a->cudaFreeHost ||
         !a->cudaDeviceGetPCIBusId || !a->cudaStreamWaitEvent)) {
        /* the same runtime on every rank: all of them stop here alike */
        f->state = FA_OFF;
        WHY("the loaded CUDA runtime lacks the IPC calls");
    }
    if (f->state == FA_UNTRIED) {
        enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        if (a->cudaStreamIsCapturing && a->cudaStreamIsCapturing(s, &cs) != cudaSuccess) {
            a->cudaGetLastError();
        }
        if (cs != cudaStreamCaptureStatusNone) {
            if (forced) {
                PyErr_Format(PyExc_RuntimeError,
                             "%s: algo='%s' sets up peer memory on its first call, which "
                             "cannot happen during CUDA graph capture; make one eager call "
                             "first", op, algo_name(algo));
                return -1;
            }
            return 0;
        }
        int prev, ran = 0;
        ncclResult_t r = ncclSuccess;
        c->inflight++; /* destroy() refuses meanwhile */
        c->setups++;   /* abort() does not wait for it: it holds the lock per NCCL call */
        Py_BEGIN_ALLOW_THREADS
        /* one set-up per communicator: another thread's call waits here, then
         * finds it done */
        pthread_mutex_lock(&f->setup_mu);
        if (f->state == FA_UNTRIED) {
            ran = 1;
            f->deadline = f->timeout > 0 ? mono() + f->timeout : 0;
            f->gone = 0;
            f->last[0] = '\0';
            if (enter_device(a, f->device, &prev) < 0) {
                r = ncclUnhandledCudaError;
            } else {
                r = setup(a, f, c, s);
                if (prev != f->device) {
                    a->cudaSetDevice(prev);
                }
            }
        }
        pthread_mutex_unlock(&f->setup_mu);
        Py_END_ALLOW_THREADS
        c->setups--;
        c->inflight--;
        if (ran && f->gone) { /* abort() or the watchdog ended it meanwhile */
            f->state = FA_OFF;
            if (pyccl_comm_alive(st, op, c) == 0) {
                PyErr_Format(PyExc_RuntimeError, "%s: %s", op, f->reason);
            }
            return -1;
        }
        if (r == ncclInProgress) { /* the peers did not come within the timeout */
            return timed_out(st, c, f, op, " (setting up pyccl's all-reduce kernels)");
        }
        if (r != ncclSuccess) {
            f->state = FA_OFF;
            pyccl_raise_nccl(st, op, r, f->last);
            return -1;
        }
        if (f->state != FA_READY) {
            log_once(f);
        }
    }
    if (f->state != FA_READY) {
        if (forced) {
            PyErr_Format(PyExc_RuntimeError, "%s: algo='%s' is unavailable on rank %d: %s", op,
                         algo_name(algo), f->rank, f->reason);
            return -1;
        }
        return 0;
    }
    if (nccl_sized) {
        return 0;
    }
    /* after the set-up, which checked that every rank has this buffer size */
    if (forced && nbytes > f->half) {
        PyErr_Format(PyExc_ValueError,
                     "%s: algo='%s' handles up to %zu bytes (PYCCL_AR_BUFFER_MB), got %zu",
                     op, algo_name(algo), f->half, nbytes);
        return -1;
    }
    if (*(volatile int *)f->host_err) {
        /* a kernel gave up on a peer: the communicator is done for */
        WHY("a wait gave up after %g s", f->timeout);
        return timed_out(st, c, f, op, " in pyccl's all-reduce kernel");
    }
    pyccl_ar_params prm;
    memset(&prm, 0, sizeof prm);
    prm.in = t->ptr;
    prm.out = o->ptr;
    memcpy(prm.base, f->peer, sizeof prm.base);
    prm.host_error = f->host_err;
    prm.nbytes = nbytes;
    prm.half = f->half;
    prm.timeout_ns = (unsigned long long)(f->kernel_timeout * 1e9);
    prm.rank = f->rank;
    prm.nranks = f->nranks;
    prm.aligned = (((uintptr_t)t->ptr | (uintptr_t)o->ptr) & 15u) == 0;
    prm.ll_slot = 2 * f->ll_max;
    prm.skew_ns = f->skew_ns;
    int variant = algo == PYCCL_ALGO_TWOSHOT ? 2 : nbytes <= f->ll_max ? 0 : 1;
    int k = variant * K_NTYPES * K_NOPS + kt * K_NOPS + ko;
    void *args[] = {&prm};
    int prev;
    CUresult r = 0;
    int bad_device = 0;
    if (enter_device(a, f->device, &prev) < 0) {
        bad_device = 1;
    } else {
        if (f->launched && s != f->last_stream) {
            /* The kernels rely on each rank's calls running one after the
             * other: a call on another stream waits for the previous one
             * (outside graph capture, where the graph's edges order them). */
            enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
            a->cudaStreamIsCapturing(s, &cs);
            if (cs == cudaStreamCaptureStatusNone) {
                a->cudaStreamIsCapturing(f->last_stream, &cs);
            }
            if (cs == cudaStreamCaptureStatusNone &&
                a->cudaEventRecord(f->order, f->last_stream) == cudaSuccess) {
                a->cudaStreamWaitEvent(s, f->order, 0);
            }
            a->cudaGetLastError();
        }
        f->last_stream = s;
        f->launched = 1;
        unsigned threads = (unsigned)f->threads;
        if (variant == 0) {
            /* LL: one 8-byte line per thread is enough; every block still
             * runs (each keeps its own epoch), just smaller */
            size_t lines = (nbytes + 7) / 8;
            size_t per = (lines + (size_t)f->blocks - 1) / (size_t)f->blocks;
            per = (per + 31) & ~(size_t)31;
            threads = per < threads ? (unsigned)per : threads;
        }
        CUfunction fn = devs[f->device].fn[k];
        if (f->pdl) {
            /* the kernels begin with griddepcontrol.wait (allreduce.cu) */
            cu_launch_attr attr;
            memset(&attr, 0, sizeof attr);
            attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.i = 1;
            cu_launch_config cfg = {{(unsigned)f->blocks, 1, 1}, {threads, 1, 1}, 0, s, &attr, 1};
            r = drv.cuLaunchKernelEx(&cfg, fn, args, NULL);
        } else {
            r = drv.cuLaunchKernel(fn, (unsigned)f->blocks, 1, 1, threads, 1, 1, 0, s, args, NULL);
        }
        if (prev != f->device) {
            a->cudaSetDevice(prev);
        }
    }
    if (bad_device || r != 0) {
        PyErr_Format(st->CudaError, "%s: launching pyccl's all-reduce kernel on cuda:%d failed: %s",
                     op, f->device, bad_device ? "cannot make the device current" : cu_error(r));
        return -1;
    }
    /* as an NCCL call would be: watched with a timeout, else noted for wait() */
    return pyccl_comm_track(st, op, c, s) < 0 ? -1 : 1;
}

void
pyccl_fastar_release(pyccl_state *st, pyccl_comm *c, int collective)
{
    pyccl_fastar *f = c->fastar;
    if (f == NULL || c->setups > 0) {
        /* a set-up in flight (abort() from another thread) cleans up after
         * itself; the rest goes with the communicator */
        return;
    }
    c->fastar = NULL;
    live_remove(f);
    const pyccl_api *a = &st->api;
    if (f->state == FA_READY && !st->exiting && a->loaded) {
        /* Peers may read this rank's region until they closed their mapping:
         * free it only after a barrier that follows every rank's close (bounded
         * by the timeout where there is one).  Without it (abort, garbage
         * collection, a peer that did not come) the region is kept (leaked). */
        int prev;
        Py_BEGIN_ALLOW_THREADS
        if (enter_device(a, f->device, &prev) == 0) {
            wait_launched(a, f); /* they poll the host word free_local frees */
            char *base = f->base;
            f->base = NULL;
            free_local(a, f, 0);
            int freed = 0;
            if (collective) {
                int *dev = NULL, ok = 1;
                f->deadline = f->timeout > 0 ? mono() + f->timeout : 0;
                if (a->cudaMalloc((void **)&dev, sizeof(int)) == cudaSuccess) {
                    ncclResult_t r = agree(a, f, c, dev, &ok, NULL);
                    freed = r == ncclSuccess;
                    if (r != ncclInProgress) { /* else its kernel may still use it */
                        a->cudaFree(dev);
                    }
                }
                a->cudaGetLastError();
            }
            if (freed) {
                a->cudaFree(base);
            }
            if (prev != f->device) {
                a->cudaSetDevice(prev);
            }
        }
        Py_END_ALLOW_THREADS
    }
    pthread_mutex_destroy(&f->setup_mu);
    PyMem_RawFree(f);
}

PyObject *
pyccl_fastar_info(pyccl_state *st, pyccl_comm *c)
{
    (void)st;
    pyccl_fastar unset; /* before the set-up call: what it would read */
    pyccl_fastar *f = c->fastar;
    if (f == NULL) {
        memset(&unset, 0, sizeof unset);
        read_settings(&unset, c);
        f = &unset;
    }
    const char *state = f->state == FA_UNTRIED ? "not set up"
                        : f->state == FA_READY ? "ready"
                                               : "off";
    const char *reason = f->state == FA_OFF     ? f->reason
                         : pyccl_fastar_built() ? ""
                                                : "built without nvcc";
    return Py_BuildValue("{s:s,s:s,s:n,s:n,s:n,s:n,s:i,s:i,s:d,s:O,s:O}", "state", state,
                         "reason", reason, "buffer_bytes", (Py_ssize_t)f->half, "ll_max",
                         (Py_ssize_t)f->ll_max, "oneshot_max", (Py_ssize_t)f->one_max,
                         "twoshot_max", (Py_ssize_t)f->two_max, "blocks", f->blocks, "threads",
                         f->threads, "timeout", f->timeout, "built",
                         pyccl_fastar_built() ? Py_True : Py_False, "pdl",
                         f->pdl ? Py_True : Py_False);
}

/* Testing aid: read or set every block's epoch counter (all ranks alike, with
 * no all_reduce in flight), e.g. just below 2^32 to cross the wrap-around. */
PyObject *
pyccl_fastar_epoch(pyccl_state *st, pyccl_comm *c, PyObject *value)
{
    pyccl_fastar *f = c->fastar;
    if (f == NULL || f->state != FA_READY) {
        PyErr_SetString(PyExc_RuntimeError,
                        "_all_reduce_epoch: the own kernels are not set up on this communicator");
        return NULL;
    }
    const pyccl_api *a = &st->api;
    uint32_t counters[PYCCL_AR_MAX_BLOCKS];
    unsigned long v = 0;
    if (value != NULL && value != Py_None) {
        v = PyLong_AsUnsignedLong(value);
        if (PyErr_Occurred() || v > 0xffffffffUL) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "_all_reduce_epoch: value must fit in 32 bits, got %R",
                         value);
            return NULL;
        }
        for (int b = 0; b < PYCCL_AR_MAX_BLOCKS; b++) {
            counters[b] = (uint32_t)v;
        }
    }
    int prev;
    cudaError_t e = cudaErrorInvalidDevice;
    Py_BEGIN_ALLOW_THREADS
    if (enter_device(a, f->device, &prev) == 0) {
        e = a->cudaDeviceSynchronize();
        if (e == cudaSuccess) {
            e = value != NULL && value != Py_None
                    ? a->cudaMemcpy(f->base + PYCCL_AR_COUNTER_OFF, counters, sizeof counters,
                                    cudaMemcpyHostToDevice)
                    : a->cudaMemcpy(counters, f->base + PYCCL_AR_COUNTER_OFF, sizeof counters,
                                    cudaMemcpyDeviceToHost);
        }
        if (prev != f->device) {
            a->cudaSetDevice(prev);
        }
    }
    Py_END_ALLOW_THREADS
    if (e != cudaSuccess) {
        pyccl_raise_cuda(st, "_all_reduce_epoch", "cudaMemcpy", e);
        return NULL;
    }
    return PyLong_FromUnsignedLong(counters[0]);
}
