"""Watch EDS files and publish every valid change.

Polling ``os.stat`` (inode, mtime, size) every ``interval`` seconds catches both in-place writes
and the atomic rename Envoy expects, without an extra dependency. An invalid file is logged with
its precise error and the last good version of that file stays in force.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence

from ext_proc.discovery.eds import ClusterEndpoints, EdsError, load_eds_file

log = logging.getLogger(__name__)

Publish = Callable[[list[ClusterEndpoints]], None]


class EdsFileSource:
    """Discovery source over a fixed list of EDS files.

    ``publish`` receives the full list of last-good :class:`ClusterEndpoints` (one per readable
    file, in file order) whenever any file changes validly.
    """

    def __init__(
        self, paths: Sequence[str], namespace: str, publish: Publish, interval: float = 0.25
    ) -> None:
        self._paths = list(paths)
        self._namespace = namespace
        self._publish = publish
        self._interval = interval
        self._stamps: dict[str, tuple[int, int, int] | None] = {}
        self._good: dict[str, ClusterEndpoints] = {}

    def _stamp(self, path: str) -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> bool:
        """Reload every file whose stamp changed; publish if anything new is good. Returns whether it did."""
        changed = False
        for path in self._paths:
            stamp = self._stamp(path)
            if path in self._stamps and stamp == self._stamps[path]:
                continue
            self._stamps[path] = stamp
            try:
                self._good[path] = load_eds_file(path, self._namespace)
            except EdsError as exc:
                kept = "keeping the last good version" if path in self._good else "no endpoints from it yet"
                log.error("rejected EDS file update: %s (%s)", exc, kept)
                continue
            log.info(
                "loaded EDS file %s: cluster %s, %d endpoints",
                path,
                self._good[path].cluster_name,
                len(self._good[path].endpoints),
            )
            changed = True
        if changed:
            try:
                self._publish([self._good[p] for p in self._paths if p in self._good])
            except Exception:
                self._stamps.clear()  # not applied: re-read and publish again on the next poll
                raise
        return changed

    async def run(self) -> None:
        """Poll forever (cancel to stop). Call :meth:`poll` once before for a synchronous first load."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.poll()
            except Exception:  # a watcher must outlive any surprise; the last good set stays
                log.exception("EDS watcher failed while polling; will retry")
