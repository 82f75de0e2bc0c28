"""Watch EDS files and publish every valid change.

Polling ``os.stat`` (inode, mtime, size) every ``interval`` seconds catches both in-place writes
and the atomic rename Envoy expects, without an extra dependency. An in-place rewrite of the same
size within one mtime tick (a kernel tick on ext4, up to 2 s on other filesystems) leaves the stat
unchanged; so while a file's mtime is less than :data:`MTIME_TICK_NS` older than the moment it was
read, every poll also compares a hash of its content (old files cost one ``stat`` per poll). An
invalid file is logged with its precise error and the last good version of that file stays in force.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence

from ext_proc.discovery.eds import EdsError, parse_eds, read_eds_file
from ext_proc.endpoints import ClusterEndpoints

log = logging.getLogger(__name__)

Publish = Callable[[list[ClusterEndpoints]], None]
Available = Callable[[bool], None]
"""Told whether a source has a set to serve at all (``False``: the InferencePool is gone; see
``ext_proc.app``)."""
Stamp = tuple[int, int, int]
"""``(inode, mtime_ns, size)`` of a file."""

MTIME_TICK_NS = 2 * 10**9
"""At least the coarsest mtime granularity of common filesystems (FAT: 2 s): a write this long
after a file's mtime is guaranteed to move it."""


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
        self._stamps: dict[str, Stamp | None] = {}
        self._digests: dict[str, bytes] = {}  # content hash of files read while their mtime was recent
        self._good: dict[str, ClusterEndpoints] = {}

    def _stamp(self, path: str) -> Stamp | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> bool:
        """Reload the files that changed and publish if anything new is good; return whether it did.

        A file changed when its stamp did or, while its mtime is recent, its content."""
        changed = False
        for path in self._paths:
            now = time.time_ns()  # taken before the read: "recent" errs on the side of hashing
            stamp = self._stamp(path)
            same = path in self._stamps and stamp == self._stamps[path]
            if same and path not in self._digests:
                continue
            self._stamps[path] = stamp
            try:
                content = read_eds_file(path)
            except EdsError as exc:
                self._digests.pop(path, None)
                self._reject(path, exc)
                continue
            digest = hashlib.blake2b(content, digest_size=16).digest()
            recent = stamp is not None and now - stamp[1] < MTIME_TICK_NS
            if same and digest == self._digests[path]:
                if not recent:  # verified after the tick: a later write will move the mtime
                    del self._digests[path]
                continue
            if recent:
                self._digests[path] = digest
            else:
                self._digests.pop(path, None)
            try:
                self._good[path] = parse_eds(content, path, self._namespace)
            except EdsError as exc:
                self._reject(path, exc)
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

    def _reject(self, path: str, exc: EdsError) -> None:
        kept = "keeping the last good version" if path in self._good else "no endpoints from it yet"
        log.error("rejected EDS file update: %s (%s)", exc, kept)

    async def run(self) -> None:
        """Poll forever (cancel to stop). Call :meth:`poll` once before for a synchronous first load."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.poll()
            except Exception:  # a watcher must outlive any surprise; the last good set stays
                log.exception("EDS watcher failed while polling; will retry")
