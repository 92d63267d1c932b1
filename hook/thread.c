/*
 * thread.c -- the hook's own background threads: detached, named, and deaf to the program's signals.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>

#include "thread.h"

int gem_thread_start(void *(*fn)(void *), const char *name) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the new thread inherits the mask */
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, fn, NULL);
    if (rc == 0)
        pthread_setname_np(t, name);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc == 0 ? 0 : -1;
}
