/*
 * util.c -- pure functions: no globals, no I/O, no CUDA. Exported with a
 * gemhook_ prefix so tests/test_hook_pure.py can call them through cffi and
 * check them against the Python implementations.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* ---- burst estimation ------------------------------------------------------------------
 * A burst runs from the first launch after a synchronisation to the next
 * synchronisation. Bursts closer than merge_gap_ns are one burst (Gemini uses
 * 2 ms: a host gap that short is launch overhead, not idleness). The
 * prediction is the 90th percentile of the bursts that ended in the last
 * window_ns (Gemini: 3 s), 0 when there are none.
 */

size_t gemhook_burst_size(void) { return sizeof(struct gemhook_burst_est); }

void gemhook_burst_init(struct gemhook_burst_est *est, int64_t merge_gap_ns, int64_t window_ns) {
    memset(est, 0, sizeof *est);
    est->head = -1;
    est->merge_gap_ns = merge_gap_ns;
    est->window_ns = window_ns;
}

void gemhook_burst_record(struct gemhook_burst_est *est, int64_t start_ns, int64_t end_ns) {
    if (end_ns < start_ns)
        return;
    if (est->count > 0) {
        int h = est->head;
        if (start_ns >= est->start[h] && start_ns - est->end[h] < est->merge_gap_ns) {
            if (end_ns > est->end[h])
                est->end[h] = end_ns;
            return;
        }
    }
    int h = (est->head + 1) % GEMHOOK_BURST_SLOTS;
    est->start[h] = start_ns;
    est->end[h] = end_ns;
    est->head = h;
    if (est->count < GEMHOOK_BURST_SLOTS)
        est->count++;
}

int64_t gemhook_burst_predict(const struct gemhook_burst_est *est, int64_t now_ns) {
    int64_t lengths[GEMHOOK_BURST_SLOTS];
    int n = 0;
    for (int i = 0; i < est->count; i++) {
        int idx = (est->head - i + GEMHOOK_BURST_SLOTS) % GEMHOOK_BURST_SLOTS;
        if (est->end[idx] < now_ns - est->window_ns)
            break; /* older entries ended even earlier */
        int64_t len = est->end[idx] - est->start[idx];
        /* insertion sort: at most 256 entries, and this runs once per sync */
        int j = n++;
        while (j > 0 && lengths[j - 1] > len) {
            lengths[j] = lengths[j - 1];
            j--;
        }
        lengths[j] = len;
    }
    if (n == 0)
        return 0;
    int rank = (n * 9 + 9) / 10; /* nearest rank: ceil(0.9 n) */
    return lengths[rank - 1];
}

/* ---- frames ------------------------------------------------------------------------------ */

void gemhook_msg_init(struct gem_msg *msg, uint16_t type, uint32_t seq) {
    memset(msg, 0, sizeof *msg);
    msg->hdr.magic = GEM_PROTO_MAGIC;
    msg->hdr.version = GEM_PROTO_VERSION;
    msg->hdr.type = type;
    msg->hdr.size = GEM_MSG_SIZE;
    msg->hdr.seq = seq;
}

int gemhook_msg_check(const struct gem_msg *msg, char *why, size_t why_len) {
    const char *problem = NULL;
    char buf[96];
    if (msg->hdr.magic != GEM_PROTO_MAGIC) {
        snprintf(buf, sizeof buf, "bad magic 0x%08x", msg->hdr.magic);
        problem = buf;
    } else if (msg->hdr.version != GEM_PROTO_VERSION) {
        snprintf(buf, sizeof buf, "protocol version %u (this hook speaks %d)", msg->hdr.version, GEM_PROTO_VERSION);
        problem = buf;
    } else if (msg->hdr.size != GEM_MSG_SIZE) {
        snprintf(buf, sizeof buf, "frame size %u (frames are %d)", msg->hdr.size, GEM_MSG_SIZE);
        problem = buf;
    } else if (msg->hdr.type < GEM_MSG_HELLO || msg->hdr.type > GEM_MSG_BOARD_INFO) {
        snprintf(buf, sizeof buf, "unknown message type %u", msg->hdr.type);
        problem = buf;
    }
    if (!problem)
        return 0;
    if (why && why_len) {
        strncpy(why, problem, why_len - 1);
        why[why_len - 1] = '\0';
    }
    return -1;
}

/* "host:port" -> ip, port. Returns 0 or -1. */
int gemhook_group_socket_name(const char *group, char *out, size_t len) {
    static const char hex[] = "0123456789ABCDEF";
    static const char prefix[] = "group.", suffix[] = ".sock";
    if (!group || !out || len < sizeof prefix)
        return -1;
    size_t n = 0;
    memcpy(out, prefix, sizeof prefix - 1);
    n = sizeof prefix - 1;
    for (const unsigned char *p = (const unsigned char *)group; *p; p++) {
        int keep = (*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_' ||
                   *p == '-' || *p == '.';
        size_t need = keep ? 1 : 3;
        if (n + need >= len)
            return -1;
        if (keep) {
            out[n++] = (char)*p;
        } else {
            out[n++] = '%';
            out[n++] = hex[*p >> 4];
            out[n++] = hex[*p & 15];
        }
    }
    if (n + sizeof suffix > len)
        return -1;
    memcpy(out + n, suffix, sizeof suffix);
    return 0;
}

int gemhook_parse_endpoint(const char *text, char *ip, size_t ip_len, int *port) {
    if (!text || !ip || !port)
        return -1;
    const char *colon = strrchr(text, ':');
    if (!colon || colon == text || (size_t)(colon - text) >= ip_len)
        return -1;
    char *end = NULL;
    long p = strtol(colon + 1, &end, 10);
    if (!end || *end != '\0' || end == colon + 1 || p <= 0 || p > 65535)
        return -1;
    memcpy(ip, text, (size_t)(colon - text));
    ip[colon - text] = '\0';
    *port = (int)p;
    return 0;
}
