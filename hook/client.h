/*
 * client.h -- the connection to a pod manager: one per device (device.c) and
 * one per NVML-only device (nvml.c). Any number of threads may call at once.
 */
#ifndef GEMINI_CLIENT_H
#define GEMINI_CLIENT_H

#include <pthread.h>
#include <stdint.h>

#include "gemini_proto.h"

#define GEM_PATH_LEN 512

/* Where a pod manager listens: a Unix socket (`path`, the socket transport) or TCP ip:port. */
struct gem_endpoint {
    char path[GEM_PATH_LEN];    /* empty: TCP */
    char ip[64];
    int port;
};

struct gem_waiter;
struct gem_session;             /* one connection: descriptor, generation, users (client.c) */
struct gem_conn {
    pthread_mutex_t mu;         /* guards everything below but descriptor I/O */
    pthread_mutex_t send_mu;    /* one writer at a time */
    pthread_cond_t cv;
    struct gem_session *current;  /* NULL when not connected */
    struct gem_session *sessions; /* every session still open: current, and broken ones with users */
    uint64_t generation;        /* of the last session opened */
    uint32_t next_seq;
    struct gem_waiter *waiters;
    struct gem_endpoint ep;
    char where[GEM_PATH_LEN];   /* the endpoint, for messages: the socket's path, or ip:port */
    int device_ordinal;
    char device_uuid[GEM_UUID_LEN];
    uint64_t client_id;
    char group[GEM_NAME_LEN];
    char farewell[GEM_ERRMSG_LEN];  /* why the pod manager said it stops (group removed); cleared on connecting */
    uint32_t ack_flags;         /* HELLO_ACK: GEM_ACK_* */
    int32_t board_slot;         /* HELLO_ACK or BOARD_INFO: the group's line on the board page, -1 if none */
    char board_path[GEM_BOARD_PATH_LEN];  /* HELLO_ACK or BOARD_INFO: the GPU's board page, "" if none */
    uint64_t board_epoch;       /* counts the times the pod manager named its board (each HELLO_ACK and BOARD_INFO):
                                 * a page under an old name may be a new file (device.c looks) */
    int connecting;             /* a thread is connecting; others wait on cv */
    int ever_connected;         /* a later connect is a reconnect */
    int last_failure;           /* what a call gets while next_connect_ns has not come */
    int64_t next_connect_ns;    /* after a failed connect, calls fail fast until then */
    uint64_t *mem_in_use;       /* the process's bytes on this device, sent in HELLO (changed under mu) */
    int hello_pending;          /* a HELLO counted mem_in_use and its session is not installed yet (or failed) */
    uint64_t hellos;            /* handshakes begun (the session each opens remembers its number) */
};

enum gem_call_result {
    GEM_CALL_OK = 0,
    GEM_CALL_UNREACHABLE = -1,  /* no connection could be made */
    GEM_CALL_BROKEN = -2,       /* the connection died during the call */
    GEM_CALL_REFUSED = -3,      /* the pod manager answered with ERROR */
    GEM_CALL_TIMEOUT = -4
};

void gem_conn_init(struct gem_conn *c, const struct gem_endpoint *ep, int ordinal, const char *uuid,
                   uint64_t *mem_in_use);
/* In a fork child: forget the parent's connection (the child makes its own). */
void gem_conn_reset_after_fork(struct gem_conn *c);
/* Send `req` and wait for its reply (any type). timeout_ns 0 = wait forever (token waits). */
int gem_conn_call(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns);
/* The process gave `bytes` back (`req` is their MEM_FREE): take them off mem_in_use and tell the pod manager that
 * counts them, if one does -- the current session's, or the one a HELLO in flight is telling (its count was
 * taken before, so it includes them: the free waits for that handshake and goes on its session). Never opens a
 * session: with none, the next HELLO's count leaves them out (GEM_CALL_UNREACHABLE). */
int gem_conn_call_freeing(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns,
                          uint64_t bytes);
/* gem_conn_call for a MEM_ALLOC, saying which session it went on (`generation`), for gem_conn_count_reserved. */
int gem_conn_call_reserving(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns,
                            uint64_t *generation);
/* The pod manager of session `generation` granted `bytes`: add them to mem_in_use and return 1 if that session's
 * count is still the one that stands (or none stands: the next HELLO carries them; a handshake in flight is waited
 * for). Else 0: a handshake since the grant told a new pod manager a count without them, so nobody counts them and
 * the allocation must be asked for again. */
int gem_conn_count_reserved(struct gem_conn *c, uint64_t generation, uint64_t bytes);
/* Ask the pod manager where its board is now (BOARD_QUERY; its answer replaces board_slot and board_path and
 * counts in board_epoch), on the session that stands: GEM_CALL_OK, or why not (UNREACHABLE if none stands). */
int gem_conn_query_board(struct gem_conn *c, int64_t timeout_ns);
/* 1 if a session stands; 0 if none does. A session the pod manager closed (it exited) is dropped here, after
 * reading what it said before it closed (its farewell) if no call is reading it. Never blocks. */
int gem_conn_alive(struct gem_conn *c);

#endif /* GEMINI_CLIENT_H */
