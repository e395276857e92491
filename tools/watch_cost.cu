/* What the watch of a timed communicator could record after a kernel, measured apart from pyccl
 * on one GPU (docs/PERFORMANCE.md, "What a timeout costs per call"):
 *   1. GPU time per kernel of a chain launched with programmatic dependent launch (PDL) and
 *      without, with nothing, an event (timing off), or a completion word that each block
 *      stores to host-mapped memory (relaxed, or release at system scope) after each kernel;
 *      kernels of 0, 5 and 10 us, 1 and 8 blocks; the host's cost of reading the words and of
 *      cudaEventQuery on a finished event;
 *   2. host us per launch of an 8-block kernel with a 144-byte parameter (the own kernels'
 *      size), alone and followed by each call a watched call makes after it, runtime and driver
 *      entry points, on the legacy default stream and on a non-blocking one (bursts of 200
 *      after a synchronize, so the launch queue never fills);
 *   3. what cudaEventQuery does to a capture when the event was recorded on the capturing
 *      stream (why a watched call asks cudaStreamIsCapturing before recording).
 *   nvcc -O2 -arch=sm_90 -o watch_cost tools/watch_cost.cu && ./watch_cost */
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include <algorithm>
#include <vector>

static double now_s()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/* ---- 1. an event or a completion word after each kernel of a chain ---- */

// Waits for the previous kernel (PDL; a no-op without it), lets the next one be scheduled,
// spins `spin` ns, then block by block stores `seq` to word[block] (when word is set).
__global__ void chain_kernel(uint32_t *word, uint32_t seq, uint32_t spin, int release)
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < spin);
    __syncthreads();
    if (word != nullptr && threadIdx.x == 0) {
        if (release) { // the block's earlier writes visible to the host before the word
            asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(word + blockIdx.x), "r"(seq)
                         : "memory");
        } else {
            asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(word + blockIdx.x), "r"(seq)
                         : "memory");
        }
    }
}

static void chain(cudaStream_t s)
{
    uint32_t *host_words, *dev_words;
    cudaHostAlloc((void **)&host_words, 4096, cudaHostAllocMapped);
    cudaHostGetDevicePointer((void **)&dev_words, host_words, 0);
    cudaEvent_t ev[64], a, b;
    for (auto &e : ev) {
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    }
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const int n = 5000;
    const char *what[] = {"nothing", "an event", "a word (relaxed)", "a word (release)"};
    uint32_t seq = 0;
    printf("# 1. GPU us per kernel of a chain of %d, median of 5 (host: us per launch, burst of "
           "200 after a sync)\n", n);
    for (int blocks : {1, 8}) {
        for (uint32_t spin : {0u, 5000u, 10000u}) {
            for (int pdl = 0; pdl < 2; pdl++) {
                for (int mode = 0; mode < 4; mode++) {
                    cudaLaunchAttribute attr;
                    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attr.val.programmaticStreamSerializationAllowed = 1;
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(blocks);
                    cfg.blockDim = dim3(512);
                    cfg.stream = s;
                    cfg.attrs = &attr;
                    cfg.numAttrs = pdl ? 1 : 0;
                    auto one = [&](int i) {
                        seq++;
                        cudaLaunchKernelEx(&cfg, chain_kernel, mode >= 2 ? dev_words : nullptr, seq,
                                           spin, (int)(mode == 3));
                        if (mode == 1) {
                            cudaEventRecord(ev[i & 63], s);
                        }
                    };
                    for (int i = 0; i < 200; i++) {
                        one(i);
                    }
                    std::vector<double> gpu, burst;
                    for (int rep = 0; rep < 5; rep++) {
                        cudaStreamSynchronize(s);
                        double t0 = now_s();
                        for (int i = 0; i < 200; i++) {
                            one(i);
                        }
                        burst.push_back((now_s() - t0) / 200 * 1e6);
                        cudaStreamSynchronize(s);
                        cudaEventRecord(a, s);
                        for (int i = 0; i < n; i++) {
                            one(i);
                        }
                        cudaEventRecord(b, s);
                        cudaEventSynchronize(b);
                        float ms;
                        cudaEventElapsedTime(&ms, a, b);
                        gpu.push_back(ms * 1e3 / n);
                    }
                    const char *words = "";
                    if (mode >= 2) {
                        uint32_t low = host_words[0];
                        for (int i = 1; i < blocks; i++) {
                            low = std::min(low, host_words[i]);
                        }
                        words = low == seq ? "  (words read back: all current)" : "  (WORDS BEHIND)";
                    }
                    printf("blocks %d, kernel %5u ns, %-6s then %-17s gpu %6.2f  host %5.2f%s\n", blocks,
                           spin, pdl ? "PDL" : "no PDL", what[mode], median(gpu), median(burst), words);
                }
            }
        }
    }
    volatile uint32_t sink = 0;
    double t0 = now_s();
    for (int i = 0; i < 100000; i++) {
        uint32_t low = ~0u;
        for (int j = 0; j < 8; j++) {
            uint32_t v = ((volatile uint32_t *)host_words)[j];
            low = v < low ? v : low;
        }
        sink += low;
    }
    printf("host: reading 8 words %.1f ns", (now_s() - t0) / 100000 * 1e9);
    t0 = now_s();
    for (int i = 0; i < 100000; i++) {
        sink += (uint32_t)cudaEventQuery(ev[i & 63]);
    }
    printf(", cudaEventQuery of a finished event %.1f ns\n", (now_s() - t0) / 100000 * 1e9);
    for (auto &e : ev) {
        cudaEventDestroy(e);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFreeHost(host_words);
}

/* ---- 2. what each call a watched call makes costs after a launch ---- */

struct params144 {
    char b[144];
};

__global__ void launch_kernel(const __grid_constant__ params144 p)
{
    if (p.b[0] == 42 && threadIdx.x == 1023) {
        printf("never\n");
    }
}

typedef int (*cu_event_record_t)(cudaEvent_t, cudaStream_t);
typedef int (*cu_stream_is_capturing_t)(cudaStream_t, int *);

static void after_launch(cudaStream_t nb)
{
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    auto cu_record = cuda ? (cu_event_record_t)dlsym(cuda, "cuEventRecord") : nullptr;
    auto cu_capturing = cuda ? (cu_stream_is_capturing_t)dlsym(cuda, "cuStreamIsCapturing") : nullptr;
    if (cu_record == nullptr || cu_capturing == nullptr) {
        printf("# 2. skipped: libcuda.so.1's cuEventRecord / cuStreamIsCapturing not found\n");
        return;
    }
    cudaEvent_t ev[200];
    for (auto &e : ev) {
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    }
    const char *what[] = {"nothing", "cudaStreamIsCapturing", "cudaEventRecord", "cuEventRecord",
                          "cuStreamIsCapturing", "cudaGetDevice + cudaSetDevice",
                          "cudaStreamIsCapturing + cudaEventRecord",
                          "cuStreamIsCapturing + cuEventRecord"};
    params144 p = {};
    printf("# 2. host us per launch of an 8-block kernel (144-byte parameter) and what follows it, "
           "burst of 200 after a sync, median of 7\n");
    for (int legacy = 1; legacy >= 0; legacy--) {
        cudaStream_t s = legacy ? (cudaStream_t)0 : nb;
        for (int mode = 0; mode < 8; mode++) {
            std::vector<double> burst;
            for (int rep = 0; rep < 7; rep++) {
                cudaDeviceSynchronize();
                double t0 = now_s();
                for (int i = 0; i < 200; i++) {
                    launch_kernel<<<8, 512, 0, s>>>(p);
                    cudaStreamCaptureStatus cs;
                    int ci, d;
                    switch (mode) {
                    case 1: cudaStreamIsCapturing(s, &cs); break;
                    case 2: cudaEventRecord(ev[i], s); break;
                    case 3: cu_record(ev[i], s); break;
                    case 4: cu_capturing(s, &ci); break;
                    case 5: cudaGetDevice(&d); cudaSetDevice(d); break;
                    case 6: cudaStreamIsCapturing(s, &cs); cudaEventRecord(ev[i], s); break;
                    case 7: cu_capturing(s, &ci); cu_record(ev[i], s); break;
                    }
                }
                burst.push_back((now_s() - t0) / 200 * 1e6);
            }
            printf("%-12s stream, launch then %-40s %5.2f\n", legacy ? "legacy" : "non-blocking",
                   what[mode], median(burst));
        }
    }
    cudaDeviceSynchronize();
    for (auto &e : ev) {
        cudaEventDestroy(e);
    }
}

/* ---- 3. querying an event recorded during a capture ---- */

__global__ void count_kernel(int *p)
{
    *p += 1;
}

static void captured_query(cudaStream_t s)
{
    const char *modes[] = {"global", "thread-local", "relaxed"};
    int *d;
    cudaMalloc((void **)&d, sizeof(int));
    cudaEvent_t ev;
    cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    printf("# 3. an event recorded on a capturing stream, then queried\n");
    for (int mode = 0; mode < 3; mode++) {
        cudaStreamBeginCapture(s, (cudaStreamCaptureMode)mode);
        count_kernel<<<1, 1, 0, s>>>(d);
        cudaError_t rec = cudaEventRecord(ev, s);
        cudaError_t query = cudaEventQuery(ev);
        cudaGetLastError();
        cudaGraph_t g = nullptr;
        cudaError_t end = cudaStreamEndCapture(s, &g);
        cudaGetLastError();
        printf("%-12s capture: cudaEventRecord %s, cudaEventQuery %s, cudaStreamEndCapture %s\n",
               modes[mode], cudaGetErrorName(rec), cudaGetErrorName(query), cudaGetErrorName(end));
        if (g != nullptr) {
            cudaGraphDestroy(g);
        }
    }
    cudaEventDestroy(ev);
    cudaFree(d);
}

int main()
{
    setvbuf(stdout, nullptr, _IONBF, 0);
    int dev = 0;
    cudaDeviceProp prop;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        printf("watch_cost: no CUDA GPU\n");
        return 1;
    }
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    printf("# %s, CUDA runtime %d, driver %d\n", prop.name, rt, drv);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    chain(s);
    after_launch(s);
    captured_query(s);
    cudaError_t e = cudaGetLastError();
    printf("# last error: %s\n", cudaGetErrorName(e));
    return 0;
}
