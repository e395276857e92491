/* What the host (csrc/ar.c) and the all-reduce kernels (allreduce.cu)
 * agree on: the layout of each rank's registered region and the kernels'
 * single by-value parameter.  Plain C, included by both sides. */
#ifndef PYCCL_AR_ABI_H
#define PYCCL_AR_ABI_H

#define PYCCL_AR_MAX_RANKS 8
#define PYCCL_AR_MAX_BLOCKS 64

/* One cudaMalloc per rank, exported by CUDA IPC, laid out as:
 *   FLAGS    uint32 [2 parity][2 phase][MAX_BLOCKS][MAX_RANKS]: slot
 *            [p][ph][b][src] is written by rank src (remotely) when its block b
 *            reached phase ph of a call whose epoch has parity p
 *   COUNTER  uint32 [MAX_BLOCKS]: the epoch of the last call each block ended
 *   DEVERR   int32: 1 once a wait on this rank gave up; every later call
 *            returns at once (the host reports it and stops using the kernels)
 *   PROBE    uint32 [2][MAX_RANKS]: the set-up's write-then-read probe
 *   DATA     two halves of `half` bytes each, used by alternate calls
 *   LL       at DATA + 2 * half: [2 parity][MAX_RANKS? no: nranks src][ll_slot]
 *            16-byte lines {data, flag, data, flag} pushed by each source
 *            rank (the one-shot kernel for small sizes, "LL": the flag travels
 *            with every 4 bytes of data, so no separate barrier) */
#define PYCCL_AR_FLAGS_OFF 0
#define PYCCL_AR_COUNTER_OFF 8192
#define PYCCL_AR_DEVERR_OFF 8448
#define PYCCL_AR_PROBE_OFF 12288
#define PYCCL_AR_DATA_OFF 65536

typedef struct {
    const void *in;
    void *out;
    char *base[PYCCL_AR_MAX_RANKS]; /* every rank's region, mapped in this process */
    int *host_error;                /* host-mapped word, set to 1 when a wait gave up */
    unsigned long long nbytes;      /* bytes to reduce (a multiple of the item size) */
    unsigned long long half;        /* bytes of one data half */
    unsigned long long timeout_ns;  /* a wait gives up after this; 0 = never */
    unsigned int magic;             /* probe only */
    int aligned;                    /* in and out are 16-byte aligned */
    unsigned long long ll_slot;     /* bytes of one source rank's LL slot (2x the payload) */
    int rank;
    int nranks;
    unsigned int skew_ns;           /* testing only: block b starts b * skew_ns late */
} pyccl_ar_params;

#endif
