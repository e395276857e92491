/* What the files of pyccl's own all-reduce share (ar.c, the calls;
 * ar_setup.c, a communicator's set-up and release; ar_region.c, the regions
 * that outlive a call; the kernels' loading, ar_load.h), and no other file
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

/* the release handshake's shared-memory page of a rank (ar_setup.c) */
#define PYCCL_AR_MARKS_NAME 40
typedef struct ar_marks ar_marks;

typedef struct pyccl_ar {
    int state;
    char reason[400];
    /* a PYCCL_AR_* setting of this rank that cannot be used (read_settings):
     * the set-up's agreement turns the kernels off for every rank with it
     * as the reason, rather than this rank raising while its peers wait */
    char bad_setting[160];
    int logged;
    char *base;                         /* this rank's region (cudaMalloc) */
    char *peer[PYCCL_AR_MAX_RANKS];     /* every rank's region here; [rank] = base */
    int *host_err;                      /* pinned, device-visible */
    size_t half_bytes;
    size_t one_max, two_max;            /* auto thresholds, read once */
    size_t ll_max;                      /* one-shot sizes up to this use the LL kernel */
    int blocks, threads;
    int pdl;                            /* launch with programmatic stream serialization */
    cudaStream_t last_stream;           /* the stream of the previous launch */
    int launched;
    cudaEvent_t order;                  /* orders a launch after the previous one on another stream */
    int rank, nranks, device;
    double timeout;                     /* seconds a wait may take; 0 = forever */
    pyccl_secs_text timeout_text;       /* as messages write it, from the set-up on */
    double kernel_timeout;              /* the kernels' deadline */
    unsigned skew_ns;                   /* PYCCL_AR_DEBUG_SKEW_NS (testing) */
    double deadline;                    /* the set-up's (monotonic s); 0: none */
    int gone;                           /* the set-up found the communicator aborted */
    int sent;                           /* the set-up enqueued its exchange */
    char last[512];                     /* ncclGetLastError after a failed set-up call */
    pthread_mutex_t setup_mu;           /* one set-up at a time on a communicator */
    /* the release handshake: this rank's page and name, and
     * each peer's page (NULL once told), name and process */
    ar_marks *marks;
    char marks_name[PYCCL_AR_MARKS_NAME];
    ar_marks *peer_marks[PYCCL_AR_MAX_RANKS];
    char peer_names[PYCCL_AR_MAX_RANKS][PYCCL_AR_MARKS_NAME];
    int32_t pids[PYCCL_AR_MAX_RANKS];
    struct pyccl_ar *prev, *next;   /* in the live list, under live_mu */
    int in_live;
} pyccl_ar;

/* Why the own kernels are off for `ar` (a pyccl_ar *), printf-style. */
#define AR_WHY(ar, ...) snprintf((ar)->reason, sizeof (ar)->reason, __VA_ARGS__)

/* ---- ar_region.c: the lists of regions that outlive a call ---- */
/* f is ready: its stop word joins those interpreter exit sets (and leaves). */
void ar_live_add(pyccl_ar *f);
void ar_live_remove(pyccl_ar *f);
/* Without the GIL.  Make this rank's page of marks (its name into name[len],
 * "" when shared memory is unavailable). */
void ar_marks_create(pyccl_ar *f, char *name, size_t len);
/* After the exchange: peer p's page (named in its record) and process. */
void ar_marks_open(pyccl_ar *f, int p, const char *name, int32_t pid);
/* This rank closed its mapping of p's region (or never had one): tell p. */
void ar_marks_closed(pyccl_ar *f, int p);
/* The page's name goes (every peer opened it); the mapping stays. */
void ar_marks_unlink(pyccl_ar *f);
/* This rank's page goes (its region freed, or parked with it). */
void ar_marks_drop(pyccl_ar *f);
/* base, which peers may still map, is freed once every peer marked it
 * closed or is gone: 1 parked, 0 kept (no page of marks). */
int ar_park(pyccl_ar *f, char *base);
/* Free the parked regions no peer maps any more; how many. */
int ar_drain(const pyccl_api *a);

/* Collective.  Called without the GIL, current device = the comm's, f's
 * setup_mu held, f->deadline set.  Returns the NCCL result of the exchange
 * (a failure there is the caller's error; f->gone: the communicator was
 * aborted meanwhile); f->state says whether the kernels are usable. */
ncclResult_t ar_setup(const pyccl_api *a, pyccl_ar *f, pyccl_comm *c, cudaStream_t s);

#pragma GCC visibility pop

#endif
