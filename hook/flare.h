/*
 * flare.h -- a latency group's flare page (gemini_proto.h): how its hooks find it to raise flares, and how a
 * batch process's claim mirror finds the flares it must honour.
 *
 * A latency process's early claim launches its request before its pod manager has answered, and the pod manager
 * writes the claim on the board only when it reads the request: about 0.5 ms later on an H100 host, half of a
 * small model's request, during which the request time-sliced with the batch queue. The flare closes that gap
 * without a round trip: at the early burst's first launch the hook raises its group's flare (one store and a futex
 * wake), and the batch processes' claim mirrors (gpugate.c) hold their streams on the GPU as for a claim.
 *
 * Who may write: the page is its pod manager's file (mode 0644) beside the board, so only processes that may write
 * that file (the daemons' user; never a container, which sees the board's directory read-only) raise flares; a
 * mirror honours a page only if its owner is the board's and nobody else may write it. A flare counts only while
 * the group's line on the board (the pod manager's) says `flare`, and for at most GEM_FLARE_MAX_NS ahead.
 */
#ifndef GEMINI_FLARE_H
#define GEMINI_FLARE_H

#include <stdint.h>

#include "device.h"
#include "gemini_proto.h"

/* The flare page of the group on line `slot` of board `b` (d's board), mapped read-write: NULL if it has none or
 * this process may not write it (then its early claims reach the batch holders through the board, as before).
 * Looked for once per board and line. */
struct gem_flare *gem_flare_of_group(struct gem_device *d, const struct gem_board *b, int slot);

/* What GPU `ordinal`'s flares hold now, for its claim mirror (which alone calls this): `until` the latest end of a
 * flare that holds batch work (0: none), `count` the flare pages followed, and `sleep_on`/`seen` a futex word that
 * changes at every flare, claim and unclaim when one page tells all (one latency group, with its page), else NULL. */
struct gem_flare_view {
    int64_t until;
    int count;
    const uint32_t *sleep_on;
    uint32_t seen;
};
void gem_flare_look(int ordinal, const struct gem_board *b, int64_t now, struct gem_flare_view *v);

void gem_flare_after_fork(void);

#endif /* GEMINI_FLARE_H */
