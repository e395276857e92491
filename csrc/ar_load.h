/* pyccl's own all-reduce kernels, loaded (ar_load.c): the CUDA driver's
 * calls that load and launch them, declared here (no cuda.h), and each
 * device's kernels.  Included by the own all-reduce's files only (through
 * ar_setup.h).  Hidden from other shared objects. */
#ifndef PYCCL_AR_LOAD_H
#define PYCCL_AR_LOAD_H

#include "pyccl.h"

#include <stddef.h>

#pragma GCC visibility push(hidden)

/* ---------------- the driver API, declared here (no cuda.h) ---------------- */

typedef int CUresult;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
/* cuLaunchKernelEx's configuration, as cuda.h (12.0 and later) lays it out */
typedef struct {
    int id;                      /* CUlaunchAttributeID */
    char pad[4];
    union {
        char pad[64];
        int i;
    } value;
} cu_launch_attr;
typedef struct {
    unsigned grid[3], block[3], shared_bytes;
    cudaStream_t stream;
    cu_launch_attr *attrs;
    unsigned nattrs;
} cu_launch_config;
_Static_assert(sizeof(cu_launch_attr) == 72, "CUlaunchAttribute is 72 bytes");
_Static_assert(sizeof(cu_launch_config) == 56, "CUlaunchConfig is 56 bytes");
#define CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
typedef struct {
    int tried;
    char err[200];
    CUresult (*cuModuleLoadData)(CUmodule *, const void *);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, unsigned, cudaStream_t, void **,
                               void **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    /* optional: programmatic dependent launch (driver 12.0+, sm_90+) */
    CUresult (*cuLaunchKernelEx)(const cu_launch_config *, CUfunction, void **, void **);
    CUresult (*cuDeviceGet)(int *, int);
    CUresult (*cuDeviceGetAttribute)(int *, int, int);
} ar_driver;

/* kernels: [0 one-shot LL, 1 one-shot, 2 two-shot][dtype][op], then the
 * probe, the empty kernel (the launch floor), the copy kernel
 * (all_reduce_coalesced's pack and unpack), reduce_scatter's [dtype][op] and
 * all_gather's by unit (16, 4 and 1 bytes) */
enum { K_F32, K_F16, K_BF16, K_I32, K_NTYPES };
enum { K_SUM, K_MAX, K_MIN, K_NOPS };
#define K_PROBE (3 * K_NTYPES * K_NOPS)
#define K_EMPTY (K_PROBE + 1)
#define K_COPY (K_PROBE + 2)
#define K_RS (K_PROBE + 3)
#define K_AG (K_RS + K_NTYPES * K_NOPS)
#define K_COUNT (K_AG + 3)

#define MAX_DEVICES 64
typedef struct {
    int state; /* 0 untried, 1 loaded, -1 failed */
    CUfunction fn[K_COUNT];
} ar_device;

/* The driver table and the kernels loaded per device. */
extern ar_driver ar_drv;
extern ar_device ar_devs[MAX_DEVICES];

/* The driver's text for an error code. */
const char *ar_cu_error(CUresult r);
/* The kernels of `device` (current), loaded once (the driver too); -1 with
 * `why`.  Without the GIL: two set-ups on two threads may race here. */
int ar_load_kernels(int device, char *why, size_t n);
/* Whether `device` can overlap a kernel's launch with the previous kernel
 * on its stream (programmatic dependent launch: compute capability 9.0 and
 * a driver with cuLaunchKernelEx). */
int ar_pdl_supported(int device);

#pragma GCC visibility pop

#endif
