/* What the host (csrc/ar.c, csrc/ar_setup.c) and the all-reduce kernels
 * (allreduce.cu) agree on: the layout of each rank's registered region and
 * the kernels' single by-value parameter.  Plain C, included by both sides.
 *
 * The two sides are compiled apart (the C compiler for the host, nvcc for the
 * kernels) and meet only through these bytes, so every offset and size either
 * side relies on is asserted below with the same numbers: a change that moves
 * one fails both compiles instead of running with disagreeing layouts.
 * tests/_ar_sim.py mirrors the parameter block with ctypes. */
#ifndef PYCCL_AR_ABI_H
#define PYCCL_AR_ABI_H

#include <assert.h> /* static_assert in C11; a keyword in C++ */
#include <stddef.h> /* offsetof */

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
 *   DATA     two halves of `half_bytes` bytes each, used by alternate calls
 *   LL       at DATA + 2 * half_bytes: [2 parity][nranks source ranks][ll_slot bytes]
 *            of 16-byte lines {data, flag, data, flag} pushed by each source
 *            rank (the one-shot kernel for small sizes, "LL": the flag travels
 *            with every 4 bytes of data, so no separate barrier)
 * The region is DATA + 2 * half_bytes + 2 * nranks * ll_slot bytes; half_bytes and
 * ll_slot are multiples of 16, so every data half and LL line is 16-byte aligned. */
#define PYCCL_AR_FLAGS_OFF 0
#define PYCCL_AR_COUNTER_OFF 8192
#define PYCCL_AR_DEVERR_OFF 8448
#define PYCCL_AR_PROBE_OFF 12288
#define PYCCL_AR_DATA_OFF 65536

/* each part ends before the next begins */
static_assert(PYCCL_AR_FLAGS_OFF + 2 * 2 * PYCCL_AR_MAX_BLOCKS * PYCCL_AR_MAX_RANKS * 4 <=
                  PYCCL_AR_COUNTER_OFF,
              "ar_abi.h: FLAGS overlaps COUNTER");
static_assert(PYCCL_AR_COUNTER_OFF + PYCCL_AR_MAX_BLOCKS * 4 <= PYCCL_AR_DEVERR_OFF,
              "ar_abi.h: COUNTER overlaps DEVERR");
static_assert(PYCCL_AR_DEVERR_OFF + 4 <= PYCCL_AR_PROBE_OFF, "ar_abi.h: DEVERR overlaps PROBE");
static_assert(PYCCL_AR_PROBE_OFF + 2 * PYCCL_AR_MAX_RANKS * 4 <= PYCCL_AR_DATA_OFF,
              "ar_abi.h: PROBE overlaps DATA");
/* the kernels read and write the data in 16-byte vectors and the flags as
 * 4-byte words */
static_assert(PYCCL_AR_DATA_OFF % 16 == 0, "ar_abi.h: DATA is not 16-byte aligned");
static_assert(PYCCL_AR_FLAGS_OFF % 4 == 0 && PYCCL_AR_COUNTER_OFF % 4 == 0 &&
                  PYCCL_AR_DEVERR_OFF % 4 == 0 && PYCCL_AR_PROBE_OFF % 4 == 0,
              "ar_abi.h: a flag word is not 4-byte aligned");

/* The kernels' parameter: the host fills one and passes its address to
 * cuLaunchKernel, which copies from it as many bytes as the kernel's by-value
 * argument has in nvcc's layout, so the host's layout must be that one. */
typedef struct {
    const void *in;
    void *out;
    char *base[PYCCL_AR_MAX_RANKS]; /* every rank's region, mapped in this process */
    int *host_error;                /* host-mapped word, set to 1 when a wait gave up */
    unsigned long long nbytes;      /* bytes to reduce (a multiple of the item size) */
    unsigned long long half_bytes;  /* bytes of one data half */
    unsigned long long timeout_ns;  /* a wait gives up after this; 0 = never */
    unsigned int magic;             /* probe only */
    int aligned;                    /* in and out are 16-byte aligned */
    unsigned long long ll_slot;     /* bytes of one source rank's LL slot (2x the payload) */
    int rank;
    int nranks;
    unsigned int skew_ns;           /* testing only: block b starts b * skew_ns late */
    unsigned long long stride;      /* all_gather: bytes between the ranks' parts of out;
                                     * reduce_scatter: of in (nbytes unless chunked) */
    unsigned long long *done;       /* host-mapped word: the last mark a kernel ended with */
    unsigned long long mark;        /* nonzero: block 0 stores it to *done as it ends */
} pyccl_ar_params;

#ifdef __cplusplus
#define PYCCL_AR_ALIGNOF(t) alignof(t)
#else
#define PYCCL_AR_ALIGNOF(t) _Alignof(t)
#endif

/* 64-bit pointers and the widths of the integer fields, on both sides */
static_assert(sizeof(void *) == 8, "ar_abi.h: pointers are not 8 bytes");
static_assert(sizeof(unsigned long long) == 8 && sizeof(int) == 4 && sizeof(unsigned int) == 4,
              "ar_abi.h: an integer field has an unexpected width");
static_assert(offsetof(pyccl_ar_params, in) == 0, "ar_abi.h: pyccl_ar_params.in moved");
static_assert(offsetof(pyccl_ar_params, out) == 8, "ar_abi.h: pyccl_ar_params.out moved");
static_assert(offsetof(pyccl_ar_params, base) == 16, "ar_abi.h: pyccl_ar_params.base moved");
static_assert(offsetof(pyccl_ar_params, host_error) == 80,
              "ar_abi.h: pyccl_ar_params.host_error moved");
static_assert(offsetof(pyccl_ar_params, nbytes) == 88, "ar_abi.h: pyccl_ar_params.nbytes moved");
static_assert(offsetof(pyccl_ar_params, half_bytes) == 96,
              "ar_abi.h: pyccl_ar_params.half_bytes moved");
static_assert(offsetof(pyccl_ar_params, timeout_ns) == 104,
              "ar_abi.h: pyccl_ar_params.timeout_ns moved");
static_assert(offsetof(pyccl_ar_params, magic) == 112, "ar_abi.h: pyccl_ar_params.magic moved");
static_assert(offsetof(pyccl_ar_params, aligned) == 116,
              "ar_abi.h: pyccl_ar_params.aligned moved");
static_assert(offsetof(pyccl_ar_params, ll_slot) == 120,
              "ar_abi.h: pyccl_ar_params.ll_slot moved");
static_assert(offsetof(pyccl_ar_params, rank) == 128, "ar_abi.h: pyccl_ar_params.rank moved");
static_assert(offsetof(pyccl_ar_params, nranks) == 132, "ar_abi.h: pyccl_ar_params.nranks moved");
static_assert(offsetof(pyccl_ar_params, skew_ns) == 136,
              "ar_abi.h: pyccl_ar_params.skew_ns moved");
static_assert(offsetof(pyccl_ar_params, stride) == 144, "ar_abi.h: pyccl_ar_params.stride moved");
static_assert(offsetof(pyccl_ar_params, done) == 152, "ar_abi.h: pyccl_ar_params.done moved");
static_assert(offsetof(pyccl_ar_params, mark) == 160, "ar_abi.h: pyccl_ar_params.mark moved");
static_assert(sizeof(pyccl_ar_params) == 168, "ar_abi.h: pyccl_ar_params changed size");
static_assert(PYCCL_AR_ALIGNOF(pyccl_ar_params) == 8, "ar_abi.h: pyccl_ar_params changed alignment");

/* The copy kernel's parameter (all_reduce_coalesced's pack and unpack): up to
 * PYCCL_COPY_MAX tensors (pointer and bytes) and each one's byte offset in the
 * packed buffer; to_flat 1 copies the tensors into it, 0 back out.  Kept
 * under the 4 KiB every driver accepts for a kernel's parameters. */
#define PYCCL_COPY_MAX 160
typedef struct {
    unsigned long long ptr, off, nbytes;
} pyccl_copy_item;
typedef struct {
    char *flat;
    unsigned int n;
    int to_flat;
    pyccl_copy_item item[PYCCL_COPY_MAX];
} pyccl_copy_params;

static_assert(sizeof(pyccl_copy_item) == 24, "ar_abi.h: pyccl_copy_item changed size");
static_assert(offsetof(pyccl_copy_params, n) == 8, "ar_abi.h: pyccl_copy_params.n moved");
static_assert(offsetof(pyccl_copy_params, to_flat) == 12,
              "ar_abi.h: pyccl_copy_params.to_flat moved");
static_assert(offsetof(pyccl_copy_params, item) == 16, "ar_abi.h: pyccl_copy_params.item moved");
static_assert(sizeof(pyccl_copy_params) == 16 + 24 * PYCCL_COPY_MAX && sizeof(pyccl_copy_params) <= 4096,
              "ar_abi.h: pyccl_copy_params changed size");

#endif
