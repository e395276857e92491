/* The lock order's check (locks.h), in builds with PYCCL_DEBUG_LOCKS: each
 * thread's held locks, and a test of the check. */
#include "locks.h"

#ifdef PYCCL_DEBUG_LOCKS
_Thread_local pyccl_held_lock pyccl_held[PYCCL_HELD_MAX];
_Thread_local int pyccl_nheld;

void
pyccl_lock_selftest(int gil)
{
    static pthread_mutex_t later = PTHREAD_MUTEX_INITIALIZER, earlier = PTHREAD_MUTEX_INITIALIZER;
    if (gil) {
        pyccl_lock(&earlier, PYCCL_LOCK_COMM); /* aborts: called with the GIL held */
        pyccl_unlock(&earlier);
        return;
    }
    pyccl_lock(&later, PYCCL_LOCK_REGIONS);
    pyccl_lock(&earlier, PYCCL_LOCK_KERNELS); /* aborts: KERNELS comes before REGIONS */
    pyccl_unlock(&earlier);
    pyccl_unlock(&later);
}
#else
/* ISO C wants a translation unit to declare something */
typedef int pyccl_locks_unused;
#endif
