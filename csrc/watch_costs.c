/* What each step a call on a communicator with a timeout adds costs, timed
 * back to back in C: the benchmark's --host-breakdown (_C._watch_costs).
 * The steps are those of watchdog.c's watch_record and of the watchdog's
 * look, each alone, on the caller's device and stream. */
#include "timeouts.h"
#include "locks.h"
#include "tensor.h"
#include "errors.h"

#include <pthread.h>

const char *const pyccl_watch_cost_names[PYCCL_WATCH_COSTS] = {
    "cudaGetDevice", "cudaStreamIsCapturing", "cudaEventRecord (timing off)",
    "cudaEventQuery (finished)", "clock read", "mutex lock and unlock",
    "GIL released and taken",
};

/* `calls` back to back of `call` (a cudaError_t; the loop stops at the first
 * error, `name` kept for the message), host microseconds per call into us[k] */
#define TIME_CALLS(k, name, call)                                     \
    do {                                                              \
        const double t0_ = pyccl_now_s();                             \
        for (int i_ = 0; i_ < calls && e == cudaSuccess; i_++) {      \
            e = (call);                                               \
        }                                                             \
        us[k] = (pyccl_now_s() - t0_) * 1e6 / calls;                  \
        what = e == cudaSuccess || what != NULL ? what : (name);      \
    } while (0)

static cudaError_t
clock_read(volatile double *sink)
{
    *sink += pyccl_now_s();
    return cudaSuccess;
}

static cudaError_t
lock_unlock(pthread_mutex_t *mu)
{
    /* a leaf's class: taken here with the GIL held, nothing else held */
    pyccl_lock(mu, PYCCL_LOCK_LOST);
    pyccl_unlock(mu);
    return cudaSuccess;
}

static cudaError_t
gil_round_trip(void)
{
    PyEval_RestoreThread(PyEval_SaveThread());
    return cudaSuccess;
}

int
pyccl_watch_costs(pyccl_state *st, const char *op, int device, cudaStream_t s, int calls,
                  double us[PYCCL_WATCH_COSTS])
{
    const pyccl_api *a = &st->api;
    const char *what = NULL;
    cudaEvent_t ev = NULL;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    volatile double sink = 0;
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    int prev, dev;
    cudaError_t e = pyccl_device_enter(a, device, &prev);
    if (e != cudaSuccess) {
        what = "cudaSetDevice";
    }
    else if ((e = a->cudaStreamIsCapturing(s, &cs)) != cudaSuccess) {
        what = "cudaStreamIsCapturing";
    }
    else if (cs != cudaStreamCaptureStatusNone) {
        pyccl_device_leave(a, device, prev);
        PyErr_Format(PyExc_ValueError,
                     "%s: the stream is being captured into a CUDA graph (the event records "
                     "would become nodes of it); measure on a stream that is not", op);
        return -1;
    }
    else if ((e = a->cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess) {
        what = "cudaEventCreateWithFlags";
        ev = NULL;
    }
    else {
        TIME_CALLS(0, "cudaGetDevice", a->cudaGetDevice(&dev));
        TIME_CALLS(1, "cudaStreamIsCapturing", a->cudaStreamIsCapturing(s, &cs));
        TIME_CALLS(2, "cudaEventRecord", a->cudaEventRecord(ev, s));
        if (e == cudaSuccess && (e = a->cudaStreamSynchronize(s)) != cudaSuccess) {
            what = "cudaStreamSynchronize";
        }
        TIME_CALLS(3, "cudaEventQuery", a->cudaEventQuery(ev));
        TIME_CALLS(4, NULL, clock_read(&sink));
        TIME_CALLS(5, NULL, lock_unlock(&mu));
        TIME_CALLS(6, NULL, gil_round_trip());
    }
    if (ev != NULL) {
        a->cudaEventDestroy(ev);
    }
    pyccl_device_leave(a, device, prev);
    pthread_mutex_destroy(&mu);
    if (e != cudaSuccess) {
        a->cudaGetLastError();
        pyccl_raise_cuda(st, op, what, e);
        return -1;
    }
    return 0;
}
#undef TIME_CALLS
