/*
 * flare.c -- finding and mapping latency groups' flare pages (flare.h): read-write for the group's own hooks,
 * read-only for batch processes' claim mirrors.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "board.h"
#include "flare.h"
#include "settings.h"

/* A mirror follows at most this many latency groups' flares per GPU (more are left to the board's claims). */
#define FLARES_MAX 8

/* "<board path>.flare<line>" (0: it does not fit) */
static int flare_path(const char *board_path, int slot, char *out, size_t len) {
    return (size_t)snprintf(out, len, "%s.flare%d", board_path, slot) < len;
}

/* Map the flare page at `path` for line `slot` of `b`; NULL (and why in `why`) if it is not that page, or if
 * `owner` is not -1 and the file is not the board owner's alone. */
static struct gem_flare *map_flare(const char *path, const struct gem_board *b, int slot, int writable,
                                   long long owner, const char **why) {
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        *why = strerror(errno);
        return NULL;
    }
    struct stat st;
    void *p = MAP_FAILED;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != GEM_FLARE_SIZE)
        *why = "not a flare page";
    else if (owner >= 0 && ((long long)st.st_uid != owner || (st.st_mode & (S_IWGRP | S_IWOTH))))
        *why = "not the board owner's alone";
    else
        p = mmap(NULL, GEM_FLARE_SIZE, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        if (!*why)
            *why = strerror(errno);
        return NULL;
    }
    struct gem_flare *f = p;
    if (__atomic_load_n(&f->magic, __ATOMIC_ACQUIRE) != GEM_FLARE_MAGIC || f->slot != (uint32_t)slot ||
        f->generation != b->head.generation) {
        munmap(p, GEM_FLARE_SIZE);
        *why = "another board's or line's";
        return NULL;
    }
    return f;
}

/* ---- the group's own hooks ---- */

static pthread_mutex_t own_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    const struct gem_board *board;  /* looked for on this board and line */
    int slot;
    struct gem_flare *flare;        /* never unmapped: a launch may still be raising it */
} own[GEM_MAX_DEVICES];

struct gem_flare *gem_flare_of_group(struct gem_device *d, const struct gem_board *b, int slot) {
    if (!b || slot < 0 || d->ordinal < 0 || d->ordinal >= GEM_MAX_DEVICES)
        return NULL;
    pthread_mutex_lock(&own_mu);
    struct gem_flare *f = NULL;
    if (own[d->ordinal].board == b && own[d->ordinal].slot == slot) {
        f = own[d->ordinal].flare;
    } else {
        char board_path[GEM_BOARD_PATH_LEN], path[GEM_BOARD_PATH_LEN + 16];
        const char *why = NULL;
        if (gem_device_board_file(d, b, board_path, sizeof board_path) &&
            flare_path(board_path, slot, path, sizeof path))
            f = map_flare(path, b, slot, 1, -1, &why);
        if (!f)
            GEM_LOG(GEM_LOG_INFO, "GPU %d: no flare page to write (%s): batch work makes way for this process's "
                    "requests when its pod manager has read them", d->ordinal, why ? why : "no board path");
        own[d->ordinal].board = b;
        own[d->ordinal].slot = slot;
        own[d->ordinal].flare = f;
    }
    pthread_mutex_unlock(&own_mu);
    return f;
}

/* ---- a batch process's claim mirror (its thread alone) ---- */

static struct {
    const struct gem_board *board;
    uint32_t gen;
    int n;
    struct {
        const struct gem_flare *flare;
        uint32_t slot;
    } page[FLARES_MAX];
} seen[GEM_MAX_DEVICES];

static void forget(int ordinal) {
    for (int k = 0; k < seen[ordinal].n; k++)
        munmap((void *)seen[ordinal].page[k].flare, GEM_FLARE_SIZE);
    seen[ordinal].n = 0;
}

/* The flare pages of the lines that say `flare` now. */
static void rescan(int ordinal, const struct gem_board *b) {
    forget(ordinal);
    seen[ordinal].board = b;
    seen[ordinal].gen = gem_board_flare_gen(b);
    char board_path[GEM_BOARD_PATH_LEN], path[GEM_BOARD_PATH_LEN + 16];
    struct stat st;
    if (!gem_device_board_file(&gem_devices[ordinal], b, board_path, sizeof board_path) || stat(board_path, &st) != 0)
        return;
    uint32_t used = __atomic_load_n(&b->claims.used_slots, __ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < used && i < GEM_BOARD_GROUPS && seen[ordinal].n < FLARES_MAX; i++) {
        if (!gemhook_board_flare(b, i) || !flare_path(board_path, (int)i, path, sizeof path))
            continue;
        const char *why = NULL;
        const struct gem_flare *f = map_flare(path, b, (int)i, 0, (long long)st.st_uid, &why);
        if (!f) {
            GEM_LOG(GEM_LOG_WARN, "GPU %d: the flare page %s is not used (%s)", ordinal, path, why);
            continue;
        }
        seen[ordinal].page[seen[ordinal].n].flare = f;
        seen[ordinal].page[seen[ordinal].n].slot = i;
        seen[ordinal].n++;
    }
}

void gem_flare_look(int ordinal, const struct gem_board *b, int64_t now, struct gem_flare_view *v) {
    memset(v, 0, sizeof *v);
    if (ordinal < 0 || ordinal >= GEM_MAX_DEVICES)
        return;
    if (!b) {
        forget(ordinal);
        seen[ordinal].board = NULL;
        return;
    }
    if (seen[ordinal].board != b || seen[ordinal].gen != gem_board_flare_gen(b))
        rescan(ordinal, b);
    v->count = seen[ordinal].n;
    for (int k = 0; k < seen[ordinal].n; k++) {
        const struct gem_flare *f = seen[ordinal].page[k].flare;
        /* the sequence before the end: a flare raised after this read changes it, and the futex returns at once */
        uint32_t seq = gem_flare_seq(f);
        if (k == 0) {
            v->sleep_on = &f->seq;
            v->seen = seq;
        }
        if (!gemhook_board_flare(b, seen[ordinal].page[k].slot))
            continue;
        int64_t until = gem_flare_holds(f, now);
        if (until > v->until)
            v->until = until;
    }
    /* one page tells all only if its group is the GPU's only latency group */
    if (seen[ordinal].n != 1 || gem_board_latency_groups(b) != 1)
        v->sleep_on = NULL;
}

void gem_flare_after_fork(void) {
    pthread_mutex_init(&own_mu, NULL);
    /* the child has no mirror yet: its first look maps the pages again (the parent's mappings are its own) */
    for (int i = 0; i < GEM_MAX_DEVICES; i++) {
        seen[i].n = 0;
        seen[i].board = NULL;
    }
}
