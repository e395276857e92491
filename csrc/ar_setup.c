/* pyccl's own all-reduce, host side: a communicator's set-up and release
 * (the kernels themselves are loaded by ar_load.c).
 *
 * The set-up happens once per
 * communicator, collectively, at the first all_reduce of a supported dtype
 * and op, of any size (ar.c decides when): a region per rank, CUDA IPC
 * handles and every rank's settings exchanged by an NCCL all_gather on the
 * communicator itself, peers mapped, a real write-then-read probe across
 * every pair, and an agreement (NCCL MIN) so that either every rank uses the
 * kernels or none does.  Release frees what it made: the exported region
 * behind a barrier of every rank, or, where no barrier can be had, once every
 * peer closed its mapping (the region and its release handshake: ar_region.c). */
#include "ar.h"
#include "locks.h"
#include "ar_setup.h"
#include "timeouts.h"
#include "tensor.h"
#include "errors.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    uint64_t half_bytes;
    uint64_t ll_max;
    uint64_t one_max, two_max; /* auto's thresholds: ranks that disagree would pick
                                  different kernels (or NCCL) for one call and hang */
    double wait_s;             /* how long a kernel waits for its peers (f->timeout), 0 for
                                  ever: a rank that waits for ever beside one that gives up
                                  would be left waiting by it */
    int32_t pid;
    int32_t ok;
    int32_t blocks;
    int32_t threads;
    uint32_t magic;
    char marks[PYCCL_AR_MARKS_NAME]; /* its shared-memory page of "closed" marks, "" none */
    char pad[256 - sizeof(cudaIpcMemHandle_t) - 32 - 48 - 20 - PYCCL_AR_MARKS_NAME];
} ar_record;
_Static_assert(sizeof(ar_record) == 256, "ar_record: 256 bytes, the same on every rank");

/* Until the work on s finished: bounded by the set-up's deadline (a peer
 * that never comes leaves the NCCL kernel waiting), and given up when
 * abort() came while destroy() ran (c->abort_asked): ncclInProgress then,
 * the kernel maybe still queued. */
static ncclResult_t
sync_stream(const pyccl_api *a, const pyccl_comm *c, cudaStream_t s, double deadline)
{
    if (a->cudaStreamQuery == NULL) {
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
        if ((deadline > 0 && pyccl_now_s() > deadline) ||
            __atomic_load_n(&c->abort_asked, __ATOMIC_ACQUIRE)) {
            a->cudaGetLastError();
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
held_call(const pyccl_api *a, pyccl_ar *f, pyccl_comm *c, int gather, const void *send,
          void *recv, size_t count, cudaStream_t s)
{
    pyccl_task t = {.coll = gather ? PYCCL_ALL_GATHER : PYCCL_ALL_REDUCE,
                    .send = send, .recv = recv, .count = count,
                    .type = gather ? ncclUint8 : ncclInt32, .stream = s};
    int gone;
    ncclResult_t r = pyccl_comm_held_call(a, c, &t, ncclMin, f->deadline, f->last,
                                          sizeof f->last, &gone);
    /* a peer may have what this rank sent once the call was made */
    f->sent |= gone == PYCCL_HELD_MADE || gone == PYCCL_HELD_CLAIMED;
    if (gone != PYCCL_HELD_MADE) {
        f->gone = 1;
        f->other |= gone == PYCCL_HELD_OTHER;
        return ncclInvalidUsage;
    }
    if (r == ncclSuccess) {
        r = sync_stream(a, c, s, f->deadline);
    }
    return r;
}

/* NCCL all_reduce(MIN) of one int through `dev` (a device int), synchronous.
 * Also the barrier of the set-up and of destroy. */
static ncclResult_t
agree(const pyccl_api *a, pyccl_ar *f, pyccl_comm *c, int *dev, int *value, cudaStream_t s)
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
wait_launched(const pyccl_api *a, pyccl_ar *f)
{
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (f->launches == 0 || f->order == NULL ||
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

/* Free what no other process sees: the ordering event and the host word
 * (the region goes through ar_region_let_go). */
static void
free_local(const pyccl_api *a, pyccl_ar *f)
{
    if (f->order != NULL && a->cudaEventDestroy) {
        a->cudaEventDestroy(f->order);
    }
    f->order = NULL;
    if (f->host_err != NULL && a->cudaFreeHost) {
        a->cudaFreeHost(f->host_err);
    }
    f->host_err = NULL;
    f->done = NULL;
}

/* The peers' regions closed here, what is local freed, and this rank's
 * region let go of (`safe`: freed now). */
static void
drop_all(const pyccl_api *a, pyccl_ar *f, int safe)
{
    ar_region_close_peers(a, &f->region);
    free_local(a, f);
    ar_region_let_go(a, &f->region, safe);
}

/* This rank's region (with its page of marks), host word and ordering
 * event; 0 when any failed (with the reason; nothing kept then). */
static int
alloc_local(const pyccl_api *a, pyccl_ar *f, size_t total, ar_record *mine)
{
    cudaError_t e = ar_region_alloc(a, &f->region, total, &mine->handle, mine->marks,
                                    sizeof mine->marks);
    if (e == cudaSuccess) {
        /* the stop word, and 8 bytes on the mark word (host_err + 2) */
        e = a->cudaHostAlloc((void **)&f->host_err, 16, cudaHostAllocMapped);
    }
    if (e == cudaSuccess) {
        e = a->cudaDeviceGetPCIBusId(mine->busid, (int)sizeof mine->busid, f->device);
    }
    if (e == cudaSuccess && a->cudaEventCreateWithFlags) {
        e = a->cudaEventCreateWithFlags(&f->order, cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
        AR_WHY(f, "setting up %zu bytes of peer memory on cuda:%d failed: %s", total, f->device,
            a->cudaGetErrorString(e));
        a->cudaGetLastError();
        drop_all(a, f, 1);
        return 0;
    }
    *f->host_err = 0;
    f->done = (unsigned long long *)(f->host_err + 2);
    *f->done = 0;
    return 1;
}

/* PYCCL_AR_SHARED_GPU=1: ranks on one GPU may use the kernels.  CUDA IPC maps
 * another process's memory of the same device, and the GPU time-slices the
 * ranks' kernels, so a wait on a peer ends once the peer's kernel gets its
 * slice: correct, but far slower than NCCL there.  Off by default: ranks on
 * one GPU are a development set-up (see pyccl.place_rank), not a fast one.
 * A rank that refuses rules the kernels out for all (the agreement after the
 * checks), so ranks need not agree on it. */
static int
shared_gpu_ok(void)
{
    const char *v = getenv("PYCCL_AR_SHARED_GPU");
    return v != NULL && *v != '\0' && strcmp(v, "0") != 0;
}

/* Why rank p's record rules the kernels out for everyone (a reason written,
 * 0), or 1. */
static int
check_record(pyccl_ar *f, const ar_record *all, const ar_record *mine, int p)
{
    const int me = f->rank;
    if (!all[p].ok) {
        AR_WHY(f, "rank %d cannot use them", p);
    } else if (all[p].host != mine->host) {
        AR_WHY(f, "rank %d is on another host", p);
    } else if (p != me && all[p].pid == mine->pid) {
        AR_WHY(f, "ranks %d and %d share a process (CUDA IPC works between processes)", me, p);
    } else if (p != me && strcmp(all[p].busid, mine->busid) == 0 && !shared_gpu_ok()) {
        AR_WHY(f, "ranks %d and %d share GPU %s (PYCCL_AR_SHARED_GPU=1 lets the own kernels run "
            "there, correct but slow: the GPU time-slices the ranks)", me, p, mine->busid);
    } else if (all[p].half_bytes != all[0].half_bytes || all[p].ll_max != all[0].ll_max ||
               all[p].blocks != all[0].blocks || all[p].threads != all[0].threads) {
        AR_WHY(f, "ranks disagree on PYCCL_AR_BUFFER_MB / PYCCL_AR_LL_MAX / PYCCL_AR_BLOCKS / "
            "PYCCL_AR_THREADS");
    } else if ((all[p].wait_s > 0) != (all[0].wait_s > 0)) {
        const ar_record *w = all[p].wait_s > 0 ? &all[p] : &all[0];
        AR_WHY(f, "ranks disagree on whether a kernel's wait for its peers ends (rank %d: after "
            "%g s, rank %d: never; PYCCL_AR_TIMEOUT, or timeout=, on some ranks only)",
            (int)(w - all), w->wait_s, w == all ? p : 0);
    } else if (all[p].one_max != all[0].one_max || all[p].two_max != all[0].two_max) {
        AR_WHY(f, "ranks disagree on PYCCL_AR_ONESHOT_MAX / PYCCL_AR_TWOSHOT_MAX (rank %d: %llu / "
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
map_peers(const pyccl_api *a, pyccl_ar *f, const ar_record *all)
{
    for (int p = 0; p < f->nranks; p++) {
        if (!ar_region_map(a, &f->region, p, all[p].busid, all[p].handle, f->reason,
                           sizeof f->reason)) {
            return 0;
        }
    }
    return 1;
}

/* The probe: stage 0 writes into every peer; the agreement is the barrier
 * before stage 1 reads back.  Returns the NCCL result of the agreements;
 * *ok says whether every rank's probe passed. */
static ncclResult_t
probe(const pyccl_api *a, pyccl_ar *f, pyccl_comm *c, int *flag, uint32_t magic,
      cudaStream_t s, int *ok)
{
    pyccl_ar_params prm;
    memset(&prm, 0, sizeof prm);
    for (int p = 0; p < f->nranks; p++) {
        prm.base[p] = f->region.peer[p];
    }
    prm.out = flag + 4;
    prm.rank = f->rank;
    prm.nranks = f->nranks;
    prm.magic = magic;
    CUfunction fn = ar_devs[f->device].fn[K_PROBE];
    int zero = 0, stage = 0;
    void *args[] = {&prm, &stage};
    int okp = 1;
    if (a->cudaMemcpy(flag + 4, &zero, sizeof zero, cudaMemcpyHostToDevice) != cudaSuccess ||
        ar_drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, args, NULL) != 0 ||
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
        if (ar_drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, args, NULL) != 0 ||
            a->cudaStreamSynchronize(s) != cudaSuccess ||
            a->cudaMemcpy(&failed, flag + 4, sizeof failed, cudaMemcpyDeviceToHost) !=
                cudaSuccess) {
            okp = 0;
            AR_WHY(f, "the peer-memory probe kernel failed");
        } else if (failed) {
            okp = 0;
            AR_WHY(f, "the write-then-read probe failed with peer mask 0x%x", failed);
        }
    } else {
        AR_WHY(f, "the peer-memory probe could not run on every rank");
    }
    a->cudaGetLastError();
    if ((r = agree(a, f, c, flag, &okp, s)) != ncclSuccess) {
        return r;
    }
    if (!okp && f->reason[0] == '\0') {
        AR_WHY(f, "the write-then-read probe failed on another rank");
    }
    *ok = okp;
    return ncclSuccess;
}

/* Collective.  Called without the GIL, current device = the comm's, f's
 * setup_mu held.  Returns the NCCL result of the exchange (a failure there
 * is the caller's error; f->gone: the communicator was aborted meanwhile,
 * or f->other: another thread's open pyccl.group() holds it);
 * f->state says whether the kernels are usable. */
ncclResult_t
ar_setup(const pyccl_api *a, pyccl_ar *f, pyccl_comm *c, cudaStream_t s)
{
    const int n = f->nranks, me = f->rank;
    int ok = 1;
    ar_record mine;
    memset(&mine, 0, sizeof mine);
    const char *off = getenv("PYCCL_DISABLE_OWN_KERNELS");
    if (off != NULL && *off != '\0' && strcmp(off, "0") != 0) {
        ok = 0;
        AR_WHY(f, "PYCCL_DISABLE_OWN_KERNELS is set");
    } else if (f->bad_setting[0] != '\0') {
        ok = 0;
        AR_WHY(f, "%s", f->bad_setting);
    } else if (n < 2 || n > PYCCL_AR_MAX_RANKS) {
        ok = 0;
        AR_WHY(f, "the own kernels serve 2 to %d ranks, this communicator has %d",
            PYCCL_AR_MAX_RANKS, n);
    } else if (ar_load_kernels(f->device, f->reason, sizeof f->reason) < 0) {
        ok = 0;
    } else if (f->pdl && !ar_pdl_supported(f->device)) {
        f->pdl = 0;
    }
    /* the exchange's scratch first: without it this rank could not join
     * the exchange, and its peers would wait for it */
    char *dev = NULL;
    const size_t scratch = (size_t)n * sizeof(ar_record) + 64;
    if (a->cudaMalloc((void **)&dev, scratch) != cudaSuccess) {
        a->cudaGetLastError();
        return ncclSystemError;
    }
    size_t total = PYCCL_AR_DATA_OFF + 2 * f->half_bytes + 2 * (size_t)n * 2 * f->ll_max;
    ar_drain(a); /* regions let go of before: free those no peer maps any more */
    if (ok) {
        ok = alloc_local(a, f, total, &mine);
    }
    mine.host = host_id();
    mine.half_bytes = f->half_bytes;
    mine.ll_max = f->ll_max;
    mine.one_max = f->one_max;
    mine.two_max = f->two_max;
    mine.wait_s = f->timeout;
    mine.pid = (int32_t)getpid();
    mine.ok = ok;
    mine.blocks = f->blocks;
    mine.threads = f->threads;
    mine.magic = (uint32_t)(host_id() ^ (uint64_t)getpid() * 2654435761u);

    /* exchange: n records + one int for agreements, in one scratch buffer */
    ar_record *all = NULL;
    ncclResult_t r = ncclSuccess;
    int exchanged = 0; /* peers may have this rank's handle from here on */
    int *flag = (int *)(dev + (size_t)n * sizeof(ar_record));
    if ((all = malloc((size_t)n * sizeof(ar_record))) == NULL) {
        r = ncclSystemError;
        goto out;
    }
    if (a->cudaMemcpy(dev + (size_t)me * sizeof(ar_record), &mine, sizeof mine,
                      cudaMemcpyHostToDevice) != cudaSuccess) {
        r = ncclUnhandledCudaError;
        goto out;
    }
    r = held_call(a, f, c, 1, dev + (size_t)me * sizeof(ar_record), dev, sizeof(ar_record), s);
    /* not when the communicator was gone before the exchange was enqueued */
    exchanged = !(r == ncclInvalidUsage && f->gone && !f->sent);
    if (r != ncclSuccess) {
        goto out;
    }
    if (a->cudaMemcpy(all, dev, (size_t)n * sizeof(ar_record), cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
        r = ncclUnhandledCudaError;
        goto out;
    }
    for (int p = 0; p < n && ok; p++) {
        ok = check_record(f, all, &mine, p);
    }
    for (int p = 0; p < n && ok; p++) {
        if (p != me) { /* where this rank tells p that it closed p's region */
            ar_region_peer(&f->region, p, all[p].marks, all[p].pid);
        }
    }
    if (ok) {
        ok = map_peers(a, f, all);
    }
    /* everyone mapped everyone, or nobody goes on */
    r = agree(a, f, c, flag, &ok, s);
    /* past this barrier every peer has opened this rank's page of marks (or
     * never will): its name goes, so none is left behind in /dev/shm by a
     * process that exits or dies; the mappings stay */
    ar_region_unlink(&f->region);
    if (r != ncclSuccess) {
        goto out;
    }
    if (!ok) {
        if (f->reason[0] == '\0') {
            AR_WHY(f, "another rank could not map its peers");
        }
    } else if ((r = probe(a, f, c, flag, all[0].magic, s, &ok)) != ncclSuccess) {
        goto out;
    }
    if (!ok) {
        /* every rank (all know it is off now) closes its mappings, then a
         * barrier: no importer is left when the regions are freed */
        ar_region_close_peers(a, &f->region);
        free_local(a, f);
        int one = 1;
        r = agree(a, f, c, flag, &one, s);
        ar_region_let_go(a, &f->region, r == ncclSuccess); /* parked when the barrier failed */
    }
out:
    if (r != ncclInProgress) { /* a timed-out NCCL kernel may still use it */
        a->cudaFree(dev);
    }
    free(all);
    if (r != ncclSuccess) {
        ok = 0;
        AR_WHY(f, f->other ? "a pyccl.group() open on another thread took the communicator during "
                             "the set-up (NCCL takes a communicator's calls from one thread's group "
                             "at a time)"
                  : f->gone ? "the communicator was aborted during the set-up"
                            : "the set-up exchange failed");
    }
    /* after the exchange every peer is past what it did before this set-up
     * (a release of an earlier communicator, say): what it closed goes now */
    ar_drain(a);
    if (ok) {
        f->reason[0] = '\0';
        ar_live_add(f);
        /* with a timeout, the watchdog reads the kernels' word from now on */
        pyccl_watch_kernels(c, f->host_err);
        /* release: a thread that reads READY (acquire) sees the mappings */
        __atomic_store_n(&f->state, AR_READY, __ATOMIC_RELEASE);
    } else {
        __atomic_store_n(&f->state, AR_OFF, __ATOMIC_RELEASE);
        /* once exchanged, a peer may have mapped this region: parked */
        drop_all(a, f, !exchanged);
    }
    return r;
}


void
pyccl_ar_release(pyccl_state *st, pyccl_comm *c, int collective)
{
    pyccl_ar *f = c->ar;
    const pyccl_api *a = &st->api;
    if (f == NULL || c->setups > 0) {
        /* a set-up in flight (abort() from another thread) cleans up after
         * itself; the rest goes with the communicator.  Any release frees
         * the parked regions that no peer maps any more. */
        if (!st->exiting && a->loaded && pyccl_ar_parked() > 0) {
            Py_BEGIN_ALLOW_THREADS
            ar_drain(a);
            Py_END_ALLOW_THREADS
        }
        return;
    }
    int ready = f->state == AR_READY && !st->exiting && a->loaded;
    int prev = -1, entered = 0;
    if (ready) {
        /* Its kernels end first (they poll the host word free_local frees).
         * c->ar stays linked meanwhile: abort() from another thread finds
         * the stop word there and ends kernels that wait for a dead peer. */
        Py_BEGIN_ALLOW_THREADS
        entered = pyccl_device_enter(a, f->device, &prev) == cudaSuccess;
        if (entered) {
            wait_launched(a, f);
        }
        Py_END_ALLOW_THREADS
    }
    /* with the GIL: from here on no other thread reaches f (a wait for a
     * mark begins with it held, so none begins after this) */
    const int waited_on = __atomic_load_n(&f->waiters, __ATOMIC_ACQUIRE) > 0;
    if (waited_on) {
        /* a call of another thread waits for a mark, reading f: abort() set
         * the stop word that ends it; set here should anything else release
         * f under such a wait */
        pyccl_ar_stop(c);
    }
    c->ar = NULL;
    ar_live_remove(f);
    if (waited_on) {
        if (st->exiting) {
            return; /* at exit, a daemon thread's call: f is left to it */
        }
        Py_BEGIN_ALLOW_THREADS
        while (__atomic_load_n(&f->waiters, __ATOMIC_ACQUIRE) > 0) {
            sched_yield();
        }
        Py_END_ALLOW_THREADS
    }
    if (ready && entered) {
        /* Peers may read this rank's region until they closed their mapping:
         * free it only after a barrier that follows every rank's close (bounded
         * by the timeout where there is one; given up when abort() comes).
         * Without it (abort, garbage collection, a peer that did not come) the
         * region is kept (leaked). */
        int aborted = __atomic_load_n(&c->abort_asked, __ATOMIC_ACQUIRE);
        Py_BEGIN_ALLOW_THREADS
        pyccl_watch_kernels(c, NULL); /* the watchdog stops reading the word first */
        ar_region_close_peers(a, &f->region);
        free_local(a, f);
        int freed = 0;
        if (collective && !aborted) {
            int *dev = NULL, ok = 1;
            f->deadline = f->timeout > 0 ? pyccl_now_s() + f->timeout : 0;
            if (a->cudaMalloc((void **)&dev, sizeof(int)) == cudaSuccess) {
                ncclResult_t r = agree(a, f, c, dev, &ok, NULL);
                freed = r == ncclSuccess;
                if (r != ncclInProgress) { /* else its kernel may still use it */
                    a->cudaFree(dev);
                }
            }
            a->cudaGetLastError();
        }
        ar_region_let_go(a, &f->region, freed); /* parked unless the barrier passed */
        ar_drain(a);
        Py_END_ALLOW_THREADS
    }
    pyccl_device_leave(a, f->device, prev); /* prev -1: nothing to do */
    pthread_mutex_destroy(&f->setup_mu);
    PyMem_RawFree(f);
}
