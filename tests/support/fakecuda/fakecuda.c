/*
 * A stand-in for NVIDIA's libcuda.so.1, for tests on machines without a GPU.
 *
 * It exports the CUDA checkpoint API with the real C signatures and implements the
 * driver's state machine:
 *
 *     RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING
 *
 * Any other transition returns CUDA_ERROR_ILLEGAL_STATE (401); a pid that never initialised
 * CUDA returns CUDA_ERROR_INVALID_VALUE (1). The state of each "GPU process" lives in a file
 * under $FAKECUDA_STATE_DIR ("<pid>.state": "<state> <restore thread id> <bytes allocated>"),
 * so that the controller (the process calling cuCheckpointProcess*) and the target agree, as
 * they do with the real driver. A test emulates a process that CRIU has just restored by
 * writing state 2 (CHECKPOINTED) into that file: the driver state travels in the image.
 *
 * It also exports the handful of driver calls a small GPU program needs (cuInit, cuDeviceGet,
 * cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuMemAlloc_v2, cuMemcpyHtoD_v2, cuMemcpyDtoH_v2,
 * cuCtxSynchronize, cuMemFree_v2). "Device memory" is host memory. Like the real driver, those
 * calls block while the process is not RUNNING; unlike it, they give up after
 * $FAKECUDA_BLOCK_MS (default 2000) and return CUDA_ERROR_ILLEGAL_STATE, so that a test can
 * see a process that was left locked without hanging forever.
 *
 * Environment, read at call time:
 *   FAKECUDA_STATE_DIR     directory for per-pid state files (required; without it cuInit
 *                          answers CUDA_ERROR_NO_DEVICE, like a machine without a GPU)
 *   FAKECUDA_LOG           call log (default $FAKECUDA_STATE_DIR/calls.log); one line a call:
 *                          "<op> <target pid> <result> [details]"
 *   FAKECUDA_FAIL          comma-separated failures to inject, each "op" or "op:pid":
 *                            lock            lock fails (CUDA_ERROR_UNKNOWN), state stays RUNNING
 *                            lock_timeout    lock waits min(timeoutMs, 200) ms, then
 *                                            CUDA_ERROR_TIMEOUT; state stays RUNNING
 *                            checkpoint      checkpoint fails (CUDA_ERROR_OUT_OF_MEMORY),
 *                                            state stays LOCKED
 *                            checkpoint_fatal checkpoint fails, state becomes FAILED
 *                            restore         restore fails (CUDA_ERROR_OUT_OF_MEMORY), state
 *                                            stays CHECKPOINTED
 *                            unlock          unlock fails (CUDA_ERROR_UNKNOWN), state stays LOCKED
 *   FAKECUDA_PERSISTENCE   "1": restore works without cuInit in the caller (persistence mode)
 *   FAKECUDA_DRIVER_VERSION  what cuDriverGetVersion reports (default 12080)
 *   FAKECUDA_GPU_UUID      32 hex digits: the UUID of the one fake GPU (for restore remapping)
 *   FAKECUDA_BLOCK_MS      how long CUDA calls wait for RUNNING before giving up
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef int CUprocessState;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};

enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
};

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointCheckpointArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct CUcheckpointUnlockArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

typedef struct CUuuid_st {
    unsigned char bytes[16];
} CUuuid;

typedef struct CUcheckpointGpuPair_st {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;

/* Driver 580 layout: 64 bytes, gpuPairs at offset 0, gpuPairsCount at offset 8. */
typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    unsigned char reserved[64 - sizeof(CUcheckpointGpuPair *) - sizeof(unsigned int)];
} CUcheckpointRestoreArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "lock args ABI");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "checkpoint args ABI");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "unlock args ABI");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "restore args ABI");

struct pstate {
    int state;
    int restore_tid;
    unsigned long long mem_bytes;
};

static int g_initialized = 0;
static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;
static int g_fake_context = 0;

/* ------------------------------------------------------------------ helpers */

static const char *state_dir(void) {
    const char *dir = getenv("FAKECUDA_STATE_DIR");
    return (dir && *dir) ? dir : NULL;
}

static void log_call(const char *op, int pid, CUresult result, const char *fmt, ...) {
    const char *dir = state_dir();
    const char *path = getenv("FAKECUDA_LOG");
    char buf[4096];
    char details[512] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(details, sizeof details, fmt, ap);
        va_end(ap);
    }
    if (!path || !*path) {
        if (!dir)
            return;
        snprintf(buf, sizeof buf, "%s/calls.log", dir);
        path = buf;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    char line[1024];
    int n = snprintf(line, sizeof line, "%s %d %d%s%s\n", op, pid, result, *details ? " " : "",
                     details);
    if (n > 0) {
        ssize_t ignored = write(fd, line, (size_t)n);
        (void)ignored;
    }
    close(fd);
}

/* A process's driver state lives in the process's own memory (g_state), as the real
 * driver's does, so a CRIU image carries it and a restored process has the state it had
 * at the dump (and an original that keeps running has its own). The process keeps an
 * "anchor" file open in $FAKECUDA_STATE_DIR whose content is the address of g_state; the
 * controller finds the anchor among /proc/PID/fd and reads and writes the state through
 * /proc/PID/mem (root, or ptrace rights, as the real controller needs). */
static volatile struct pstate g_state;
static int g_anchor_fd = -1;
static int g_key = 0; /* host pid at cuInit: names the anchor and the call log entries */

/* The first NSpid field of /proc/self/status: the pid as the host sees it. */
static int host_pid(void) {
    FILE *f = fopen("/proc/self/status", "re");
    if (!f)
        return (int)getpid();
    char line[512];
    int id = (int)getpid();
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "NSpid:", 6) == 0) {
            id = atoi(line + 6);
            break;
        }
    }
    fclose(f);
    return id;
}

/* The address of process `pid`'s g_state, from its anchor; 0 if it has none. */
static unsigned long long state_address(int pid) {
    const char *dir = state_dir();
    char fd_dir[64], link[4096], target[4096];
    snprintf(fd_dir, sizeof fd_dir, "/proc/%d/fd", pid);
    DIR *d = opendir(fd_dir);
    if (!d || !dir) {
        if (d)
            closedir(d);
        return 0;
    }
    size_t dir_len = strlen(dir);
    unsigned long long address = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && address == 0) {
        snprintf(link, sizeof link, "%s/%s", fd_dir, e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0)
            continue;
        target[n] = '\0';
        if (strncmp(target, dir, dir_len) != 0 || target[dir_len] != '/' ||
            !strstr(target + dir_len, ".anchor"))
            continue;
        FILE *f = fopen(target, "re");
        if (f) {
            if (fscanf(f, "%llx", &address) != 1)
                address = 0;
            fclose(f);
        }
    }
    closedir(d);
    return address;
}

static int access_state(int pid, struct pstate *ps, int write_it) {
    unsigned long long address = state_address(pid);
    if (address == 0)
        return -1;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", pid);
    int fd = open(path, (write_it ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write_it ? pwrite(fd, ps, sizeof *ps, (off_t)address)
                         : pread(fd, ps, sizeof *ps, (off_t)address);
    close(fd);
    return n == (ssize_t)sizeof *ps ? 0 : -1;
}

/* A whole-directory lock, so read-modify-write transitions do not interleave. */
static int lock_dir(void) {
    const char *dir = state_dir();
    char path[4096];
    if (!dir)
        return -1;
    snprintf(path, sizeof path, "%s/.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    return fd;
}

static void unlock_dir(int fd) {
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
}

static int process_alive(int pid) {
    if (pid <= 0)
        return 0;
    return kill(pid, 0) == 0 || errno == EPERM;
}

/* Controller side: the state of process `pid` (a host pid), if it is a CUDA process. */
static int load_state(int pid, struct pstate *ps) {
    if (!process_alive(pid))
        return -1;
    return access_state(pid, ps, 0);
}

static int save_state(int pid, const struct pstate *ps) {
    struct pstate copy = *ps;
    return access_state(pid, &copy, 1);
}

/* For tests: set the state of `pid` as a CRIU restore would leave it (e.g. CHECKPOINTED). */
int fakecuda_set_state(int pid, int state) {
    struct pstate ps;
    if (load_state(pid, &ps) != 0)
        return -1;
    ps.state = state;
    return save_state(pid, &ps);
}

/* Is FAKECUDA_FAIL asking for `op` to fail on `pid`? */
static int should_fail(const char *op, int pid) {
    const char *spec = getenv("FAKECUDA_FAIL");
    if (!spec || !*spec)
        return 0;
    char *copy = strdup(spec);
    if (!copy)
        return 0;
    int hit = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        char *colon = strchr(tok, ':');
        int target = -1;
        if (colon) {
            *colon = '\0';
            target = atoi(colon + 1);
        }
        if (strcmp(tok, op) == 0 && (target < 0 || target == pid)) {
            hit = 1;
            break;
        }
    }
    free(copy);
    return hit;
}

static long env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    if (!v || !*v)
        return fallback;
    return strtol(v, NULL, 10);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static int all_zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

/* The state of a thread from /proc: 'T' or 't' means stopped (SIGSTOP or ptrace). */
static char thread_state(int pid, int tid) {
    char path[128], buf[512];
    snprintf(path, sizeof path, "/proc/%d/task/%d/stat", pid, tid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return '?';
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return '?';
    buf[n] = '\0';
    char *paren = strrchr(buf, ')');
    if (!paren || paren[1] != ' ')
        return '?';
    return paren[2];
}

/* The real driver does the checkpoint and restore work on the target's own "restore
 * thread" (CRIU's CUDA plugin resumes that thread before each action). The stand-in
 * cannot hang like the real one would when that thread is stopped; it waits a little and
 * answers CUDA_ERROR_NOT_READY. */
/* The restore thread of `pid` as the controller sees it (host tid): found by its name,
 * since its tid changes when CRIU restores the process in another PID namespace. */
static int find_restore_tid(int pid, int fallback) {
    char task_dir[64], path[512], comm[64];
    snprintf(task_dir, sizeof task_dir, "/proc/%d/task", pid);
    DIR *d = opendir(task_dir);
    if (!d)
        return fallback;
    struct dirent *e;
    int found = fallback;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "%s/%s/comm", task_dir, e->d_name);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        if (fgets(comm, sizeof comm, f) && strncmp(comm, "fakecuda-rst", 12) == 0)
            found = atoi(e->d_name);
        fclose(f);
    }
    closedir(d);
    return found;
}

static int restore_thread_stopped(int pid, const struct pstate *ps) {
    int tid = find_restore_tid(pid, ps->restore_tid);
    for (int i = 0; i < 50; i++) {
        char st = thread_state(pid, tid);
        if (st != 'T' && st != 't')
            return 0;
        sleep_ms(10);
    }
    return 1;
}

/* ---------------------------------------------------- the target's own side */

static void *restore_thread_main(void *arg) {
    (void)arg;
    for (;;)
        pause();
    return NULL;
}

static pid_t g_restore_tid = 0;
static pthread_mutex_t g_tid_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_tid_cond = PTHREAD_COND_INITIALIZER;

static void *restore_thread_start(void *arg) {
    pthread_mutex_lock(&g_tid_mutex);
    prctl(PR_SET_NAME, "fakecuda-rst", 0, 0, 0);
    g_restore_tid = (pid_t)syscall(SYS_gettid);
    pthread_cond_signal(&g_tid_cond);
    pthread_mutex_unlock(&g_tid_mutex);
    return restore_thread_main(arg);
}

/* Register the calling process as a CUDA process (done once, by cuInit). */
static CUresult register_self(void) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, restore_thread_start, NULL) != 0)
        return CUDA_ERROR_UNKNOWN;
    pthread_detach(thread);
    pthread_mutex_lock(&g_tid_mutex);
    while (g_restore_tid == 0)
        pthread_cond_wait(&g_tid_cond, &g_tid_mutex);
    pthread_mutex_unlock(&g_tid_mutex);

    g_state.state = CU_PROCESS_STATE_RUNNING;
    g_state.restore_tid = (int)g_restore_tid;
    g_state.mem_bytes = 0;
    g_key = host_pid();
    char anchor[4096], content[64];
    snprintf(anchor, sizeof anchor, "%s/%d.anchor", state_dir(), g_key);
    int fd = open(anchor, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return CUDA_ERROR_UNKNOWN;
    int n = snprintf(content, sizeof content, "%llx\n", (unsigned long long)(uintptr_t)&g_state);
    if (write(fd, content, (size_t)n) != n) {
        close(fd);
        return CUDA_ERROR_UNKNOWN;
    }
    g_anchor_fd = fd;
    return CUDA_SUCCESS;
}

/* CUDA calls in the target block while it is not RUNNING (the stand-in gives up). */
static CUresult wait_running(void) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    long limit = env_long("FAKECUDA_BLOCK_MS", 2000);
    long waited = 0;
    for (;;) {
        struct pstate ps;
        ps = *(struct pstate *)&g_state;
        if (ps.state == CU_PROCESS_STATE_RUNNING)
            return CUDA_SUCCESS;
        if (waited >= limit)
            return CUDA_ERROR_ILLEGAL_STATE;
        sleep_ms(5);
        waited += 5;
    }
}

static void add_mem(long long delta) {
    int lk = lock_dir();
    g_state.mem_bytes = (unsigned long long)((long long)g_state.mem_bytes + delta);
    unlock_dir(lk);
}

/* -------------------------------------------------------------- driver API */

CUresult cuInit(unsigned int flags) {
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!state_dir())
        return CUDA_ERROR_NO_DEVICE;
    pthread_mutex_lock(&g_mutex);
    CUresult rc = CUDA_SUCCESS;
    if (!g_initialized) {
        rc = register_self();
        if (rc == CUDA_SUCCESS)
            g_initialized = 1;
        log_call("init", g_key, rc, NULL);
    }
    pthread_mutex_unlock(&g_mutex);
    return rc;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = (int)env_long("FAKECUDA_DRIVER_VERSION", 12080);
    return CUDA_SUCCESS;
}

static const char *error_name(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_TIMEOUT: return "CUDA_ERROR_TIMEOUT";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
    }
}

static const char *error_string(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_OUT_OF_MEMORY: return "out of memory";
    case CUDA_ERROR_NOT_INITIALIZED: return "initialization error";
    case CUDA_ERROR_NO_DEVICE: return "no CUDA-capable device is detected";
    case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case CUDA_ERROR_ILLEGAL_STATE: return "the operation is not permitted in the present state";
    case CUDA_ERROR_NOT_READY: return "device not ready";
    case CUDA_ERROR_NOT_SUPPORTED: return "operation not supported";
    case CUDA_ERROR_TIMEOUT: return "the operation timed out";
    case CUDA_ERROR_UNKNOWN: return "unknown error";
    default: return NULL;
    }
}

CUresult cuGetErrorName(CUresult error, const char **out) {
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = error_name(error);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **out) {
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = error_string(error);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx || dev != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = wait_running();
    if (rc == CUDA_SUCCESS)
        *ctx = &g_fake_context;
    return rc;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    (void)ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) { return wait_running(); }

/* Allocations carry a header with their size, so that cuMemFree_v2 can account. */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = wait_running();
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t *block = malloc(size + 16);
    if (!block)
        return CUDA_ERROR_OUT_OF_MEMORY;
    block[0] = size;
    memset((char *)block + 16, 0, size);
    *dptr = (CUdeviceptr)(uintptr_t)((char *)block + 16);
    add_mem((long long)size);
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult rc = wait_running();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    size_t *block = (size_t *)((char *)(uintptr_t)dptr - 16);
    add_mem(-(long long)block[0]);
    free(block);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    CUresult rc = wait_running();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dst || !src)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    CUresult rc = wait_running();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dst || !src)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------- checkpoint API */

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    struct pstate ps;
    CUresult rc = CUDA_SUCCESS;
    if (!tid)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (load_state(pid, &ps) != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        *tid = find_restore_tid(pid, ps.restore_tid);
    log_call("get_restore_tid", pid, rc, NULL);
    return rc;
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    struct pstate ps;
    CUresult rc = CUDA_SUCCESS;
    if (!state)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (load_state(pid, &ps) != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        *state = ps.state;
    log_call("get_state", pid, rc, rc == CUDA_SUCCESS ? "state=%d" : NULL,
             rc == CUDA_SUCCESS ? *state : 0);
    return rc;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    unsigned int timeout = args ? args->timeoutMs : 0;
    struct pstate ps;
    CUresult rc;
    if (args && (args->reserved0 != 0 || !all_zero(args->reserved1, sizeof args->reserved1))) {
        rc = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    int lk = lock_dir();
    if (load_state(pid, &ps) != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (ps.state != CU_PROCESS_STATE_RUNNING)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else if (should_fail("lock_timeout", pid)) {
        unlock_dir(lk);
        lk = -1;
        sleep_ms(timeout < 200 ? (long)timeout : 200);
        rc = CUDA_ERROR_TIMEOUT;
    } else if (should_fail("lock", pid))
        rc = CUDA_ERROR_UNKNOWN;
    else {
        ps.state = CU_PROCESS_STATE_LOCKED;
        rc = save_state(pid, &ps) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
    }
    unlock_dir(lk);
out:
    log_call("lock", pid, rc, "timeout_ms=%u", timeout);
    return rc;
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    struct pstate ps;
    CUresult rc;
    if (args && !all_zero(args, sizeof *args)) {
        rc = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    int lk = lock_dir();
    if (load_state(pid, &ps) != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (ps.state != CU_PROCESS_STATE_LOCKED)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else if (restore_thread_stopped(pid, &ps))
        rc = CUDA_ERROR_NOT_READY;
    else if (should_fail("checkpoint_fatal", pid)) {
        ps.state = CU_PROCESS_STATE_FAILED;
        save_state(pid, &ps);
        rc = CUDA_ERROR_UNKNOWN;
    } else if (should_fail("checkpoint", pid))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else {
        ps.state = CU_PROCESS_STATE_CHECKPOINTED;
        rc = save_state(pid, &ps) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
    }
    unlock_dir(lk);
out:
    log_call("checkpoint", pid, rc, NULL);
    return rc;
}

static int parse_uuid(const char *hex, unsigned char out[16]) {
    if (!hex || strlen(hex) != 32)
        return -1;
    for (int i = 0; i < 16; i++) {
        unsigned int byte;
        if (sscanf(hex + 2 * i, "%2x", &byte) != 1)
            return -1;
        out[i] = (unsigned char)byte;
    }
    return 0;
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    struct pstate ps;
    CUresult rc;
    unsigned int pairs = args ? args->gpuPairsCount : 0;
    if (args) {
        if (!all_zero(args->reserved, sizeof args->reserved) ||
            (args->gpuPairsCount > 0) != (args->gpuPairs != NULL)) {
            rc = CUDA_ERROR_INVALID_VALUE;
            goto out;
        }
        if (args->gpuPairsCount > 0) {
            unsigned char gpu[16];
            if (parse_uuid(getenv("FAKECUDA_GPU_UUID"), gpu) != 0) {
                rc = CUDA_ERROR_NOT_SUPPORTED;
                goto out;
            }
            for (unsigned int i = 0; i < args->gpuPairsCount; i++) {
                if (memcmp(args->gpuPairs[i].newUuid.bytes, gpu, 16) != 0) {
                    rc = CUDA_ERROR_INVALID_DEVICE;
                    goto out;
                }
            }
        }
    }
    if (!g_initialized && env_long("FAKECUDA_PERSISTENCE", 0) != 1) {
        /* "CUDA process restore requires persistence mode to be enabled or cuInit to have
         * been called before execution." (CUDA driver API reference) */
        rc = CUDA_ERROR_NOT_INITIALIZED;
        goto out;
    }
    int lk = lock_dir();
    if (load_state(pid, &ps) != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (ps.state != CU_PROCESS_STATE_CHECKPOINTED)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else if (restore_thread_stopped(pid, &ps))
        rc = CUDA_ERROR_NOT_READY;
    else if (should_fail("restore", pid))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else {
        ps.state = CU_PROCESS_STATE_LOCKED;
        rc = save_state(pid, &ps) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
    }
    unlock_dir(lk);
out:
    log_call("restore", pid, rc, "gpu_pairs=%u", pairs);
    return rc;
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    struct pstate ps;
    CUresult rc;
    if (args && !all_zero(args, sizeof *args)) {
        rc = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    int lk = lock_dir();
    if (load_state(pid, &ps) != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (ps.state != CU_PROCESS_STATE_LOCKED)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else if (should_fail("unlock", pid))
        rc = CUDA_ERROR_UNKNOWN;
    else {
        ps.state = CU_PROCESS_STATE_RUNNING;
        rc = save_state(pid, &ps) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
    }
    unlock_dir(lk);
out:
    log_call("unlock", pid, rc, NULL);
    return rc;
}
