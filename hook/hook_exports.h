/*
 * hook_exports.h -- the exported wrapper of every intercepted row of
 * hook_table.h (all kinds but REAL), declared from the table. Declarations
 * only, like the table: each file that defines wrappers includes it, so the
 * compiler checks every definition against its row. The uniform kinds are
 * generated in wrappers.c (launch, sync, capture) and memory.c (stream-
 * ordered allocation); CUSTOM rows are written by hand where their concern
 * lives (memory.c, nvml.c, symbols.c).
 */
#ifndef GEMINI_HOOK_EXPORTS_H
#define GEMINI_HOOK_EXPORTS_H

#include "cuda_types.h"
#include "hook_table.h"

#define GEM_WRAP_PROTO_YES(ret, name, params) __attribute__((visibility("default"))) ret name params;
#define GEM_WRAP_PROTO_NO(ret, name, params)
#define GEM_WRAP_PROTO_LAUNCH GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_GRAPH_LAUNCH GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_SYNC GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_CAPTURE_BEGIN GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_CAPTURE_END GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_ALLOC_ASYNC GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_ALLOC_FROM_POOL GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_CUSTOM GEM_WRAP_PROTO_YES
#define GEM_WRAP_PROTO_REAL GEM_WRAP_PROTO_NO
#define GEM_WRAP_PROTO(kind, lib, ret, name, since, pt, params, ...) GEM_WRAP_PROTO_##kind(ret, name, params)
GEM_HOOK_TABLE(GEM_WRAP_PROTO)
#undef GEM_WRAP_PROTO

/* Is this kind of row intercepted (does it have a wrapper)? */
#define GEM_WRAPPED_LAUNCH 1
#define GEM_WRAPPED_GRAPH_LAUNCH 1
#define GEM_WRAPPED_SYNC 1
#define GEM_WRAPPED_CAPTURE_BEGIN 1
#define GEM_WRAPPED_CAPTURE_END 1
#define GEM_WRAPPED_ALLOC_ASYNC 1
#define GEM_WRAPPED_ALLOC_FROM_POOL 1
#define GEM_WRAPPED_CUSTOM 1
#define GEM_WRAPPED_REAL 0

#endif /* GEMINI_HOOK_EXPORTS_H */
