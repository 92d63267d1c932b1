/*
 * thread.h -- the hook's own background threads (the gate's watcher, the rejoin thread, the claim mirror).
 */
#ifndef GEMINI_THREAD_H
#define GEMINI_THREAD_H

/* Start fn(NULL) on a detached thread named `name` that never takes the program's signals (all are blocked
 * in it: a program's handler must run on a thread of its own). Returns 0, or -1 if no thread could be made. */
int gem_thread_start(void *(*fn)(void *), const char *name);

#endif /* GEMINI_THREAD_H */
