/*
 * sim_state.c -- configuration, the cross-process shared file, the handle
 * registry, devices and error strings, cuInit.
 *
 * The shared file (SIMCUDA_SHM, default /dev/shm/simcuda-<uid>) holds, per
 * simulated device, the kernel execution lock and the memory accounting. The
 * first process to use it creates and initialises it under flock(2); the
 * device count and capacity are fixed then (from that process's
 * SIMCUDA_DEVICES / SIMCUDA_MEM_BYTES) and every later process reads them
 * from the file, as it would read them from the hardware.
 *
 * Execution lock: a robust, process-shared mutex guards a FIFO of waiting
 * worker threads (pid, tid) and the current owner. The mutex is held only
 * for bookkeeping, never while a kernel runs, so a process SIGKILLed at any
 * moment cannot wedge it (EOWNERDEAD -> pthread_mutex_consistent). A waiter
 * that times out (20 ms) drops dead owners and dead waiters, so a process
 * killed while running a kernel delays the others by at most that much; so
 * are stopped ones (SIGSTOP), until they run again.
 * Handoff is FIFO: a releasing thread that wants the device again queues
 * behind those already waiting.
 */
#include "sim_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct sim_config sim_cfg = {.trace_fd = -1};

/* ------------------------------------------------------------------ shared file layout */

#define SIM_SHM_MAGIC 0x31414455434d4953ULL /* "SIMCUDA1" */
#define SIM_MAX_WAITERS 512
#define SIM_MAX_PIDS 512

struct sim_waiter {
    int32_t pid, tid;
};

struct sim_pidmem {
    int32_t pid;
    int32_t pad;
    uint64_t bytes;
};

struct sim_shdev {
    pthread_mutex_t lock; /* robust, shared: owner + waiter queue */
    pthread_cond_t cv;
    int32_t owner_pid, owner_tid;
    uint32_t nwait;
    uint32_t pad;
    uint64_t kernels;
    struct sim_waiter wait[SIM_MAX_WAITERS];
    pthread_mutex_t mlock; /* robust, shared: memory table */
    struct sim_pidmem mem[SIM_MAX_PIDS];
};

struct sim_shared {
    uint64_t magic;
    uint64_t size;
    int32_t ndev;
    int32_t pad;
    uint64_t mem_bytes;
    struct sim_shdev dev[SIM_MAX_DEVICES];
};

static struct sim_shared *sh;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static atomic_int initialized;
static atomic_int forked_after_init; /* a fork child of an initialised process */

/* ------------------------------------------------------------------ small helpers */

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

pid_t sim_gettid(void)
{
    static __thread pid_t tid;
    if (!tid) tid = (pid_t)syscall(SYS_gettid);
    return tid;
}

void sim_sleep_until(uint64_t t_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ull), .tv_nsec = (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || end == v) return dflt;
    return x;
}

/* The state letter of /proc/<pid>/stat ('R', 'S', 'T', 'Z', ...); 0 if the process is gone, '?' if unknown. */
static char pid_state(pid_t pid)
{
    if (pid <= 0) return 0;
    if (kill(pid, 0) == -1 && errno == ESRCH) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : '?';
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return '?';
    buf[n] = 0;
    char *rp = strrchr(buf, ')');
    return rp && rp[1] == ' ' && rp[2] ? rp[2] : '?';
}

/* Dead, or a zombie nobody has reaped yet (its kernels are not running). */
static int pid_alive(pid_t pid)
{
    char st = pid_state(pid);
    return st != 0 && st != 'Z' && st != 'X';
}

/* May hold or wait for the execution lock: alive and not stopped. A GPU runs a stopped (SIGSTOP) process's
 * queued kernels on its own and ends them, but here its stopped worker would hold the lock, or get it next and
 * never take it, forever; so the others treat it as gone until it runs again (then it queues anew). */
static int pid_may_hold(pid_t pid)
{
    char st = pid_state(pid);
    return st != 0 && st != 'Z' && st != 'X' && st != 'T' && st != 't';
}

static void robust_lock(pthread_mutex_t *m)
{
    int r = pthread_mutex_lock(m);
    if (r == EOWNERDEAD) pthread_mutex_consistent(m);
}

/* ------------------------------------------------------------------ init */

static int init_shared_locks(struct sim_shared *s)
{
    pthread_mutexattr_t ma;
    pthread_condattr_t ca;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        if (pthread_mutex_init(&s->dev[d].lock, &ma) || pthread_mutex_init(&s->dev[d].mlock, &ma) ||
            pthread_cond_init(&s->dev[d].cv, &ca))
            return -1;
    }
    pthread_mutexattr_destroy(&ma);
    pthread_condattr_destroy(&ca);
    return 0;
}

static CUresult open_shared(void)
{
    char dflt[64];
    const char *path = getenv("SIMCUDA_SHM");
    if (!path || !*path) {
        snprintf(dflt, sizeof dflt, "/dev/shm/simcuda-%u", (unsigned)getuid());
        path = dflt;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        fprintf(stderr, "simcuda: cannot open %s: %s\n", path, strerror(errno));
        return CUDA_ERROR_SYSTEM_NOT_READY;
    }
    if (flock(fd, LOCK_EX) != 0) {
        close(fd);
        return CUDA_ERROR_SYSTEM_NOT_READY;
    }
    CUresult rc = CUDA_SUCCESS;
    struct stat st;
    size_t size = sizeof(struct sim_shared);
    int fresh = fstat(fd, &st) != 0 || (size_t)st.st_size != size;
    if (fresh && (ftruncate(fd, 0) != 0 || ftruncate(fd, (off_t)size) != 0)) {
        rc = CUDA_ERROR_SYSTEM_NOT_READY;
        goto out;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        rc = CUDA_ERROR_SYSTEM_NOT_READY;
        goto out;
    }
    struct sim_shared *s = p;
    if (fresh || s->magic != SIM_SHM_MAGIC || s->size != size) {
        memset(s, 0, size);
        uint64_t ndev = env_u64("SIMCUDA_DEVICES", 1);
        s->ndev = (int32_t)(ndev > SIM_MAX_DEVICES ? SIM_MAX_DEVICES : ndev);
        s->mem_bytes = env_u64("SIMCUDA_MEM_BYTES", 16ull << 30);
        if (init_shared_locks(s) != 0) {
            munmap(p, size);
            rc = CUDA_ERROR_SYSTEM_NOT_READY;
            goto out;
        }
        s->size = size;
        __atomic_store_n(&s->magic, SIM_SHM_MAGIC, __ATOMIC_RELEASE);
    }
    sh = s;
out:
    flock(fd, LOCK_UN);
    close(fd);
    if (rc != CUDA_SUCCESS) fprintf(stderr, "simcuda: cannot set up %s: %s\n", path, strerror(errno));
    return rc;
}

int sim_driver_version(void)
{
    static atomic_int v;
    int x = atomic_load(&v);
    if (!x) {
        x = (int)env_u64("SIMCUDA_DRIVER_VERSION", 13000);
        atomic_store(&v, x);
    }
    return x;
}

/* The child has none of the parent's worker threads: like the real driver,
 * CUDA is unusable there (every call fails as not initialised). */
static void atfork_child(void)
{
    if (atomic_load(&initialized)) {
        atomic_store(&initialized, 0);
        atomic_store(&forked_after_init, 1);
    }
}

static void do_init(void)
{
    sim_cfg.driver_version = sim_driver_version();
    sim_cfg.kernel_ns = env_u64("SIMCUDA_KERNEL_US", 100) * 1000ull;
    const char *gbps = getenv("SIMCUDA_MIGRATE_GBPS");
    sim_cfg.migrate_bytes_per_ns = gbps && *gbps ? strtod(gbps, NULL) : 16.0; /* GB/s = bytes per ns */
    if (!(sim_cfg.migrate_bytes_per_ns > 0)) sim_cfg.migrate_bytes_per_ns = 0;
    sim_cfg.concurrent_managed = (int)env_u64("SIMCUDA_CONCURRENT_MANAGED", 1) != 0;
    sim_cfg.host_prefetch_fails = (int)env_u64("SIMCUDA_HOST_PREFETCH_FAILS", 0) != 0;
    sim_cfg.no_stream_memops = (int)env_u64("SIMCUDA_NO_STREAM_MEMOPS", 0) != 0;
    sim_cfg.wait_value_ns = env_u64("SIMCUDA_WAIT_VALUE_US", 0) * 1000ull;
    sim_cfg.wait_value_gpu_ns = env_u64("SIMCUDA_WAIT_VALUE_GPU_US", 0) * 1000ull;
    sim_cfg.elapsed_ns = env_u64("SIMCUDA_ELAPSED_US", 0) * 1000ull;
    sim_cfg.untimed_event_fail_at = env_u64("SIMCUDA_UNTIMED_EVENT_FAIL_AT", 0);
    sim_cfg.record_ns = env_u64("SIMCUDA_RECORD_US", 0) * 1000ull;
    const char *trace = getenv("SIMCUDA_TRACE");
    if (trace && *trace) {
        sim_cfg.trace_fd = open(trace, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (sim_cfg.trace_fd < 0) fprintf(stderr, "simcuda: cannot open trace %s: %s\n", trace, strerror(errno));
    }
    init_result = open_shared();
    if (init_result != CUDA_SUCCESS) return;
    sim_cfg.ndev = sh->ndev;
    sim_cfg.mem_bytes = sh->mem_bytes;
    if (sim_cfg.ndev <= 0) {
        init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    pthread_atfork(NULL, NULL, atfork_child);
    atomic_store(&initialized, 1);
}

int sim_initialized(void) { return atomic_load_explicit(&initialized, memory_order_acquire); }

CUresult cuInit(unsigned int flags)
{
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (atomic_load(&forked_after_init)) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_once(&init_once, do_init);
    return init_result;
}

int simcuda_is_simulated(void) { return 1; }

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = sim_driver_version();
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ device execution lock */

/* d->lock held. Drop a dead or stopped owner and such waiters; 1 if anything changed. */
static int reap_dead(struct sim_shdev *d)
{
    int changed = 0;
    if (d->owner_pid && !pid_may_hold(d->owner_pid)) {
        d->owner_pid = d->owner_tid = 0;
        changed = 1;
    }
    uint32_t j = 0;
    for (uint32_t i = 0; i < d->nwait; i++) {
        if (pid_may_hold(d->wait[i].pid))
            d->wait[j++] = d->wait[i];
        else
            changed = 1;
    }
    d->nwait = j;
    return changed;
}

static void cv_wait_ms(struct sim_shdev *d, int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += ms * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    int r = pthread_cond_timedwait(&d->cv, &d->lock, &ts);
    if (r == EOWNERDEAD) pthread_mutex_consistent(&d->lock);
    if (r == ETIMEDOUT || r == EOWNERDEAD) {
        if (reap_dead(d)) pthread_cond_broadcast(&d->cv);
    }
}

void sim_dev_acquire(int dev)
{
    struct sim_shdev *d = &sh->dev[dev];
    int32_t pid = (int32_t)getpid(), tid = (int32_t)sim_gettid();
    robust_lock(&d->lock);
    while (d->nwait >= SIM_MAX_WAITERS) cv_wait_ms(d, 20);
    d->wait[d->nwait].pid = pid;
    d->wait[d->nwait].tid = tid;
    d->nwait++;
    for (;;) {
        if (d->owner_pid == 0 && d->nwait > 0 && d->wait[0].pid == pid && d->wait[0].tid == tid) break;
        cv_wait_ms(d, 20);
        /* Someone may have reaped us by mistake (pid reuse cannot make us dead, but be safe). */
        int queued = 0;
        for (uint32_t i = 0; i < d->nwait; i++)
            if (d->wait[i].pid == pid && d->wait[i].tid == tid) queued = 1;
        if (!queued && d->nwait < SIM_MAX_WAITERS) {
            d->wait[d->nwait].pid = pid;
            d->wait[d->nwait].tid = tid;
            d->nwait++;
        }
    }
    memmove(&d->wait[0], &d->wait[1], (d->nwait - 1) * sizeof d->wait[0]);
    d->nwait--;
    d->owner_pid = pid;
    d->owner_tid = tid;
    pthread_mutex_unlock(&d->lock);
}

void sim_dev_release(int dev)
{
    sim_dev_release_counted(dev, 1);
}

void sim_dev_release_counted(int dev, int kernel)
{
    struct sim_shdev *d = &sh->dev[dev];
    robust_lock(&d->lock);
    if (d->owner_pid == (int32_t)getpid() && d->owner_tid == (int32_t)sim_gettid()) {
        d->owner_pid = d->owner_tid = 0;
        if (kernel) d->kernels++;
    }
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->lock);
}

/* ------------------------------------------------------------------ memory accounting */

/* d->mlock held: bytes used by live processes; dead entries are dropped. */
static uint64_t mem_used_locked(struct sim_shdev *d, int *mine, int *free_slot)
{
    int32_t me = (int32_t)getpid();
    uint64_t used = 0;
    if (mine) *mine = -1;
    if (free_slot) *free_slot = -1;
    for (int i = 0; i < SIM_MAX_PIDS; i++) {
        struct sim_pidmem *e = &d->mem[i];
        if (e->pid && e->pid != me && !pid_alive(e->pid)) e->pid = 0, e->bytes = 0;
        if (!e->pid) {
            if (free_slot && *free_slot < 0) *free_slot = i;
            continue;
        }
        if (e->pid == me && mine) *mine = i;
        used += e->bytes;
    }
    return used;
}

CUresult sim_mem_charge(int dev, uint64_t bytes)
{
    struct sim_shdev *d = &sh->dev[dev];
    CUresult rc = CUDA_SUCCESS;
    robust_lock(&d->mlock);
    int mine, free_slot;
    uint64_t used = mem_used_locked(d, &mine, &free_slot);
    if (bytes > sim_cfg.mem_bytes || used + bytes > sim_cfg.mem_bytes) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (mine >= 0) {
        d->mem[mine].bytes += bytes;
    } else if (free_slot >= 0) {
        d->mem[free_slot].pid = (int32_t)getpid();
        d->mem[free_slot].bytes = bytes;
    } else {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&d->mlock);
    return rc;
}

void sim_mem_charge_managed(int dev, uint64_t bytes)
{
    struct sim_shdev *d = &sh->dev[dev];
    robust_lock(&d->mlock);
    int mine, free_slot;
    mem_used_locked(d, &mine, &free_slot);
    if (mine >= 0) {
        d->mem[mine].bytes += bytes;
    } else if (free_slot >= 0) {
        d->mem[free_slot].pid = (int32_t)getpid();
        d->mem[free_slot].bytes = bytes;
    }
    pthread_mutex_unlock(&d->mlock);
}

void sim_mem_uncharge(int dev, uint64_t bytes)
{
    struct sim_shdev *d = &sh->dev[dev];
    int32_t me = (int32_t)getpid();
    robust_lock(&d->mlock);
    for (int i = 0; i < SIM_MAX_PIDS; i++) {
        if (d->mem[i].pid != me) continue;
        d->mem[i].bytes = d->mem[i].bytes > bytes ? d->mem[i].bytes - bytes : 0;
        if (!d->mem[i].bytes) d->mem[i].pid = 0;
        break;
    }
    pthread_mutex_unlock(&d->mlock);
}

void sim_mem_info(int dev, uint64_t *free_bytes, uint64_t *total_bytes)
{
    struct sim_shdev *d = &sh->dev[dev];
    robust_lock(&d->mlock);
    uint64_t used = mem_used_locked(d, NULL, NULL);
    pthread_mutex_unlock(&d->mlock);
    *total_bytes = sim_cfg.mem_bytes;
    *free_bytes = used >= sim_cfg.mem_bytes ? 0 : sim_cfg.mem_bytes - used;
}

/* ------------------------------------------------------------------ trace */

void sim_trace_kernel(int dev, uint64_t t0, uint64_t t1, const char *name)
{
    if (sim_cfg.trace_fd < 0) return;
    char line[SIM_NAME_LEN + 96];
    int n = snprintf(line, sizeof line, "%d %d %llu %llu %s\n", (int)getpid(), dev, (unsigned long long)t0,
                     (unsigned long long)t1, name);
    if (n > (int)sizeof line - 1) n = (int)sizeof line - 1;
    ssize_t w = write(sim_cfg.trace_fd, line, (size_t)n);
    (void)w;
}

/* ------------------------------------------------------------------ handle registry */

#define HBITS 12
struct hnode {
    const void *p;
    int type;
    struct hnode *next;
};
static struct hnode *hbuckets[1 << HBITS];
static pthread_mutex_t hlock = PTHREAD_MUTEX_INITIALIZER;

static unsigned hhash(const void *p)
{
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull;
    return (unsigned)(x >> (64 - HBITS));
}

void sim_handle_add(const void *p, int type)
{
    struct hnode *n = malloc(sizeof *n);
    if (!n) abort();
    n->p = p;
    n->type = type;
    unsigned h = hhash(p);
    pthread_mutex_lock(&hlock);
    n->next = hbuckets[h];
    hbuckets[h] = n;
    pthread_mutex_unlock(&hlock);
}

void sim_handle_del(const void *p)
{
    unsigned h = hhash(p);
    pthread_mutex_lock(&hlock);
    for (struct hnode **pp = &hbuckets[h]; *pp; pp = &(*pp)->next) {
        if ((*pp)->p == p) {
            struct hnode *n = *pp;
            *pp = n->next;
            free(n);
            break;
        }
    }
    pthread_mutex_unlock(&hlock);
}

int sim_handle_is(const void *p, int type)
{
    if (!p) return 0;
    unsigned h = hhash(p);
    int found = 0;
    pthread_mutex_lock(&hlock);
    for (struct hnode *n = hbuckets[h]; n; n = n->next)
        if (n->p == p) {
            found = n->type == type;
            break;
        }
    pthread_mutex_unlock(&hlock);
    return found;
}

/* ------------------------------------------------------------------ errors */

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {5, "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled while using external profiling tool"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"},
    {205, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {206, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {300, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {301, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "primary context active"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would result in a merge of separate capture sequences"},
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream as it began"},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capturing stream has unjoined work"},
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
     "dependency created on uncaptured work in another stream"},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *pStr = errors[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *pStr = errors[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ devices */

CUresult sim_check_device(CUdevice dev)
{
    if (!sim_initialized()) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= sim_cfg.ndev) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    SIM_CHECK_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= sim_cfg.ndev) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
    SIM_CHECK_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = sim_cfg.ndev;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "SimCUDA H100 (simulated device %d)", dev);
    return CUDA_SUCCESS;
}

static void make_uuid(CUuuid *uuid, CUdevice dev)
{
    /* Fixed per device index: "simcuda" bytes, then the index, version-4 style bits. */
    static const unsigned char base[16] = {0x51, 0x6d, 0x43, 0x75, 0x64, 0x61, 0x4a, 0x00,
                                           0x80, 0x00, 0x73, 0x69, 0x6d, 0x67, 0x70, 0x00};
    memcpy(uuid->bytes, base, 16);
    uuid->bytes[7] = (char)(0x40 | (dev >> 8 & 0x0f));
    uuid->bytes[15] = (char)(dev & 0xff);
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    make_uuid(uuid, dev);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    make_uuid(uuid, dev);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = (size_t)sim_cfg.mem_bytes;
    return CUDA_SUCCESS;
}

CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    *major = 9;
    *minor = 0;
    return CUDA_SUCCESS;
}

/* An H100 SXM, roughly; anything not listed is 0. */
static int attribute_value(int attr, CUdevice dev)
{
    switch (attr) {
    case 1: return 1024;        /* MAX_THREADS_PER_BLOCK */
    case 2: return 1024;        /* MAX_BLOCK_DIM_X */
    case 3: return 1024;        /* MAX_BLOCK_DIM_Y */
    case 4: return 64;          /* MAX_BLOCK_DIM_Z */
    case 5: return 2147483647;  /* MAX_GRID_DIM_X */
    case 6: return 65535;       /* MAX_GRID_DIM_Y */
    case 7: return 65535;       /* MAX_GRID_DIM_Z */
    case 8: return 49152;       /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: return 65536;       /* TOTAL_CONSTANT_MEMORY */
    case 10: return 32;         /* WARP_SIZE */
    case 11: return 2147483647; /* MAX_PITCH */
    case 12: return 65536;      /* MAX_REGISTERS_PER_BLOCK */
    case 13: return 1980000;    /* CLOCK_RATE kHz */
    case 14: return 512;        /* TEXTURE_ALIGNMENT */
    case 15: return 1;          /* GPU_OVERLAP */
    case 16: return 132;        /* MULTIPROCESSOR_COUNT */
    case 19: return 1;          /* CAN_MAP_HOST_MEMORY */
    case 30: return 512;        /* SURFACE_ALIGNMENT */
    case 31: return 1;          /* CONCURRENT_KERNELS */
    case 32: return 1;          /* ECC_ENABLED */
    case 33: return 0x18 + dev; /* PCI_BUS_ID */
    case 34: return 0;          /* PCI_DEVICE_ID */
    case 36: return 2619000;    /* MEMORY_CLOCK_RATE kHz */
    case 37: return 5120;       /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: return 52428800;   /* L2_CACHE_SIZE */
    case 39: return 2048;       /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: return 3;          /* ASYNC_ENGINE_COUNT */
    case 41: return 1;          /* UNIFIED_ADDRESSING */
    case 51: return 32;         /* TEXTURE_PITCH_ALIGNMENT */
    case 75: return 9;          /* COMPUTE_CAPABILITY_MAJOR */
    case 76: return 0;          /* COMPUTE_CAPABILITY_MINOR */
    case 78: return 1;          /* STREAM_PRIORITIES_SUPPORTED */
    case 79: return 1;          /* GLOBAL_L1_CACHE_SUPPORTED */
    case 80: return 1;          /* LOCAL_L1_CACHE_SUPPORTED */
    case 81: return 233472;     /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: return 65536;      /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: return 1;          /* MANAGED_MEMORY */
    case 85: return dev;        /* MULTI_GPU_BOARD_GROUP_ID */
    case 87: return 2;          /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    case 89: return sim_cfg.concurrent_managed; /* CONCURRENT_MANAGED_ACCESS (SIMCUDA_CONCURRENT_MANAGED) */
    case 90: return 1;          /* COMPUTE_PREEMPTION_SUPPORTED */
    case 95: return 1;          /* COOPERATIVE_LAUNCH */
    case 97: return 232448;     /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 99: return 1;          /* HOST_REGISTER_SUPPORTED */
    case 102: return 1;         /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: return 1;         /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 106: return 32;        /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 108: return 31457280;  /* MAX_PERSISTING_L2_CACHE_SIZE */
    case 109: return 134213632; /* MAX_ACCESS_POLICY_WINDOW_SIZE */
    case 111: return 1024;      /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    case 112: return 1;         /* SPARSE_CUDA_ARRAY_SUPPORTED */
    case 114: return 1;         /* TIMELINE_SEMAPHORE_INTEROP_SUPPORTED */
    case 115: return 1;         /* MEMORY_POOLS_SUPPORTED */
    case 119: return 1;         /* MEMPOOL_SUPPORTED_HANDLE_TYPES (posix fd) */
    case 120: return 1;         /* CLUSTER_LAUNCH */
    case 121: return 1;         /* DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED */
    case 126: return 4;         /* MEM_SYNC_DOMAIN_COUNT */
    case 127: return 1;         /* TENSOR_MAP_ACCESS_SUPPORTED */
    case 129: return 1;         /* UNIFIED_FUNCTION_POINTERS */
    case 134: return -1;        /* HOST_NUMA_ID */
    default: return 0;
    }
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!pi || attrib < 1 || attrib > 160) return CUDA_ERROR_INVALID_VALUE;
    *pi = attribute_value(attrib, dev);
    return CUDA_SUCCESS;
}

void sim_spend_host(uint64_t ns)
{
    if (!ns) return;
    struct timespec d = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    nanosleep(&d, NULL);
}
