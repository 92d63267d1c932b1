/*
 * context.h -- context teardown: cuCtxDestroy, and a primary context's reset
 * or last release, free what the context held; the group gets it back
 * (the wrappers are in context.c; memory.c keeps the allocations' owners).
 */
#ifndef GEMINI_CONTEXT_H
#define GEMINI_CONTEXT_H

#endif /* GEMINI_CONTEXT_H */
