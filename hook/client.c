/*
 * client.c -- the connection to the pod manager.
 *
 * One persistent connection per process (and device), opened lazily on
 * the first call that needs it. Several threads may have requests in flight
 * at once: a launch thread can wait seconds for a token while another thread
 * allocates memory. Each request carries a seq; whichever waiting thread
 * finds nobody reading becomes the reader and hands replies to their owners
 * (leader/follower), so there is no extra thread and no per-request socket.
 *
 * The connection is a Unix stream socket on the socket transport (GEMINI_IPC_DIR: the file system decides who
 * may connect; a refusal is final, not retried) or TCP (POD_MANAGER_IP/PORT).
 *
 * A dead or unreachable pod manager never hangs the program and never kills
 * it: connects retry with backoff for GEMINI_CONNECT_TIMEOUT_MS with a clear
 * message, then the call fails and the CUDA call returns an error. The next
 * call reconnects (the HELLO carries the memory the process already holds, so
 * a restarted pod manager rebuilds its accounting; rejoin.c reconnects a
 * process that holds memory at once, without waiting for its next call).
 *
 * Each connection is a session with a generation number and a count of the
 * calls using it. Threads use its descriptor outside the lock (a writer in
 * send, the reader in poll/recv), so a session that breaks is shut down, which
 * wakes them all and fails their I/O, but closed only when its last user
 * leaves: until then its number cannot be reused by the program, and no frame
 * can land in someone else's file or socket.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client.h"
#include "settings.h"
#include "stats.h"
#include "util.h"

struct gem_session {
    int fd;
    uint64_t generation;        /* 1 for the conn's first session, then counting up */
    uint64_t hello;             /* the handshake that opened it (gem_conn.hellos when its HELLO was sent) */
    int users;                  /* calls that may use fd outside c->mu */
    int broken;                 /* shut down: no new users; closed when users drops to 0 */
    int reader_active;          /* a thread is reading replies for everyone */
    struct gem_session *next;   /* the conn's live sessions: the current one and broken ones in use */
};

struct gem_waiter {
    uint32_t seq;
    int done;
    int result;
    struct gem_msg *reply;
    struct gem_session *session; /* the reply can only come on the session the request went out on */
    struct gem_waiter *next;
};

static void cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

void gem_conn_init(struct gem_conn *c, const struct gem_endpoint *ep, int ordinal, const char *uuid,
                   uint64_t *mem_in_use) {
    memset(c, 0, sizeof *c);
    c->board_slot = -1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->send_mu, NULL);
    cond_init_monotonic(&c->cv);
    c->ep = *ep;
    if (ep->path[0])
        snprintf(c->where, sizeof c->where, "%s", ep->path);
    else
        snprintf(c->where, sizeof c->where, "%s:%d", ep->ip, ep->port);
    c->device_ordinal = ordinal;
    snprintf(c->device_uuid, sizeof c->device_uuid, "%s", uuid ? uuid : "");
    c->mem_in_use = mem_in_use;
}

void gem_conn_reset_after_fork(struct gem_conn *c) {
    /* The parent's sessions are the parent's: the child closes its copies of their descriptors (never
     * shutdown(), which would end them for the parent too) and forgets them; its parent's threads,
     * their users, do not exist here. */
    for (struct gem_session *s = c->sessions, *next; s; s = next) {
        next = s->next;
        close(s->fd);
        free(s);
    }
    c->sessions = c->current = NULL;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->send_mu, NULL);
    cond_init_monotonic(&c->cv);
    c->connecting = 0;
    c->hello_pending = 0;
    c->waiters = NULL;
    c->next_connect_ns = 0;
    c->ever_connected = 0;
}

/* ---- raw I/O ------------------------------------------------------------------------------- */

/* The socket stays non-blocking after connect, so no send or recv can block past these bounds. */
#define IO_BOUND_NS (5 * GEM_NS_PER_S)

/* Write a whole frame. A pod manager that takes none of it for 5 s is treated as gone. */
static int write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    int64_t limit = gem_now_ns() + IO_BOUND_NS;
    while (len > 0) {
        /* MSG_NOSIGNAL: a dead pod manager must not SIGPIPE the program */
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int64_t left = limit - gem_now_ns();
                if (left <= 0) {
                    errno = ETIMEDOUT;
                    return -1;
                }
                struct pollfd pfd = {.fd = fd, .events = POLLOUT};
                poll(&pfd, 1, (int)(left / GEM_NS_PER_MS) + 1);
                continue;
            }
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Read one frame. Returns 1 with a frame, 0 if nothing arrived within wait_ms, -1 on EOF/error.
 * Once the first byte is in, the rest must follow within 5 s, or the stream is out of step. */
static int read_frame(int fd, struct gem_msg *m, int wait_ms, char *why, size_t why_len) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int pr = poll(&pfd, 1, wait_ms);
    if (pr == 0)
        return 0;
    if (pr < 0)
        return errno == EINTR ? 0 : -1;
    char *p = (char *)m;
    size_t got = 0;
    int64_t limit = gem_now_ns() + IO_BOUND_NS;
    while (got < sizeof *m) {
        ssize_t n = recv(fd, p + got, sizeof *m - got, 0);
        if (n == 0) {
            snprintf(why, why_len, "the pod manager closed the connection");
            return -1;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (gem_now_ns() > limit) {
                    snprintf(why, why_len, "truncated frame from the pod manager");
                    return -1;
                }
                poll(&pfd, 1, 100);
                continue;
            }
            snprintf(why, why_len, "%s", strerror(errno));
            return -1;
        }
        got += (size_t)n;
    }
    if (gemhook_msg_check(m, why, why_len) != 0)
        return -1;
    return 1;
}

static int connect_tcp(const char *ip, int port, int timeout_ms, char *why, size_t why_len) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    int gai = getaddrinfo(ip, portstr, &hints, &res);
    if (gai != 0) {
        snprintf(why, why_len, "cannot resolve '%s': %s", ip, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0)
            continue;
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            rc = poll(&pfd, 1, timeout_ms) == 1 ? 0 : -1;
            int err = 0;
            socklen_t len = sizeof err;
            if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) {
                errno = err;
                rc = -1;
            } else if (rc != 0) {
                errno = ETIMEDOUT;
            }
        }
        if (rc == 0)
            break;
        snprintf(why, why_len, "%s", strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd; /* still non-blocking: read_frame and write_all bound every wait */
}

/* The socket transport. A path too long for sockaddr_un is reached through /proc/self/fd/N/<name>, N an open
 * descriptor of its directory. Returns the fd (non-blocking, as connect_tcp's), -1 (nobody listens: retry) or -2
 * (this user may not open the socket: the file system says no, and retrying will not change that). */
static int connect_unix(const char *path, char *why, size_t why_len) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int dirfd = -1;
    if (strlen(path) < sizeof sa.sun_path) {
        snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    } else {
        const char *slash = strrchr(path, '/');
        char dir[GEM_PATH_LEN];
        if (!slash || (size_t)(slash - path) >= sizeof dir) {
            snprintf(why, why_len, "socket path too long");
            return -1;
        }
        memcpy(dir, path, (size_t)(slash - path));
        dir[slash - path] = '\0';
        dirfd = open(dir[0] ? dir : "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (dirfd < 0) {
            int err = errno;
            snprintf(why, why_len, "...%.100s: %s", dir + (strlen(dir) > 100 ? strlen(dir) - 100 : 0),
                     strerror(err));
            return err == EACCES ? -2 : -1;
        }
        if ((size_t)snprintf(sa.sun_path, sizeof sa.sun_path, "/proc/self/fd/%d/%s", dirfd, slash + 1) >=
            sizeof sa.sun_path) {
            close(dirfd);
            snprintf(why, why_len, "socket file name too long");
            return -1;
        }
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int rc = fd < 0 ? -1 : connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int err = errno;
    if (dirfd >= 0)
        close(dirfd);
    if (rc == 0)
        return fd; /* a Unix stream connect completes at once, or fails (EAGAIN: the backlog is full) */
    if (fd >= 0)
        close(fd);
    if (err == EACCES || err == EPERM) {
        snprintf(why, why_len, "permission denied: this user (uid %d) may not open the group's socket",
                 (int)geteuid());
        return -2;
    }
    snprintf(why, why_len, "%s", strerror(err));
    return -1;
}

/* Connect and handshake. Returns the fd, -1 (unreachable: retry) or -2 (refused: do not retry). */
static int handshake(struct gem_conn *c, char *why, size_t why_len);

/* The board the pod manager named (HELLO_ACK, BOARD_INFO); under mu, as device.c reads it. */
static void set_board(struct gem_conn *c, int32_t slot, const char *path) {
    pthread_mutex_lock(&c->mu);
    c->board_slot = slot;
    snprintf(c->board_path, sizeof c->board_path, "%.*s", GEM_BOARD_PATH_LEN - 1, path);
    c->board_epoch++;
    pthread_mutex_unlock(&c->mu);
}

static int open_session(struct gem_conn *c, char *why, size_t why_len) {
    int fd = handshake(c, why, why_len);
    if (fd < 0) {   /* this try told nobody: a free waiting for it need not (the next try counts afresh) */
        pthread_mutex_lock(&c->mu);
        c->hello_pending = 0;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    return fd;
}

static int handshake(struct gem_conn *c, char *why, size_t why_len) {
    int fd = c->ep.path[0] ? connect_unix(c->ep.path, why, why_len)
                           : connect_tcp(c->ep.ip, c->ep.port, 1000, why, why_len);
    if (fd < 0)
        return fd;
    struct gem_msg hello, reply;
    gemhook_msg_init(&hello, GEM_MSG_HELLO, 1);
    hello.u.hello.pid = (int32_t)getpid();
    hello.u.hello.device_ordinal = c->device_ordinal;
    /* What the process holds, counted under mu and marked in flight until the session is installed (or this try
     * failed): a free meanwhile waits and goes on that session, since this count includes it (sent nowhere, it
     * stayed counted for good). */
    pthread_mutex_lock(&c->mu);
    hello.u.hello.mem_in_use = c->mem_in_use ? __atomic_load_n(c->mem_in_use, __ATOMIC_RELAXED) : 0;
    c->hello_pending = 1;
    c->hellos++;                /* this handshake: the session it installs, if it succeeds, is known by it */
    pthread_mutex_unlock(&c->mu);
    hello.u.hello.flags = gem_cfg.fail_open ? GEM_HELLO_FLAG_FAIL_OPEN : 0;
    struct stat ns;
    hello.u.hello.pid_ns = stat("/proc/self/ns/pid", &ns) == 0 ? (uint32_t)ns.st_ino : 0;
    snprintf(hello.u.hello.pod_name, sizeof hello.u.hello.pod_name, "%s", gem_cfg.pod_name);
    snprintf(hello.u.hello.device_uuid, sizeof hello.u.hello.device_uuid, "%s", c->device_uuid);
    if (write_all(fd, &hello, sizeof hello) != 0) {
        snprintf(why, why_len, "%s", strerror(errno));
        close(fd);
        return -1;
    }
    int r = read_frame(fd, &reply, 5000, why, why_len);
    if (r == 0)
        snprintf(why, why_len, "no answer to the handshake within 5 s");
    if (r != 1) {
        close(fd);
        return -1;
    }
    if (reply.hdr.type == GEM_MSG_ERROR) {
        snprintf(why, why_len, "%.*s", GEM_ERRMSG_LEN, reply.u.error.message);
        close(fd);
        return -2;
    }
    if (reply.hdr.type != GEM_MSG_HELLO_ACK) {
        snprintf(why, why_len, "unexpected reply type %u to the handshake", reply.hdr.type);
        close(fd);
        return -1;
    }
    c->client_id = reply.u.hello_ack.client_id;
    snprintf(c->group, sizeof c->group, "%.*s", GEM_NAME_LEN - 1, reply.u.hello_ack.group);
    c->ack_flags = reply.u.hello_ack.flags;
    set_board(c, reply.u.hello_ack.board_slot, reply.u.hello_ack.board_path);
    return fd;
}

/* Make sure there is a session. Called with c->mu held; may drop it while connecting. */
static int ensure_connected(struct gem_conn *c) {
    while (!c->current) {
        if (c->connecting) {
            pthread_cond_wait(&c->cv, &c->mu);
            continue;
        }
        int64_t now = gem_now_ns();
        if (now < c->next_connect_ns)
            return c->last_failure; /* failed moments ago: fail fast, do not stall every call */
        /* A bad setting leaves no endpoint: never a default one in its place (some other group's). */
        const char *unusable = NULL;
        if (!c->ep.path[0] && c->ep.port <= 0)
            unusable = gem_cfg.settings_error[0] ? gem_cfg.settings_error : "no port for it";
        else if (c->ep.path[0] && !gem_cfg.pod_name[0])
            unusable = "no group name (set GEMINI_GROUP_NAME or POD_NAME; launch-command does)";
        if (unusable) {
            c->last_failure = GEM_CALL_REFUSED;
            c->next_connect_ns = now + GEM_NS_PER_S;
            GEM_LOG(GEM_LOG_ERROR, "no pod manager to ask: %s; this CUDA call fails", unusable);
            return c->last_failure;
        }
        c->connecting = 1;
        pthread_mutex_unlock(&c->mu);
        char why[GEM_ERRMSG_LEN + 64] = "";
        int64_t give_up = now + gem_cfg.connect_timeout_ns;
        int64_t backoff = 50 * GEM_NS_PER_MS;
        int fd, attempts = 0;
        for (;;) {
            fd = open_session(c, why, sizeof why);
            attempts++;
            if (fd >= 0 || fd == -2)
                break;
            int64_t t = gem_now_ns();
            if (t + backoff > give_up)
                break;
            if (attempts == 1)
                GEM_LOG(GEM_LOG_WARN, "cannot reach the pod manager at %s (%s); retrying for %.0f s",
                        c->where, why, (double)(give_up - t) / 1e9);
            struct timespec ts = {.tv_sec = backoff / GEM_NS_PER_S, .tv_nsec = backoff % GEM_NS_PER_S};
            nanosleep(&ts, NULL);
            backoff = backoff * 2 > GEM_NS_PER_S ? GEM_NS_PER_S : backoff * 2;
        }
        struct gem_session *s = fd >= 0 ? calloc(1, sizeof *s) : NULL;
        if (fd >= 0 && !s) {
            close(fd);
            fd = -1;
            snprintf(why, sizeof why, "out of memory");
        }
        pthread_mutex_lock(&c->mu);
        c->connecting = 0;
        c->hello_pending = 0;   /* installed below, or failed: a free waiting for it goes on, or nowhere */
        pthread_cond_broadcast(&c->cv);
        if (s) {
            s->fd = fd;
            s->generation = ++c->generation;
            s->hello = c->hellos;   /* the last try's HELLO opened it */
            s->next = c->sessions;
            c->sessions = c->current = s;
            c->next_connect_ns = 0;
            if (c->ever_connected)
                atomic_fetch_add(&gem_stats.reconnects, 1);
            else if (!gem_cfg.pod_name[0])
                GEM_LOG(GEM_LOG_WARN, "POD_NAME is not set: this process joined group '%s', whose pod manager "
                        "listens at %s; set POD_NAME to the group to be sure (launch-command does)", c->group,
                        c->where);
            c->ever_connected = 1;
            c->farewell[0] = '\0';
            GEM_LOG(GEM_LOG_DEBUG, "connected to the pod manager of group '%s' at %s (client %llu, "
                    "connection %llu)", c->group, c->where, (unsigned long long)c->client_id,
                    (unsigned long long)s->generation);
            break;
        }
        c->last_failure = fd == -2 ? GEM_CALL_REFUSED : GEM_CALL_UNREACHABLE;
        c->next_connect_ns = gem_now_ns() + GEM_NS_PER_S;
        if (fd == -2)
            GEM_LOG(GEM_LOG_ERROR, "the pod manager at %s refused this process: %s", c->where, why);
        else if (c->farewell[0])    /* it said why it went away: that, not how to start one */
            GEM_LOG(GEM_LOG_ERROR, "the pod manager at %s is gone (%s): %.*s; this CUDA call fails", c->where, why,
                    GEM_ERRMSG_LEN, c->farewell);
        else
            GEM_LOG(GEM_LOG_ERROR, "the pod manager at %s is unreachable (%s); this CUDA call fails "
                    "(start it with launch-backend, or set GEMINI_FAIL_OPEN=1 to run ungated)",
                    c->where, why);
        return c->last_failure;
    }
    return GEM_CALL_OK;
}

/* A call leaves session s. The last user of a broken session closes it. Called with c->mu held. */
static void session_leave(struct gem_conn *c, struct gem_session *s) {
    if (--s->users > 0 || !s->broken)
        return;
    for (struct gem_session **pp = &c->sessions; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    close(s->fd);
    free(s);
}

/* Session s died: no new call uses it, the calls on it fail, and its descriptor is shut down (which wakes
 * a reader in poll and a writer waiting for room) but stays open until its last user leaves. Called with
 * c->mu held, by a user of s. */
static void mark_broken(struct gem_conn *c, struct gem_session *s, const char *why) {
    if (s->broken)
        return;
    GEM_LOG(GEM_LOG_WARN, "lost the connection to the pod manager at %s: %s", c->where, why);
    s->broken = 1;
    if (c->current == s)
        c->current = NULL;
    shutdown(s->fd, SHUT_RDWR);
    for (struct gem_waiter *w = c->waiters; w; w = w->next)
        if (w->session == s && !w->done) {
            w->done = 1;
            w->result = GEM_CALL_BROKEN;
        }
    pthread_cond_broadcast(&c->cv);
}

static void dispatch(struct gem_conn *c, struct gem_session *s, const struct gem_msg *m) {
    if (m->hdr.seq == 0) {
        /* a push: the only one is an ERROR (a refusal before the HELLO was read, or its last word as it stops) */
        if (m->hdr.type == GEM_MSG_ERROR) {
            GEM_LOG(GEM_LOG_ERROR, "pod manager: %.*s", GEM_ERRMSG_LEN, m->u.error.message);
            if (m->u.error.code == GEM_ERR_UNKNOWN_GROUP)   /* the group was removed: it is going away */
                snprintf(c->farewell, sizeof c->farewell, "%.*s", GEM_ERRMSG_LEN - 1, m->u.error.message);
        }
        return;
    }
    for (struct gem_waiter *w = c->waiters; w; w = w->next)
        if (w->session == s && w->seq == m->hdr.seq && !w->done) {
            *w->reply = *m;
            w->done = 1;
            w->result = GEM_CALL_OK;
            return;
        }
    /* a reply nobody waits for any more (its caller timed out): drop it */
}

/* s is found dead: read what its pod manager said before it closed, if nobody else reads it. Its farewell (an
 * ERROR push saying why it went) is still queued there: unread, the process said only that its pod manager was
 * unreachable, and how to start one. The peer closed, so each read ends at once. Called with c->mu held. */
static void read_last_words(struct gem_conn *c, struct gem_session *s) {
    if (s->reader_active)   /* that reader sees the frames first, shut down or not */
        return;
    struct gem_msg m;
    char why[128];
    for (int i = 0; i < 8 && read_frame(s->fd, &m, 0, why, sizeof why) == 1; i++)
        dispatch(c, s, &m);
}

int gem_conn_alive(struct gem_conn *c) {
    pthread_mutex_lock(&c->mu);
    struct gem_session *s = c->current;
    int alive = 0;
    if (s && !s->broken) {
        /* current and not broken: its descriptor is open. A zero-timeout poll reads nothing. */
        struct pollfd pfd = {.fd = s->fd, .events = POLLRDHUP};
        if (poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) {
            if (s->users == 0)
                read_last_words(c, s);
            mark_broken(c, s, "the pod manager closed the connection");
            /* No call uses it, so no user will leave it: free it here (each pod manager restart seen while the
             * process was idle kept one descriptor open for good). */
            s->users++;
            session_leave(c, s);
        } else {
            alive = 1;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return alive;
}

static int conn_call(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns,
                     int may_connect, uint64_t only_generation, uint64_t *answered_by);

int gem_conn_call(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns) {
    return conn_call(c, req, reply, timeout_ns, 1, 0, NULL);
}

int gem_conn_call_reserving(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns,
                            uint64_t *generation) {
    return conn_call(c, req, reply, timeout_ns, 1, 0, generation);
}

int gem_conn_count_reserved(struct gem_conn *c, uint64_t generation, uint64_t bytes) {
    pthread_mutex_lock(&c->mu);
    /* The count a HELLO sends is read under mu (handshake): so is this. A handshake in flight counted without
     * them: its outcome decides (as for a free). Then: still the answering session's, or none open (the next
     * HELLO's count will hold the bytes): they are counted once. Else a handshake since the grant told a pod
     * manager a count without them, and the one that counted them is gone. */
    while (c->hello_pending)
        pthread_cond_wait(&c->cv, &c->mu);
    int counted = c->current ? c->current->generation == generation : 1;
    if (counted && c->mem_in_use)
        __atomic_fetch_add(c->mem_in_use, bytes, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&c->mu);
    return counted;
}

int gem_conn_call_freeing(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns,
                          uint64_t bytes) {
    pthread_mutex_lock(&c->mu);
    if (c->mem_in_use)
        __atomic_fetch_sub(c->mem_in_use, bytes, __ATOMIC_RELAXED);
    /* Only on the session that counts the bytes: the one a HELLO in flight installs, else the current one; never
     * one that a later HELLO opens (its count left them out). */
    uint64_t generation = c->current ? c->current->generation : 0;
    if (c->hello_pending) {
        uint64_t counted = c->hellos;   /* the handshake whose count holds the bytes (a retry counts afresh) */
        while (c->hello_pending && c->hellos == counted)
            pthread_cond_wait(&c->cv, &c->mu);
        generation = c->current && c->current->hello == counted ? c->current->generation : 0;
    }
    pthread_mutex_unlock(&c->mu);
    return generation ? conn_call(c, req, reply, timeout_ns, 0, generation, NULL) : GEM_CALL_UNREACHABLE;
}

static int conn_call(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns,
                     int may_connect, uint64_t only_generation, uint64_t *answered_by) {
    pthread_mutex_lock(&c->mu);
    int rc = may_connect ? ensure_connected(c)
             : c->current && (!only_generation || c->current->generation == only_generation) ? GEM_CALL_OK
                                                                                            : GEM_CALL_UNREACHABLE;
    if (rc != GEM_CALL_OK) {
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
    if (++c->next_seq == 0)
        c->next_seq = 1;
    struct gem_session *s = c->current;
    s->users++; /* from here until session_leave, s->fd stays open (if shut down) and s stays allocated */
    if (answered_by)
        *answered_by = s->generation;
    struct gem_waiter w = {.seq = c->next_seq, .reply = reply, .session = s};
    req->hdr.seq = w.seq;
    w.next = c->waiters;
    c->waiters = &w;
    pthread_mutex_unlock(&c->mu);

    pthread_mutex_lock(&c->send_mu);
    int sent = write_all(s->fd, req, sizeof *req);
    int send_errno = errno;
    pthread_mutex_unlock(&c->send_mu);

    pthread_mutex_lock(&c->mu);
    if (sent != 0) {
        /* A pod manager that stopped with this request unread: what it said first is still queued here. */
        read_last_words(c, s);
        mark_broken(c, s, strerror(send_errno));
    }
    int64_t start = gem_now_ns();
    int64_t give_up = timeout_ns > 0 ? start + timeout_ns : INT64_MAX;
    int64_t next_note = start + 10 * GEM_NS_PER_S;
    while (!w.done) {
        if (s->broken) {
            w.done = 1;
            w.result = GEM_CALL_BROKEN;
            break;
        }
        int64_t now = gem_now_ns();
        if (now >= give_up) {
            w.done = 1;
            w.result = GEM_CALL_TIMEOUT;
            break;
        }
        if (now >= next_note) {
            GEM_LOG(GEM_LOG_WARN, "still waiting for the pod manager at %s after %.0f s (message type %u)",
                    c->where, (double)(now - start) / 1e9, req->hdr.type);
            next_note = now + 10 * GEM_NS_PER_S;
        }
        if (!s->reader_active) {
            s->reader_active = 1;
            pthread_mutex_unlock(&c->mu);
            struct gem_msg m;
            char why[128] = "";
            int64_t wait_ns = give_up - now < 200 * GEM_NS_PER_MS ? give_up - now : 200 * GEM_NS_PER_MS;
            int r = read_frame(s->fd, &m, (int)(wait_ns / GEM_NS_PER_MS) + 1, why, sizeof why);
            pthread_mutex_lock(&c->mu);
            s->reader_active = 0;
            if (r < 0)
                mark_broken(c, s, why);
            else if (r == 1)
                dispatch(c, s, &m);
            pthread_cond_broadcast(&c->cv); /* someone else may need to read now */
        } else {
            struct timespec ts;
            int64_t until = now + 200 * GEM_NS_PER_MS < give_up ? now + 200 * GEM_NS_PER_MS : give_up;
            gem_ns_to_timespec(until, &ts);
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        }
    }
    for (struct gem_waiter **pp = &c->waiters; *pp; pp = &(*pp)->next)
        if (*pp == &w) {
            *pp = w.next;
            break;
        }
    session_leave(c, s);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (w.result == GEM_CALL_OK && reply->hdr.type == GEM_MSG_ERROR)
        return GEM_CALL_REFUSED;
    return w.result;
}

int gem_conn_query_board(struct gem_conn *c, int64_t timeout_ns) {
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_BOARD_QUERY, 0);
    /* On the session that stands (no reconnect: a new session's HELLO_ACK names the board anyway). */
    int rc = conn_call(c, &req, &reply, timeout_ns, 0, 0, NULL);
    if (rc != GEM_CALL_OK)
        return rc;
    if (reply.hdr.type != GEM_MSG_BOARD_INFO)
        return GEM_CALL_REFUSED;
    set_board(c, reply.u.board_info.board_slot, reply.u.board_info.board_path);
    return GEM_CALL_OK;
}
