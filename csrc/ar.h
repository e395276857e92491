/* The own kernels' layer: what ar.c (the calls: which algorithm, the
 * launch, all_reduce_info) and ar_setup.c (loading the kernels, a
 * communicator's set-up, its release, stopping the waits) offer to the layers
 * above, in one header for the two.  What the two share between themselves
 * is ar_setup.h. */
#ifndef PYCCL_AR_H
#define PYCCL_AR_H

#include "pyccl.h"

typedef enum { PYCCL_ALGO_AUTO, PYCCL_ALGO_NCCL, PYCCL_ALGO_ONESHOT, PYCCL_ALGO_TWOSHOT } pyccl_algo;
/* The algo= argument (None: auto); two: 'twoshot' is one (all_reduce's),
 * else only 'auto', 'nccl' and 'oneshot' (all_gather's, reduce_scatter's). */
int pyccl_read_algo(const char *op, PyObject *obj, int two, pyccl_algo *out);
/* Run t -> o on the own kernels when `algo` and the arguments allow: 1 when
 * enqueued, 0 when NCCL should do it, -1 with an exception.  Collective on
 * the first call that qualifies (it sets up peer memory). */
int pyccl_ar_all_reduce(pyccl_state *st, pyccl_comm *c, const char *op,
                            pyccl_algo algo, const pyccl_tensor *t,
                            const pyccl_tensor *o, int redop, cudaStream_t s);
/* all_gather (rs 0: in, one rank's part, into every rank's part of out) or
 * reduce_scatter (rs 1: part `rank` of every rank's in, reduced with redop,
 * into out) on the own kernels, where algo='oneshot' asks for them (auto is
 * NCCL's): 1 enqueued, 0 NCCL's, -1 with an exception.  Larger calls than
 * the buffer holds run in chunks. */
int pyccl_ar_gather_scatter(pyccl_state *st, pyccl_comm *c, const char *op, pyccl_algo algo,
                            const pyccl_tensor *in, const pyccl_tensor *out, int redop, int rs,
                            cudaStream_t s);
/* Free what the own kernels hold on c (also after abort(): the stop word
 * ended their waits).  `collective`: every rank is destroying c together, so
 * the exported region is freed behind a barrier (bounded by c's timeout);
 * otherwise it is kept.  Nothing while a set-up of c is in flight. */
void pyccl_ar_release(pyccl_state *st, pyccl_comm *c, int collective);
PyObject *pyccl_ar_info(pyccl_state *st, pyccl_comm *c);
PyObject *pyccl_ar_epoch(pyccl_state *st, pyccl_comm *c, PyObject *value);
/* Make c's kernels that wait for peers give up now (abort); all of them (exit). */
void pyccl_ar_stop(pyccl_comm *c);
void pyccl_ar_stop_all(void);
/* Regions of this process's released communicators that a peer may still
 * map, kept until every peer closed its mapping or is gone (the release
 * handshake, ar_setup.c). */
int pyccl_ar_parked(void);
/* Host microseconds per launch of an empty kernel with the kernels'
 * parameter block on `device`, `calls` launches back to back on s, as the
 * kernels launch (pdl: with programmatic dependent launch): the floor of an
 * own-kernel call.  -1 with an exception naming op. */
double pyccl_ar_launch_floor(pyccl_state *st, const char *op, int device, cudaStream_t s,
                             int calls, int pdl);
/* all_reduce_coalesced's pack and unpack with the copy kernel.  usable: 1
 * when the kernels load on `device` (else the caller packs with torch),
 * tried once per device.
 * copy_list: the n tensors of ts into (to_flat) or out of flat, each after
 * the one before, on stream s of `device`, PYCCL_COPY_MAX a launch; 0, or -1
 * with CudaError naming op. */
int pyccl_ar_copy_usable(pyccl_state *st, int device);
int pyccl_ar_copy_list(pyccl_state *st, const char *op, int device, cudaStream_t s, char *flat,
                       const pyccl_tensor *ts, Py_ssize_t n, int to_flat);
/* Whether the kernels were compiled in (setup.py found nvcc). */
int pyccl_ar_built(void);
/* The kernels' fatbin as compiled in (its bytes; 0 and NULL when not built). */
size_t pyccl_ar_image(const unsigned char **image);

#endif /* PYCCL_AR_H */
