/* A stand-in for libnccl and libcudart, for testing pyccl's timeout
 * machinery (csrc/watchdog.c) on machines without a GPU.
 *
 * It models what the watchdog depends on: non-blocking init and connection
 * setup (ncclInProgress until a delay passed, or forever), streams whose
 * work finishes after a simulated time or never (a peer that is gone) until
 * the communicator is aborted, CUDA events on them, asynchronous errors,
 * and NCCL's rule that a split writes the child's handle when it completes.
 * It also counts what pyccl must never do: use a communicator after abort or
 * destroy, use one from two threads at once, leave cudaErrorNotReady as the
 * thread's last error.  Tests drive it with fake_set()/fake_get() (ctypes).
 *
 * Types are declared here, not taken from nccl.h/cuda_runtime.h, so the
 * test builds it with nothing but a C compiler; they match the real ABI. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int ncclResult_t;
enum {
    ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2,
    ncclInternalError = 3, ncclInvalidArgument = 4, ncclInvalidUsage = 5,
    ncclRemoteError = 6, ncclInProgress = 7
};
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { /* the head of ncclConfig_t */
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
} ncclConfig_head;
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorNoDevice = 100,
       cudaErrorInvalidResourceHandle = 400, cudaErrorNotReady = 600 };
typedef void *cudaStream_t;
struct cudaPointerAttributes {
    int type; /* cudaMemoryTypeDevice = 2 */
    int device;
    void *devicePointer;
    void *hostPointer;
};

struct fcomm;
typedef struct fcomm *ncclComm_t;

typedef struct {
    uintptr_t handle;
    double done_at;        /* when the work enqueued so far is finished */
    struct fcomm *blocker; /* work waits for a peer of this comm */
} fstream;

struct fevent {
    int magic;
    double done_at;
    struct fcomm *blocker;
};

struct fcomm {
    int magic;
    int rank, nranks, dev, blocking;
    int state;          /* the asyncResult */
    double ready_at;    /* state becomes ncclSuccess then (INFINITY: never) */
    int connected, aborted, destroyed, finalized, in_call;
    ncclComm_t *split_slot; /* written when the split completes */
    struct fcomm *split_child;
};

#define MAGIC 0x5ca1ab1e
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static fstream streams[64];
static int nstreams;
static __thread int cur_dev;
static __thread cudaError_t last_error;
static __thread int group_depth;
static __thread int capture_mode; /* cudaStreamCaptureModeGlobal = 0, Relaxed = 2 */
static __thread struct { struct fcomm *c; uintptr_t s; int bytes; void *recv; const void *send; size_t n; } group_ops[256];
static __thread int group_nops;

/* controls and counters */
#define KEYS(X) X(init_delay) X(init_hang) X(connect_delay) X(connect_hang) \
    X(split_delay) X(split_hang) X(finalize_hang) X(peer_dead) X(op_time)   \
    X(launch_block)                                                         \
    X(async_error) X(capturing) X(ndev)                                     \
    X(inits) X(aborts) X(destroys) X(finalizes) X(ops) X(misuse)            \
    X(concurrent) X(events_live) X(event_records) X(event_queries)          \
    X(capture_mode_calls) X(capture_violations) X(stream_syncs) X(splits)   \
    X(redops)
#define DECL(k) static double k;
KEYS(DECL)
#undef DECL

double
fake_get(const char *key)
{
#define GET(k) if (strcmp(key, #k) == 0) return k;
    KEYS(GET)
#undef GET
    if (strcmp(key, "last_error") == 0) {
        return last_error; /* the calling thread's */
    }
    return NAN;
}

int
fake_set(const char *key, double v)
{
    pthread_mutex_lock(&mu);
#define SET(k) if (strcmp(key, #k) == 0) { k = v; pthread_mutex_unlock(&mu); return 0; }
    KEYS(SET)
#undef SET
    pthread_mutex_unlock(&mu);
    return -1;
}

static double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static fstream *
stream_of(cudaStream_t s)
{
    uintptr_t h = (uintptr_t)s;
    if (h == 0) {
        h = 0x100 + (uintptr_t)cur_dev; /* the legacy stream of the device */
    }
    for (int i = 0; i < nstreams; i++) {
        if (streams[i].handle == h) {
            return &streams[i];
        }
    }
    fstream *f = &streams[nstreams++ % 64];
    memset(f, 0, sizeof *f);
    f->handle = h;
    return f;
}

/* Enter an NCCL call on c: counts misuse (dead comm) and two threads in one
 * comm (each call lingers a little outside the lock to make overlaps seen). */
static int
enter(struct fcomm *c)
{
    if (c == NULL || c->magic != MAGIC || c->aborted || c->destroyed) {
        misuse++;
        return -1;
    }
    if (c->in_call) {
        concurrent++;
    }
    c->in_call++;
    pthread_mutex_unlock(&mu);
    usleep(30);
    pthread_mutex_lock(&mu);
    return 0;
}

static void
leave(struct fcomm *c)
{
    c->in_call--;
}

static void
settle(struct fcomm *c)
{
    if (c->state == ncclInProgress && now() >= c->ready_at) {
        c->state = ncclSuccess;
        if (c->split_slot != NULL) {
            *c->split_slot = c->split_child; /* as NCCL: written at the end */
            c->split_slot = NULL;
        }
    }
}

/* ---------------- NCCL ---------------- */

ncclResult_t ncclGetVersion(int *v) { *v = 22809; return ncclSuccess; }

ncclResult_t
ncclGetUniqueId(ncclUniqueId *id)
{
    for (int i = 0; i < 128; i++) {
        id->internal[i] = (char)rand();
    }
    return ncclSuccess;
}

const char *
ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

const char *ncclGetLastError(ncclComm_t c) { (void)c; return ""; }

static struct fcomm *
new_comm(int nranks, int rank, int blocking)
{
    struct fcomm *c = calloc(1, sizeof *c); /* never freed: misuse stays detectable */
    c->magic = MAGIC;
    c->rank = rank;
    c->nranks = nranks;
    c->dev = cur_dev;
    c->blocking = blocking;
    return c;
}

ncclResult_t
ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank,
                       ncclConfig_head *config)
{
    (void)id;
    pthread_mutex_lock(&mu);
    int blocking = config == NULL || config->blocking != 0;
    struct fcomm *c = new_comm(nranks, rank, blocking);
    inits++;
    *out = c;
    if (!blocking) {
        c->state = ncclInProgress;
        c->ready_at = init_hang ? INFINITY : now() + init_delay;
        pthread_mutex_unlock(&mu);
        return ncclInProgress;
    }
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

ncclResult_t
ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank)
{
    return ncclCommInitRankConfig(out, nranks, id, rank, NULL);
}

ncclResult_t
ncclCommInitAll(ncclComm_t *comms, int n, const int *devs)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n; i++) {
        comms[i] = new_comm(n, i, 1);
        comms[i]->dev = devs ? devs[i] : i;
        inits++;
    }
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

ncclResult_t
ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *e)
{
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    settle(c);
    *e = async_error != 0 && c->state != ncclInProgress ? (int)async_error : c->state;
    leave(c);
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

ncclResult_t
ncclCommAbort(ncclComm_t c)
{
    pthread_mutex_lock(&mu);
    if (c == NULL || c->magic != MAGIC || c->aborted || c->destroyed) {
        misuse++;
    }
    else {
        if (c->in_call) {
            concurrent++;
        }
        c->aborted = 1; /* its stuck work ends: the kernels see the flag */
        aborts++;
    }
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

ncclResult_t
ncclCommFinalize(ncclComm_t c)
{
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    finalizes++;
    c->finalized = 1;
    if (!c->blocking) {
        c->state = ncclInProgress;
        c->ready_at = finalize_hang ? INFINITY : now() + 0.01;
    }
    leave(c);
    pthread_mutex_unlock(&mu);
    return c->blocking ? ncclSuccess : ncclInProgress;
}

ncclResult_t
ncclCommDestroy(ncclComm_t c)
{
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    leave(c);
    c->destroyed = 1;
    destroys++;
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

#define ATTR(name, field)                                                     \
    ncclResult_t name(ncclComm_t c, int *v)                                   \
    {                                                                         \
        pthread_mutex_lock(&mu);                                              \
        if (enter(c) < 0) {                                                   \
            pthread_mutex_unlock(&mu);                                        \
            return ncclInvalidArgument;                                       \
        }                                                                     \
        *v = c->field;                                                        \
        leave(c);                                                             \
        pthread_mutex_unlock(&mu);                                            \
        return ncclSuccess;                                                   \
    }
ATTR(ncclCommCount, nranks)
ATTR(ncclCommUserRank, rank)
ATTR(ncclCommCuDevice, dev)

ncclResult_t
ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *newcomm,
              ncclConfig_head *config)
{
    (void)key;
    (void)config;
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    splits++;
    struct fcomm *child = color < 0 ? NULL : new_comm(c->nranks, c->rank, c->blocking);
    *newcomm = NULL;
    if (c->blocking) {
        *newcomm = child;
        leave(c);
        pthread_mutex_unlock(&mu);
        return ncclSuccess;
    }
    c->state = ncclInProgress;
    c->ready_at = split_hang ? INFINITY : now() + split_delay;
    c->split_slot = newcomm;
    c->split_child = child;
    leave(c);
    pthread_mutex_unlock(&mu);
    return ncclInProgress;
}

ncclResult_t
ncclRedOpCreatePreMulSum(int *op, void *scalar, int type, int residence,
                         ncclComm_t c)
{
    (void)scalar; (void)type; (void)residence;
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    redops++;
    *op = 5;
    leave(c);
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

ncclResult_t
ncclRedOpDestroy(int op, ncclComm_t c)
{
    (void)op;
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    redops--;
    leave(c);
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

static int
type_size(int t)
{
    static const int sz[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return t >= 0 && t < 12 ? sz[t] : 1;
}

/* The work of one op on its stream; with a live peer the result is the
 * float32 sum over ranks that all hold the same data (x * nranks). */
static void
run_op(struct fcomm *c, uintptr_t s, const void *send, void *recv, size_t n,
       int bytes, int is_f32_sum)
{
    fstream *f = stream_of((cudaStream_t)s);
    ops++;
    if (peer_dead) {
        if (f->blocker == NULL || f->blocker->aborted) {
            f->blocker = c; /* stuck until c is aborted */
        }
        return;
    }
    double t = now();
    f->done_at = (f->done_at > t ? f->done_at : t) + op_time;
    if (recv != NULL && send != NULL) {
        memmove(recv, send, (size_t)bytes);
        if (is_f32_sum) {
            for (size_t i = 0; i < n; i++) {
                ((float *)recv)[i] *= (float)c->nranks;
            }
        }
    }
}

/* One collective call: queued inside a group, else run (connecting first
 * on a non-blocking comm's first call, which then returns ncclInProgress). */
static ncclResult_t
coll(struct fcomm *c, cudaStream_t s, const void *send, void *recv, size_t n,
     int type, int f32sum)
{
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    ncclResult_t r = ncclSuccess;
    settle(c);
    if (c->state == ncclInProgress) {
        misuse++; /* a call while the previous one is still in progress */
    }
    int bytes = (int)(n * (size_t)type_size(type));
    if (group_depth > 0) {
        int k = group_nops++ % 256;
        group_ops[k].c = c;
        group_ops[k].s = (uintptr_t)s;
        group_ops[k].send = send;
        group_ops[k].recv = recv;
        group_ops[k].n = f32sum ? n : 0;
        group_ops[k].bytes = bytes;
    }
    else {
        /* a launch queue full behind stuck work blocks the launch itself
         * until that work ends */
        fstream *f = stream_of(s);
        while (launch_block && f->blocker != NULL && !f->blocker->aborted) {
            pthread_mutex_unlock(&mu);
            usleep(1000);
            pthread_mutex_lock(&mu);
        }
        run_op(c, (uintptr_t)s, send, recv, n, bytes, f32sum);
        if (!c->blocking && !c->connected) {
            c->connected = 1;
            c->state = ncclInProgress;
            c->ready_at = connect_hang ? INFINITY : now() + connect_delay;
            r = ncclInProgress;
        }
    }
    leave(c);
    pthread_mutex_unlock(&mu);
    return r;
}

ncclResult_t
ncclAllReduce(const void *s, void *r, size_t n, int type, int op, ncclComm_t c,
              cudaStream_t st)
{
    return coll(c, st, s, r, n, type, type == 7 && op == 0);
}

ncclResult_t
ncclReduce(const void *s, void *r, size_t n, int type, int op, int root,
           ncclComm_t c, cudaStream_t st)
{
    (void)op; (void)root;
    return coll(c, st, s, r, n, type, 0);
}

ncclResult_t
ncclBroadcast(const void *s, void *r, size_t n, int type, int root,
              ncclComm_t c, cudaStream_t st)
{
    (void)root;
    return coll(c, st, s, r, n, type, 0);
}

ncclResult_t
ncclAllGather(const void *s, void *r, size_t n, int type, ncclComm_t c,
              cudaStream_t st)
{
    return coll(c, st, s, r, n, type, 0);
}

ncclResult_t
ncclReduceScatter(const void *s, void *r, size_t n, int type, int op,
                  ncclComm_t c, cudaStream_t st)
{
    (void)op;
    return coll(c, st, s, r, n, type, 0);
}

ncclResult_t
ncclSend(const void *s, size_t n, int type, int peer, ncclComm_t c,
         cudaStream_t st)
{
    (void)peer;
    return coll(c, st, s, NULL, n, type, 0);
}

ncclResult_t
ncclRecv(void *r, size_t n, int type, int peer, ncclComm_t c, cudaStream_t st)
{
    (void)peer;
    return coll(c, st, NULL, r, n, type, 0);
}

ncclResult_t
ncclGroupStart(void)
{
    if (group_depth++ == 0) {
        group_nops = 0;
    }
    return ncclSuccess;
}

ncclResult_t
ncclGroupEnd(void)
{
    if (group_depth == 0) {
        return ncclInvalidUsage;
    }
    if (--group_depth > 0) {
        return ncclSuccess;
    }
    pthread_mutex_lock(&mu);
    ncclResult_t r = ncclSuccess;
    int n = group_nops < 256 ? group_nops : 256, blocking = -1;
    for (int i = 0; i < n; i++) {
        struct fcomm *c = group_ops[i].c;
        if (blocking >= 0 && blocking != c->blocking) {
            r = ncclInvalidArgument; /* NCCL: no mixing in one group */
        }
        blocking = c->blocking;
    }
    for (int i = 0; i < n && r != ncclInvalidArgument; i++) {
        struct fcomm *c = group_ops[i].c;
        if (c->aborted || c->destroyed) {
            misuse++;
            continue;
        }
        run_op(c, group_ops[i].s, group_ops[i].send, group_ops[i].recv,
               group_ops[i].n, group_ops[i].bytes, group_ops[i].n > 0);
        if (!c->blocking && !c->connected) {
            c->connected = 1;
            c->state = ncclInProgress;
            c->ready_at = connect_hang ? INFINITY : now() + connect_delay;
            r = ncclInProgress;
        }
    }
    group_nops = 0;
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---------------- CUDA runtime ---------------- */

cudaError_t cudaGetDevice(int *d) { *d = cur_dev; return cudaSuccess; }

/* Devices made current in this process: as with CUDA >= 12, making one
 * current creates its context (a cost the watchdog must not add). */
static int device_used[64];

cudaError_t
cudaSetDevice(int d)
{
    int n = ndev > 0 ? (int)ndev : 2;
    if (d < 0 || d >= n) {
        return last_error = cudaErrorInvalidValue;
    }
    cur_dev = d;
    pthread_mutex_lock(&mu);
    if (d < 64) {
        device_used[d] = 1;
    }
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

int
fake_device_used(int d)
{
    return d >= 0 && d < 64 ? device_used[d] : 0;
}

cudaError_t
cudaGetDeviceCount(int *n)
{
    *n = ndev > 0 ? (int)ndev : 2;
    return cudaSuccess;
}

const char *
cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorNotReady: return "device not ready";
    default: return "fake CUDA error";
    }
}

cudaError_t
cudaGetLastError(void)
{
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

static int
stream_done(fstream *f)
{
    return (f->blocker == NULL || f->blocker->aborted) && now() >= f->done_at;
}

cudaError_t
cudaStreamSynchronize(cudaStream_t s)
{
    pthread_mutex_lock(&mu);
    stream_syncs++;
    fstream *f = stream_of(s);
    while (!stream_done(f)) {
        pthread_mutex_unlock(&mu);
        usleep(1000);
        pthread_mutex_lock(&mu);
    }
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaDeviceSynchronize(void)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nstreams && i < 64; i++) {
        while (!stream_done(&streams[i])) {
            pthread_mutex_unlock(&mu);
            usleep(1000);
            pthread_mutex_lock(&mu);
        }
    }
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p)
{
    a->type = 2;
    a->device = cur_dev;
    a->devicePointer = (void *)p;
    a->hostPointer = NULL;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n) { *p = calloc(1, n ? n : 1); return cudaSuccess; }
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }

cudaError_t
cudaEventCreateWithFlags(struct fevent **ev, unsigned flags)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    *ev = calloc(1, sizeof **ev);
    (*ev)->magic = MAGIC;
    events_live++;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaEventDestroy(struct fevent *ev)
{
    pthread_mutex_lock(&mu);
    if (ev == NULL || ev->magic != MAGIC) {
        misuse++;
    }
    else {
        ev->magic = 0;
        events_live--;
        free(ev);
    }
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaEventRecord(struct fevent *ev, cudaStream_t s)
{
    pthread_mutex_lock(&mu);
    if (ev == NULL || ev->magic != MAGIC) {
        misuse++;
        pthread_mutex_unlock(&mu);
        return cudaErrorInvalidResourceHandle;
    }
    fstream *f = stream_of(s);
    ev->done_at = f->done_at;
    ev->blocker = f->blocker != NULL && !f->blocker->aborted ? f->blocker : NULL;
    event_records++;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaEventQuery(struct fevent *ev)
{
    pthread_mutex_lock(&mu);
    cudaError_t e;
    if (ev == NULL || ev->magic != MAGIC) {
        misuse++;
        e = cudaErrorInvalidResourceHandle;
    }
    else {
        event_queries++;
        if (capturing && capture_mode != 2) {
            capture_violations++; /* would invalidate the capture */
        }
        e = (ev->blocker == NULL || ev->blocker->aborted) && now() >= ev->done_at
                ? cudaSuccess
                : cudaErrorNotReady;
    }
    pthread_mutex_unlock(&mu);
    if (e != cudaSuccess) {
        last_error = e; /* as the real runtime does */
    }
    return e;
}

cudaError_t
cudaStreamIsCapturing(cudaStream_t s, int *status)
{
    (void)s;
    *status = capturing ? 1 : 0;
    return cudaSuccess;
}

cudaError_t
cudaThreadExchangeStreamCaptureMode(int *mode)
{
    pthread_mutex_lock(&mu);
    capture_mode_calls++;
    pthread_mutex_unlock(&mu);
    int old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return cudaSuccess;
}
