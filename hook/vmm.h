/*
 * vmm.h -- the virtual memory management API (cuMemCreate, cuMemMap, ...):
 * physical allocations are counted from their creation until the driver
 * frees them, when no handle reference and no mapping is left (vmm.c).
 */
#ifndef GEMINI_VMM_H
#define GEMINI_VMM_H

void gem_vmm_after_fork(void);          /* the parent's physical allocations are not the child's */

#endif /* GEMINI_VMM_H */
