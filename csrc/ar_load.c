/* pyccl's own all-reduce kernels, loaded: the fatbin setup.py compiled from
 * csrc/kernels/allreduce.cu, embedded here, and the CUDA driver's module and
 * launch calls, found the way NCCL is (dlopen, nothing linked).  Process-wide,
 * as the driver is: the table and each device's kernels filled once, by the
 * first set-up that needs them (ar_setup.c), and read by every launch (ar.c). */
#include "ar_load.h"
#include "locks.h"

#include <dlfcn.h>
#include <stdio.h>

#ifdef PYCCL_FATBIN_PATH
/* the fatbin setup.py compiled, placed in .rodata by the assembler */
__asm__(".section .rodata\n"
        ".balign 64\n"
        "pyccl_ar_fatbin:\n"
        ".incbin \"" PYCCL_FATBIN_PATH "\"\n"
        "pyccl_ar_fatbin_end:\n"
        ".byte 0\n"
        ".previous\n");
extern const unsigned char pyccl_ar_fatbin[] __asm__("pyccl_ar_fatbin");
extern const unsigned char pyccl_ar_fatbin_end[] __asm__("pyccl_ar_fatbin_end");
#endif

int
pyccl_ar_built(void)
{
#ifdef PYCCL_FATBIN_PATH
    return 1;
#else
    return 0;
#endif
}

size_t
pyccl_ar_image(const unsigned char **image)
{
#ifdef PYCCL_FATBIN_PATH
    *image = pyccl_ar_fatbin;
    return (size_t)(pyccl_ar_fatbin_end - pyccl_ar_fatbin);
#else
    *image = NULL;
    return 0;
#endif
}

/* The driver table and the kernels loaded per device are process-wide (the
 * driver is); without kernels compiled in, both stay empty. */
ar_driver ar_drv;
ar_device ar_devs[MAX_DEVICES];

#ifdef PYCCL_FATBIN_PATH
/* Filled once, under load_mu, by the first set-up that needs
 * them, which runs without the GIL, so two set-ups on two threads may race. */
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *const type_names[K_NTYPES] = {"f32", "f16", "bf16", "i32"};
static const char *const op_names[K_NOPS] = {"sum", "max", "min"};

/* Under load_mu. */
static int
load_driver(char *why, size_t n)
{
    if (!ar_drv.tried) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (h == NULL) {
            h = dlopen("libcuda.so.1", RTLD_NOW);
        }
        if (h == NULL) {
            snprintf(ar_drv.err, sizeof ar_drv.err, "libcuda.so.1 not found: %s", dlerror());
        } else {
            *(void **)&ar_drv.cuModuleLoadData = dlsym(h, "cuModuleLoadData");
            *(void **)&ar_drv.cuModuleGetFunction = dlsym(h, "cuModuleGetFunction");
            *(void **)&ar_drv.cuLaunchKernel = dlsym(h, "cuLaunchKernel");
            *(void **)&ar_drv.cuGetErrorString = dlsym(h, "cuGetErrorString");
            *(void **)&ar_drv.cuLaunchKernelEx = dlsym(h, "cuLaunchKernelEx");
            *(void **)&ar_drv.cuDeviceGet = dlsym(h, "cuDeviceGet");
            *(void **)&ar_drv.cuDeviceGetAttribute = dlsym(h, "cuDeviceGetAttribute");
            if (!ar_drv.cuModuleLoadData || !ar_drv.cuModuleGetFunction || !ar_drv.cuLaunchKernel ||
                !ar_drv.cuGetErrorString) {
                snprintf(ar_drv.err, sizeof ar_drv.err, "libcuda.so.1 lacks the module calls");
            }
        }
        ar_drv.tried = 1; /* after every symbol: nobody sees a half-filled table */
    }
    if (ar_drv.err[0]) {
        snprintf(why, n, "%s", ar_drv.err);
        return -1;
    }
    return 0;
}
#endif

const char *
ar_cu_error(CUresult r)
{
    const char *s = NULL;
    if (ar_drv.cuGetErrorString == NULL || ar_drv.cuGetErrorString(r, &s) != 0 || s == NULL) {
        return "unknown CUDA driver error";
    }
    return s;
}

#ifdef PYCCL_FATBIN_PATH
static int load_kernels_locked(int device, char *why, size_t n);
#endif

int
ar_load_kernels(int device, char *why, size_t n)
{
#ifndef PYCCL_FATBIN_PATH
    (void)device;
    snprintf(why, n, "pyccl was built without nvcc, so its kernels are not compiled in");
    return -1;
#else
    if (device < 0 || device >= MAX_DEVICES) {
        snprintf(why, n, "device index %d is out of pyccl's range", device);
        return -1;
    }
    pyccl_lock(&load_mu, PYCCL_LOCK_KERNELS);
    int rc = load_kernels_locked(device, why, n);
    pyccl_unlock(&load_mu);
    return rc;
#endif
}

#ifdef PYCCL_FATBIN_PATH
static int
load_kernels_locked(int device, char *why, size_t n)
{
    if (ar_devs[device].state == 1) {
        return 0;
    }
    if (load_driver(why, n) < 0) {
        return -1;
    }
    CUmodule mod;
    CUresult r = ar_drv.cuModuleLoadData(&mod, pyccl_ar_fatbin);
    if (r != 0) {
        snprintf(why, n, "loading the kernels on cuda:%d failed: %s (no code for this GPU?)",
                 device, ar_cu_error(r));
        return -1;
    }
    for (int k = 0; k < K_COUNT; k++) {
        char name[64];
        if (k == K_PROBE || k == K_EMPTY || k == K_COPY) {
            snprintf(name, sizeof name, "%s",
                     k == K_PROBE ? "pyccl_ar_probe" : k == K_EMPTY ? "pyccl_ar_empty"
                                                                     : "pyccl_copy_list");
        } else if (k >= K_AG) {
            snprintf(name, sizeof name, "pyccl_ag_%d", (int[]){16, 4, 1}[k - K_AG]);
        } else if (k >= K_RS) {
            snprintf(name, sizeof name, "pyccl_rs_%s_%s", type_names[(k - K_RS) / K_NOPS],
                     op_names[(k - K_RS) % K_NOPS]);
        } else {
            snprintf(name, sizeof name, "pyccl_ar_%d_%s_%s", k / (K_NTYPES * K_NOPS),
                     type_names[(k / K_NOPS) % K_NTYPES], op_names[k % K_NOPS]);
        }
        r = ar_drv.cuModuleGetFunction(&ar_devs[device].fn[k], mod, name);
        if (r != 0) {
            snprintf(why, n, "kernel %s missing: %s", name, ar_cu_error(r));
            return -1;
        }
    }
    ar_devs[device].state = 1;
    return 0;
}
#endif

int
ar_pdl_supported(int device)
{
    int dev, major = 0;
    return ar_drv.cuLaunchKernelEx != NULL && ar_drv.cuDeviceGet != NULL &&
           ar_drv.cuDeviceGetAttribute != NULL && ar_drv.cuDeviceGet(&dev, device) == 0 &&
           ar_drv.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                    dev) == 0 &&
           major >= 9;
}
