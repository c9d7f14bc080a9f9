"""What every kvforge.nixl pull in flight shares: waiting for it, with a timeout that abandons it."""

import time

import kvforge


class PullTimeout(kvforge.Error, TimeoutError):
    """A pull did not complete in time. It was abandoned: its NIXL requests were cancelled and released
    (or are released by a later call where NIXL could not yet), and the target positions hold undefined
    bytes, as before any write. Nothing else changed; the same request can be pulled again."""


class InFlight:
    """A pull in flight. Subclasses say when it is done(), how to _finish() it (under the agent's lock)
    and how to _abandon() it, and which `peers` it reads from; `report` is what wait() returns."""

    peers = ()
    after = None  # a check once the READs are done and finished (_nixl_generations.check), or None

    def wait(self, timeout=30.0):
        """Blocks until done; after `timeout` seconds abandons the pull and raises PullTimeout."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                self._abandon()
                raise PullTimeout(f"timeout: the pull from {', '.join(map(repr, self.peers))} did not complete in "
                                  f"{timeout} s; it was abandoned")
            time.sleep(0)
        if not self._finished:
            with self._agent._lock:
                self._finish()
        if self.after is not None:
            check, self.after = self.after, None
            check(deadline)
        return self.report
