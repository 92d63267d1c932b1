/*
 * symbols.h -- how programs reach the hook's wrappers: the exported dlsym and
 * cuGetProcAddress (symbols.c) hand out the wrapper of a table row in place
 * of the driver's function.
 */
#ifndef GEMINI_SYMBOLS_H
#define GEMINI_SYMBOLS_H

#include "real.h"

/* The wrapper handed out for each row of the table; NULL for REAL rows. */
extern void *const gem_hook_fn[GEM_FN_COUNT];

#endif /* GEMINI_SYMBOLS_H */
