/*
 * libgemhook.c -- the library's entry: constructor, destructor, and the
 * at-fork registry.
 *
 * The constructor only reads environment variables. It makes no CUDA call,
 * opens no connection and starts no thread, so a process that never touches
 * CUDA (a shell, Python starting up) is not affected by the preload. All
 * real work starts lazily, on the first intercepted CUDA call.
 *
 * The hook's files form layers; each includes only headers of its own layer
 * or below (tests/test_hook_layers.py checks it):
 *
 *   0  cuda_types.h, gemini_proto.h, hook_table.h, hook_exports.h
 *                  declarations only: the ABI, the wire format, the table
 *   1  util        macros, clocks, pure functions (exported for tests)
 *      board       the board page's protocol (exported for the daemons)
 *      settings    settings from the environment, logging
 *      stats       counters
 *      kcost       what each kernel costs the GPU (markers beside a latency group follow it)
 *      real        the driver's real functions, resolved from the table
 *      thread      the hook's background threads: detached, named, deaf to signals
 *   2  client      the connection to a pod manager
 *   3  device      the device registry, endpoints, fail-open
 *      gpugate     a batch process's streams held on the GPU during a latency group's claim
 *      flare       latency groups' flare pages: raised by their hooks, honoured by batch mirrors
 *   4  capture     open stream captures
 *      inflight    marker events that keep the queued work short
 *      gate        the token: bursts, drain, expiry, the watcher
 *      memory      allocation accounting and limits; who owns each allocation
 *      vmm         physical allocations: counted until unmapped and released
 *      context     context teardown gives the context's memory back
 *      rejoin      held memory re-announced to a restarted pod manager at once
 *      residency   unified groups: managed allocations moved to the GPU / the host
 *      nvml        NVML's memory numbers inside a group
 *   5  wrappers    the generated launch, sync and capture wrappers
 *   6  symbols     dlsym and cuGetProcAddress hand out the wrappers
 *   7  libgemhook  this file
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "capture.h"
#include "device.h"
#include "gate.h"
#include "flare.h"
#include "gpugate.h"
#include "inflight.h"
#include "kcost.h"
#include "memory.h"
#include "nvml.h"
#include "real.h"
#include "rejoin.h"
#include "residency.h"
#include "settings.h"
#include "stats.h"
#include "vmm.h"

/* ---- fork ----------------------------------------------------------------------------------------
 * A fork child inherits the parent's memory but not its threads: a lock another thread held stays
 * locked, a connection is shared with the parent, a token or an allocation is the parent's. Each
 * module that keeps such state resets its own, here in layer order (lowest first), so a module's
 * reset may rely on the layers below it being reset already. A module with new state adds its reset
 * to this list. */
static void (*const after_fork_child[])(void) = {
    gem_stats_after_fork,       /* the child's counters start at zero */
    gem_real_after_fork,        /* its locks free */
    gem_device_after_fork,      /* no connection of the parent's, fail-open forgotten */
    gem_flare_after_fork,       /* the mirror's pages looked for again */
    gem_gpugate_after_fork,     /* no mirror thread, no registered word */
    gem_capture_after_fork,     /* no capture open */
    gem_inflight_after_fork,    /* no marker events of the parent's */
    gem_kcost_after_fork,       /* no kernel costs of the parent's functions */
    gem_gate_after_fork,        /* no token, no watcher */
    gem_memory_after_fork,      /* no allocations */
    gem_vmm_after_fork,         /* no physical allocations or mappings */
    gem_rejoin_after_fork,      /* no rejoin thread (the first allocation starts one) */
    gem_residency_after_fork,   /* no managed allocations recorded */
    gem_nvml_after_fork,        /* no NVML connection of the parent's */
};

static void on_fork_child(void) {
    for (size_t i = 0; i < sizeof after_fork_child / sizeof after_fork_child[0]; i++)
        after_fork_child[i]();
}

/* ---- lifecycle ----------------------------------------------------------------------------------- */

__attribute__((constructor)) static void gemhook_constructor(void) {
    gem_settings_load();
    gem_gate_measure_clock();
    pthread_atfork(NULL, NULL, on_fork_child);
}

__attribute__((destructor)) static void gemhook_destructor(void) {
    gem_gate_shutdown();
    gem_rejoin_shutdown();
    /* Only a CUDA program reports; a shell or a Python that never used CUDA stays silent. */
    if (atomic_load(&gem_real_ready) || gem_total_launches() > 0)
        gem_stats_report();
}
