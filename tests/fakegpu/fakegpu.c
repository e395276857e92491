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
       cudaErrorInvalidResourceHandle = 400, cudaErrorNotReady = 600,
       cudaErrorCapturedEvent = 907 };
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
    int behind;            /* NCCL calls enqueued since its work got stuck */
    int kwait;             /* work waits behind own kernel kwaits[kwait - 1] */
} fstream;

struct fevent {
    int magic;
    double done_at;
    struct fcomm *blocker;
    int kwait;
    int captured; /* last recorded on a capturing stream */
};

/* FAKE_PEER_MEMORY: pyccl's own kernels launched while `peer_dead` is set wait
 * for the peer until the host word pyccl gave them (pyccl_ar_params.host_error)
 * is set, its stop word, or their own timeout passed (then they set it to 1,
 * as the real kernels do).  The table, not the word, is what streams and
 * events point at: pyccl frees the word (cudaFreeHost), and freeing it while
 * a kernel still polls it is misuse. */
static struct {
    volatile int *word;
    double until;
    int over;
    volatile unsigned long long *done; /* the kernel's mark word (pyccl_ar_params.done) */
    unsigned long long mark;           /* stored there as it ends; 0: none */
} kwaits[256];
#ifdef FAKE_PEER_MEMORY
static int nkwaits;
#endif

struct fcomm {
    int magic;
    int rank, nranks, dev, blocking;
    int state;          /* the asyncResult */
    double ready_at;    /* state becomes ncclSuccess then (INFINITY: never) */
    int connected, aborted, destroyed, finalized, in_call;
    int revoked;        /* ncclCommRevoke: its work stopped, only management calls after */
    ncclComm_t *split_slot; /* written when the split completes */
    int xseq;           /* FAKE_PEER_MEMORY: collectives exchanged so far */
    int serial;         /* the n-th communicator this process made (ranks make them alike) */
    struct fcomm *split_child;
    double work_until;  /* its ops enqueued so far end then (INFINITY: behind a dead peer) */
};

#define MAGIC 0x5ca1ab1e
/* aborted or revoked: its stuck work ends (the kernels see the flag) */
#define STOPPED(c) ((c)->aborted || (c)->revoked)
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static fstream streams[64];
static int nstreams;
static __thread int cur_dev;
static __thread cudaError_t last_error;
static __thread double my_queries; /* cudaEventQuery calls of this thread */
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
    X(redops) X(module_error) X(no_p2p) X(last_redop)                      \
    X(mem_live) X(ipc_live) X(host_live) X(launches)                        \
    X(nccl_mem_live) X(mem_allocs) X(registered) X(windows) X(reg_calls)    \
    X(dereg_calls) X(reg_delay) X(reg_hang) X(reg_quiet) X(cumem_held)    \
    X(dereg_delay) X(redop_creates) X(ar_stuck) X(revokes) X(shrinks)    \
    X(dereg_busy) X(abort_delay) X(copy_launches) X(ar_kernels) X(ar_oversize) X(module_loads) X(module_device) X(ag_kernels) X(rs_kernels) \
    X(last_send) X(last_recv)
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
    if (strcmp(key, "my_queries") == 0) {
        return my_queries; /* the calling thread's */
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

/* Whether own kernel kwaits[k - 1] still waits for its peer (under mu). */
static int
kwait_active(int k)
{
    if (k <= 0) {
        return 0;
    }
    if (!kwaits[k - 1].over) {
        if (*kwaits[k - 1].word != 0) {
            kwaits[k - 1].over = 1;
        } else if (now() >= kwaits[k - 1].until) {
            *kwaits[k - 1].word = 1; /* the kernel gave up */
            kwaits[k - 1].over = 1;
        }
        if (kwaits[k - 1].over && kwaits[k - 1].mark > *kwaits[k - 1].done) {
            *kwaits[k - 1].done = kwaits[k - 1].mark; /* it ended: its mark, if any */
        }
    }
    return !kwaits[k - 1].over;
}

/* The GPU's time passes for every own kernel that waits (under mu): one past
 * its own deadline gives up now, writing its word, as the real kernel does
 * while nothing looks at its stream.  Called from the watchdog's look
 * (ncclCommGetAsyncError), which reads the words. */
static void
kwaits_tick(void)
{
#ifdef FAKE_PEER_MEMORY
    for (int k = 1; k <= 256 && k <= nkwaits; k++) {
        kwait_active(k);
    }
#endif
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

/* -DFAKE_NCCL_VERSION=21806 (or 21903): an NCCL without the registration
 * calls (or without windows), for the "NCCL too old" messages */
#ifndef FAKE_NCCL_VERSION
#define FAKE_NCCL_VERSION 22809
#endif
ncclResult_t ncclGetVersion(int *v) { *v = FAKE_NCCL_VERSION; return ncclSuccess; }

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
    static int serials;
    struct fcomm *c = calloc(1, sizeof *c); /* never freed: misuse stays detectable */
    c->magic = MAGIC;
    c->serial = serials++;
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
    kwaits_tick();
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
    double d = abort_delay;
    pthread_mutex_unlock(&mu);
    if (d > 0) {
        /* NCCL's abort returns after its teardown (proxy threads, memory),
         * long after the kernels it ended */
        usleep((useconds_t)(d * 1e6));
    }
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

#if FAKE_NCCL_VERSION >= 22800
ncclResult_t
ncclCommRevoke(ncclComm_t c, int flags)
{
    pthread_mutex_lock(&mu);
    if (flags != 0 || enter(c) < 0) {
        misuse += flags != 0;
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    revokes++;
    c->revoked = 1;
    if (!c->blocking) { /* quiescent a little later */
        c->state = ncclInProgress;
        c->ready_at = now() + 0.005;
    }
    leave(c);
    pthread_mutex_unlock(&mu);
    return c->blocking ? ncclSuccess : ncclInProgress;
}
#endif

#if FAKE_NCCL_VERSION >= 22700
/* The ranks not in ex, renumbered in their order; inherits blocking. */
ncclResult_t
ncclCommShrink(ncclComm_t c, int *ex, int n, ncclComm_t *newcomm, ncclConfig_head *config,
               int flags)
{
    (void)config;
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    settle(c);
    if (c->state == ncclInProgress || (c->revoked && !(flags & 1))) {
        misuse++; /* revoked and not quiescent, or revoked without NCCL_SHRINK_ABORT */
    }
    int below = 0;
    for (int i = 0; i < n; i++) {
        if (ex[i] == c->rank || ex[i] < 0 || ex[i] >= c->nranks) {
            misuse++;
        }
        below += ex[i] < c->rank;
    }
    shrinks++;
    struct fcomm *child = new_comm(c->nranks - n, c->rank - below, c->blocking);
    *newcomm = NULL;
    if (c->blocking) {
        *newcomm = child;
        leave(c);
        pthread_mutex_unlock(&mu);
        return ncclSuccess;
    }
    c->state = ncclInProgress;
    c->ready_at = now() + split_delay;
    c->split_slot = newcomm;
    c->split_child = child;
    leave(c);
    pthread_mutex_unlock(&mu);
    return ncclInProgress;
}
#endif

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
    redop_creates++;
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
        if (f->blocker == NULL || STOPPED(f->blocker)) {
            f->blocker = c; /* stuck until c is aborted */
            f->behind = 0;
        }
        f->behind++;
        c->work_until = INFINITY;
        return;
    }
    double t = now();
    f->done_at = (f->done_at > t ? f->done_at : t) + op_time;
    c->work_until = c->work_until > f->done_at ? c->work_until : f->done_at;
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
    if (c != NULL && c->magic == MAGIC && c->revoked) {
        misuse++; /* only management calls on a revoked communicator */
        pthread_mutex_unlock(&mu);
        return ncclInvalidUsage;
    }
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
         * until that work ends: `launch_block` calls deep (1: the first
         * call after the stuck one blocks) */
        fstream *f = stream_of(s);
        while (launch_block && f->blocker != NULL && !STOPPED(f->blocker) &&
               f->behind >= launch_block) {
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

#ifdef FAKE_PEER_MEMORY
/* Built with -DFAKE_PEER_MEMORY (tests/test_selection_cpu.py): the ranks of
 * a communicator are processes, each loading this library, and its
 * all_gather and all_reduce exchange their data through files in
 * $FAKE_XPROC_DIR (written whole, then renamed into place), synchronously.
 * Enough for the own kernels' set-up, which agrees on everything through
 * those two collectives, and for the NCCL all_reduce it falls back to.
 * With `peer_dead` nothing is exchanged: the work waits on the stream. */
static int
xproc(struct fcomm *c)
{
    /* a dead peer exchanges nothing: the work is stuck on its stream (and,
     * with `launch_block`, the next launch behind it), as without the files */
    return c->nranks > 1 && getenv("FAKE_XPROC_DIR") != NULL && group_depth == 0 && !peer_dead;
}

/* every rank's `bytes` of `mine`, in rank order, into `all`; -1 after 30 s */
static int
xproc_exchange(struct fcomm *c, const void *mine, size_t bytes, void *all)
{
    const char *dir = getenv("FAKE_XPROC_DIR");
    char path[600], tmp[620];
    pthread_mutex_lock(&mu);
    unsigned seq = (unsigned)c->xseq++;
    ops++;
    pthread_mutex_unlock(&mu);
    snprintf(path, sizeof path, "%s/%d.%u.%d", dir, c->serial, seq, c->rank);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL || fwrite(mine, 1, bytes, f) != bytes || fclose(f) != 0 || rename(tmp, path) != 0) {
        return -1;
    }
    double deadline = now() + 30;
    for (int r = 0; r < c->nranks; r++) {
        snprintf(path, sizeof path, "%s/%d.%u.%d", dir, c->serial, seq, r);
        while ((f = fopen(path, "rb")) == NULL) {
            if (now() > deadline) {
                return -1;
            }
            usleep(1000);
        }
        size_t got = fread((char *)all + (size_t)r * bytes, 1, bytes, f);
        fclose(f);
        if (got != bytes) {
            return -1;
        }
    }
    return 0;
}

/* int32 (2) sum/max/min and float32 (7) sum, in rank order */
static ncclResult_t
xproc_all_reduce(struct fcomm *c, const void *s, void *r, size_t n, int type, int op)
{
    if (!((type == 2 && op >= 0 && op <= 3 && op != 1) || (type == 7 && op == 0))) {
        return ncclInvalidArgument;
    }
    size_t bytes = n * 4;
    char *mine = malloc(bytes ? bytes : 1), *all = malloc((size_t)c->nranks * bytes + 1);
    memcpy(mine, s, bytes);
    int rc = xproc_exchange(c, mine, bytes, all);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        if (type == 7) {
            float acc = 0;
            for (int k = 0; k < c->nranks; k++) {
                acc += ((float *)(all + (size_t)k * bytes))[i];
            }
            ((float *)r)[i] = acc;
        } else {
            int32_t acc = ((int32_t *)all)[i];
            for (int k = 1; k < c->nranks; k++) {
                int32_t v = ((int32_t *)(all + (size_t)k * bytes))[i];
                acc = op == 0 ? acc + v : op == 2 ? (v > acc ? v : acc) : (v < acc ? v : acc);
            }
            ((int32_t *)r)[i] = acc;
        }
    }
    free(mine);
    free(all);
    return rc == 0 ? ncclSuccess : ncclSystemError;
}
#endif

ncclResult_t
ncclAllReduce(const void *s, void *r, size_t n, int type, int op, ncclComm_t c,
              cudaStream_t st)
{
    last_redop = op; /* the op pyccl passed (tests of its spellings) */
#ifdef FAKE_PEER_MEMORY
    if (xproc(c)) {
        return xproc_all_reduce(c, s, r, n, type, op);
    }
#endif
    return coll(c, st, s, r, n, type, type == 7 && op == 0);
}

ncclResult_t
ncclReduce(const void *s, void *r, size_t n, int type, int op, int root,
           ncclComm_t c, cudaStream_t st)
{
    (void)root;
    last_redop = op;
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
#ifdef FAKE_PEER_MEMORY
    if (xproc(c)) {
        size_t bytes = n * (size_t)type_size(type);
        return xproc_exchange(c, s, bytes, r) < 0 ? ncclSystemError : ncclSuccess;
    }
#endif
    return coll(c, st, s, r, n, type, 0);
}

ncclResult_t
ncclReduceScatter(const void *s, void *r, size_t n, int type, int op,
                  ncclComm_t c, cudaStream_t st)
{
    last_redop = op;
    return coll(c, st, s, r, n, type, 0);
}

ncclResult_t
ncclSend(const void *s, size_t n, int type, int peer, ncclComm_t c,
         cudaStream_t st)
{
    (void)peer;
    last_send = (double)(uintptr_t)s; /* where pyccl said the data is (tests of its keywords) */
    return coll(c, st, s, NULL, n, type, 0);
}

ncclResult_t
ncclRecv(void *r, size_t n, int type, int peer, ncclComm_t c, cudaStream_t st)
{
    (void)peer;
    last_recv = (double)(uintptr_t)r;
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
    /* NCCL works on each communicator of the group here: another thread
     * inside one of them meanwhile is two threads in one communicator */
    struct fcomm *in[256];
    int nin = 0;
    for (int i = 0; i < n && r != ncclInvalidArgument; i++) {
        struct fcomm *c = group_ops[i].c;
        int seen = c->aborted || c->destroyed;
        for (int k = 0; k < nin && !seen; k++) {
            seen = in[k] == c;
        }
        if (!seen) {
            concurrent += c->in_call > 0;
            c->in_call++;
            in[nin++] = c;
        }
    }
    if (nin > 0) {
        pthread_mutex_unlock(&mu);
        usleep(30);
        pthread_mutex_lock(&mu);
    }
    for (int i = 0; i < n && r != ncclInvalidArgument; i++) {
        struct fcomm *c = group_ops[i].c;
        /* the group's launch blocks behind a full queue as a call's does */
        fstream *f = stream_of((cudaStream_t)group_ops[i].s);
        while (launch_block && f->blocker != NULL && !STOPPED(f->blocker) &&
               f->behind >= launch_block) {
            pthread_mutex_unlock(&mu);
            usleep(1000);
            pthread_mutex_lock(&mu);
        }
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
    for (int k = 0; k < nin; k++) {
        in[k]->in_call--;
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
    return (f->blocker == NULL || STOPPED(f->blocker)) && !kwait_active(f->kwait) &&
           now() >= f->done_at;
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

#ifndef FAKE_PEER_MEMORY
cudaError_t cudaMalloc(void **p, size_t n) { *p = calloc(1, n ? n : 1); return cudaSuccess; }
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
#endif

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
    ev->blocker = f->blocker != NULL && !STOPPED(f->blocker) ? f->blocker : NULL;
    ev->kwait = kwait_active(f->kwait) ? f->kwait : 0;
    ev->captured = capturing != 0;
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
        my_queries++;
        if (capturing && capture_mode != 2) {
            capture_violations++; /* would invalidate the capture */
        }
        if (ev->captured) {
            /* as the real runtime does in every capture mode: an error, and
             * the capture that recorded the event is invalidated */
            capture_violations++;
            e = cudaErrorCapturedEvent;
        }
        else {
            e = (ev->blocker == NULL || STOPPED(ev->blocker)) && !kwait_active(ev->kwait) &&
                        now() >= ev->done_at
                    ? cudaSuccess
                    : cudaErrorNotReady;
        }
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

/* ---------------- registered memory ----------------
 * ncclMemAlloc hands out host memory and remembers it, so that the driver's
 * cuMemRetainAllocationHandle (this library is also libcuda.so.1 where a test
 * links it so) can tell cuMem memory from other memory, and a window over
 * other memory fails as NCCL's would.  On a non-blocking communicator a
 * registration completes after `reg_delay` s (never with `reg_hang`). */
cudaError_t
cudaMemcpy(void *dst, const void *src, size_t n, int kind)
{
    (void)kind;
    memmove(dst, src, n);
    return cudaSuccess;
}

#if FAKE_NCCL_VERSION >= 21900
static struct { char *p; size_t n; } mem[256];

static int
is_nccl_mem(const void *p)
{
    for (int i = 0; i < 256; i++) {
        if (mem[i].p != NULL && (const char *)p >= mem[i].p && (const char *)p < mem[i].p + mem[i].n) {
            return 1;
        }
    }
    return 0;
}

ncclResult_t
ncclMemAlloc(void **ptr, size_t size)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 256; i++) {
        if (mem[i].p == NULL) {
            mem[i].p = calloc(1, size);
            mem[i].n = size;
            *ptr = mem[i].p;
            nccl_mem_live++;
            mem_allocs++;
            pthread_mutex_unlock(&mu);
            return ncclSuccess;
        }
    }
    pthread_mutex_unlock(&mu);
    return ncclSystemError;
}

ncclResult_t
ncclMemFree(void *ptr)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 256; i++) {
        if (mem[i].p == ptr && ptr != NULL) {
            free(mem[i].p);
            mem[i].p = NULL;
            nccl_mem_live--;
            pthread_mutex_unlock(&mu);
            return ncclSuccess;
        }
    }
    misuse++; /* not ours, or freed twice */
    pthread_mutex_unlock(&mu);
    return ncclInvalidArgument;
}

typedef int CUresult_;

CUresult_
cuMemRetainAllocationHandle(unsigned long long *handle, void *addr)
{
    pthread_mutex_lock(&mu);
    int ok = is_nccl_mem(addr);
    if (ok) {
        cumem_held++;
        *handle = (unsigned long long)(uintptr_t)addr;
    }
    pthread_mutex_unlock(&mu);
    return ok ? 0 : 1; /* CUDA_ERROR_INVALID_VALUE */
}

CUresult_
cuMemRelease(unsigned long long handle)
{
    (void)handle;
    pthread_mutex_lock(&mu);
    cumem_held--;
    pthread_mutex_unlock(&mu);
    return 0;
}

/* mu held, inside a deregister call (c entered): `dereg_delay` s with mu
 * released and the call still open, so that another thread's call on the
 * communicator (a second deregister, a destroy) meets it there. */
static void
dereg_wait(void)
{
    if (dereg_delay > 0) {
        pthread_mutex_unlock(&mu);
        usleep((useconds_t)(dereg_delay * 1e6));
        pthread_mutex_lock(&mu);
    }
}

/* A registration call on c: in progress for a while on a non-blocking one. */
static ncclResult_t
reg_finish(struct fcomm *c)
{
    if (!c->blocking) {
        c->state = ncclInProgress;
        c->ready_at = reg_hang ? INFINITY : now() + reg_delay;
        /* reg_quiet: ncclSuccess returned while the state is still in progress,
         * as NCCL 2.28.9's ncclCommWindowRegister does on a non-blocking one */
        return reg_quiet ? ncclSuccess : ncclInProgress;
    }
    return ncclSuccess;
}

ncclResult_t
ncclCommRegister(const ncclComm_t c, void *buff, size_t size, void **handle)
{
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    settle(c);
    if (c->state == ncclInProgress) {
        misuse++;
    }
    reg_calls++;
    registered++;
    *handle = (char *)buff + size; /* any non-NULL token */
    ncclResult_t r = reg_finish(c);
    leave(c);
    pthread_mutex_unlock(&mu);
    return r;
}

ncclResult_t
ncclCommDeregister(const ncclComm_t c, void *handle)
{
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    dereg_wait();
    settle(c);
    dereg_busy += now() < c->work_until; /* memory that work still reads or writes */
    if (handle == NULL || registered <= 0) {
        misuse++;
    }
    dereg_calls++;
    registered--;
    ncclResult_t r = reg_finish(c);
    leave(c);
    pthread_mutex_unlock(&mu);
    return r;
}

#if FAKE_NCCL_VERSION >= 22700
typedef struct fwin { int magic; void *p; } fwin;

ncclResult_t
ncclCommWindowRegister(ncclComm_t c, void *buff, size_t size, fwin **win, int flags)
{
    (void)size;
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    settle(c);
    ncclResult_t r = ncclSuccess;
    if (flags != 1 /* NCCL_WIN_COLL_SYMMETRIC */ || !is_nccl_mem(buff)) {
        r = ncclInvalidArgument; /* NCCL: not cuMem memory */
    }
    else {
        reg_calls++;
        windows++;
        *win = calloc(1, sizeof(fwin));
        (*win)->magic = MAGIC;
        (*win)->p = buff;
        r = reg_finish(c);
    }
    leave(c);
    pthread_mutex_unlock(&mu);
    return r;
}

ncclResult_t
ncclCommWindowDeregister(ncclComm_t c, fwin *win)
{
    pthread_mutex_lock(&mu);
    if (enter(c) < 0) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    dereg_wait();
    settle(c);
    dereg_busy += now() < c->work_until;
    if (win == NULL || win->magic != MAGIC) {
        misuse++;
    }
    else {
        win->magic = 0; /* never freed: a second deregister is seen */
    }
    dereg_calls++;
    windows--;
    ncclResult_t r = reg_finish(c);
    leave(c);
    pthread_mutex_unlock(&mu);
    return r;
}
#endif
#endif

#ifdef FAKE_PEER_MEMORY
/* ---------------- peer memory, and the driver's module calls ----------------
 * What the own kernels' set-up (csrc/ar.c) needs before it launches
 * anything.  Device memory is host memory; an IPC handle carries the
 * pointer.  `module_error` makes cuModuleLoadData fail with that code (209
 * is CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image for this GPU), `no_p2p`
 * makes every pair of GPUs lack peer access (PCIe without P2P).  This
 * library is also installed as libcuda.so.1 for the driver calls. */
typedef struct { char reserved[64]; } cudaIpcMemHandle_t;

cudaError_t
cudaMemset(void *p, int v, size_t n)
{
    memset(p, v, n);
    return cudaSuccess;
}

cudaError_t
cudaHostAlloc(void **p, size_t n, unsigned flags)
{
    (void)flags;
    *p = calloc(1, n ? n : 1);
    pthread_mutex_lock(&mu);
    host_live++;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaFreeHost(void *p)
{
    pthread_mutex_lock(&mu);
    for (int k = 1; k <= nkwaits && k <= 256; k++) {
        if ((void *)kwaits[k - 1].word == p && p != NULL) {
            if (kwait_active(k)) {
                misuse++; /* an own kernel still polls this word */
            }
            kwaits[k - 1].over = 1;
        }
    }
    free(p);
    host_live--;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

/* Device memory that other processes can map: with $FAKE_XPROC_DIR, a
 * cudaMalloc is a file there mapped shared, and its IPC handle carries the
 * file's name; cudaIpcOpenMemHandle maps it again (in the peer process).
 * mem_live counts the bytes cudaMalloc'ed and not freed, ipc_live the peer
 * mappings open. */
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
static struct fmap { void *p; size_t n; int own; char name[72]; } maps[512];

static struct fmap *
map_of(void *p)
{
    for (int i = 0; i < 512; i++) {
        if (maps[i].p == p && p != NULL) {
            return &maps[i];
        }
    }
    return NULL;
}

static struct fmap *
map_slot(void)
{
    for (int i = 0; i < 512; i++) {
        if (maps[i].p == NULL) {
            return &maps[i];
        }
    }
    return NULL;
}

static void *
map_file(const char *name, size_t n, int create)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", getenv("FAKE_XPROC_DIR"), name);
    int fd = open(path, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0 || (create && ftruncate(fd, (off_t)n) != 0)) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? NULL : p;
}

cudaError_t
cudaMalloc(void **p, size_t n)
{
    static unsigned seq;
    n = n ? n : 1;
    if (getenv("FAKE_XPROC_DIR") == NULL) {
        *p = calloc(1, n);
    } else {
        pthread_mutex_lock(&mu);
        struct fmap *m = map_slot();
        if (m == NULL) {
            pthread_mutex_unlock(&mu);
            return last_error = 2; /* cudaErrorMemoryAllocation */
        }
        snprintf(m->name, sizeof m->name, "mem.%d.%u", (int)getpid(), seq++);
        m->p = *p = map_file(m->name, n, 1);
        m->n = n;
        m->own = 1;
        if (m->p == NULL) {
            pthread_mutex_unlock(&mu);
            return last_error = 2;
        }
        pthread_mutex_unlock(&mu);
    }
    pthread_mutex_lock(&mu);
    mem_live += (double)n;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaFree(void *p)
{
    if (p == NULL) {
        return cudaSuccess;
    }
    pthread_mutex_lock(&mu);
    struct fmap *m = map_of(p);
    if (m == NULL) {
        pthread_mutex_unlock(&mu);
        free(p); /* without $FAKE_XPROC_DIR (no size known: not counted back) */
        return cudaSuccess;
    }
    if (!m->own) {
        misuse++; /* a peer's mapping is closed, never freed */
        pthread_mutex_unlock(&mu);
        return last_error = cudaErrorInvalidValue;
    }
    char path[600];
    snprintf(path, sizeof path, "%s/%s", getenv("FAKE_XPROC_DIR"), m->name);
    unlink(path);
    munmap(m->p, m->n);
    mem_live -= (double)m->n;
    memset(m, 0, sizeof *m);
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p)
{
    memset(h, 0, sizeof *h);
    pthread_mutex_lock(&mu);
    struct fmap *m = map_of(p);
    if (m != NULL) {
        memcpy(h->reserved, m->name, sizeof h->reserved); /* names are short: NUL inside */
    }
    pthread_mutex_unlock(&mu);
    return m != NULL ? cudaSuccess : (last_error = cudaErrorInvalidValue);
}

cudaError_t
cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags)
{
    (void)flags;
    *p = NULL;
    char name[65];
    memcpy(name, h.reserved, 64);
    name[64] = '\0';
    char path[600];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", getenv("FAKE_XPROC_DIR") ? getenv("FAKE_XPROC_DIR") : "", name);
    if (name[0] == '\0' || stat(path, &sb) != 0) {
        return last_error = cudaErrorInvalidValue;
    }
    pthread_mutex_lock(&mu);
    struct fmap *m = map_slot();
    void *q = m != NULL ? map_file(name, (size_t)sb.st_size, 0) : NULL;
    if (q == NULL) {
        pthread_mutex_unlock(&mu);
        return last_error = cudaErrorInvalidValue;
    }
    m->p = *p = q;
    m->n = (size_t)sb.st_size;
    m->own = 0;
    snprintf(m->name, sizeof m->name, "%s", name);
    ipc_live++;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaIpcCloseMemHandle(void *p)
{
    pthread_mutex_lock(&mu);
    struct fmap *m = map_of(p);
    if (m == NULL || m->own) {
        misuse++;
        pthread_mutex_unlock(&mu);
        return last_error = cudaErrorInvalidValue;
    }
    munmap(m->p, m->n);
    memset(m, 0, sizeof *m);
    ipc_live--;
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

cudaError_t
cudaDeviceGetPCIBusId(char *buf, int len, int dev)
{
    snprintf(buf, (size_t)len, "00000000:%02X:00.0", 0x10 + dev);
    return cudaSuccess;
}

cudaError_t
cudaDeviceGetByPCIBusId(int *dev, const char *busid)
{
    unsigned bus = 0;
    if (sscanf(busid, "%*x:%x:", &bus) != 1 || bus < 0x10) {
        return last_error = cudaErrorInvalidValue;
    }
    *dev = (int)bus - 0x10;
    return cudaSuccess;
}

cudaError_t
cudaDeviceCanAccessPeer(int *can, int dev, int peer)
{
    *can = no_p2p ? 0 : dev != peer;
    return cudaSuccess;
}

cudaError_t
cudaStreamWaitEvent(cudaStream_t s, struct fevent *ev, unsigned flags)
{
    (void)s;
    (void)ev;
    (void)flags;
    return cudaSuccess;
}

cudaError_t
cudaStreamQuery(cudaStream_t s)
{
    pthread_mutex_lock(&mu);
    int done = stream_done(stream_of(s));
    pthread_mutex_unlock(&mu);
    return done ? cudaSuccess : cudaErrorNotReady;
}

typedef int CUresult;
/* CUfunction handles: an index into these names (set by cuModuleGetFunction) */
static char fn_names[64][48];
static int nfn;

CUresult
cuModuleLoadData(void **mod, const void *image)
{
    (void)image;
    *mod = fn_names;
    pthread_mutex_lock(&mu);
    module_loads++;
    module_device = cur_dev; /* the module goes into the current device's context */
    pthread_mutex_unlock(&mu);
    return (CUresult)module_error;
}

CUresult
cuModuleGetFunction(void **fn, void *mod, const char *name)
{
    (void)mod;
    pthread_mutex_lock(&mu);
    int i = 0;
    while (i < nfn && strcmp(fn_names[i], name) != 0) {
        i++;
    }
    if (i == nfn && nfn < 64) {
        snprintf(fn_names[nfn++], sizeof fn_names[0], "%s", name);
    }
    pthread_mutex_unlock(&mu);
    *fn = fn_names[i < 64 ? i : 63];
    return 0;
}

#include "../../csrc/kernels/ar_abi.h"

/* The exchange of a kernel's ranks: its own serial, apart from the
 * communicators' exchanges, and its own sequence of calls. */
static struct fcomm
kernel_fcomm(const pyccl_ar_params *p, int serial, int seq)
{
    struct fcomm fc;
    memset(&fc, 0, sizeof fc);
    fc.rank = p->rank;
    fc.nranks = p->nranks;
    fc.serial = serial;
    fc.xseq = seq;
    return fc;
}

/* all_gather's kernels (pyccl_ag_<unit>: bytes) and reduce_scatter's
 * (pyccl_rs_<type>_<op>, int32 SUM/MAX/MIN and float32 SUM modelled), done at
 * once across the rank processes.  A launch that would stage more than a half
 * of the buffer, or whose pointers, part or stride do not fit its unit (16,
 * 4 or 1 bytes; reduce_scatter: 16 when `aligned`, else 4), is refused and
 * counted in ar_oversize. */
static int
fake_gather_scatter(const char *name, const pyccl_ar_params *p)
{
    static int gseq;
    struct fcomm fc = kernel_fcomm(p, -2, gseq++); /* apart from the all-reduce kernels' */
    const int rs = name[6] == 'r';
    size_t nb = (size_t)p->nbytes, unit = 16;
    int t = 0, o = 0;
    if (rs) {
        char type[8], op[8];
        if (sscanf(name, "pyccl_rs_%7[a-z0-9]_%7[a-z]", type, op) != 2) {
            return 98;
        }
        t = strcmp(type, "f32") == 0 ? 7 : strcmp(type, "i32") == 0 ? 2 : -1;
        o = strcmp(op, "sum") == 0 ? 0 : strcmp(op, "max") == 0 ? 2 : strcmp(op, "min") == 0 ? 3 : -1;
        if (t < 0 || o < 0) {
            return 98; /* not modelled */
        }
        unit = p->aligned ? 16 : 4;
    } else {
        unit = (size_t)atoi(name + 9);
    }
    uintptr_t m = (uintptr_t)p->in | (uintptr_t)p->out | nb | (uintptr_t)p->stride;
    pthread_mutex_lock(&mu);
    if (rs) {
        rs_kernels++;
    } else {
        ag_kernels++;
    }
    int bad = (rs ? nb * (size_t)p->nranks : nb) > p->half_bytes || (m & (unit - 1)) != 0;
    if (bad) {
        ar_oversize++;
    }
    pthread_mutex_unlock(&mu);
    if (bad) {
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    }
    size_t mine_bytes = rs ? nb * (size_t)p->nranks : nb;
    char *mine = malloc(mine_bytes + 1), *all = malloc((size_t)p->nranks * mine_bytes + 1);
    for (int s = 0; s < (rs ? p->nranks : 1); s++) {
        memcpy(mine + (size_t)s * nb, (const char *)p->in + (size_t)s * p->stride, nb);
    }
    int rc = xproc_exchange(&fc, mine, mine_bytes, all);
    for (int r = 0; rc == 0 && r < p->nranks; r++) {
        if (!rs) {
            memcpy((char *)p->out + (size_t)r * p->stride, all + (size_t)r * nb, nb);
            continue;
        }
        /* part `rank` of rank r's input, reduced in rank order */
        const char *part = all + (size_t)r * mine_bytes + (size_t)p->rank * nb;
        for (size_t i = 0; i < nb / 4; i++) {
            if (t == 7) {
                float v = ((const float *)part)[i];
                ((float *)p->out)[i] = r == 0 ? v : ((float *)p->out)[i] + v;
            } else {
                int32_t v = ((const int32_t *)part)[i], *acc = (int32_t *)p->out + i;
                *acc = r == 0 ? v : o == 0 ? (int32_t)((uint32_t)*acc + (uint32_t)v)
                                  : o == 2 ? (v > *acc ? v : *acc) : (v < *acc ? v : *acc);
            }
        }
    }
    free(mine);
    free(all);
    return rc == 0 ? 0 : 999;
}

/* What the kernels do, done at once on the host (device memory is host
 * memory here): the set-up's write-then-read probe across the ranks'
 * regions, and the all-reduce itself for int32 SUM/MAX/MIN and float32 SUM,
 * exchanged between the rank processes through files as the fake NCCL does
 * (in rank order).  With `peer_dead` an all-reduce kernel runs nothing and
 * waits on its stream instead (launch(), kwaits). */
static int
fake_kernel(const char *name, void **args)
{
    const pyccl_ar_params *p = args[0];
    if (strcmp(name, "pyccl_ar_empty") == 0) {
        return 0; /* the launch floor's kernel does nothing */
    }
    if (strcmp(name, "pyccl_copy_list") == 0) {
        /* all_reduce_coalesced's pack (to_flat) or unpack, item by item */
        const pyccl_copy_params *cp = args[0];
        for (unsigned i = 0; i < cp->n && i < PYCCL_COPY_MAX; i++) {
            const pyccl_copy_item *it = &cp->item[i];
            char *t = (char *)(uintptr_t)it->ptr, *f = cp->flat + it->off;
            memmove(cp->to_flat ? f : t, cp->to_flat ? t : f, (size_t)it->nbytes);
        }
        pthread_mutex_lock(&mu);
        copy_launches++;
        pthread_mutex_unlock(&mu);
        return 0;
    }
    if (strcmp(name, "pyccl_ar_probe") == 0) {
        int stage = *(int *)args[1];
        uint32_t *mine = (uint32_t *)(p->base[p->rank] + PYCCL_AR_PROBE_OFF);
        for (int r = 0; r < p->nranks; r++) {
            uint32_t *theirs = (uint32_t *)(p->base[r] + PYCCL_AR_PROBE_OFF);
            if (stage == 0) {
                theirs[p->rank] = p->magic ^ (uint32_t)(p->rank * 16 + r);
                if (r == p->rank) {
                    mine[PYCCL_AR_MAX_RANKS + r] = p->magic + (uint32_t)r;
                }
            } else if (mine[r] != (p->magic ^ (uint32_t)(r * 16 + p->rank)) ||
                       theirs[PYCCL_AR_MAX_RANKS + r] != p->magic + (uint32_t)r) {
                *(int *)p->out |= 1 << r;
            }
        }
        return 0;
    }
    if (strncmp(name, "pyccl_ag_", 9) == 0 || strncmp(name, "pyccl_rs_", 9) == 0) {
        return fake_gather_scatter(name, p);
    }
    char type[8], op[8];
    int variant;
    if (sscanf(name, "pyccl_ar_%d_%7[a-z0-9]_%7[a-z]", &variant, type, op) != 3) {
        return 98;
    }
    int t = strcmp(type, "f32") == 0 ? 7 : strcmp(type, "i32") == 0 ? 2 : -1;
    int o = strcmp(op, "sum") == 0 ? 0 : strcmp(op, "max") == 0 ? 2 : strcmp(op, "min") == 0 ? 3 : -1;
    static int kseq;
    struct fcomm fc = kernel_fcomm(p, -1, kseq++);
    if (t < 0 || o < 0 || p->nbytes % 4) {
        return 98; /* CUDA_ERROR_INVALID_HANDLE: not modelled */
    }
    ar_kernels++;
    if (p->nbytes > p->half_bytes || (variant == 0 && p->nbytes > p->ll_slot / 2)) {
        /* the real kernel would stage past its half of the buffer (or its LL
         * slot): refused here, and counted */
        ar_oversize++;
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    }
    return xproc_all_reduce(&fc, p->in, p->out, (size_t)(p->nbytes / 4), t, o) == ncclSuccess ? 0 : 999;
}

static CUresult
launch(void *f, cudaStream_t s, void **args)
{
    const pyccl_ar_params *p = args[0];
    pthread_mutex_lock(&mu);
    launches++;
    if (peer_dead && strcmp((const char *)f, "pyccl_ar_probe") != 0 &&
        strcmp((const char *)f, "pyccl_ar_empty") != 0 &&
        strcmp((const char *)f, "pyccl_copy_list") != 0) {
        /* an all-reduce kernel whose peer is gone: it waits on its stream */
        int k = nkwaits++ % 256;
        kwaits[k].word = (volatile int *)p->host_error;
        kwaits[k].until = p->timeout_ns ? now() + (double)p->timeout_ns * 1e-9 : INFINITY;
        kwaits[k].over = 0;
        kwaits[k].done = p->done;
        kwaits[k].mark = p->mark;
        stream_of(s)->kwait = k + 1;
        ar_stuck++;
        pthread_mutex_unlock(&mu);
        return 0;
    }
    pthread_mutex_unlock(&mu);
    CUresult r = (CUresult)fake_kernel((const char *)f, args);
    const char *name = f;
    if (r == 0 && (strncmp(name, "pyccl_ar_", 9) == 0 || strncmp(name, "pyccl_ag_", 9) == 0 ||
                   strncmp(name, "pyccl_rs_", 9) == 0) &&
        strcmp(name, "pyccl_ar_probe") != 0 && strcmp(name, "pyccl_ar_empty") != 0 &&
        p->mark != 0) {
        *p->done = p->mark; /* a marked kernel ended (it ran at its launch) */
    }
    return r;
}

/* the head of CUlaunchConfig */
typedef struct { unsigned grid[3], block[3], shared; cudaStream_t stream; } launch_config_head;

CUresult
cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
               unsigned bz, unsigned shared, cudaStream_t s, void **args, void **extra)
{
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
    (void)shared; (void)extra;
    return launch(f, s, args);
}

CUresult
cuLaunchKernelEx(const launch_config_head *cfg, void *f, void **args, void **extra)
{
    (void)extra;
    return launch(f, cfg->stream, args);
}

CUresult
cuGetErrorString(CUresult r, const char **s)
{
    *s = r == 209 ? "no kernel image is available for execution on the device"
                  : "fake CUDA driver error";
    return 0;
}
#endif
