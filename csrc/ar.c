/* pyccl's own intra-node all-reduce: the calls.
 *
 * Decides per call whether the own kernels run (algo=, dtype, op, size,
 * group, capture), has the communicator set up on the first call that may
 * use them (ar_setup.c), and launches one kernel per call on the
 * caller's stream (graph capture works: the kernels keep their epochs on the
 * device).  Where anything is missing the reason is kept
 * (comm.all_reduce_info) and logged once, and NCCL does the work. */
#include "ar.h"
#include "locks.h"
#include "ar_setup.h"
#include "call.h"
#include "timeouts.h"
#include "enqueue.h"
#include "tensor.h"
#include "errors.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* A setting the kernels cannot use is not raised where it is read (a
 * setting of one rank would leave the others waiting in the set-up): the
 * first such is kept in f->bad_setting, and the set-up turns the kernels off
 * for all, saying why. */
static void
bad_setting(pyccl_ar *f, const char *fmt, ...)
{
    if (f->bad_setting[0] != '\0') {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->bad_setting, sizeof f->bad_setting, fmt, ap);
    va_end(ap);
}

/* A whole number from lo to hi, or dflt where unset (blank is unset); one
 * that is not: bad_setting, and dflt. */
static long
env_long(pyccl_ar *f, const char *name, long dflt, long lo, long hi)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') {
        return dflt;
    }
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end != '\0' || errno == ERANGE || x < lo || x > hi) {
        bad_setting(f, "%s must be a whole number from %ld to %ld, got '%.60s'", name, lo, hi, v);
        return dflt;
    }
    return x;
}

static size_t
buffer_bytes(pyccl_ar *f)
{
    return (size_t)env_long(f, "PYCCL_AR_BUFFER_MB", 16, 1, 4096) << 20;
}

/* Auto's thresholds by world size, in bytes: the one-shot kernel up to
 * `one`, the two-shot up to `two`, NCCL above (the table's values capped at
 * the buffer; an override is not, and a call above the buffer runs in
 * chunks of it).
 * Each row from a sweep of float32 sum in place (tools/sweep.sh):
 *   2 ranks, 2xH200 and 2xH100 (docs/PERFORMANCE.md): one-shot beats NCCL
 *     up to the whole buffer (8 MiB: 36 against 51 us on H200, 36 against
 *     42 us against NCCL's symmetric kernels on H100), and two-shot never
 *     beats one-shot;
 *   3 ranks, 4xH200 (docs/results/4xH200/algos3.txt): one-shot 8.9 us
 *     against two-shot 12.0 at 512 KiB; the two tie at 2 MiB (20.9 and 20.5);
 *     two-shot 55.6 against NCCL's 60.1 at 8 MiB; NCCL at 32 MiB;
 *   4 ranks, 4xH100 NV18: one-shot 12.7 us against two-shot 15.8 at 512 KiB;
 *     two-shot 23.8 against one-shot 29.6 at 2 MiB and 55.9 against NCCL's
 *     63.5 at 8 MiB; NCCL at 32 MiB (4xH200, algos4.txt: 11.7 against 13.7,
 *     24.1 against 29.9, 56.5 against 62.6).
 * Other counts are not measured: the 3- and 4-rank crossover for one-shot
 * (it reads n-1 copies, so it stays on small sizes) and the limit of
 * two-shot from before those sweeps.  PYCCL_AR_ONESHOT_MAX / PYCCL_AR_TWOSHOT_MAX
 * (bytes) override them.  Every rank must see the same values (the set-up
 * checks). */
#define AR_BUFFER ((size_t)0) /* the whole buffer */
static const struct {
    int nranks;
    size_t one, two;
} ar_thresholds[] = {
    {2, AR_BUFFER, AR_BUFFER},
    {3, (size_t)512 << 10, (size_t)8 << 20},
    {4, (size_t)512 << 10, (size_t)8 << 20},
    {0, (size_t)512 << 10, (size_t)4 << 20}, /* any other count: not measured */
};

static void
thresholds(pyccl_ar *f, int nranks, size_t *one, size_t *two)
{
    size_t cap = buffer_bytes(f);
    size_t k = 0;
    while (ar_thresholds[k].nranks != 0 && ar_thresholds[k].nranks != nranks) {
        k++;
    }
    size_t o = ar_thresholds[k].one == AR_BUFFER ? cap : ar_thresholds[k].one;
    size_t t = ar_thresholds[k].two == AR_BUFFER ? cap : ar_thresholds[k].two;
    *one = (size_t)env_long(f, "PYCCL_AR_ONESHOT_MAX", (long)(o < cap ? o : cap), 0, 1L << 40);
    *two = (size_t)env_long(f, "PYCCL_AR_TWOSHOT_MAX", (long)(t < cap ? t : cap), 0, 1L << 40);
}

int
pyccl_read_algo(const char *op, PyObject *obj, int two, pyccl_algo *out)
{
    static const char *const names[] = {"auto", "nccl", "oneshot", "twoshot"};
    const char *which = two ? "'auto', 'nccl', 'oneshot' or 'twoshot'" : "'auto', 'nccl' or 'oneshot'";
    *out = PYCCL_ALGO_AUTO;
    if (obj == NULL || obj == Py_None) {
        return 0;
    }
    if (PyUnicode_Check(obj)) {
        for (int i = 0; i < (two ? 4 : 3); i++) {
            if (PyUnicode_CompareWithASCIIString(obj, names[i]) == 0) {
                *out = (pyccl_algo)i;
                return 0;
            }
        }
        PyErr_Format(PyExc_ValueError, "%s: algo must be %s, got %R", op, which, obj);
        return -1;
    }
    PyErr_Format(PyExc_TypeError, "%s: algo must be a str (%s), got %.200s", op, which,
                 Py_TYPE(obj)->tp_name);
    return -1;
}

static const char *
algo_name(pyccl_algo a)
{
    return a == PYCCL_ALGO_ONESHOT ? "oneshot" : "twoshot";
}

static void
log_once(pyccl_ar *f)
{
    const char *quiet = getenv("PYCCL_QUIET"); /* blank and 0: unset */
    if (f->logged || (quiet != NULL && *quiet != '\0' && strcmp(quiet, "0") != 0)) {
        return;
    }
    f->logged = 1;
    pyccl_log(PYCCL_LOG_WARNING, "rank %d of %d uses NCCL for all_reduce: %s", f->rank,
              f->nranks, f->reason);
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
 * rank must see the same values; the set-up checks the ones that matter).
 * -1 with ValueError naming op for a PYCCL_AR_TIMEOUT that is no number of
 * seconds > 0 (where it is used: c has no timeout of its own). */
static int
read_settings(pyccl_ar *f, const pyccl_comm *c, const char *op)
{
    f->rank = c->rank;
    f->nranks = c->size;
    f->device = c->device;
    f->half_bytes = buffer_bytes(f);
    thresholds(f, c->size > 0 ? c->size : 2, &f->one_max, &f->two_max);
    f->ll_max = ((size_t)env_long(f, "PYCCL_AR_LL_MAX", 256 << 10, 0, 1L << 24) + 15) & ~(size_t)15;
    f->blocks = (int)env_long(f, "PYCCL_AR_BLOCKS", 64, 1, PYCCL_AR_MAX_BLOCKS);
    f->threads = (int)env_long(f, "PYCCL_AR_THREADS", 512, 32, 512) & ~31;
    /* a wait on peers gives up after the communicator's timeout (or
     * PYCCL_AR_TIMEOUT seconds for one without).  With a timeout of the
     * communicator, that is what bounds a call of the kernels (no event
     * follows them): a kernel that gave up says so in its word, which the
     * watchdog reads */
    const char *to = getenv("PYCCL_AR_TIMEOUT");
    const double ct = c->timeout;
    f->timeout = ct;
    if (ct <= 0 && to != NULL && *to != '\0') { /* blank: unset */
        char *end = NULL;
        double v = strtod(to, &end);
        /* the kernels count nanoseconds in 64 bits: up to a century */
        if (end == to || *end != '\0' || !(v > 0.0) || !(v < 3.0e9)) {
            bad_setting(f, "PYCCL_AR_TIMEOUT must be a finite number of seconds > 0, got '%.60s'", to);
        }
        else {
            f->timeout = v;
        }
    }
    f->skew_ns = (unsigned)env_long(f, "PYCCL_AR_DEBUG_SKEW_NS", 0, 0, 1000000);
    /* programmatic dependent launch: a rank-local choice (it changes when a
     * kernel is scheduled, not what it does), so ranks need not agree; the
     * set-up turns it off where the GPU or the driver lacks it */
    f->pdl = (int)env_long(f, "PYCCL_AR_PDL", 1, 0, 1);
    return 0;
}

static pyccl_ar *
ar_of(pyccl_comm *c, const char *op)
{
    if (c->ar == NULL) {
        pyccl_ar *f = PyMem_RawCalloc(1, sizeof *f);
        if (f == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        if (read_settings(f, c, op) < 0) {
            PyMem_RawFree(f);
            return NULL;
        }
        ar_region_init(&f->region, c->rank, c->size, c->device);
        pthread_mutex_init(&f->setup_mu, NULL);
        c->ar = f;
    }
    return c->ar;
}

/* The own kernels are off on c for good, and the call raises: one place for
 * what ends them.  `gone`: abort() or the watchdog ended c during the set-up
 * (RuntimeError now if it was alive).  Else r: ncclInProgress, the peers did
 * not come within the timeout (`where`: during the set-up, or in a kernel):
 * c fails, its kernels that wait for peers give up, and the call raises
 * (NcclTimeoutError, or the failure before it).  Both through the door's
 * tracking of the call on stream s, where c has a watch (a timeout, or the
 * record that an abort() leaves), which finds the failure (or a destroy()
 * begun) and raises it, tracking nothing.  Any other result, the set-up's
 * NCCL error, raised with c still usable.  Always -1. */
static int
turn_off(pyccl_state *st, pyccl_comm *c, pyccl_ar *f, const char *op, int gone,
         ncclResult_t r, const char *where, cudaStream_t s)
{
    f->state = AR_OFF;
    char msg[sizeof f->reason + 64];
    if (gone) {
        snprintf(msg, sizeof msg, "%s: %s", op, f->reason);
    } else {
        snprintf(msg, sizeof msg,
                 "%s: rank %d of %d timed out after %s s waiting for its peers%s; the "
                 "communicator was aborted",
                 op, f->rank, f->nranks, f->timeout_text.s, where);
    }
    int rc;
    if (gone || r == ncclInProgress) {
        /* the enqueue raises c's failure, or that it is destroyed (without
         * a watch, c is gone only then, or not ready) */
        rc = pyccl_call_track(st, op, c, s, gone ? NULL : f->host_err, gone ? NULL : msg);
    } else {
        pyccl_raise_nccl(st, op, r, f->last);
        return -1;
    }
    if (rc == 0) {
        PyErr_SetString(PyExc_RuntimeError, msg); /* c was still usable */
    }
    return -1;
}

/* The collective set-up of c's kernels, GIL released, one at a time per
 * communicator; f->state says the outcome.  -1 with an exception. */
static int
set_up(pyccl_state *st, pyccl_comm *c, pyccl_ar *f, const char *op, cudaStream_t s)
{
    const pyccl_api *a = &st->api;
    int prev, ran = 0, gone = 0, refused = 0;
    ncclResult_t r = ncclSuccess;
    /* inside the caller's call (begun, so destroy() refuses meanwhile);
     * abort() does not wait for a set-up: it holds the lock per NCCL call */
    c->setups++;
    Py_BEGIN_ALLOW_THREADS
    /* one set-up per communicator: another thread's call waits here, then
     * finds it done */
    pyccl_lock(&f->setup_mu, PYCCL_LOCK_SETUP);
    if (f->state == AR_UNTRIED) {
        ran = 1;
        f->deadline = f->timeout > 0 ? pyccl_now_s() + f->timeout : 0;
        f->gone = 0;
        f->other = 0;
        f->sent = 0;
        f->last[0] = '\0';
        if (pyccl_device_enter(a, f->device, &prev) != cudaSuccess) {
            r = ncclUnhandledCudaError;
        } else {
            /* for the messages that end the kernels: published with their
             * state (a thread that reads it READY reads this too) */
            f->timeout_text = pyccl_secs(f->timeout);
            r = ar_setup(a, f, c, s);
        }
        pyccl_device_leave(a, f->device, prev);
        /* read here: once the lock is let go, another thread's set-up may
         * begin (after a refusal) and rewrite them */
        gone = f->gone;
        refused = f->other && !f->sent;
        if (refused) {
            /* refused before anything was sent (all dropped): a later call
             * sets the kernels up */
            __atomic_store_n(&f->state, AR_UNTRIED, __ATOMIC_RELEASE);
        }
    }
    pyccl_unlock(&f->setup_mu);
    Py_END_ALLOW_THREADS
    c->setups--;
    if (refused) {
        return pyccl_raise_other_group(op, c);
    }
    if (ran && (gone || r != ncclSuccess)) {
        return turn_off(st, c, f, op, gone, r, " (setting up pyccl's all-reduce kernels)", s);
    }
    if (f->state != AR_READY) {
        log_once(f);
    }
    return 0;
}

/* The parameter block of a kernel of f for nbytes of in -> out. */
static void
params(const pyccl_ar *f, pyccl_ar_params *prm, const char *in, char *out, size_t nbytes)
{
    memset(prm, 0, sizeof *prm);
    prm->in = in;
    prm->out = out;
    memcpy(prm->base, f->region.peer, sizeof prm->base);
    prm->host_error = f->host_err;
    prm->done = f->done;
    prm->nbytes = nbytes;
    prm->half_bytes = f->half_bytes;
    /* 0 is "for ever" to the kernels: a bound under 1 ns is 1 ns, and one
     * past 64 bits of nanoseconds (a finite timeout= may be) the largest */
    const double ns = f->timeout * 1e9;
    prm->timeout_ns = f->timeout <= 0 ? 0ULL
                      : ns < 1.0      ? 1ULL
                      : ns >= 1.8e19  ? ULLONG_MAX
                                      : (unsigned long long)ns;
    prm->rank = f->rank;
    prm->nranks = f->nranks;
    prm->aligned = (((uintptr_t)in | (uintptr_t)out) & 15u) == 0;
    prm->ll_slot = 2 * f->ll_max;
    prm->skew_ns = f->skew_ns;
}

/* Kernel k with the parameter block prm (ll: the LL kernel, whose blocks
 * shrink to the size) on stream s, ordered after c's previous one; 0, or -1
 * with CudaError naming op and `what` (the kernel). */
static int
launch_prm(pyccl_state *st, pyccl_ar *f, const char *op, pyccl_ar_params *prm, int ll, int k,
           const char *what, cudaStream_t s)
{
    const pyccl_api *a = &st->api;
    const size_t nbytes = prm->nbytes;
    const int variant = ll ? 0 : 1;
    void *args[] = {prm};
    int prev;
    CUresult r = 0;
    int bad_device = 0;
    if (pyccl_device_enter(a, f->device, &prev) != cudaSuccess) {
        bad_device = 1;
    } else {
        if (f->launches > 0 && s != f->last_stream) {
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
        if (++f->launches % PYCCL_LEAD_EVERY == 0) {
            /* a mark (not in a capture: a replay would store a stale one) */
            prm->mark = pyccl_stream_captured(a, s) ? 0 : f->launches;
        }
        unsigned threads = (unsigned)f->threads;
        if (variant == 0) {
            /* LL: one 8-byte line per thread is enough; every block still
             * runs (each keeps its own epoch), just smaller */
            size_t lines = (nbytes + 7) / 8;
            size_t per = (lines + (size_t)f->blocks - 1) / (size_t)f->blocks;
            per = (per + 31) & ~(size_t)31;
            threads = per < threads ? (unsigned)per : threads;
        }
        CUfunction fn = ar_devs[f->device].fn[k];
        if (f->pdl) {
            /* the kernels begin with griddepcontrol.wait (allreduce.cu) */
            cu_launch_attr attr;
            memset(&attr, 0, sizeof attr);
            attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.i = 1;
            cu_launch_config cfg = {{(unsigned)f->blocks, 1, 1}, {threads, 1, 1}, 0, s, &attr, 1};
            r = ar_drv.cuLaunchKernelEx(&cfg, fn, args, NULL);
        } else {
            r = ar_drv.cuLaunchKernel(fn, (unsigned)f->blocks, 1, 1, threads, 1, 1, 0, s, args, NULL);
        }
    }
    pyccl_device_leave(a, f->device, prev);
    if (!bad_device && r == 0 && prm->mark != 0) {
        /* the call waits for the mark PYCCL_LEAD_MARKS back (wait_for_marks) */
        unsigned long long *slot = &f->lead[f->nlead++ % PYCCL_LEAD_MARKS];
        f->lead_back = *slot > f->lead_back ? *slot : f->lead_back;
        *slot = prm->mark;
    }
    if (bad_device || r != 0) {
        PyErr_Format(st->CudaError, "%s: launching pyccl's %s kernel on cuda:%d failed: %s",
                     op, what, f->device,
                     bad_device ? "cannot make the device current" : ar_cu_error(r));
        return -1;
    }
    return 0;
}

/* After a call's launches: where one carried a mark, the mark PYCCL_LEAD_MARKS
 * back must have ended (ar_setup.h), waited for with the GIL released; a
 * kernel that gave up meanwhile fails the call as it would the next one, and
 * abort() or a failure of c (their stop word) end the wait for the call's
 * tracking to raise.  f is read again only while c still has it (abort()
 * from another thread frees it).  0, or -1 raised. */
static int
wait_for_marks(pyccl_state *st, pyccl_comm *c, pyccl_ar *f, const char *op, cudaStream_t s)
{
    const unsigned long long back = f->lead_back;
    f->lead_back = 0;
    if (back == 0) {
        return 0;
    }
    if (pyccl_wait_mark(f->done, back, f->host_err, &f->waiters) < 0) {
        return -1;
    }
    if (c->ar == f && *(volatile int *)f->host_err == 1) {
        AR_WHY(f, "a wait gave up after %g s", f->timeout);
        return turn_off(st, c, f, op, 0, ncclInProgress, " in pyccl's all-reduce kernel", s);
    }
    return 0;
}

/* One all-reduce kernel of variant (0 LL, 1 one-shot, 2 two-shot) and index k
 * for nbytes of t -> o from byte off on, on stream s; 0, or -1 with an
 * exception. */
static int
launch(pyccl_state *st, pyccl_ar *f, const char *op, const pyccl_tensor *t,
       const pyccl_tensor *o, size_t off, size_t nbytes, int variant, int k, cudaStream_t s)
{
    pyccl_ar_params prm;
    params(f, &prm, t->ptr + off, o->ptr + off, nbytes);
    return launch_prm(st, f, op, &prm, variant == 0, k, "all-reduce", s);
}

/* Whether the own kernels may take this call at all (kt, ko: the kernel's type
 * and op): 1 yes, 0 NCCL's, -1 raised (a forced algo that cannot). */
static int
eligible(pyccl_comm *c, const char *op, pyccl_algo algo, const pyccl_tensor *t, int redop,
         int typed, int *kt, int *ko)
{
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
    *kt = t->dtype >= 0 ? kernel_type(pyccl_dtype_table[t->dtype].nccl) : -1;
    *ko = kernel_op(redop);
    if (typed && (*kt < 0 || *ko < 0)) {
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
    return 1;
}

/* The first call that gets here sets the kernels up, on every rank together
 * (not during a capture).  0 done or off (f->state says which), -1 raised. */
static int
set_up_first(pyccl_state *st, pyccl_comm *c, pyccl_ar *f, const char *op, pyccl_algo algo,
             int forced, cudaStream_t s)
{
    const pyccl_api *a = &st->api;
    if (f->state == AR_UNTRIED &&
        (!a->cudaIpcGetMemHandle || !a->cudaIpcOpenMemHandle || !a->cudaIpcCloseMemHandle ||
         !a->cudaMemset || !a->cudaMemcpy || !a->cudaHostAlloc || !a->cudaFreeHost ||
         !a->cudaDeviceGetPCIBusId || !a->cudaStreamWaitEvent)) {
        /* the same runtime on every rank: all of them stop here alike */
        f->state = AR_OFF;
        AR_WHY(f, "the loaded CUDA runtime lacks the IPC calls");
    }
    if (f->state != AR_UNTRIED) {
        return 0;
    }
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
        return 0; /* still untried: the next eager call sets up */
    }
    return set_up(st, c, f, op, s);
}

int
pyccl_ar_all_reduce(pyccl_state *st, pyccl_comm *c, const char *op, pyccl_algo algo,
                        const pyccl_tensor *t, const pyccl_tensor *o, int redop,
                        cudaStream_t s)
{
    if (algo == PYCCL_ALGO_NCCL || t->numel == 0) {
        return 0;
    }
    int kt, ko;
    int ok = eligible(c, op, algo, t, redop, 1, &kt, &ko);
    if (ok <= 0) {
        return ok;
    }
    const int forced = algo != PYCCL_ALGO_AUTO;
    const size_t nbytes = (size_t)t->numel * (size_t)t->itemsize;
    /* the struct is made (without any GPU work) on the first call that gets
     * here, so the settings from the environment are read once */
    pyccl_ar *f = ar_of(c, op);
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
            if (f->state != AR_UNTRIED) {
                return 0;
            }
        }
    }
    if (set_up_first(st, c, f, op, algo, forced, s) < 0) {
        return -1;
    }
    /* acquire: pairs with the set-up's release (another thread's maybe) */
    if (__atomic_load_n(&f->state, __ATOMIC_ACQUIRE) != AR_READY) {
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
    if (*(volatile int *)f->host_err) {
        /* a kernel gave up on a peer: the communicator is done for */
        AR_WHY(f, "a wait gave up after %g s", f->timeout);
        return turn_off(st, c, f, op, 0, ncclInProgress, " in pyccl's all-reduce kernel", s);
    }
    /* A call larger than a half of the staging buffer runs as chunks of equal
     * size (256-byte multiples, so each stays aligned and whole elements), one
     * kernel each, in order on s: a chunk's kernel reuses the buffer as the
     * next call would.  Every rank cuts the same chunks (the set-up checked
     * that they have one buffer size; the call's size is the same). */
    size_t chunks = (nbytes + f->half_bytes - 1) / f->half_bytes;
    size_t per = chunks == 1 ? nbytes : ((nbytes + chunks - 1) / chunks + 255) & ~(size_t)255;
    for (size_t off = 0; off < nbytes; off += per) {
        size_t n = nbytes - off < per ? nbytes - off : per;
        int variant = algo == PYCCL_ALGO_TWOSHOT ? 2 : n <= f->ll_max ? 0 : 1;
        int k = variant * K_NTYPES * K_NOPS + kt * K_NOPS + ko;
        if (launch(st, f, op, t, o, off, n, variant, k, s) < 0) {
            return -1;
        }
    }
    if (wait_for_marks(st, c, f, op, s) < 0) {
        return -1;
    }
    /* as an NCCL call would be: watched with a timeout, else noted for wait() */
    return pyccl_call_track(st, op, c, s, NULL, NULL) < 0 ? -1 : 1;
}

int
pyccl_ar_gather_scatter(pyccl_state *st, pyccl_comm *c, const char *op, pyccl_algo algo,
                        const pyccl_tensor *in, const pyccl_tensor *out, int redop, int rs,
                        cudaStream_t s)
{
    const pyccl_tensor *part_of = rs ? out : in;
    if (algo != PYCCL_ALGO_ONESHOT || part_of->numel == 0) {
        return 0; /* auto: NCCL's until a sweep measures where the kernels win */
    }
    int kt, ko;
    int ok = eligible(c, op, algo, part_of, redop, rs, &kt, &ko);
    if (ok <= 0) {
        return ok;
    }
    const size_t part = (size_t)part_of->numel * (size_t)part_of->itemsize;
    pyccl_ar *f = ar_of(c, op);
    if (f == NULL || set_up_first(st, c, f, op, algo, 1, s) < 0) {
        return -1;
    }
    if (__atomic_load_n(&f->state, __ATOMIC_ACQUIRE) != AR_READY) {
        PyErr_Format(PyExc_RuntimeError, "%s: algo='%s' is unavailable on rank %d: %s", op,
                     algo_name(algo), f->rank, f->reason);
        return -1;
    }
    if (*(volatile int *)f->host_err) {
        AR_WHY(f, "a wait gave up after %g s", f->timeout);
        return turn_off(st, c, f, op, 0, ncclInProgress, " in pyccl's all-reduce kernel", s);
    }
    /* A launch stages one part (all_gather) or every rank's (reduce_scatter)
     * in a half of the buffer: larger calls run in equal chunks of the parts,
     * as all_reduce does. */
    size_t cap = (rs ? f->half_bytes / (size_t)f->nranks : f->half_bytes) & ~(size_t)255;
    size_t chunks = (part + cap - 1) / cap;
    size_t per = chunks == 1 ? part : ((part + chunks - 1) / chunks + 255) & ~(size_t)255;
    for (size_t off = 0; off < part; off += per) {
        size_t n = part - off < per ? part - off : per;
        pyccl_ar_params prm;
        params(f, &prm, in->ptr + off, out->ptr + off, n);
        prm.stride = part;
        uintptr_t m = (uintptr_t)prm.in | (uintptr_t)prm.out | n | part;
        int k;
        if (rs) {
            prm.aligned = (m & 15u) == 0;
            k = K_RS + kt * K_NOPS + ko;
        } else {
            k = K_AG + ((m & 15u) == 0 ? 0 : (m & 3u) == 0 ? 1 : 2);
        }
        if (launch_prm(st, f, op, &prm, 0, k, rs ? "reduce_scatter" : "all_gather", s) < 0) {
            return -1;
        }
    }
    if (wait_for_marks(st, c, f, op, s) < 0) {
        return -1;
    }
    return pyccl_call_track(st, op, c, s, NULL, NULL) < 0 ? -1 : 1;
}

PyObject *
pyccl_ar_info(pyccl_state *st, pyccl_comm *c)
{
    (void)st;
    pyccl_ar unset; /* before the set-up call: what it would read */
    pyccl_ar *f = c->ar;
    if (f == NULL) {
        memset(&unset, 0, sizeof unset);
        if (read_settings(&unset, c, "all_reduce_info") < 0) {
            return NULL;
        }
        f = &unset;
    }
    const char *state = f->state == AR_UNTRIED ? "not set up"
                        : f->state == AR_READY ? "ready"
                                               : "off";
    const char *reason = f->state == AR_OFF     ? f->reason
                         : pyccl_ar_built() ? ""
                                                : "built without nvcc";
    return Py_BuildValue("{s:s,s:s,s:n,s:n,s:n,s:n,s:i,s:i,s:d,s:O,s:O,s:i}", "state", state,
                         "reason", reason, "buffer_bytes", (Py_ssize_t)f->half_bytes, "ll_max",
                         (Py_ssize_t)f->ll_max, "oneshot_max", (Py_ssize_t)f->one_max,
                         "twoshot_max", (Py_ssize_t)f->two_max, "blocks", f->blocks, "threads",
                         f->threads, "timeout", f->timeout, "built",
                         pyccl_ar_built() ? Py_True : Py_False, "pdl",
                         f->pdl ? Py_True : Py_False, "parked", pyccl_ar_parked());
}

/* The kernels loaded on `device`, made current for the load (the module
 * goes into the current context), whatever device the calling thread has;
 * -1 with `why`. */
static int
load_on(pyccl_state *st, int device, char *why, size_t n)
{
    const pyccl_api *a = &st->api;
    int prev, rc = -1;
    if (pyccl_device_enter(a, device, &prev) != cudaSuccess) {
        snprintf(why, n, "cannot make cuda:%d current", device);
    } else {
        rc = ar_load_kernels(device, why, n);
    }
    pyccl_device_leave(a, device, prev);
    return rc;
}

double
pyccl_ar_launch_floor(pyccl_state *st, const char *op, int device, cudaStream_t s, int calls,
                      int pdl)
{
    const pyccl_api *a = &st->api;
    char why[400];
    if (!pyccl_ar_built()) {
        PyErr_Format(PyExc_RuntimeError, "%s: pyccl was built without its own kernels (no nvcc)",
                     op);
        return -1;
    }
    if (load_on(st, device, why, sizeof why) < 0) {
        PyErr_Format(PyExc_RuntimeError, "%s: %s", op, why);
        return -1;
    }
    if (pdl && !ar_pdl_supported(device)) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: cuda:%d cannot launch with programmatic dependent launch", op, device);
        return -1;
    }
    pyccl_ar_params prm;
    memset(&prm, 0, sizeof prm);
    void *args[] = {&prm};
    CUfunction fn = ar_devs[device].fn[K_EMPTY];
    cu_launch_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.i = 1;
    cu_launch_config cfg = {{1, 1, 1}, {32, 1, 1}, 0, s, &attr, 1};
    int prev;
    CUresult r = 0;
    double t = 0;
    if (pyccl_device_enter(a, device, &prev) != cudaSuccess) {
        pyccl_device_leave(a, device, prev);
        PyErr_Format(PyExc_RuntimeError, "%s: cannot make cuda:%d current", op, device);
        return -1;
    }
    const double t0 = pyccl_now_s();
    for (int i = 0; i < calls && r == 0; i++) {
        r = pdl ? ar_drv.cuLaunchKernelEx(&cfg, fn, args, NULL)
                : ar_drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, args, NULL);
    }
    t = pyccl_now_s() - t0;
    pyccl_device_leave(a, device, prev);
    if (r != 0) {
        PyErr_Format(st->CudaError, "%s: launching an empty kernel on cuda:%d failed: %s", op,
                     device, ar_cu_error(r));
        return -1;
    }
    return t * 1e6 / calls;
}

int
pyccl_ar_copy_usable(pyccl_state *st, int device)
{
    /* per device: 0 not tried, 1 loaded, -1 cannot load (kept, so a call does
     * not try the module's load again each time: that is set-up work) */
    static int usable[MAX_DEVICES];
    if (!pyccl_ar_built() || device < 0 || device >= MAX_DEVICES) {
        return 0;
    }
    int u = __atomic_load_n(&usable[device], __ATOMIC_ACQUIRE);
    if (u == 0) {
        char why[400];
        u = load_on(st, device, why, sizeof why) == 0 ? 1 : -1;
        __atomic_store_n(&usable[device], u, __ATOMIC_RELEASE);
    }
    return u > 0;
}

int
pyccl_ar_copy_list(pyccl_state *st, const char *op, int device, cudaStream_t s, char *flat,
                   const pyccl_tensor *ts, Py_ssize_t n, int to_flat)
{
    const pyccl_api *a = &st->api;
    pyccl_copy_params prm;
    memset(&prm, 0, sizeof prm);
    prm.flat = flat;
    prm.to_flat = to_flat;
    void *args[] = {&prm};
    CUfunction fn = ar_devs[device].fn[K_COPY];
    int prev;
    CUresult r = 0;
    if (pyccl_device_enter(a, device, &prev) != cudaSuccess) {
        pyccl_device_leave(a, device, prev);
        PyErr_Format(st->CudaError, "%s: cannot make cuda:%d current", op, device);
        return -1;
    }
    unsigned long long off = 0;
    for (Py_ssize_t i = 0; i < n && r == 0;) {
        unsigned long long most = 0;
        prm.n = 0;
        for (; i < n && prm.n < PYCCL_COPY_MAX; i++) {
            const unsigned long long nbytes =
                (unsigned long long)ts[i].numel * (unsigned long long)ts[i].itemsize;
            pyccl_copy_item *it = &prm.item[prm.n++];
            it->ptr = (unsigned long long)(uintptr_t)ts[i].ptr;
            it->off = off;
            it->nbytes = nbytes;
            off += nbytes;
            most = nbytes > most ? nbytes : most;
        }
        /* a block per 64 KiB of the largest tensor, at most 64 (one at least) */
        unsigned blocks = (unsigned)((most + 65535) / 65536);
        blocks = blocks < 1 ? 1 : blocks > 64 ? 64 : blocks;
        r = ar_drv.cuLaunchKernel(fn, blocks, prm.n, 1, 256, 1, 1, 0, s, args, NULL);
    }
    pyccl_device_leave(a, device, prev);
    if (r != 0) {
        PyErr_Format(st->CudaError, "%s: launching pyccl's copy kernel on cuda:%d failed: %s", op,
                     device, ar_cu_error(r));
        return -1;
    }
    return 0;
}

/* Testing aid: read or set every block's epoch counter (all ranks alike, with
 * no all_reduce in flight), e.g. just below 2^32 to cross the wrap-around. */
PyObject *
pyccl_ar_epoch(pyccl_state *st, pyccl_comm *c, PyObject *value)
{
    pyccl_ar *f = c->ar;
    if (f == NULL || f->state != AR_READY) {
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
    if (pyccl_device_enter(a, f->device, &prev) == cudaSuccess) {
        e = a->cudaDeviceSynchronize();
        if (e == cudaSuccess) {
            e = value != NULL && value != Py_None
                    ? a->cudaMemcpy(f->region.base + PYCCL_AR_COUNTER_OFF, counters, sizeof counters,
                                    cudaMemcpyHostToDevice)
                    : a->cudaMemcpy(counters, f->region.base + PYCCL_AR_COUNTER_OFF, sizeof counters,
                                    cudaMemcpyDeviceToHost);
        }
    }
    pyccl_device_leave(a, f->device, prev);
    Py_END_ALLOW_THREADS
    if (e != cudaSuccess) {
        pyccl_raise_cuda(st, "_all_reduce_epoch", "cudaMemcpy", e);
        return NULL;
    }
    return PyLong_FromUnsignedLong(counters[0]);
}
