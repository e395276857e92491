/* What tensor.c offers: the one reader of tensors, arrays and streams (it
 * fills the pyccl_tensor of pyccl.h), the dtype table, the device guard, the
 * module state with torch looked up, the size and overlap checks, and the
 * reader's own part of the module state (st->torch, defined in tensor.c).
 * A shared piece (the lowest layer): one header per file there. */
#ifndef PYCCL_TENSOR_H
#define PYCCL_TENSOR_H

#include "pyccl.h"

/* The rows of pyccl_dtype_info (pyccl.h), as the reader's state (tensor.c)
 * holds their torch objects. */
extern const pyccl_dtype_info pyccl_dtype_table[PYCCL_NDTYPES];

/* The one device guard, without the GIL: make `device` current on this
 * thread (its primary context too, which a driver-API launch needs) and put
 * the device to go back to in *prev (-1: none known).  cudaSuccess when
 * `device` is current.  pyccl_device_leave goes back (also after a failure). */
cudaError_t pyccl_device_enter(const pyccl_api *a, int device, int *prev);
void pyccl_device_leave(const pyccl_api *a, int device, int prev);
/* Whether work put on s now would become part of a CUDA graph being
 * captured: 1 when s is captured, or when CUDA cannot say (another thread
 * captures in global mode; its error cleared), else 0.  What may not go into
 * a graph (an event the host reads, a mark whose replays would be stale)
 * is left out then.  s of the current device for the handles 0, 1, 2. */
static inline int
pyccl_stream_captured(const pyccl_api *a, cudaStream_t s)
{
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (a->cudaStreamIsCapturing(s, &cs) != cudaSuccess) {
        a->cudaGetLastError();
        return 1;
    }
    return cs != cudaStreamCaptureStatusNone;
}
/* st with torch looked up; NULL with RuntimeError once the interpreter tears
 * the module down. */
pyccl_state *pyccl_state_ready(pyccl_state *st);
/* The same for the module behind the Communicator type (or a method's type). */
pyccl_state *pyccl_state_of_type(PyTypeObject *tp);
/* st->torch, the reader's part of the module state: made with the interned
 * names (-1 with an exception), visited, cleared (from then on
 * pyccl_state_ready refuses), freed (module.c's exec, m_traverse, m_clear,
 * m_free). */
int pyccl_torch_state_init(pyccl_state *st);
int pyccl_torch_state_traverse(pyccl_state *st, visitproc visit, void *arg);
void pyccl_torch_state_clear(pyccl_state *st);
void pyccl_torch_state_free(pyccl_state *st);
int pyccl_torch_init(pyccl_state *st);
int pyccl_is_tensor(pyccl_state *st, PyObject *obj);
/* all_reduce_coalesced's pack and unpack (torch._C._nn.flatten_dense_tensors,
 * unflatten_dense_tensors, torch._foreach_copy_), looked up once; borrowed.
 * -1 with torch's exception where one is missing. */
int pyccl_torch_pack(pyccl_state *st, PyObject **flatten, PyObject **unflatten, PyObject **copy);
/* The torch-order checks of one tensor: cuda dense, dtype == *ref_dtype
 * (set it, a new reference the caller releases, when NULL), contiguous.
 * Fills t.  RuntimeError with torch's texts; a nonsense attribute value
 * raises ValueError naming op and what ("inputs[0]"). */
int pyccl_check_tensor(pyccl_state *st, const char *op, const char *what,
                       PyObject *obj, PyObject **ref_dtype, pyccl_tensor *t);
/* The Communicator API's reader: a CUDA torch.Tensor or an object with
 * __cuda_array_interface__ (CuPy, Numba, JAX), dense and contiguous, with the
 * Communicator API's messages ("<op>: <what> ..."). */
int pyccl_read_array(pyccl_state *st, const char *op, const char *what,
                     PyObject *obj, pyccl_tensor *t);
/* NCCL type to reduce t (the argument `what`) with, or -1 with TypeError
 * "<op>: <what> has dtype D, which NCCL cannot reduce" (RuntimeError for
 * torch.bool, and for fp8 on an NCCL without it); what NULL: the drop-in,
 * which keeps torch.cuda.nccl's RuntimeError "Unconvertible NCCL type X". */
int pyccl_reduce_type(pyccl_state *st, const char *op, const char *what,
                      const pyccl_tensor *t);
/* NCCL type and count that move t's bytes unchanged. */
void pyccl_move_type(pyccl_state *st, const pyccl_tensor *t, int *type,
                     size_t *count, size_t numel);
/* *out = a * b (a, b >= 0), or -1 with a ValueError naming op, what has a
 * (elements or bytes) and `how` it is multiplied, when that overflows int64. */
int pyccl_mul_size(const char *op, const char *what, int64_t a, int64_t b,
                   const char *how, int64_t *out);
/* a and b may share memory only as NCCL's in-place form: a exactly at
 * b + offset bytes (`slot` names that place, e.g. "rank 1's slot of it").
 * offset < 0: no sharing allowed, and `slot` is the message's tail.  Any
 * other overlap would have NCCL read bytes it already overwrote: -1 with a
 * ValueError naming both buffers' addresses and sizes. */
int pyccl_check_overlap(const char *op, const char *a_what, const pyccl_tensor *a,
                        const char *b_what, const pyccl_tensor *b,
                        int64_t offset, const char *slot);
/* The stream to enqueue on: `stream` (a torch.cuda.Stream or None) checked
 * against `device`, which belongs to `owner` (named in the error); None
 * means torch's current stream of that device.  Its device_index and
 * cuda_stream must be ints in range: TypeError / ValueError naming op and
 * what; an exception its own properties raise is passed on. */
int pyccl_stream(pyccl_state *st, const char *op, const char *what,
                 PyObject *stream, int device, const char *owner,
                 cudaStream_t *out);
/* "torch.float32"-style name of t's dtype (works for rows with no object). */
PyObject *pyccl_dtype_name(const pyccl_tensor *t);

#endif /* PYCCL_TENSOR_H */
