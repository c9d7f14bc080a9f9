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
    # The generations check (_nixl_generations.check), called with the deadline and what the target holds if it
    # fails; or None. It runs once the data READs are done: before _finish where _finish writes the cache
    # (staged, decoded), so that a refused pull writes nothing there; after it where the READs landed in the
    # cache's own pages (direct, prepared), whose bytes are then undefined.
    after = None
    writes_on_finish = False
    target_pages = None  # the target's pages that this pull's READs reach (or None, and its target_row), for that error
    target_row = None

    def wait(self, timeout=30.0):
        """Blocks until done; after `timeout` seconds abandons the pull and raises PullTimeout."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                self._abandon()
                raise PullTimeout(f"timeout: the pull from {', '.join(map(repr, self.peers))} did not complete in "
                                  f"{timeout} s; it was abandoned")
            time.sleep(0)
        if self.after is not None and self.writes_on_finish and not self._finished:
            check, self.after = self.after, None
            try:
                check(deadline, "nothing was written to the target")
            except BaseException:
                with self._agent._lock:
                    self._drop()
                raise
        if not self._finished:
            with self._agent._lock:
                self._finish()
        if self.after is not None:
            check, self.after = self.after, None
            reached = f"pages {self.target_pages}" if self.target_pages is not None else f"row {self.target_row}"
            try:
                check(deadline, f"the target's {reached} hold undefined bytes: free them or pull again")
            except kvforge.StateError as refused:
                refused.undefined_pages = self.target_pages  # what the caller frees (None: a row target)
                raise
        return self.report

    def _drop(self):
        """Ends a pull whose READs completed without writing what they read (under the agent's lock)."""
        self._abandon_locked()
