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
    GEM_MSG_LIMIT_UPDATE = 11,  /* pmgr -> hook push: the group's limit changed */
    GEM_MSG_ERROR = 12          /* pmgr -> hook: the request failed; code and text */
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
    GEM_ERR_DEVICE_MISMATCH = 8 /* the hook's device is not the one this pmgr serves */
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
    uint32_t reserved;
    char pod_name[GEM_NAME_LEN];     /* the group the hook was told to join; may be empty */
    char device_uuid[GEM_UUID_LEN];  /* "GPU-xxxxxxxx-..." of the device, or empty */
};

#define GEM_HELLO_FLAG_FAIL_OPEN 1

struct gem_hello_ack {
    uint64_t client_id;         /* the pod manager's id for this connection */
    uint64_t mem_limit;         /* the group's memory limit, bytes */
    uint64_t mem_used;          /* the group's memory in use, bytes */
    char group[GEM_NAME_LEN];   /* the group this pod manager serves */
};

struct gem_token_request {
    int64_t overuse_ns;         /* GPU time used past the last slot's deadline */
    int64_t burst_ns;           /* predicted kernel burst (p90 over 3 s); 0 if none */
    int64_t used_ns;            /* GPU time the last slot really used (events), 0 if not measured */
};

struct gem_token_grant {
    int64_t quota_ns;           /* time left on the group's token from now */
    uint64_t token_seq;         /* id of the group token; echoed on release */
};

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

struct gem_mem_reply {
    int32_t verdict;            /* enum gem_mem_verdict */
    uint32_t reserved;
    uint64_t used;              /* the group's memory in use after this request */
    uint64_t limit;             /* the group's limit */
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
    uint8_t raw[GEM_PAYLOAD_SIZE];
};

struct gem_msg {
    struct gem_header hdr;
    union gem_payload u;
};
/* cffi-end */

#ifndef __cplusplus
_Static_assert(sizeof(struct gem_header) == GEM_HEADER_SIZE, "gem_header size");
_Static_assert(sizeof(union gem_payload) == GEM_PAYLOAD_SIZE, "gem_payload size");
_Static_assert(sizeof(struct gem_msg) == GEM_MSG_SIZE, "gem_msg size");
#endif

#endif /* GEMINI_PROTO_H */
