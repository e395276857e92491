/* Every lock of pyccl._C, and the one order in which a thread takes them.
 *
 * A thread holding a lock of one class takes only locks of a later class
 * (below), never one of its own class, except the communicators' (several
 * at once: a call's watched communicators in the address order of their
 * watches, then its others in address order: watch_enqueue.c's acquire_all
 * and each_plain).  A trylock never waits, so it is outside the order
 * (the watchdog thread, holding the list of watches, trylocks each one).
 * Every lock is taken and released through these calls; builds with
 * PYCCL_DEBUG=1 (PYCCL_DEBUG_LOCKS) check the order at each lock and abort
 * with both locks named when it is broken, or when a lock is taken twice.
 *
 *   class                 the lock                     guards
 *   PYCCL_LOCK_SETUP      ar_setup.h `setup_mu`        one own-kernel set-up of a communicator
 *   PYCCL_LOCK_KERNELS    ar_load.c `load_mu`          loading the kernels per device
 *   PYCCL_LOCK_COMM       pyccl_comm `mu` (a watch's   every NCCL call on the handle, the watch's
 *                         `mu` points to it)           events and failure record
 *   PYCCL_LOCK_WATCHDOG   the watchdog's `mu`          the list of watches, the thread's tick
 *   PYCCL_LOCK_REGIONS    ar_region.c `live_mu`,       the communicators exit releases; regions
 *                         `parked_mu`                  peers may still map (never nested)
 *   PYCCL_LOCK_LOST       enqueue.c `lost_mu`          the groups of threads that ended with
 *                                                      them open
 *
 * The clique locks (clique.c's clique_lock, clique_call_lock: PyThread locks
 * waited for with the GIL released; clique_call_lock held without it inside
 * pyccl_enqueue) come before all of these.  A thread holding a set-up's or a
 * communicator's lock may take the GIL (to raise, to run a signal handler),
 * so no thread waits for one of those with the GIL held: it waits with the
 * GIL released (pyccl_lock_released), and the debug build checks that too.
 * The other locks' holders never take the GIL, and their sections are
 * short: a GIL holder may wait for them. */
#ifndef PYCCL_LOCKS_H
#define PYCCL_LOCKS_H

#include "pyccl.h"

#include <pthread.h>

enum {
    PYCCL_LOCK_SETUP = 1,
    PYCCL_LOCK_KERNELS,
    PYCCL_LOCK_COMM,
    PYCCL_LOCK_WATCHDOG,
    PYCCL_LOCK_REGIONS,
    PYCCL_LOCK_LOST,
};

#pragma GCC visibility push(hidden)

#ifdef PYCCL_DEBUG_LOCKS
#include <stdio.h>
#include <stdlib.h>

/* The check: each thread's held locks (locks.c holds them), looked at before
 * every wait for another. */
#define PYCCL_HELD_MAX 64
typedef struct {
    pthread_mutex_t *mu;
    int cls;
} pyccl_held_lock;
extern _Thread_local pyccl_held_lock pyccl_held[PYCCL_HELD_MAX];
extern _Thread_local int pyccl_nheld;
/* The check's own test (it aborts): two locks taken against the order, or
 * (gil) a communicator-class lock waited for with the GIL held. */
void pyccl_lock_selftest(int gil);

static inline void
pyccl_lock_broken(const char *what, pthread_mutex_t *mu, int cls, const pyccl_held_lock *h)
{
    static const char *const names[] = {
        "?", "an own-kernel set-up's setup_mu", "the kernels' load_mu", "a communicator's mu",
        "the watchdog's mu", "a region list's mu", "a lost-group list's mu",
    };
    fprintf(stderr, "pyccl: lock order broken: %s %s (%p)", what,
            names[cls > 0 && cls <= PYCCL_LOCK_LOST ? cls : 0], (void *)mu);
    if (h != NULL) {
        fprintf(stderr, " while holding %s (%p)",
                names[h->cls > 0 && h->cls <= PYCCL_LOCK_LOST ? h->cls : 0], (void *)h->mu);
    }
    fprintf(stderr, "; the order is csrc/locks.h's\n");
    fflush(stderr);
    abort();
}

static inline void
pyccl_lock_check(pthread_mutex_t *mu, int cls)
{
    if ((cls == PYCCL_LOCK_SETUP || cls == PYCCL_LOCK_COMM) && !Py_IsFinalizing() &&
        PyGILState_Check()) {
        pyccl_lock_broken("waiting with the GIL held for", mu, cls, NULL);
    }
    for (int i = 0; i < pyccl_nheld && i < PYCCL_HELD_MAX; i++) {
        const pyccl_held_lock *h = &pyccl_held[i];
        if (h->mu == mu) {
            pyccl_lock_broken("taking again", mu, cls, h);
        }
        if (h->cls > cls || (h->cls == cls && cls != PYCCL_LOCK_COMM)) {
            pyccl_lock_broken("taking", mu, cls, h);
        }
    }
}

static inline void
pyccl_lock_held(pthread_mutex_t *mu, int cls)
{
    if (pyccl_nheld < PYCCL_HELD_MAX) {
        pyccl_held[pyccl_nheld].mu = mu;
        pyccl_held[pyccl_nheld].cls = cls;
    }
    pyccl_nheld++;
}

static inline void
pyccl_lock_dropped(pthread_mutex_t *mu)
{
    int n = pyccl_nheld < PYCCL_HELD_MAX ? pyccl_nheld : PYCCL_HELD_MAX;
    for (int i = n - 1; i >= 0; i--) {
        if (pyccl_held[i].mu == mu) {
            for (int k = i + 1; k < n; k++) {
                pyccl_held[k - 1] = pyccl_held[k];
            }
            pyccl_nheld--;
            return;
        }
    }
    pyccl_lock_broken("releasing, not held,", mu, 0, NULL);
}
#else
#define pyccl_lock_check(mu, cls) ((void)0)
#define pyccl_lock_held(mu, cls) ((void)0)
#define pyccl_lock_dropped(mu) ((void)0)
#endif

#pragma GCC visibility pop

static inline void
pyccl_lock(pthread_mutex_t *mu, int cls)
{
    pyccl_lock_check(mu, cls);
    pthread_mutex_lock(mu);
    pyccl_lock_held(mu, cls);
}

/* 0 when taken (as pthread_mutex_trylock). */
static inline int
pyccl_trylock(pthread_mutex_t *mu, int cls)
{
    int r = pthread_mutex_trylock(mu);
    if (r == 0) {
        pyccl_lock_held(mu, cls);
    }
    return r;
}

static inline void
pyccl_unlock(pthread_mutex_t *mu)
{
    pyccl_lock_dropped(mu);
    pthread_mutex_unlock(mu);
}

/* Lock mu with the GIL held: the GIL is released only while waiting for it,
 * so a thread holding mu that needs the GIL cannot deadlock with us. */
static inline void
pyccl_lock_released(pthread_mutex_t *mu, int cls)
{
    if (pyccl_trylock(mu, cls) == 0) {
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    pyccl_lock(mu, cls);
    Py_END_ALLOW_THREADS
}

#endif /* PYCCL_LOCKS_H */
