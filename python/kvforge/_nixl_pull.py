"""A pull in flight over NIXL (kvforge.nixl.Agent.start_pull): its READs posted, polled and, where they
fail or time out, parked with the agent until NIXL releases them."""

import numpy as np

import kvforge

from . import _nixl_pages as page_pulls
from . import _nixl_staged as staged_pulls
from ._nixl_wait import InFlight


class Pull(InFlight):
    """A pull in flight (Agent.start_pull). wait(timeout) completes it or abandons it."""

    def __init__(self, agent, plan, notify):
        self._agent, self._plan, self._handles = agent, plan, []
        nixl, mine = agent._nixl, plan["mine"]
        how = plan.get("how") or ("staged" if plan["staging"] is not None else "direct")
        self.report = {"how": how, "descriptors": 0, "bytes": 0}
        self.writes_on_finish = plan.get("then") is not None or plan["staging"] is not None
        # NIXL reports a failure by "ERR" or (1.5: a peer gone) by raising: every READ posted is then parked
        # with the agent until NIXL lets it go, staging area and all, and the error is kvforge's, naming the peer.
        self.peers, peer = [], "?"
        try:
            for peer, (src, dst, lengths), theirs in plan["requests"]:
                local = np.stack([dst, lengths, np.full_like(dst, mine["device_id"])], axis=1).astype(np.uint64)
                remote = np.stack([src, lengths, np.full_like(src, theirs["device_id"])], axis=1).astype(np.uint64)
                self._handles.append(nixl.initialize_xfer("READ", nixl.get_xfer_descs(local, mine["device"]),
                                                          nixl.get_xfer_descs(remote, theirs["device"]), peer, notify))
                self.peers.append(peer)
                self.report["descriptors"] += len(lengths)
                self.report["bytes"] += int(lengths.sum())
            for handle, peer in zip(self._handles, self.peers):
                if nixl.transfer(handle) == "ERR":
                    raise RuntimeError("its state is ERR")
        except Exception as e:  # noqa: BLE001  (NIXL's error classes derive from Exception only)
            self._abandon()
            raise kvforge.BackendError(f"nixl: posting a READ from peer {peer!r} failed: {type(e).__name__}: {e}") from e
        self._finished = False

    def done(self):
        """True once every READ completed (then wait() returns at once). Raises BackendError on a failed READ."""
        if self._finished:
            return True
        try:
            with self._agent._lock:  # the agent's thread polls NIXL too
                states = [self._agent._nixl.check_xfer_state(h) for h in self._handles]
        except Exception as e:  # noqa: BLE001  (a peer gone, raised rather than reported as ERR)
            self._abandon()
            raise kvforge.BackendError(f"nixl: a READ of this pull from peers {self.peers} failed: {type(e).__name__}: "
                                       f"{e}; the target positions hold undefined bytes") from e
        if "ERR" in states:
            failed = [p for p, st in zip(self.peers, states) if st == "ERR"]
            self._abandon()
            raise kvforge.BackendError(f"nixl: a READ of this pull from peer {failed[0]!r} failed; the target positions "
                                       f"hold undefined bytes")
        return all(s == "DONE" for s in states)

    def _release_handles(self):
        for handle in self._handles:
            handle.release()
        self._handles = []

    def _finish(self):
        plan = self._plan
        self._release_handles()
        if plan.get("then") is not None:
            staged_pulls.write_decoded(self._agent, plan)
        elif plan["staging"] is not None:
            staged_pulls.write_staged(plan)
            self._agent._spare.append(plan["area"])
        self._finished = True

    def _drop(self):
        plan = self._plan
        self._release_handles()
        if plan.get("then") is not None:
            page_pulls.give_back(self._agent, plan["area"])
        elif plan["staging"] is not None:
            self._agent._spare.append(plan["area"])
        self._finished = True

    def _abandon(self):
        """Cancels and releases this pull's READs. One that NIXL cannot cancel yet keeps the staging area
        alive and registered, parked with the agent, until a later call releases it."""
        with self._agent._lock:
            self._abandon_locked()

    def _abandon_locked(self):
        area = self._plan["area"] or (None, None)
        self._agent._abandoned.append((self._handles, area[0], area[1]))
        self._handles = []
        self._agent._release_abandoned()
        self._finished = True
