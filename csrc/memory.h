/* The memory layer (memory.c): pyccl._C.NcclBuffer, the ncclMemAlloc
 * memory behind pyccl.empty, and the two allocator functions of
 * pyccl.mem_pool(), for the module. */
#ifndef PYCCL_MEMORY_H
#define PYCCL_MEMORY_H

#include "pyccl.h"

extern PyType_Spec pyccl_buffer_spec;
PyObject *pyccl_mem_alloc(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *pyccl_mem_pool_functions(PyObject *m, PyObject *unused);

#endif /* PYCCL_MEMORY_H */
