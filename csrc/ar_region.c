/* pyccl's own all-reduce, the peers' region (ar_region: this rank's region
 * made and exported, the peers' mapped, closed and let go of) and what
 * outlives one communicator: the ready communicators' stop words
 * (interpreter exit ends kernels still waiting for peers), and the release
 * handshake (a region peers may still map, parked and freed once each peer
 * marked it closed or exited).  Both lists are process-wide, under the
 * regions' locks. */
#include "ar.h"
#include "locks.h"
#include "ar_setup.h"
#include "tensor.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Every ready communicator's stop word, so that interpreter exit can release
 * kernels still waiting for peers.  A list (no limit on how many), changed
 * under live_mu: the set-up adds to it without the GIL. */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static pyccl_ar *live_head;

void
ar_live_add(pyccl_ar *f)
{
    pyccl_lock(&live_mu, PYCCL_LOCK_REGIONS);
    f->prev = NULL;
    f->next = live_head;
    if (live_head != NULL) {
        live_head->prev = f;
    }
    live_head = f;
    f->in_live = 1;
    pyccl_unlock(&live_mu);
}

void
ar_live_remove(pyccl_ar *f)
{
    pyccl_lock(&live_mu, PYCCL_LOCK_REGIONS);
    if (f->in_live) {
        if (f->prev != NULL) {
            f->prev->next = f->next;
        } else {
            live_head = f->next;
        }
        if (f->next != NULL) {
            f->next->prev = f->prev;
        }
        f->prev = f->next = NULL;
        f->in_live = 0;
    }
    pyccl_unlock(&live_mu);
}

/* The kernels of c that wait for peers give up now (they poll this
 * host-mapped word); the communicator's own kernels are unusable afterwards. */
void
pyccl_ar_stop(pyccl_comm *c)
{
    pyccl_ar *f = c->ar;
    if (f != NULL && f->host_err != NULL) {
        *(volatile int *)f->host_err = 2;
    }
}

void
pyccl_ar_stop_all(void)
{
    pyccl_lock(&live_mu, PYCCL_LOCK_REGIONS);
    for (pyccl_ar *f = live_head; f != NULL; f = f->next) {
        if (f->host_err != NULL) {
            *(volatile int *)f->host_err = 2;
        }
    }
    pyccl_unlock(&live_mu);
}

/* ---------------- the release handshake ----------------
 *
 * Giving back the own kernels' region when no barrier of every rank can be
 * had (abort(), garbage collection, a peer that died): the release handshake.
 *
 * A rank's region is exported by CUDA IPC; freeing it while a peer still
 * maps it is undefined, so until now it was kept (leaked) whenever destroy()'s
 * barrier could not prove every peer had closed its mapping: about 34 MiB per
 * aborted communicator, per rank.  Two ways were weighed:
 * - memory from the driver's cuMem calls exported as POSIX file descriptors
 *   (the driver keeps the physical memory until the last mapping goes, so the
 *   exporter may let go at once).  It needs the descriptors carried between
 *   the ranks' processes over Unix sockets, a listener per rank, and a second
 *   allocation and mapping path beside the CUDA IPC one;
 * - a handshake: each rank has a small shared-memory page of "closed" marks;
 *   a peer sets its mark in the owner's page after it closed its mapping of
 *   the owner's region (the order that makes the free safe), and a peer whose
 *   process is gone counts as closed (its mappings died with it).
 * The handshake is chosen: it keeps the one mapping path, needs no sockets,
 * and the CPU tier's stand-in library covers it.  A region is "parked" when
 * its rank lets go of it before its peers did, and freed at this process's
 * next own-kernel set-up or release once every peer has marked or is gone.
 * A page's name is unlinked once the set-up's agreement showed every peer
 * opened it, so no name outlives the set-up, whatever happens to the
 * processes later.  Where shared memory cannot be had (shm_open fails), the
 * region is kept as before.  A peer that never closes its mapping (alive, the communicator not
 * destroyed or aborted there) keeps the region parked until it does. */

#define MARKS_MAGIC 0x70636d6bu /* "pcmk" */

struct ar_marks {
    uint32_t magic;
    int32_t closed[PYCCL_AR_MAX_RANKS]; /* [p] = 1: rank p closed its mapping */
};

/* A region let go of before every peer closed its mapping. */
typedef struct parked {
    struct parked *next;
    char *base;
    int device, rank, nranks;
    ar_marks *marks;
    char name[PYCCL_AR_MARKS_NAME];
    char peer_names[PYCCL_AR_MAX_RANKS][PYCCL_AR_MARKS_NAME];
    int32_t pids[PYCCL_AR_MAX_RANKS];
} parked;

static pthread_mutex_t parked_mu = PTHREAD_MUTEX_INITIALIZER;
static parked *parked_head;
static unsigned marks_serial;

static ar_marks *
map_marks(const char *name, int create)
{
    int fd = shm_open(name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
    if (fd < 0) {
        return NULL;
    }
    if (create && ftruncate(fd, sizeof(ar_marks)) != 0) {
        close(fd);
        shm_unlink(name);
        return NULL;
    }
    void *p = mmap(NULL, sizeof(ar_marks), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        if (create) {
            shm_unlink(name);
        }
        return NULL;
    }
    return p;
}

/* A peer's process is gone (or a zombie, whose mappings went with it). */
static int
pid_gone(int32_t pid)
{
    if (pid <= 0) {
        return 0;
    }
    if (kill(pid, 0) != 0) {
        return errno == ESRCH;
    }
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *fp = fopen(path, "r");
    if (fp == NULL) {
        return 0;
    }
    size_t got = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[got] = '\0';
    const char *close_paren = strrchr(buf, ')');
    return close_paren != NULL && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

/* Names left in /dev/shm by processes of this host that died during a
 * set-up (between making their page and the agreement that unlinks it). */
static void
sweep_dead_names(void)
{
    DIR *d = opendir("/dev/shm");
    if (d == NULL) {
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int pid = 0;
        unsigned k = 0;
        if (sscanf(e->d_name, "pyccl-ar-%d-%u", &pid, &k) == 2 && pid > 0 && pid != getpid() &&
            pid_gone(pid)) {
            char name[300];
            snprintf(name, sizeof name, "/%s", e->d_name);
            shm_unlink(name);
        }
    }
    closedir(d);
}

void
ar_region_init(ar_region *g, int rank, int nranks, int device)
{
    memset(g, 0, sizeof *g);
    g->rank = rank;
    g->nranks = nranks;
    g->device = device;
}

/* Without the GIL.  Make this rank's page of marks (its name into name[len],
 * "" when shared memory is unavailable). */
static void
marks_create(ar_region *g, char *name, size_t len)
{
    static int swept;
    if (!__atomic_exchange_n(&swept, 1, __ATOMIC_RELAXED)) {
        sweep_dead_names(); /* once per process */
    }
    name[0] = '\0';
    unsigned k = __atomic_fetch_add(&marks_serial, 1, __ATOMIC_RELAXED);
    snprintf(g->marks_name, sizeof g->marks_name, "/pyccl-ar-%d-%u", (int)getpid(), k);
    g->marks = map_marks(g->marks_name, 1);
    if (g->marks == NULL) {
        g->marks_name[0] = '\0';
        return;
    }
    memset(g->marks, 0, sizeof *g->marks);
    g->marks->magic = MARKS_MAGIC;
    snprintf(name, len, "%s", g->marks_name);
}

cudaError_t
ar_region_alloc(const pyccl_api *a, ar_region *g, size_t total, cudaIpcMemHandle_t *handle,
                char *marks, size_t len)
{
    cudaError_t e = a->cudaMalloc((void **)&g->base, total);
    if (e == cudaSuccess) {
        /* all of it, the LL lines too: cudaMalloc often returns a destroyed
         * communicator's region, whose flags a new epoch 1 would accept */
        e = a->cudaMemset(g->base, 0, total);
    }
    if (e == cudaSuccess) {
        e = a->cudaIpcGetMemHandle(handle, g->base);
    }
    if (e != cudaSuccess) {
        if (g->base != NULL) {
            a->cudaFree(g->base);
            g->base = NULL;
        }
        return e;
    }
    marks_create(g, marks, len);
    return cudaSuccess;
}

void
ar_region_peer(ar_region *g, int p, const char *name, int32_t pid)
{
    g->pids[p] = pid;
    snprintf(g->peer_names[p], sizeof g->peer_names[p], "%.*s", PYCCL_AR_MARKS_NAME - 1, name);
    g->peer_marks[p] = NULL;
    if (name[0] == '/') {
        ar_marks *m = map_marks(g->peer_names[p], 0);
        if (m != NULL && m->magic != MARKS_MAGIC) {
            munmap(m, sizeof *m);
            m = NULL;
        }
        g->peer_marks[p] = m;
    }
}

int
ar_region_map(const pyccl_api *a, ar_region *g, int p, const char *busid,
              cudaIpcMemHandle_t handle, char *why, size_t len)
{
    if (p == g->rank) {
        g->peer[p] = g->base;
        return 1;
    }
    int pd = -1, can = 1;
    /* a peer on this very GPU (PYCCL_AR_SHARED_GPU) needs no peer access */
    if (a->cudaDeviceGetByPCIBusId && a->cudaDeviceCanAccessPeer &&
        a->cudaDeviceGetByPCIBusId(&pd, busid) == cudaSuccess && pd != g->device) {
        if (a->cudaDeviceCanAccessPeer(&can, g->device, pd) != cudaSuccess) {
            can = 0;
        }
    }
    a->cudaGetLastError(); /* a peer GPU this process does not see is fine */
    if (!can) {
        snprintf(why, len, "cuda:%d has no peer access to cuda:%d (rank %d)", g->device, pd, p);
        return 0;
    }
    void *ptr = NULL;
    cudaError_t e = a->cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        snprintf(why, len, "mapping rank %d's memory failed: %s", p, a->cudaGetErrorString(e));
        a->cudaGetLastError();
        return 0;
    }
    g->peer[p] = ptr;
    return 1;
}

/* This rank closed its mapping of p's region (or never had one): tell p. */
static void
marks_closed(ar_region *g, int p)
{
    ar_marks *m = g->peer_marks[p];
    g->peer_marks[p] = NULL;
    if (m != NULL) {
        /* release: the mapping was closed before this store */
        __atomic_store_n(&m->closed[g->rank], 1, __ATOMIC_RELEASE);
        munmap(m, sizeof *m);
    }
}

void
ar_region_close_peers(const pyccl_api *a, ar_region *g)
{
    for (int r = 0; r < PYCCL_AR_MAX_RANKS; r++) {
        if (r != g->rank && g->peer[r] != NULL && a->cudaIpcCloseMemHandle) {
            a->cudaIpcCloseMemHandle(g->peer[r]);
        }
        if (r != g->rank) {
            marks_closed(g, r);
        }
        g->peer[r] = NULL;
    }
}

void
ar_region_unlink(ar_region *g)
{
    if (g->marks_name[0] != '\0') {
        shm_unlink(g->marks_name);
        g->marks_name[0] = '\0';
    }
}

/* This rank's page goes (its region freed, or parked with it). */
static void
marks_drop(ar_region *g)
{
    if (g->marks != NULL) {
        munmap(g->marks, sizeof *g->marks);
        g->marks = NULL;
    }
    ar_region_unlink(g);
}

/* g's region, which peers may still map, is freed once every peer marked
 * it closed or is gone: 1 parked (the page of marks with it), 0 kept (no
 * page of marks). */
static int
park(ar_region *g)
{
    if (g->base == NULL || g->marks == NULL) {
        return 0; /* no handshake: the region is kept */
    }
    parked *k = calloc(1, sizeof *k);
    if (k == NULL) {
        return 0;
    }
    k->base = g->base;
    k->device = g->device;
    k->rank = g->rank;
    k->nranks = g->nranks;
    k->marks = g->marks;
    /* the name is no use once the set-up is over (a peer that has not
     * opened the page by now never will) */
    ar_region_unlink(g);
    k->name[0] = '\0';
    memcpy(k->peer_names, g->peer_names, sizeof k->peer_names);
    memcpy(k->pids, g->pids, sizeof k->pids);
    g->marks = NULL;
    pyccl_lock(&parked_mu, PYCCL_LOCK_REGIONS);
    k->next = parked_head;
    parked_head = k;
    pyccl_unlock(&parked_mu);
    return 1;
}

void
ar_region_let_go(const pyccl_api *a, ar_region *g, int safe)
{
    if (g->base == NULL) {
        return;
    }
    if (safe) {
        a->cudaFree(g->base);
    }
    else {
        park(g);
    }
    g->base = NULL;
    marks_drop(g); /* parked: the marks went with the region */
}

/* Whether every peer of k closed its mapping or is gone. */
static int
released(parked *k)
{
    for (int p = 0; p < k->nranks; p++) {
        if (p == k->rank) {
            continue;
        }
        /* acquire: pairs with the peer's release after it closed */
        if (!__atomic_load_n(&k->marks->closed[p], __ATOMIC_ACQUIRE) && !pid_gone(k->pids[p])) {
            return 0;
        }
    }
    return 1;
}

/* Free the parked regions no peer maps any more; how many. */
int
ar_drain(const pyccl_api *a)
{
    int freed = 0;
    pyccl_lock(&parked_mu, PYCCL_LOCK_REGIONS);
    for (parked **pp = &parked_head; *pp != NULL;) {
        parked *k = *pp;
        if (!released(k)) {
            pp = &k->next;
            continue;
        }
        *pp = k->next;
        int prev;
        if (pyccl_device_enter(a, k->device, &prev) == cudaSuccess) {
            a->cudaFree(k->base);
            freed++;
        }
        pyccl_device_leave(a, k->device, prev);
        a->cudaGetLastError();
        munmap(k->marks, sizeof *k->marks);
        if (k->name[0] != '\0') {
            shm_unlink(k->name);
        }
        free(k);
    }
    pyccl_unlock(&parked_mu);
    return freed;
}

int
pyccl_ar_parked(void)
{
    int n = 0;
    pyccl_lock(&parked_mu, PYCCL_LOCK_REGIONS);
    for (parked *k = parked_head; k != NULL; k = k->next) {
        n++;
    }
    pyccl_unlock(&parked_mu);
    return n;
}
