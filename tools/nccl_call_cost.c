/* Where a timed communicator's host time goes: NCCL's own cost of an
 * all_reduce on a blocking and on a non-blocking handle, measured apart from
 * pyccl.  Two processes (fork), one GPU each.  For each mode: the call's
 * return, then (non-blocking) the wait for ncclCommGetAsyncError to leave
 * ncclInProgress, polled by spinning or by usleep(20).
 *   gcc -O2 -o nccl_call_cost tools/nccl_call_cost.c -I<nccl>/include -I<cuda>/include -L<cuda>/lib64 -lcudart -ldl
 *   ./nccl_call_cost <nccl>/lib/libnccl.so.2 [iters]   (2 GPUs) */
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec * 1e-3; }
#define F(n) static __typeof__(n) *p_##n;
F(ncclGetUniqueId) F(ncclCommInitRankConfig) F(ncclAllReduce) F(ncclCommGetAsyncError) F(ncclCommDestroy) F(ncclCommFinalize)
static int cmpd(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }

static ncclResult_t settle(ncclComm_t c, ncclResult_t r, int sleep_us, int *polls) {
  *polls = 0;
  while (r == ncclInProgress) {
    ncclResult_t s; p_ncclCommGetAsyncError(c, &s); (*polls)++;
    if (s != ncclInProgress) return s;
    if (sleep_us) usleep(sleep_us);
  }
  return r;
}

static void run(int rank, ncclUniqueId *uid, int iters) {
  cudaSetDevice(rank);
  float *buf; cudaMalloc((void **)&buf, 4096); cudaMemset(buf, 0, 4096);
  cudaStream_t s; cudaStreamCreate(&s);
  for (int blocking = 1; blocking >= 0; blocking--) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER; cfg.blocking = blocking;
    ncclComm_t c; int polls;
    ncclResult_t r = p_ncclCommInitRankConfig(&c, 2, uid[blocking ? 0 : 1], rank, &cfg);
    r = settle(c, r, 0, &polls);
    if (r != ncclSuccess) { fprintf(stderr, "init %d\n", r); exit(1); }
    for (int sleepmode = 0; sleepmode < (blocking ? 1 : 2); sleepmode++) {
      double *ret = malloc(iters * sizeof *ret), *tot = malloc(iters * sizeof *tot); long np = 0;
      for (int i = 0; i < 20 + iters; i++) {
        double t0 = now_us();
        r = p_ncclAllReduce(buf, buf, 2, ncclFloat, ncclSum, c, s);
        double t1 = now_us();
        r = settle(c, r, sleepmode ? 20 : 0, &polls);
        double t2 = now_us();
        if (r != ncclSuccess) { fprintf(stderr, "allreduce %d\n", r); exit(1); }
        if (i >= 20) { ret[i - 20] = t1 - t0; tot[i - 20] = t2 - t0; np += polls; }
      }
      cudaStreamSynchronize(s);
      qsort(ret, iters, sizeof *ret, cmpd); qsort(tot, iters, sizeof *tot, cmpd);
      if (rank == 0)
        printf("nccl_call_cost: %-12s %-14s call returns %6.1f us (median), done %6.1f us (median, p90 %6.1f), %.1f polls/call\n",
               blocking ? "blocking" : "non-blocking", blocking ? "-" : sleepmode ? "poll usleep(20)" : "poll spinning",
               ret[iters / 2], tot[iters / 2], tot[iters * 9 / 10], (double)np / iters);
      free(ret); free(tot);
    }
    if (!blocking) { r = p_ncclCommFinalize(c); settle(c, r, 0, &polls); }
    p_ncclCommDestroy(c);
  }
}

int main(int argc, char **argv) {
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
#define L(n) p_##n = (__typeof__(n) *)dlsym(h, #n);
  L(ncclGetUniqueId) L(ncclCommInitRankConfig) L(ncclAllReduce) L(ncclCommGetAsyncError) L(ncclCommDestroy) L(ncclCommFinalize)
  int iters = argc > 2 ? atoi(argv[2]) : 200;
  ncclUniqueId *uid = mmap(NULL, 2 * sizeof *uid, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  p_ncclGetUniqueId(&uid[0]); p_ncclGetUniqueId(&uid[1]);
  pid_t pid = fork();
  run(pid == 0 ? 1 : 0, uid, iters);
  if (pid == 0) return 0;
  int st; waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}
