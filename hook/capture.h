/*
 * capture.h -- which streams of the process are capturing. Launches into a
 * capture are recorded into a graph, not run, so they are never gated; and
 * while any capture is open the hook must not synchronise (a context-wide
 * sync would invalidate it).
 */
#ifndef GEMINI_CAPTURE_H
#define GEMINI_CAPTURE_H

#include <stdatomic.h>

#include "cuda_types.h"

extern atomic_int gem_active_captures;

/* Before the program's cuStreamBeginCapture*: waits while the hook drains. */
void gem_capture_before_begin(void);
/* After the program's cuStreamBeginCapture* (begins=1) or cuStreamEndCapture* (begins=0) returned rc. */
void gem_capture_changed(CUstream stream, int begins, int ptsz, CUresult rc);

/* The hook is about to make a call that would break an open capture (a context-wide synchronise, work on
 * the legacy stream). Returns 1 if it may: no capture is open or beginning, and none begins until
 * gem_capture_drain_exit. Returns 0 if it must not (then no exit call). */
int gem_capture_drain_enter(void);
void gem_capture_drain_exit(void);
/* Is `s` capturing (asks the driver; never about the legacy stream)? */
int gem_stream_is_capturing(CUstream s, int ptsz);

void gem_capture_after_fork(void);       /* the child captures nothing */

#endif /* GEMINI_CAPTURE_H */
