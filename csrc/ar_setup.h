/* What the files of pyccl's own all-reduce share (ar.c, the calls;
 * ar_setup.c, a communicator's set-up and release; ar_region.c, the peers'
 * region and what outlives a call; the kernels' loading, ar_load.h), and no other file
 * includes.  Hidden from other shared objects. */
#ifndef PYCCL_AR_SETUP_H
#define PYCCL_AR_SETUP_H

#include "ar.h"
#include "ar_load.h"
#include "kernels/ar_abi.h"
#include "errors.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#pragma GCC visibility push(hidden)



enum { AR_UNTRIED = 0, AR_READY = 1, AR_OFF = -1 };

/* How far the host may run ahead of its own kernels (pyccl.h's
 * PYCCL_LEAD_EVERY, PYCCL_LEAD_MARKS): every PYCCL_LEAD_EVERY-th launch carries
 * a mark, which its kernel stores to a host-mapped word as it ends, and a
 * call waits (GIL released, interruptible) for the mark PYCCL_LEAD_MARKS back
 * to have ended, with or without a timeout; no CUDA call for it but a capture
 * check per mark. */

/* the release handshake's shared-memory page of a rank (ar_region.c) */
#define PYCCL_AR_MARKS_NAME 40
typedef struct ar_marks ar_marks;

/* The peers' region of one communicator's own kernels, owned by its
 * pyccl_ar (ar_region.c): this rank's region (cudaMalloc, exported by CUDA
 * IPC), every peer's mapped here, and the release handshake that lets this
 * rank's region go only once no peer maps it. */
typedef struct ar_region {
    int rank, nranks, device;
    char *base;                         /* this rank's region */
    char *peer[PYCCL_AR_MAX_RANKS];     /* every rank's region here; [rank] = base */
    /* the release handshake: this rank's page and name, and each peer's
     * page (NULL once told), name and process */
    ar_marks *marks;
    char marks_name[PYCCL_AR_MARKS_NAME];
    ar_marks *peer_marks[PYCCL_AR_MAX_RANKS];
    char peer_names[PYCCL_AR_MAX_RANKS][PYCCL_AR_MARKS_NAME];
    int32_t pids[PYCCL_AR_MAX_RANKS];
} ar_region;

typedef struct pyccl_ar {
    int state;
    char reason[400];
    /* a PYCCL_AR_* setting of this rank that cannot be used (read_settings):
     * the set-up's agreement turns the kernels off for every rank with it
     * as the reason, rather than this rank raising while its peers wait */
    char bad_setting[160];
    int logged;
    ar_region region;                   /* the peers' region */
    int *host_err;                      /* pinned, device-visible */
    unsigned long long *done;           /* in host_err's allocation: the last mark that ended */
    unsigned long long launches;        /* kernels launched (eagerly or captured) */
    unsigned long long lead[PYCCL_LEAD_MARKS]; /* the last marks launched, a ring */
    unsigned nlead;
    unsigned long long lead_back;       /* the mark the call in hand waits for (0: none) */
    int waiters;                        /* threads waiting for a mark, GIL released (atomic) */
    size_t half_bytes;
    size_t one_max, two_max;            /* auto thresholds, read once */
    size_t ll_max;                      /* one-shot sizes up to this use the LL kernel */
    int blocks, threads;
    int pdl;                            /* launch with programmatic stream serialization */
    cudaStream_t last_stream;           /* the stream of the previous launch */
    cudaEvent_t order;                  /* orders a launch after the previous one on another stream */
    int rank, nranks, device;
    double timeout;                     /* seconds a wait may take; 0 = forever */
    pyccl_secs_text timeout_text;       /* as messages write it, from the set-up on */
    unsigned skew_ns;                   /* PYCCL_AR_DEBUG_SKEW_NS (testing) */
    double deadline;                    /* the set-up's (monotonic s); 0: none */
    int gone;                           /* the set-up found the communicator aborted */
    int other;                          /* ... or in another thread's open pyccl.group() */
    int sent;                           /* the set-up enqueued its exchange */
    char last[512];                     /* ncclGetLastError after a failed set-up call */
    pthread_mutex_t setup_mu;           /* one set-up at a time on a communicator */
    struct pyccl_ar *prev, *next;   /* in the live list, under live_mu */
    int in_live;
} pyccl_ar;

/* Why the own kernels are off for `ar` (a pyccl_ar *), printf-style. */
#define AR_WHY(ar, ...) snprintf((ar)->reason, sizeof (ar)->reason, __VA_ARGS__)

/* ---- ar_region.c: the peers' region, and what outlives a call ---- */
/* f is ready: its stop word joins those interpreter exit sets (and leaves). */
void ar_live_add(pyccl_ar *f);
void ar_live_remove(pyccl_ar *f);
/* A region of no memory yet, for rank `rank` of `nranks` on `device`. */
void ar_region_init(ar_region *g, int rank, int nranks, int device);
/* This rank's region of `total` bytes, zeroed and exported (*handle), and
 * (without the GIL) its page of marks, named in marks[len] ("" when shared
 * memory is unavailable).  On failure the CUDA error, nothing kept. */
cudaError_t ar_region_alloc(const pyccl_api *a, ar_region *g, size_t total,
                            cudaIpcMemHandle_t *handle, char *marks, size_t len);
/* After the exchange: peer p's page of marks (named in its record) and
 * process, where this rank tells p that it closed p's region. */
void ar_region_peer(ar_region *g, int p, const char *marks, int32_t pid);
/* Map peer p's region (its GPU's bus id and exported handle; for p = this
 * rank, its own): 1, or 0 with the reason in why[len]. */
int ar_region_map(const pyccl_api *a, ar_region *g, int p, const char *busid,
                  cudaIpcMemHandle_t handle, char *why, size_t len);
/* The page's name goes (every peer opened it); the mapping stays. */
void ar_region_unlink(ar_region *g);
/* Close the peers' regions mapped here, telling each that it is closed. */
void ar_region_close_peers(const pyccl_api *a, ar_region *g);
/* This rank's region is let go of: freed when `safe` (no peer can map it:
 * never shared, or a barrier followed every peer's close); else parked until
 * every peer closed its mapping or is gone, or kept (leaked) where that
 * cannot be, since freeing exported memory that an importer still maps is
 * undefined.  Its page of marks goes (parked: with the region). */
void ar_region_let_go(const pyccl_api *a, ar_region *g, int safe);
/* Free the parked regions no peer maps any more; how many. */
int ar_drain(const pyccl_api *a);

/* Collective.  Called without the GIL, current device = the comm's, f's
 * setup_mu held, f->deadline set.  Returns the NCCL result of the exchange
 * (a failure there is the caller's error; f->gone: the communicator was
 * aborted meanwhile); f->state says whether the kernels are usable. */
ncclResult_t ar_setup(const pyccl_api *a, pyccl_ar *f, pyccl_comm *c, cudaStream_t s);

#pragma GCC visibility pop

#endif
