"""Live reload of the configuration file: the ``affinity`` section (mode, bonus, auto, prefix), no restart.

The server polls its ``--config`` file and compares the bytes it reads with the last version seen.
Kubernetes updates a mounted ConfigMap by writing a new timestamped folder and swapping the
``..data`` symlink atomically: the path never changes, and the inode or mtime it leads to says
nothing reliable (a same-size rewrite within one mtime tick keeps the stat). The content does, and
a configuration file is a few KB, so reading it once per interval costs nothing.

A changed file is loaded with the environment and flags of the start (they keep their precedence).
Its ``affinity`` section takes effect at once: the router decides every later request with it, and
requests already placed keep their endpoints and charges, so nothing is dropped. Any other key that
differs from the running configuration is logged as needing a restart. An invalid file is logged
once, with the key and the allowed values, and the running configuration stays in force.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from pathlib import Path

from ext_proc.checks import ConfigError
from ext_proc.config import Config, ConfigSource, as_dict
from ext_proc.live import LiveParts
from ext_proc.metrics import Metrics
from ext_proc.router import Router

log = logging.getLogger(__name__)

RELOAD_INTERVAL_SECONDS = 1.0
"""How often the configuration file is read (kubelet itself takes up to a minute or so to swap a
changed ConfigMap into the pod)."""


def _flatten(data: dict[str, object], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


class ConfigWatcher:
    """Watches ``source.path`` and applies a changed ``affinity`` section.

    Its policy to ``router``, its prefix settings to the ``live`` parts (:mod:`ext_proc.live`: the prefix
    source and the tokenizer).

    ``running`` is the configuration in force: the one the server started with, plus the affinity
    of the last valid file. Every change of the file counts in ``metrics`` (``applied`` or
    ``rejected``) and logs one line.
    """

    def __init__(
        self,
        source: ConfigSource,
        running: Config,
        router: Router,
        live: LiveParts,
        metrics: Metrics,
        interval: float = RELOAD_INTERVAL_SECONDS,
    ) -> None:
        if source.path is None:
            raise ValueError("a configuration without a file has nothing to watch")
        self._path = Path(source.path)
        self._source = source
        self.running = running
        self._router = router
        self._live = live
        self._metrics = metrics
        self._interval = interval
        self._digest = self._read_digest()

    def _read_digest(self) -> bytes | None:
        try:
            return hashlib.blake2b(self._path.read_bytes(), digest_size=16).digest()
        except OSError:
            return None  # loading it says why, once

    def poll(self) -> None:
        """Reload the file if its content changed since the last poll."""
        digest = self._read_digest()
        if digest == self._digest:
            return
        self._digest = digest
        try:
            new = self._source.load()
        except ConfigError as exc:
            self._metrics.config_reload("rejected")
            log.error(
                "rejected the changed config file %s: %s (the running configuration stays)", self._path, exc
            )
            return
        self._apply(new)

    def _apply(self, new: Config) -> None:
        old = self.running
        before, after = _flatten(as_dict(old)), _flatten(as_dict(new))
        changed = [key for key in after if after[key] != before[key]]
        if new.affinity != old.affinity:
            self._router.set_policy(new.affinity.policy(self._router.policy.fallback_count))
            self._live.set_prefix(new.affinity.prefix.settings())
            self.running = dataclasses.replace(old, affinity=new.affinity)
        self._metrics.config_reload("applied")
        live = [f"{key} {before[key]} -> {after[key]}" for key in changed if key.startswith("affinity.")]
        log.info(
            "reloaded config file %s: %s",
            self._path,
            ", ".join(live) if live else "affinity unchanged",
        )
        restart = [key for key in changed if not key.startswith("affinity.")]
        if restart:
            log.warning(
                "config file %s changes %s: only the affinity keys apply live; "
                "restart pd-extproc for the others (running with the old values)",
                self._path,
                ", ".join(restart),
            )

    async def run(self) -> None:
        """Poll forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.poll()
            except Exception:  # a watcher must outlive any surprise; the running config stays
                log.exception("config watcher failed while polling; will retry")
