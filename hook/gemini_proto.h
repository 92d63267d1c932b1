/*
 * gemini_proto.h -- the wire format between libgemhook (one connection per
 * process) and gem-pmgr (one server per group).
 *
 * This header is the only definition of the format. The hook includes it;
 * gemini/wire/hook.py feeds the text between the cffi-begin and cffi-end
 * markers to cffi, keeping integer #defines and dropping other preprocessor
 * lines, so keep that region to plain declarations.
 *
 * Every frame is exactly GEM_MSG_SIZE bytes: a 16-byte header and a payload
 * union. Integers are little-endian (the byte order of every platform the
 * CUDA driver supports). A reply carries the seq of its request; a message
 * the pod manager sends on its own (a push) carries seq 0.
 */
#ifndef GEMINI_PROTO_H
#define GEMINI_PROTO_H

#include <stdint.h>

/* cffi-begin */
#define GEM_PROTO_MAGIC 0x314d4547
#define GEM_PROTO_VERSION 1
#define GEM_MSG_SIZE 256
#define GEM_HEADER_SIZE 16
#define GEM_PAYLOAD_SIZE 240
#define GEM_NAME_LEN 64
#define GEM_UUID_LEN 64
#define GEM_ERRMSG_LEN 192
#define GEM_BOARD_PATH_LEN 128

enum gem_msg_type {
    GEM_MSG_HELLO = 1,          /* hook -> pmgr: first frame on a connection */
    GEM_MSG_HELLO_ACK = 2,      /* pmgr -> hook */
    GEM_MSG_TOKEN_REQUEST = 3,  /* hook -> pmgr; answered by TOKEN_GRANT when granted */
    GEM_MSG_TOKEN_GRANT = 4,    /* pmgr -> hook */
    GEM_MSG_TOKEN_RELEASE = 5,  /* hook -> pmgr: idle, give the rest of the slot back */
    GEM_MSG_ACK = 6,            /* pmgr -> hook: generic reply with no payload */
    GEM_MSG_MEM_ALLOC = 7,      /* hook -> pmgr: reserve bytes before allocating */
    GEM_MSG_MEM_FREE = 8,       /* hook -> pmgr: return bytes */
    GEM_MSG_MEM_INFO = 9,       /* hook -> pmgr: ask (used, limit) */
    GEM_MSG_MEM_REPLY = 10,     /* pmgr -> hook: verdict, used, limit */
    /* 11 was LIMIT_UPDATE, a push of the group's new limit that nothing read (the hooks ask with MEM_INFO
     * whenever they need the limit): retired, and not to be reused. */
    GEM_MSG_ERROR = 12,         /* pmgr -> hook: the request failed; code and text */
    GEM_MSG_RESIDENCY = 13,     /* hook -> pmgr: managed memory moved (unified group); answered by ACK */
    GEM_MSG_BOARD_QUERY = 14,   /* hook -> pmgr: where is the group's board now? answered by BOARD_INFO */
    GEM_MSG_BOARD_INFO = 15     /* pmgr -> hook: the group's board page and line (as in HELLO_ACK) */
};

enum gem_error_code {
    GEM_ERR_NONE = 0,
    GEM_ERR_PROTOCOL = 1,       /* malformed frame, bad magic, bad size, bad type */
    GEM_ERR_VERSION = 2,        /* protocol version mismatch */
    GEM_ERR_GROUP_MISMATCH = 3, /* the hook's POD_NAME is not the group this pmgr serves */
    GEM_ERR_UNKNOWN_GROUP = 4,  /* the scheduler does not know (or no longer knows) the group */
    GEM_ERR_NO_SCHEDULER = 5,   /* the pod manager cannot reach gem-schd */
    GEM_ERR_NOT_HELLO = 6,      /* a request arrived before the handshake */
    GEM_ERR_INTERNAL = 7,
    GEM_ERR_DEVICE_MISMATCH = 8, /* the hook's device is not the one this pmgr serves */
    GEM_ERR_REFUSED = 9         /* this process may not join (authorizer, too many connections, no HELLO) */
};

enum gem_mem_kind {
    GEM_MEM_DEVICE = 0,         /* cuMemAlloc, pitch, arrays */
    GEM_MEM_MANAGED = 1,        /* cuMemAllocManaged */
    GEM_MEM_ASYNC = 2,          /* stream-ordered allocations and pools */
    GEM_MEM_VMM = 3             /* cuMemCreate physical handles */
};

enum gem_mem_verdict {
    GEM_MEM_OK = 0,
    GEM_MEM_DENIED = 1          /* would exceed the group's limit */
};

struct gem_header {
    uint32_t magic;             /* GEM_PROTO_MAGIC */
    uint16_t version;           /* GEM_PROTO_VERSION */
    uint16_t type;              /* enum gem_msg_type */
    uint32_t size;              /* bytes in the whole frame: GEM_MSG_SIZE */
    uint32_t seq;               /* request id, echoed by the reply; 0 on pushes */
};

struct gem_hello {
    int32_t pid;
    int32_t device_ordinal;     /* CUdevice ordinal in the process, for logs */
    uint64_t mem_in_use;        /* bytes this process already holds (reconnects) */
    uint32_t flags;             /* GEM_HELLO_FLAG_* */
    uint32_t pid_ns;            /* inode of the process's pid namespace (/proc/self/ns/pid), 0 if unknown: when
                                 * it is the pod manager's own, `pid` names a process the pod manager can see */
    char pod_name[GEM_NAME_LEN];     /* the group the hook was told to join; may be empty */
    char device_uuid[GEM_UUID_LEN];  /* "GPU-xxxxxxxx-..." of the device, or empty */
};

#define GEM_HELLO_FLAG_FAIL_OPEN 1

struct gem_hello_ack {
    uint64_t client_id;         /* the pod manager's id for this connection */
    uint64_t mem_limit;         /* the group's memory limit, bytes */
    uint64_t mem_used;          /* the group's memory in use, bytes */
    char group[GEM_NAME_LEN];   /* the group this pod manager serves */
    uint32_t flags;             /* GEM_ACK_* */
    int32_t board_slot;         /* the group's line on the board page, -1 if none */
    char board_path[GEM_BOARD_PATH_LEN];  /* the GPU's board page (read-only for hooks); empty if none */
};

/* The group is latency class: its tokens are claims, and it never pauses for claims. */
#define GEM_ACK_LATENCY 1
/* The group is unified (MemoryMode = unified): its allocations are managed memory, moved to the GPU at each
 * grant and to the host when gem-schd asks (its board line's evict_seq). */
#define GEM_ACK_UNIFIED 2

struct gem_token_request {
    int64_t overuse_ns;         /* GPU time used past the last slot's deadline */
    int64_t burst_ns;           /* predicted kernel burst (p90 over 3 s); 0 if none */
    int64_t used_ns;            /* GPU time the last slot really used (events), 0 if not measured */
    int64_t launched_ns;        /* an early claim (a latency process): when its burst's first launch went ahead
                                 * of the answer (CLOCK_MONOTONIC, the board's clock); 0: it waited */
};

struct gem_token_grant {
    int64_t quota_ns;           /* time left on the group's token from now */
    uint64_t token_seq;         /* id of the group token; echoed on release */
    uint32_t flags;             /* GEM_GRANT_* */
    uint32_t reserved;
};

/* GEM_GRANT_BOUND: keep the work queued on the GPU within the slot (the group is capped below 1, another group
 * is configured on the GPU, or a latency group is present): at most half the time left until the slot's
 * deadline, and never less than GEMINI_INFLIGHT_MS, stays queued, so a slot's end takes effect about when it is due.
 * GEM_GRANT_TIGHT (with BOUND): at most GEMINI_INFLIGHT_MS stays queued whatever the time left, so that a
 * latency group's claim takes effect within about that (a latency group is present).
 * GEM_GRANT_CLAIM: the token is a latency group's claim (batch holders pause meanwhile).
 * (GEM_GRANT_BOARD below.) */
#define GEM_GRANT_BOUND 1
#define GEM_GRANT_CLAIM 2
#define GEM_GRANT_TIGHT 4
/* GEM_GRANT_BOARD: the board page or line this hook was last told of (HELLO_ACK, BOARD_INFO) is no longer the pod
 * manager's (a new gem-schd, a reload that moved the group's line, a page mapped after the handshake): ask again
 * (BOARD_QUERY). */
#define GEM_GRANT_BOARD 8

struct gem_token_release {
    uint64_t token_seq;
    int64_t overuse_ns;
    int64_t burst_ns;
    int64_t used_ns;            /* GPU time the slot really used (events), 0 if not measured */
};

struct gem_mem_request {
    uint64_t bytes;
    uint32_t kind;              /* enum gem_mem_kind */
    uint32_t reserved;
};

/* A unified group's hook moved its managed memory: to the device at a grant (direction 0), or to the host
 * because gem-schd asked (direction 1, evict_seq: the board line's evict_seq it answers). */
struct gem_residency {
    uint64_t evict_seq;         /* direction 1: the request answered; 0 otherwise */
    uint64_t moved_bytes;       /* bytes moved by this swap */
    int64_t moved_ns;           /* how long the move took (issue to completion) */
    uint64_t resident_bytes;    /* this process's managed bytes on the device now */
    uint64_t managed_bytes;     /* this process's managed bytes in all */
    uint32_t direction;         /* 0: to the device, 1: to the host */
    uint32_t reserved;
};

#define GEM_RESIDENCY_TO_DEVICE 0
#define GEM_RESIDENCY_TO_HOST 1

struct gem_mem_reply {
    int32_t verdict;            /* enum gem_mem_verdict */
    uint32_t reserved;
    uint64_t used;              /* the group's memory in use after this request */
    uint64_t limit;             /* the group's limit */
};

/* The answer to BOARD_QUERY, which a hook sends when its board line says the pod manager moved away (gem-schd
 * restarted with a new page): the page and line the pod manager uses now, as HELLO_ACK gives them. */
struct gem_board_info {
    int32_t board_slot;         /* the group's line on the board page, -1 if none */
    uint32_t reserved;
    char board_path[GEM_BOARD_PATH_LEN];  /* the GPU's board page; empty if none */
};

struct gem_error {
    int32_t code;               /* enum gem_error_code */
    uint32_t reserved;
    char message[GEM_ERRMSG_LEN];
};

union gem_payload {
    struct gem_hello hello;
    struct gem_hello_ack hello_ack;
    struct gem_token_request token_request;
    struct gem_token_grant token_grant;
    struct gem_token_release token_release;
    struct gem_mem_request mem_request;
    struct gem_mem_reply mem_reply;
    struct gem_error error;
    struct gem_residency residency;
    struct gem_board_info board_info;
    uint8_t raw[GEM_PAYLOAD_SIZE];
};

struct gem_msg {
    struct gem_header hdr;
    union gem_payload u;
};

/*
 * The board: one shared-memory page per GPU (a file gem-schd creates; hooks map it read-only, the daemons
 * read-write). It carries what must reach the hooks without a round trip:
 *   - claims: a latency group's pod manager writes its claim's end (CLOCK_MONOTONIC ns) on its line and
 *     raises claim_until_ns, the latest end of any claim; batch hooks do not launch while now < it;
 *   - continuations: gem-schd publishes each group's current slot (token_seq, the slot it continues,
 *     deadline), so a holder whose slot continues keeps launching at its deadline without draining;
 *   - turn_waiters: a pod manager in turns mode says how many processes wait for the turn;
 *   - groups_waiting: gem-schd says whether another group could be granted now, so that a holder gives the
 *     GPU back when its burst ends instead of after the idle release;
 *   - evict_seq: a unified group's pod manager asks its hooks to move their managed memory to the host;
 *   - moved: a pod manager left this page for a new gem-schd's; its hooks ask it for the new one.
 * Every field is written through the gemhook_board_* functions (hook/board.c), which order the stores
 * (a seqlock for a slot; atomics for claims), so the hook and the Python daemons agree on one protocol.
 */
/* magic "BORD"; 1022 group lines make the file 64 KiB */
#define GEM_BOARD_MAGIC 0x44524f42
#define GEM_BOARD_VERSION 1
/* claim_seq is raised and woken at every claim and unclaim (a page from an older gem-schd has 0 here, and
 * hooks then do not rely on it: no GPU-side gate) */
#define GEM_BOARD_FEATURE_CLAIM_SEQ 0x1
#define GEM_BOARD_LINE 64
#define GEM_BOARD_GROUPS 1022
#define GEM_BOARD_SIZE 65536

struct gem_board_head {                  /* line 0: written once by gem-schd */
    uint32_t magic;
    uint16_t version;
    uint16_t line;                       /* GEM_BOARD_LINE */
    uint32_t groups;                     /* GEM_BOARD_GROUPS */
    int32_t scheduler_pid;
    uint64_t generation;                 /* a new board (gem-schd restarted) has a new one */
    uint8_t pad[40];
};

struct gem_board_claims {                /* line 1: read on every batch launch */
    int64_t claim_until_ns;              /* batch hooks pause while CLOCK_MONOTONIC < this */
    uint32_t latency_groups;             /* gem-schd: latency groups in the config (0: nothing to bound) */
    uint32_t used_slots;                 /* gem-schd: group lines in use are below this */
    uint32_t groups_waiting;             /* gem-schd: 1 while another group than the holder could be granted
                                          * now (the holder then gives the GPU back when its burst ends);
                                          * written at most once per scheduling decision */
    uint32_t claim_seq;                  /* the pod managers: raised at every claim and unclaim, and the page's
                                          * waiters woken (futex): batch hooks' claim mirrors sleep on it */
    uint32_t features;                   /* gem-schd, once: GEM_BOARD_FEATURE_* its daemons keep up */
    uint32_t flare_gen;                  /* the pod managers: raised whenever a group line's `flare` changes (batch
                                          * hooks' claim mirrors then look again for flare pages) */
    uint32_t groups;                     /* gem-schd: groups in the config (0 from an older gem-schd: unknown); with
                                          * more than one a continued holder bounds its queue, as its grant would */
    uint8_t pad[28];
};

struct gem_board_group {                 /* one line per group */
    uint32_t seq_lock;                   /* even: stable; odd: gem-schd is writing the three below */
    uint32_t turn_waiters;               /* the pod manager (turns): processes waiting for the turn */
    uint64_t token_seq;                  /* gem-schd: the group's current slot */
    uint64_t prev_seq;                   /* gem-schd: the slot it continues (0: a fresh grant) */
    int64_t deadline_ns;                 /* gem-schd: when that slot ends (CLOCK_MONOTONIC ns) */
    int64_t claim_until_ns;              /* the pod manager (latency class): its claim's end, 0 if none */
    uint64_t evict_seq;                  /* the pod manager (unified group): raised to ask the group's hooks to
                                          * move their managed memory to the host (answered by RESIDENCY) */
    uint32_t moved;                      /* the pod manager: 1 once it left this page for another (gem-schd
                                          * restarted); its hooks then ask it where (BOARD_QUERY) */
    uint32_t flare;                      /* the pod manager (latency class): 1 while its group may claim and its flare
                                          * page is up: batch hooks then honour the flares its hooks raise there */
    uint8_t pad[8];
};

struct gem_board {
    struct gem_board_head head;
    struct gem_board_claims claims;
    struct gem_board_group group[GEM_BOARD_GROUPS];
};

/*
 * A latency group's flare page: a file beside the board ("<board path>.flare<line>") that its pod manager creates,
 * not writable by others (mode 0644), and the group's hooks map read-write. A hook whose early claim launches
 * before its pod manager has answered (about 0.5 ms of Python later) raises the flare at its first launch: batch
 * hooks' claim mirrors hold their queued work on the GPU at once, as they do for a claim on the board. The board
 * stays read-only to hooks; a flare counts only while the group's board line says `flare` (the pod manager's
 * word: the group may claim), for at most GEM_FLARE_MAX_NS ahead, and the pod manager takes the right away from a
 * group whose flares are not followed by requests.
 */
#define GEM_FLARE_MAGIC 0x52414c46       /* "FLAR" */
#define GEM_FLARE_SIZE 4096
struct gem_flare {
    uint32_t magic;                      /* the pod manager, last at creation */
    uint32_t slot;                       /* the pod manager: the group's line on the board */
    uint64_t generation;                 /* the pod manager: the board's generation */
    int64_t until_ns;                    /* the group's hooks: batch work holds until then (0: down) */
    uint64_t raises;                     /* the group's hooks: flares raised */
    uint32_t seq;                        /* raised at every flare, lowering, claim and unclaim of the group (a futex
                                          * word: a batch mirror with this one flare to follow sleeps on it) */
    uint8_t pad[28];
};
/* cffi-end */

#ifndef __cplusplus
_Static_assert(sizeof(struct gem_header) == GEM_HEADER_SIZE, "gem_header size");
_Static_assert(sizeof(union gem_payload) == GEM_PAYLOAD_SIZE, "gem_payload size");
_Static_assert(sizeof(struct gem_msg) == GEM_MSG_SIZE, "gem_msg size");
_Static_assert(sizeof(struct gem_board_head) == GEM_BOARD_LINE, "gem_board_head size");
_Static_assert(sizeof(struct gem_board_claims) == GEM_BOARD_LINE, "gem_board_claims size");
_Static_assert(sizeof(struct gem_board_group) == GEM_BOARD_LINE, "gem_board_group size");
_Static_assert(sizeof(struct gem_board) == GEM_BOARD_SIZE, "gem_board size");
_Static_assert(sizeof(struct gem_flare) == 64, "gem_flare size");
#endif

#endif /* GEMINI_PROTO_H */
