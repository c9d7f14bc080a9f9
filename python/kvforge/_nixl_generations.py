"""Page generations over NIXL: what lets a pull tell that its sender reused a page after publishing it.

The sender keeps one int64 a page (a row, for a contiguous cache) of each registered cache, registered
with NIXL beside the cache: the SequenceManager's own page generations where the cache was registered with
its manager, which every free and reuse of a page advances (BlockAllocator::generations); else the agent's,
which Agent.retire(key, pages) advances when the sender frees a request's pages. Agent.placement(key,
pages) publishes a request's pages with their generations now. A pull given such a Placement READs those
generations back after its data READs have completed: equal, nothing was retired while or before the bytes were read; else the pull is refused
with StateError and its target positions hold undefined bytes, as after any failed pull.
"""

import time

import numpy as np
import torch

import kvforge


class Generations:
    """A sender's generations of one registered cache: int64 [units], in host memory, registered. Its own
    (advanced by retire), or a SequenceManager's page_generations (advanced by its frees and reuses)."""

    def __init__(self, nixl, units, managed=None):  # managed: int64 [units], a SequenceManager's
        # A view of the manager's counters keeps the manager alive while they are registered.
        self.values = torch.zeros(units, dtype=torch.int64) if managed is None else managed
        self.registered = nixl.register_memory([self.values])

    def describe(self):
        return [self.values.data_ptr(), self.values.numel()]

    def units(self, what, pages, row):
        if (pages is None) == (row is None):
            raise kvforge.ArgumentError(f"{what}: give pages (a paged cache) or row (a contiguous one), not both")
        units = np.asarray([row] if pages is None else pages, dtype=np.int64).reshape(-1)
        bad = np.flatnonzero((units < 0) | (units >= self.values.numel()))
        if bad.size:
            name = f"{what}.pages[{int(bad[0])}]" if pages is not None else f"{what}.row"
            raise kvforge.OutOfRangeError(f"{name} = {int(units[bad[0]])} is outside [0, {self.values.numel()})")
        return units

    def retire(self, units):
        self.values[torch.from_numpy(np.unique(units))] += 1

    def now(self, units):
        return self.values[torch.from_numpy(units)].numpy().copy()


def refuse_unchecked(agent, sources, source, unchecked):
    """Refuses a pull that could not tell a stale page table: a source Placement without generations (unless
    the caller passes unchecked=True), or generations of a sender that publishes none."""
    if getattr(source, "generations", None) is None:
        if not unchecked:
            raise kvforge.ArgumentError("source.generations: the source Placement carries none, so a page its sender "
                                        "freed or reused since would pass unseen (another request's K/V); pull what "
                                        "the sender's Agent.placement(key, pages) published, or pass unchecked=True")
        return
    for name, their_key in sources:
        if "generations" not in agent._peers.get(name, {}).get(their_key, {"generations": 0}):
            raise kvforge.ArgumentError(f"source.generations: {name!r} publishes no generations for "
                                        f"{their_key!r} (a kvforge.nixl before them); pull without them")


def check_after(agent, pull, sources, key, source, target, positions):
    """Arms `pull` to check source's generations after its READs (check), and tells it which of the
    target's pages (or its row) the positions reach, which a failed check names."""
    from ._nixl_plan import placement_units
    units = placement_units(agent._peers[sources[0][0]][sources[0][1]], source, positions)
    pull.after = lambda deadline, landed: check(agent, sources, source, units, deadline, landed)
    reached = placement_units(agent._caches[key][1], target, positions)
    pull.target_pages = target.pages[reached].tolist() if target.pages is not None else None
    pull.target_row = target.row


def check(agent, sources, source, units, deadline, landed):
    """After a pull's READs: READs every sender's generations of source's `units` (indices into its pages,
    or [0] for its row), one READ a sender, all in flight together, and compares them with
    source.generations. Raises StateError naming the first page retired since, BackendError where a READ
    fails, kvforge.nixl.PullTimeout past the deadline. A READ that fails or times out is handed to the
    agent's abandoned pulls, its buffer registered and alive until NIXL lets it go (Agent.abandoned).
    landed: what the target holds if the pull fails here, for the error."""
    from ._nixl_wait import PullTimeout
    nixl = agent._nixl
    on = source.pages[units] if source.pages is not None else np.asarray([source.row], dtype=np.int64)
    n = len(on)
    reads = []  # (sender name, NIXL request, int64 [n] the generations land in, its registration)

    def abandon(error):
        with agent._lock:
            for _, handle, got, registered in reads:
                agent._abandoned.append(([handle], got, registered))
            agent._release_abandoned()
        raise error

    try:
        with agent._lock:
            for name, key in sources:
                address = agent._peers[name][key]["generations"]  # start_pull checked that each sender has them
                got = torch.full((n,), -1, dtype=torch.int64)
                registered = nixl.register_memory([got])
                local = np.stack([got.data_ptr() + 8 * np.arange(n), np.full(n, 8), np.zeros(n)], 1)
                remote = np.stack([address[0] + 8 * on, np.full(n, 8), np.zeros(n)], 1)
                try:
                    handle = nixl.initialize_xfer("READ", nixl.get_xfer_descs(local.astype(np.uint64), "DRAM"),
                                                  nixl.get_xfer_descs(remote.astype(np.uint64), "DRAM"), name, b"")
                except Exception:  # noqa: BLE001  (nothing posted: the registration goes at once)
                    nixl.deregister_memory(registered)
                    raise
                reads.append((name, handle, got, registered))
                if nixl.transfer(handle) == "ERR":
                    raise RuntimeError(f"the READ from {name!r} is in state ERR")
        while True:
            with agent._lock:  # the agent's thread polls NIXL too
                states = [nixl.check_xfer_state(handle) for _, handle, _, _ in reads]
            if "ERR" in states:
                raise RuntimeError(f"the READ from {reads[states.index('ERR')][0]!r} is in state ERR")
            if all(state == "DONE" for state in states):
                break
            if time.monotonic() >= deadline:
                abandon(PullTimeout(f"timeout: reading the page generations of {[r[0] for r in reads]} did not "
                                    f"complete; {landed}"))
            time.sleep(0)
    except (PullTimeout, kvforge.Error):
        raise
    except Exception as e:  # noqa: BLE001  (NIXL's error classes derive from Exception only)
        abandon(kvforge.BackendError(f"nixl: reading the page generations of {[r[0] for r in reads] or sources} "
                                     f"failed: {type(e).__name__}: {e}; {landed}"))
    with agent._lock:
        for _, handle, _, registered in reads:
            handle.release()
            nixl.deregister_memory(registered)
    expected = source.generations[units]
    for name, _, got, _ in reads:
        stale = np.flatnonzero(got.numpy() != expected)
        if stale.size:
            i = int(stale[0])
            where = f"source.pages[{int(units[i])}] = {int(on[i])}" if source.pages is not None else \
                f"source.row = {source.row}"
            raise kvforge.StateError(f"source.generations: {where} on {name!r} was retired since it was published "
                                     f"(generation {int(expected[i])} then, {int(got[i])} now): its bytes may be "
                                     f"another request's, so the pull is refused and {landed}; pull again from "
                                     f"the sender's current placement")
