/*
 * rejoin.h -- a process that holds device memory tells a restarted pod
 * manager what it holds at once, not at its next CUDA call (rejoin.c).
 */
#ifndef GEMINI_REJOIN_H
#define GEMINI_REJOIN_H

void gem_rejoin_start(void);            /* the process holds memory now: watch its connections (idempotent) */
void gem_rejoin_shutdown(void);         /* exiting: stop watching */
void gem_rejoin_after_fork(void);       /* the thread did not survive the fork; the child starts its own */

#endif /* GEMINI_REJOIN_H */
