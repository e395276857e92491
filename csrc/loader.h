/* What loader.c offers: NCCL and the CUDA runtime found and dlopen'ed into
 * pyccl_state.api (torch's copies when torch loaded them), the loaded NCCL's
 * version, the device count, the check that an optional NCCL call is there,
 * and where to look for the libraries (st->libs, the loader's part of the
 * module state, defined in loader.c).
 * A shared piece (the lowest layer): one header per file there, as each
 * file above uses only some of them. */
#ifndef PYCCL_LOADER_H
#define PYCCL_LOADER_H

#include "pyccl.h"

/* Resolve NCCL and the CUDA runtime (torch's copies when loaded); -1 with an
 * exception naming `op` when they cannot be found. */
int pyccl_load(pyccl_state *st, const char *op);
/* _set_library_candidates: nccl_paths and cudart_paths (lists of str, checked
 * by the caller) copied as the paths to try; -1 with an exception. */
int pyccl_set_library_candidates(pyccl_state *st, PyObject *nccl_paths,
                                 PyObject *cudart_paths);
/* The NCCL version code of the loaded library, loading it if needed. */
int pyccl_nccl_version(pyccl_state *st, const char *op);
/* The number of CUDA devices in *ndev, loading the libraries if needed; -1
 * with CudaError "<op>: no CUDA GPU is available (cudaGetDeviceCount: ...)"
 * when there is none. */
int pyccl_gpu_count(pyccl_state *st, const char *op, int *ndev);
/* 0 when `fn` (an optional NCCL call, named `call`) was resolved; else -1
 * with RuntimeError "<op>: needs NCCL >= <needed> for <call>; the loaded
 * NCCL is <x.y.z>".  NCCL must be loaded. */
int pyccl_need_nccl(pyccl_state *st, const char *op, const void *fn,
                    const char *call, const char *needed);
/* st->libs, the loader's part of the module state: made (-1 with an
 * exception), cleared, freed by module.c (lists of str: nothing to visit). */
int pyccl_libs_state_init(pyccl_state *st);
void pyccl_libs_state_clear(pyccl_state *st);
void pyccl_libs_state_free(pyccl_state *st);

#endif /* PYCCL_LOADER_H */
