/*
 * memory.h -- memory accounting and limits: every allocation is reserved with
 * the group's pod manager first (the wrappers are in memory.c).
 */
#ifndef GEMINI_MEMORY_H
#define GEMINI_MEMORY_H

/* After a synchronising call of the program (wrappers.c): pools may have returned memory to the device. */
void gem_memory_on_sync(void);

void gem_memory_after_fork(void);        /* the parent's allocations are not the child's */

#endif /* GEMINI_MEMORY_H */
