// pyccl's own intra-node all-reduce over CUDA-IPC peer memory.
//
// Built by setup.py into a fatbin embedded in pyccl._C and loaded with the
// driver API (cuModuleLoadData), so the extension links no CUDA library.
// The only C++ of the project; everything the host sees is extern "C".
//
// Each rank owns one registered region (layout in ar_abi.h) that every
// other rank has mapped.  A call is:
//   1. copy the input into this rank's data half (eager and graph mode alike:
//      no separate memcpy launch);
//   2. per-block barrier: block b of every rank tells block b of every rank
//      that its part is in place (release store into the peer's flag slot),
//      then waits for the same from all of them (acquire loads on its own
//      slots: remote writes, local polling);
//   3. one-shot: every rank reduces everything, reading all ranks' halves in
//      rank order 0..n-1.  two-shot: rank r reduces slice r only, writes it
//      back into its own half, second barrier, then copies the other slices
//      from their owners.
// Both sum in rank order with float accumulation for 16-bit types, so every
// rank ends with the same bits.
//
// Block b of every rank handles the same vectors (fixed grid, grid-stride), so
// a barrier between equal block indices is enough: no grid-wide sync.
// Epochs: block b's counter says how many calls it ended.  The grid is the same
// for every call, so all blocks share one epoch sequence; its parity picks the
// data half and the flag slots.  Why two halves suffice: a rank writes half h
// again two calls later, and in between it passed the next call's barrier,
// which needs every peer to have started that call, so their kernels of the
// call that read half h have ended (same stream order on each rank).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "ar_abi.h"

namespace {

enum { OP_SUM = 0, OP_MAX = 1, OP_MIN = 2 };

__device__ __forceinline__ uint32_t flag_value(uint32_t epoch)
{
    // never 0 (the initial slot contents), different for consecutive epochs
    // across the 2^32 wrap
    return (epoch << 1) | 1u;
}

__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v)
{
    // release at system scope: the block's earlier writes (made visible to
    // this thread by the preceding __syncthreads) are visible to the peer GPU
    // before this flag is
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p)
{
    // acquire at system scope: once the peer's flag is seen, its data written
    // before the flag is visible to the loads that follow (after the block's
    // __syncthreads, to every thread of the block)
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t now_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Programmatic dependent launch (sm_90 and newer).  The host launches the
// kernels with programmatic stream serialization (ar.c, PYCCL_AR_PDL), so
// this grid may be scheduled while the previous kernel on the stream still
// runs.  griddepcontrol.wait returns once that kernel has completed and its
// memory operations are visible, so nothing may touch memory before it (the
// previous kernel may have written our input, our counters or DEVERR).  Then
// launch_dependents lets the next kernel on the stream be scheduled at once:
// it waits the same way, so it only saves the launch latency.  Launched
// without the attribute, both instructions do nothing.
__device__ __forceinline__ void pdl_enter()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The block's barrier with block blockIdx.x of every rank, for `phase` of the
// call with `epoch`.  False when a wait gave up (timeout); the whole block
// then leaves the kernel.
__device__ bool block_barrier(const pyccl_ar_params &p, uint32_t epoch, int phase,
                              int *gaveup)
{
    __syncthreads(); // this block's part of the data is written
    const int t = threadIdx.x;
    const size_t slot =
        ((size_t)((epoch & 1u) * 2u + (uint32_t)phase) * PYCCL_AR_MAX_BLOCKS + blockIdx.x) *
        PYCCL_AR_MAX_RANKS;
    if (t < p.nranks) {
        const uint32_t want = flag_value(epoch);
        uint32_t *theirs = (uint32_t *)(p.base[t] + PYCCL_AR_FLAGS_OFF) + slot + p.rank;
        st_release_sys(theirs, want);
        const uint32_t *mine =
            (const uint32_t *)(p.base[p.rank] + PYCCL_AR_FLAGS_OFF) + slot + t;
        if (ld_acquire_sys(mine) != want) {
            const uint64_t start = now_ns();
            unsigned spins = 0;
            while (ld_acquire_sys(mine) != want) {
                if ((++spins & 1023u) == 0 &&
                    ((p.timeout_ns && now_ns() - start > p.timeout_ns) ||
                     *(volatile int *)p.host_error != 0)) {
                    // timed out, or the host aborted the communicator (the
                    // host-mapped word: read over PCIe, so only now and then)
                    *gaveup = 1; // shared; read after the barrier below
                    break;
                }
            }
        }
    }
    __syncthreads(); // every peer's part is visible to the whole block
    return *gaveup == 0;
}

__device__ void give_up(const pyccl_ar_params &p)
{
    if (threadIdx.x == 0) {
        // the device word stops later calls of this rank at once; the host
        // word is what the host polls without synchronizing
        *(volatile int *)(p.base[p.rank] + PYCCL_AR_DEVERR_OFF) = 1;
        atomicCAS_system(p.host_error, 0, 1); // keep a host abort's 2
        __threadfence_system(); // push both out before the kernel ends
    }
}

template <typename T> struct Acc;
template <> struct Acc<float> {
    typedef float type;
    static __device__ float in(float x) { return x; }
    static __device__ float out(float x) { return x; }
};
template <> struct Acc<__half> {
    typedef float type;
    static __device__ float in(__half x) { return __half2float(x); }
    static __device__ __half out(float x) { return __float2half_rn(x); }
};
template <> struct Acc<__nv_bfloat16> {
    typedef float type;
    static __device__ float in(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __nv_bfloat16 out(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Acc<int32_t> {
    typedef int32_t type;
    static __device__ int32_t in(int32_t x) { return x; }
    static __device__ int32_t out(int32_t x) { return x; }
};

template <int OP> __device__ __forceinline__ float combine(float a, float b)
{
    return OP == OP_SUM ? a + b : OP == OP_MAX ? fmaxf(a, b) : fminf(a, b);
}
template <int OP> __device__ __forceinline__ int32_t combine(int32_t a, int32_t b)
{
    // sums wrap like NCCL's (two's complement), without signed overflow
    return OP == OP_SUM ? (int32_t)((uint32_t)a + (uint32_t)b) : OP == OP_MAX ? max(a, b)
                                                                               : min(a, b);
}

// Reduce one 16-byte vector at byte offset `off` of every rank's region, in
// rank order.  The loads are issued together (unrolled, predicated).
template <typename T, int OP>
__device__ __forceinline__ uint4 reduce_vec(const pyccl_ar_params &p, size_t off)
{
    typedef typename Acc<T>::type A;
    constexpr int N = 16 / sizeof(T);
    union Vec {
        uint4 u;
        T e[N];
    };
    Vec v[PYCCL_AR_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < PYCCL_AR_MAX_RANKS; r++) {
        if (r < p.nranks) {
            // .cg: served by the owner's L2, never by this SM's L1, which
            // could hold the previous call's bytes of the same address
            v[r].u = __ldcg((const uint4 *)(p.base[r] + off));
        }
    }
    A acc[N];
#pragma unroll
    for (int i = 0; i < N; i++) {
        acc[i] = Acc<T>::in(v[0].e[i]);
    }
#pragma unroll
    for (int r = 1; r < PYCCL_AR_MAX_RANKS; r++) {
        if (r < p.nranks) {
#pragma unroll
            for (int i = 0; i < N; i++) {
                acc[i] = combine<OP>(acc[i], Acc<T>::in(v[r].e[i]));
            }
        }
    }
    Vec res;
#pragma unroll
    for (int i = 0; i < N; i++) {
        res.e[i] = Acc<T>::out(acc[i]);
    }
    return res.u;
}

// The bytes after the last whole vector (fewer than 16), element by element.
template <typename T, int OP>
__device__ void reduce_tail(const pyccl_ar_params &p, size_t data_off, size_t vbytes)
{
    typedef typename Acc<T>::type A;
    const size_t n = (p.nbytes - vbytes) / sizeof(T);
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        const size_t off = data_off + vbytes + i * sizeof(T);
        A acc = Acc<T>::in(__ldcg((const T *)(p.base[0] + off)));
        for (int r = 1; r < p.nranks; r++) {
            acc = combine<OP>(acc, Acc<T>::in(__ldcg((const T *)(p.base[r] + off))));
        }
        ((T *)((char *)p.out + vbytes))[i] = Acc<T>::out(acc);
    }
}

// One 16-byte vector of `in`/`out`, element by element when the caller's
// pointers are not 16-byte aligned (a view at an odd offset); the registered
// halves always are.
template <typename T> union Vec16 {
    uint4 u;
    T e[16 / sizeof(T)];
};

template <typename T>
__device__ __forceinline__ uint4 load_in(const pyccl_ar_params &p, size_t v)
{
    if (p.aligned) {
        return ((const uint4 *)p.in)[v];
    }
    Vec16<T> x;
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); i++) {
        x.e[i] = ((const T *)p.in)[v * (16 / sizeof(T)) + i];
    }
    return x.u;
}

template <typename T>
__device__ __forceinline__ void store_out(const pyccl_ar_params &p, size_t v, uint4 val)
{
    if (p.aligned) {
        ((uint4 *)p.out)[v] = val;
        return;
    }
    Vec16<T> x;
    x.u = val;
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); i++) {
        ((T *)p.out)[v * (16 / sizeof(T)) + i] = x.e[i];
    }
}

// Block 0 copies the bytes past the last whole vector (and reduces them later).
template <typename T>
__device__ __forceinline__ void copy_tail(const pyccl_ar_params &p, char *half, size_t nvec)
{
    if (blockIdx.x == 0) {
        const size_t vbytes = nvec * 16;
        const size_t n = (p.nbytes - vbytes) / sizeof(T);
        for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
            ((T *)(half + vbytes))[i] = ((const T *)((const char *)p.in + vbytes))[i];
        }
    }
}

// Step 1 of the one-shot kernel: this block's vectors (grid stride, the same
// positions the reduce step takes) and the tail into this rank's half.
template <typename T>
__device__ __forceinline__ void copy_in(const pyccl_ar_params &p, char *half, size_t nvec)
{
    uint4 *dst = (uint4 *)half;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += stride) {
        dst[v] = load_in<T>(p, v);
    }
    copy_tail<T>(p, half, nvec);
}

__device__ __forceinline__ uint32_t begin(const pyccl_ar_params &p, int *gaveup, bool *stop)
{
    pdl_enter();
    if (threadIdx.x == 0) {
        *gaveup = 0;
    }
    char *mine = p.base[p.rank];
    if (p.skew_ns) {
        // testing only (PYCCL_AR_DEBUG_SKEW_NS): block b starts b * skew_ns
        // late, so a block that relied on another block's work unsynchronized
        // reads stale data instead of winning the race by luck
        const uint64_t until = now_ns() + (uint64_t)blockIdx.x * p.skew_ns;
        while (now_ns() < until) {
        }
    }
    // both loads in flight together (nothing between them waits for the first)
    *stop = *(volatile int *)(mine + PYCCL_AR_DEVERR_OFF) != 0;
    return *(volatile uint32_t *)((uint32_t *)(mine + PYCCL_AR_COUNTER_OFF) + blockIdx.x) + 1u;
}

__device__ __forceinline__ void end(const pyccl_ar_params &p, uint32_t epoch)
{
    if (threadIdx.x == 0) {
        ((uint32_t *)(p.base[p.rank] + PYCCL_AR_COUNTER_OFF))[blockIdx.x] = epoch;
    }
}

// The bodies of the one-shot and two-shot kernels, between begin() and end():
// this call's epoch, its half of every rank's region at data_off, nvec whole
// 16-byte vectors.  false: gave up (then the counter must not move).
template <typename T, int OP>
__device__ __forceinline__ bool oneshot_body(const pyccl_ar_params &p, uint32_t epoch,
                                             size_t data_off, size_t nvec, int *gaveup)
{
    copy_in<T>(p, p.base[p.rank] + data_off, nvec);
    if (!block_barrier(p, epoch, 0, gaveup)) {
        give_up(p);
        return false;
    }
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += stride) {
        store_out<T>(p, v, reduce_vec<T, OP>(p, data_off + v * 16));
    }
    if (blockIdx.x == 0) {
        reduce_tail<T, OP>(p, data_off, nvec * 16);
    }
    return true;
}

template <typename T, int OP>
__device__ __forceinline__ bool twoshot_body(const pyccl_ar_params &p, uint32_t epoch,
                                             size_t data_off, size_t nvec, int *gaveup)
{
    char *mine = p.base[p.rank] + data_off;
    // slice r = vectors [r*per, min((r+1)*per, nvec)); within every slice,
    // thread t of block b takes the positions first, first + stride, ... in all
    // three steps (copy in, reduce, gather) and on every rank.  That is what
    // lets the per-block barriers stand for the whole grid: block b's barrier
    // covers exactly the vectors block b touches next.  (Copying in with a
    // plain grid stride over all vectors would hand the reduce step vectors
    // that another block copies in, maybe not yet; and in place, overwrite
    // inputs another block has not read yet.)
    const size_t per = (nvec + p.nranks - 1) / p.nranks;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int s = 0; s < p.nranks; s++) {
        const size_t lo = (size_t)s * per;
        const size_t hi = min(lo + per, nvec);
        for (size_t v = lo + first; v < hi; v += stride) {
            ((uint4 *)mine)[v] = load_in<T>(p, v);
        }
    }
    copy_tail<T>(p, mine, nvec);
    if (!block_barrier(p, epoch, 0, gaveup)) {
        give_up(p);
        return false;
    }
    {
        const size_t lo = (size_t)p.rank * per;
        const size_t hi = min(lo + per, nvec);
        for (size_t v = lo + first; v < hi; v += stride) {
            const uint4 r = reduce_vec<T, OP>(p, data_off + v * 16);
            // only this rank reads slice `rank` of its own half in this phase,
            // so the sum can replace it for the peers to fetch
            ((uint4 *)mine)[v] = r;
            store_out<T>(p, v, r);
        }
    }
    if (blockIdx.x == 0) {
        // the tail stays outside the slices and was never overwritten
        reduce_tail<T, OP>(p, data_off, nvec * 16);
    }
    if (!block_barrier(p, epoch, 1, gaveup)) {
        give_up(p);
        return false;
    }
    for (int k = 1; k < p.nranks; k++) {
        const int s = (p.rank + k) % p.nranks; // spread the load over the peers
        const size_t lo = (size_t)s * per;
        const size_t hi = min(lo + per, nvec);
        const char *theirs = p.base[s] + data_off;
        for (size_t v = lo + first; v < hi; v += stride) {
            store_out<T>(p, v, __ldcg((const uint4 *)theirs + v));
        }
    }
    return true;
}

// begin(), the call's half, Body::run (one of the bodies: this call's epoch,
// its half at data_off; false when it gave up), end().
template <typename Body> __device__ void staged(const pyccl_ar_params &p)
{
    __shared__ int gaveup;
    bool stop;
    const uint32_t epoch = begin(p, &gaveup, &stop);
    if (stop) {
        return;
    }
    const size_t data_off = PYCCL_AR_DATA_OFF + (size_t)(epoch & 1u) * p.half_bytes;
    if (Body::run(p, epoch, data_off, &gaveup)) {
        end(p, epoch);
    }
}

template <typename T, int OP, bool TWO> struct AllReduceBody {
    static __device__ bool run(const pyccl_ar_params &p, uint32_t epoch, size_t data_off,
                               int *gaveup)
    {
        const size_t nvec = p.nbytes / 16;
        return TWO ? twoshot_body<T, OP>(p, epoch, data_off, nvec, gaveup)
                   : oneshot_body<T, OP>(p, epoch, data_off, nvec, gaveup);
    }
};

template <typename T, int OP> __device__ void oneshot(const pyccl_ar_params &p)
{
    staged<AllReduceBody<T, OP, false>>(p);
}

template <typename T, int OP> __device__ void twoshot(const pyccl_ar_params &p)
{
    staged<AllReduceBody<T, OP, true>>(p);
}

// ---- all_gather and reduce_scatter, staged as the one-shot all-reduce ----
// p.nbytes: this launch's bytes of each rank's part; p.stride: the bytes
// between the ranks' parts of out (all_gather) or of in (reduce_scatter).
// As in the all-reduce, block b takes the same positions in every step and on
// every rank, so its barrier covers exactly what it reads next.

// all_gather in units U (16, 4 or 1 bytes: the largest that divides in, out,
// nbytes and stride): this rank's part into its half, the barrier, then every
// rank's half into out at rank * stride.  Any dtype: bytes are moved.
template <typename U>
__device__ __forceinline__ bool gather_body(const pyccl_ar_params &p, uint32_t epoch,
                                            size_t data_off, int *gaveup)
{
    const size_t n = p.nbytes / sizeof(U);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    U *mine = (U *)(p.base[p.rank] + data_off);
    for (size_t v = first; v < n; v += stride) {
        mine[v] = ((const U *)p.in)[v];
    }
    if (!block_barrier(p, epoch, 0, gaveup)) {
        give_up(p);
        return false;
    }
    for (int k = 0; k < p.nranks; k++) {
        const int s = (p.rank + k) % p.nranks; // spread the load over the peers
        const U *theirs = (const U *)(p.base[s] + data_off);
        U *dst = (U *)((char *)p.out + (size_t)s * p.stride);
        for (size_t v = first; v < n; v += stride) {
            dst[v] = __ldcg(theirs + v);
        }
    }
    return true;
}

// reduce_scatter: the nranks parts of in (stride apart) one after another
// into this rank's half, the barrier, then part `rank` of every rank's half
// reduced in rank order into out (16-byte vectors where in, out, nbytes and
// stride allow, else element by element).
template <typename T, int OP>
__device__ __forceinline__ bool scatter_body(const pyccl_ar_params &p, uint32_t epoch,
                                             size_t data_off, int *gaveup)
{
    typedef typename Acc<T>::type A;
    char *mine = p.base[p.rank] + data_off;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t mine_off = data_off + (size_t)p.rank * p.nbytes;
    if (p.aligned) {
        const size_t n = p.nbytes / 16;
        for (int s = 0; s < p.nranks; s++) {
            const uint4 *src = (const uint4 *)((const char *)p.in + (size_t)s * p.stride);
            uint4 *dst = (uint4 *)(mine + (size_t)s * p.nbytes);
            for (size_t v = first; v < n; v += stride) {
                dst[v] = src[v];
            }
        }
        if (!block_barrier(p, epoch, 0, gaveup)) {
            give_up(p);
            return false;
        }
        for (size_t v = first; v < n; v += stride) {
            ((uint4 *)p.out)[v] = reduce_vec<T, OP>(p, mine_off + v * 16);
        }
        return true;
    }
    const size_t n = p.nbytes / sizeof(T);
    for (int s = 0; s < p.nranks; s++) {
        const T *src = (const T *)((const char *)p.in + (size_t)s * p.stride);
        T *dst = (T *)(mine + (size_t)s * p.nbytes);
        for (size_t i = first; i < n; i += stride) {
            dst[i] = src[i];
        }
    }
    if (!block_barrier(p, epoch, 0, gaveup)) {
        give_up(p);
        return false;
    }
    for (size_t i = first; i < n; i += stride) {
        const size_t off = mine_off + i * sizeof(T);
        A acc = Acc<T>::in(__ldcg((const T *)(p.base[0] + off)));
        for (int r = 1; r < p.nranks; r++) {
            acc = combine<OP>(acc, Acc<T>::in(__ldcg((const T *)(p.base[r] + off))));
        }
        ((T *)p.out)[i] = Acc<T>::out(acc);
    }
    return true;
}

template <typename U> struct GatherBody {
    static __device__ bool run(const pyccl_ar_params &p, uint32_t epoch, size_t data_off,
                               int *gaveup)
    {
        return gather_body<U>(p, epoch, data_off, gaveup);
    }
};

template <typename T, int OP> struct ScatterBody {
    static __device__ bool run(const pyccl_ar_params &p, uint32_t epoch, size_t data_off,
                               int *gaveup)
    {
        return scatter_body<T, OP>(p, epoch, data_off, gaveup);
    }
};

// ---- one-shot for small sizes, LL: 8 payload bytes per 16-byte line ----

template <typename T> union Vec8 {
    uint2 u;
    T e[8 / sizeof(T)];
};

// Payload line l of `in` (zero past the end).
template <typename T> __device__ __forceinline__ uint2 ll_load(const pyccl_ar_params &p, size_t l)
{
    constexpr int N = 8 / sizeof(T);
    if (p.aligned && (l + 1) * 8 <= p.nbytes) {
        return ((const uint2 *)p.in)[l];
    }
    Vec8<T> x;
    x.u = make_uint2(0, 0);
    const size_t n = p.nbytes / sizeof(T);
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (l * N + i < n) {
            x.e[i] = ((const T *)p.in)[l * N + i];
        }
    }
    return x.u;
}

template <typename T>
__device__ __forceinline__ void ll_store(const pyccl_ar_params &p, size_t l, uint2 v)
{
    constexpr int N = 8 / sizeof(T);
    if (p.aligned && (l + 1) * 8 <= p.nbytes) {
        ((uint2 *)p.out)[l] = v;
        return;
    }
    Vec8<T> x;
    x.u = v;
    const size_t n = p.nbytes / sizeof(T);
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (l * N + i < n) {
            ((T *)p.out)[l * N + i] = x.e[i];
        }
    }
}

template <typename T, int OP>
__device__ __forceinline__ void ll_combine(typename Acc<T>::type *acc, uint2 v, bool first)
{
    constexpr int N = 8 / sizeof(T);
    Vec8<T> x;
    x.u = v;
#pragma unroll
    for (int i = 0; i < N; i++) {
        acc[i] = first ? Acc<T>::in(x.e[i]) : combine<OP>(acc[i], Acc<T>::in(x.e[i]));
    }
}

template <typename T, int OP> __device__ void oneshot_ll(const pyccl_ar_params &p)
{
    typedef typename Acc<T>::type A;
    constexpr int N = 8 / sizeof(T);
    pdl_enter();
    char *mine = p.base[p.rank];
    const size_t lines = (p.nbytes + 7) / 8;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    // The stop word, the epoch and this thread's first input line are loaded
    // before any of them is used: one memory round trip instead of three in a
    // row (at small sizes the kernel is a chain of latencies).
    const int stopped = *(volatile int *)(mine + PYCCL_AR_DEVERR_OFF);
    const uint32_t epoch =
        *(volatile uint32_t *)((uint32_t *)(mine + PYCCL_AR_COUNTER_OFF) + blockIdx.x) + 1u;
    const uint2 v0 = first < lines ? ll_load<T>(p, first) : make_uint2(0, 0);
    if (stopped != 0) {
        return;
    }
    const uint32_t flag = flag_value(epoch);
    // [parity][source rank][line]
    const size_t par_off = PYCCL_AR_DATA_OFF + 2 * p.half_bytes +
                           (size_t)(epoch & 1u) * (size_t)p.nranks * p.ll_slot;
    bool ok = true;
    for (size_t l = first; l < lines && ok; l += stride) {
        const uint2 v = l == first ? v0 : ll_load<T>(p, l);
        const size_t at = par_off + (size_t)p.rank * p.ll_slot + l * 16;
        for (int r = 0; r < p.nranks; r++) {
            if (r != p.rank) {
                // data and flag share each 8-byte half of the line: a reader
                // that sees the flag in a half sees that half's data (NVLink
                // keeps aligned 8-byte stores whole), so no fence is needed
                asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(
                                 p.base[r] + at),
                             "r"(v.x), "r"(flag), "r"(v.y), "r"(flag)
                             : "memory");
            }
        }
        A acc[N];
        for (int r = 0; r < p.nranks && ok; r++) {
            uint2 x;
            if (r == p.rank) {
                x = v;
            } else {
                const char *src = mine + par_off + (size_t)r * p.ll_slot + l * 16;
                uint32_t d0, f0, d1, f1;
                uint64_t start = 0;
                unsigned spins = 0;
                for (;;) {
                    // volatile: every poll reaches memory (L2), never L1
                    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                                 : "l"(src)
                                 : "memory");
                    if (f0 == flag && f1 == flag) {
                        break;
                    }
                    if ((++spins & 1023u) == 0) {
                        const uint64_t t = now_ns();
                        if (start == 0) {
                            start = t;
                        } else if ((p.timeout_ns && t - start > p.timeout_ns) ||
                                   *(volatile int *)p.host_error != 0) {
                            ok = false; // timed out, or the host aborted it
                            break;
                        }
                    }
                }
                x = make_uint2(d0, d1);
            }
            ll_combine<T, OP>(acc, x, r == 0);
        }
        if (ok) {
            Vec8<T> res;
#pragma unroll
            for (int i = 0; i < N; i++) {
                res.e[i] = Acc<T>::out(acc[i]);
            }
            ll_store<T>(p, l, res.u);
        }
    }
    // the counter moves once every thread of the block is done; one barrier
    // also tells every thread whether any of them gave up
    if (__syncthreads_or(!ok)) {
        give_up(p);
        return;
    }
    end(p, epoch);
}

// A marked launch (ar.c marks every PYCCL_LEAD_EVERY-th) tells the host how far its kernels
// got: block 0 stores the mark to the host-mapped word as it leaves, by whichever path (done,
// gave up, stopped).  The kernels of a communicator run one after another, so every launch
// before it has ended too.
__device__ __forceinline__ void tell_done(const pyccl_ar_params &p)
{
    if (p.mark != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        *(volatile unsigned long long *)p.done = p.mark;
    }
}

} // namespace

// extern "C" entry points pyccl_ar_<variant>_<type>_<op>: variant 0 one-shot LL,
// 1 one-shot, 2 two-shot (the names ar.c looks up)
#define PYCCL_AR_KERNEL(variant, body, bound, tname, T, opname, OP)                           \
    extern "C" __global__ void __launch_bounds__(bound)                                        \
        pyccl_ar_##variant##_##tname##_##opname(const __grid_constant__ pyccl_ar_params p)     \
    {                                                                                          \
        body<T, OP>(p);                                                                        \
        tell_done(p);                                                                          \
    }
#define PYCCL_AR_OPS(variant, body, bound, tname, T)                                          \
    PYCCL_AR_KERNEL(variant, body, bound, tname, T, sum, OP_SUM)                               \
    PYCCL_AR_KERNEL(variant, body, bound, tname, T, max, OP_MAX)                               \
    PYCCL_AR_KERNEL(variant, body, bound, tname, T, min, OP_MIN)
#define PYCCL_AR_KERNELS(tname, T)                                                            \
    PYCCL_AR_OPS(0, oneshot_ll, 512, tname, T)                                                 \
    PYCCL_AR_OPS(1, oneshot, 512, tname, T)                                                    \
    PYCCL_AR_OPS(2, twoshot, 512, tname, T)

PYCCL_AR_KERNELS(f32, float)
PYCCL_AR_KERNELS(f16, __half)
PYCCL_AR_KERNELS(bf16, __nv_bfloat16)
PYCCL_AR_KERNELS(i32, int32_t)

// reduce_scatter: pyccl_rs_<type>_<op>; all_gather: pyccl_ag_<unit bytes>
#define PYCCL_RS_KERNEL(tname, T, opname, OP)                                                  \
    extern "C" __global__ void __launch_bounds__(512)                                          \
        pyccl_rs_##tname##_##opname(const __grid_constant__ pyccl_ar_params p)                 \
    {                                                                                          \
        staged<ScatterBody<T, OP>>(p);                                                         \
        tell_done(p);                                                                          \
    }
#define PYCCL_RS_KERNELS(tname, T)                                                            \
    PYCCL_RS_KERNEL(tname, T, sum, OP_SUM)                                                     \
    PYCCL_RS_KERNEL(tname, T, max, OP_MAX)                                                     \
    PYCCL_RS_KERNEL(tname, T, min, OP_MIN)
PYCCL_RS_KERNELS(f32, float)
PYCCL_RS_KERNELS(f16, __half)
PYCCL_RS_KERNELS(bf16, __nv_bfloat16)
PYCCL_RS_KERNELS(i32, int32_t)

extern "C" __global__ void __launch_bounds__(512) pyccl_ag_16(const __grid_constant__ pyccl_ar_params p)
{
    staged<GatherBody<uint4>>(p);
    tell_done(p);
}
extern "C" __global__ void __launch_bounds__(512) pyccl_ag_4(const __grid_constant__ pyccl_ar_params p)
{
    staged<GatherBody<unsigned int>>(p);
    tell_done(p);
}
extern "C" __global__ void __launch_bounds__(512) pyccl_ag_1(const __grid_constant__ pyccl_ar_params p)
{
    staged<GatherBody<unsigned char>>(p);
    tell_done(p);
}

// Nothing, with the kernels' parameter block: the launch floor the benchmark prints beside the
// own kernels' host time (pyccl._C._ar_launch_floor).
extern "C" __global__ void pyccl_ar_empty(const __grid_constant__ pyccl_ar_params p)
{
}

// all_reduce_coalesced's pack (to_flat) and unpack: block row y copies tensor y, the blocks of
// the row striding over its bytes, 16 at a time where both ends allow it.  Ordered on the stream
// like any kernel: no flag, no fence.
extern "C" __global__ void pyccl_copy_list(const __grid_constant__ pyccl_copy_params p)
{
    if (blockIdx.y >= p.n) {
        return;
    }
    const pyccl_copy_item it = p.item[blockIdx.y];
    char *dst = p.to_flat ? p.flat + it.off : (char *)it.ptr;
    const char *src = p.to_flat ? (const char *)it.ptr : p.flat + it.off;
    const size_t n = it.nbytes;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15u) == 0) {
        const size_t nvec = n / 16;
        for (size_t v = first; v < nvec; v += stride) {
            ((uint4 *)dst)[v] = ((const uint4 *)src)[v];
        }
        done = nvec * 16;
    }
    for (size_t b = done + first; b < n; b += stride) {
        dst[b] = src[b];
    }
}

// The set-up's write-then-read probe, one thread per peer.
// stage 0: write a value naming (me, peer) into each peer's PROBE[0][me]
//          (remote write), and one naming me into my own PROBE[1][me].
// stage 1 (after a host-side barrier): check PROBE[0][peer] in my region
//          (written by the peer) and PROBE[1][peer] in the peer's region
//          (a remote read).  out: int bit mask of the peers that failed.
extern "C" __global__ void pyccl_ar_probe(const __grid_constant__ pyccl_ar_params p, int stage)
{
    const int r = threadIdx.x;
    if (r >= p.nranks) {
        return;
    }
    uint32_t *mine = (uint32_t *)(p.base[p.rank] + PYCCL_AR_PROBE_OFF);
    uint32_t *theirs = (uint32_t *)(p.base[r] + PYCCL_AR_PROBE_OFF);
    if (stage == 0) {
        *(volatile uint32_t *)&theirs[p.rank] = p.magic ^ (uint32_t)(p.rank * 16 + r);
        if (r == p.rank) {
            *(volatile uint32_t *)&mine[PYCCL_AR_MAX_RANKS + r] = p.magic + (uint32_t)r;
        }
        __threadfence_system(); // visible to the peers before the kernel ends
        return;
    }
    const uint32_t wrote = *(volatile uint32_t *)&mine[r];
    const uint32_t read = *(volatile uint32_t *)&theirs[PYCCL_AR_MAX_RANKS + r];
    if (wrote != (p.magic ^ (uint32_t)(r * 16 + p.rank)) || read != p.magic + (uint32_t)r) {
        atomicOr((int *)p.out, 1 << r);
    }
}
