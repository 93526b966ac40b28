/*
 * A tiny GPU program for the GPU checkpoint tests, written against the CUDA driver API.
 *
 * It loads a libcuda (the stand-in from fakecuda.c, or NVIDIA's real one) with dlopen, so its
 * /proc/PID/maps shows libcuda, allocates some device memory, fills it with a pattern and
 * then answers commands on stdin, one a line:
 *
 *   check   copy the device memory back and verify it:    "ok <counter>" | "bad" | "err <code>"
 *   inc     add one to the counter kept in device memory:  "ok <counter>" | "err <code>"
 *   quit    exit
 *
 * Usage: gpuprog LIBCUDA_PATH [MEBIBYTES]. It prints "ready <pid>" once set up, or
 * "err <code> <call>" and exits 1.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*p_cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuCtxSynchronize)(void);

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        printf("err -1 dlsym:%s\n", name);
        fflush(stdout);
        exit(1);
    }
    return p;
}

#define CHECK(call, name)                                                                     \
    do {                                                                                      \
        CUresult rc_ = (call);                                                                \
        if (rc_ != 0) {                                                                       \
            printf("err %d %s\n", rc_, name);                                                 \
            fflush(stdout);                                                                   \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s LIBCUDA_PATH [MEBIBYTES]\n", argv[0]);
        return 2;
    }
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 16;
    size_t size = mib * 1024 * 1024;
    if (size < 4096)
        size = 4096;

    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        printf("err -1 dlopen:%s\n", dlerror());
        return 1;
    }
    *(void **)&p_cuInit = sym(lib, "cuInit");
    *(void **)&p_cuDeviceGet = sym(lib, "cuDeviceGet");
    *(void **)&p_cuDevicePrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&p_cuCtxSetCurrent = sym(lib, "cuCtxSetCurrent");
    *(void **)&p_cuMemAlloc = sym(lib, "cuMemAlloc_v2");
    *(void **)&p_cuMemcpyHtoD = sym(lib, "cuMemcpyHtoD_v2");
    *(void **)&p_cuMemcpyDtoH = sym(lib, "cuMemcpyDtoH_v2");
    *(void **)&p_cuCtxSynchronize = sym(lib, "cuCtxSynchronize");

    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr dptr;
    CHECK(p_cuInit(0), "cuInit");
    CHECK(p_cuDeviceGet(&dev, 0), "cuDeviceGet");
    CHECK(p_cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    CHECK(p_cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    CHECK(p_cuMemAlloc(&dptr, size), "cuMemAlloc_v2");

    /* Word 0 is the counter; the rest is a pattern derived from the index. */
    size_t words = size / sizeof(unsigned int);
    unsigned int *host = malloc(size);
    if (!host)
        return 1;
    for (size_t i = 0; i < words; i++)
        host[i] = (unsigned int)(i * 2654435761u);
    host[0] = 0;
    CHECK(p_cuMemcpyHtoD(dptr, host, size), "cuMemcpyHtoD_v2");
    CHECK(p_cuCtxSynchronize(), "cuCtxSynchronize");

    printf("ready %d\n", (int)getpid());
    fflush(stdout);

    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\r\n")] = '\0';
        CUresult rc = 0;
        if (strcmp(line, "check") == 0) {
            memset(host, 0, size);
            rc = p_cuMemcpyDtoH(host, dptr, size);
            if (rc == 0) {
                int good = 1;
                for (size_t i = 1; i < words; i++) {
                    if (host[i] != (unsigned int)(i * 2654435761u)) {
                        good = 0;
                        break;
                    }
                }
                if (good)
                    printf("ok %u\n", host[0]);
                else
                    printf("bad\n");
            }
        } else if (strcmp(line, "inc") == 0) {
            unsigned int counter = 0;
            rc = p_cuMemcpyDtoH(&counter, dptr, sizeof counter);
            if (rc == 0) {
                counter++;
                rc = p_cuMemcpyHtoD(dptr, &counter, sizeof counter);
            }
            if (rc == 0)
                rc = p_cuCtxSynchronize();
            if (rc == 0)
                printf("ok %u\n", counter);
        } else if (strcmp(line, "quit") == 0) {
            break;
        } else {
            printf("unknown %s\n", line);
        }
        if (rc != 0)
            printf("err %d\n", rc);
        fflush(stdout);
    }
    return 0;
}
