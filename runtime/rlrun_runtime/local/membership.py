"""The servers file of an autoscaled ``rlrun local`` run: which inference servers and which router the
orchestrator uses now (``constants.ENV_LOCAL_SERVERS_FILE``, ``DIR/local/servers.json``).

In a cluster the orchestrator resolves a headless Service, so pods joining or leaving show up by DNS. Locally
every server has its own loopback port, so the local scaler writes the current set here (atomically) and the
orchestrator re-reads it when its mtime changes. Format (JSON object)::

    {"inference": ["127.0.0.1:41001", ...],   # every server the orchestrator reaches directly (weight updates)
     "prefill": ["127.0.0.1:41001", ...],     # the prefill part of "inference" (P/D update order)
     "router": "http://127.0.0.1:41020"}      # where completions go

A server is listed only once it serves the current weights (the scaler loads them first), and unlisted
before it is stopped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class ServerSet:
    """What the orchestrator uses: ``inference`` and ``prefill`` as ``host:port`` items, ``router`` a URL
    (None: completions go round-robin to the servers)."""

    inference: tuple[str, ...]
    prefill: tuple[str, ...] = ()
    router: str | None = None

    def as_json(self) -> str:
        return json.dumps({"inference": list(self.inference), "prefill": list(self.prefill),
                           "router": self.router}, indent=1) + "\n"


def parse_server_set(text: str) -> ServerSet:
    """A ServerSet from the file's text (pure).

    Raises:
        ValueError: not JSON, or ``inference`` missing or empty, or an item is not a string.
    """
    data: Any = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("the servers file holds no JSON object")
    items = {key: data.get(key) or [] for key in ("inference", "prefill")}
    for key, value in items.items():
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"servers file: {key!r} is not a list of host:port strings")
    if not items["inference"]:
        raise ValueError("servers file: 'inference' lists no server")
    router = data.get("router")
    if router is not None and not isinstance(router, str):
        raise ValueError("servers file: 'router' is not a URL string")
    return ServerSet(tuple(items["inference"]), tuple(items["prefill"]), router.rstrip("/") if router else None)


def write_server_set(path: Path, servers: ServerSet) -> None:
    """Write ``servers`` to ``path`` atomically (a reader sees the old or the new file, never a part)."""
    from ..storage import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, servers.as_json())


class ServersFile:
    """Reads the servers file when it changed (by mtime and size); keeps the last good set otherwise.

    Args:
        path: the file (``ENV_LOCAL_SERVERS_FILE``).
        fallback: what to use before the file exists or while it cannot be parsed (the role's env values).
    """

    def __init__(self, path: str | os.PathLike[str], fallback: ServerSet):
        self.path = Path(path)
        self.current = fallback
        self._stamp: tuple[int, int] | None = None
        self.error: str | None = None

    def read(self) -> ServerSet:
        """The current set (one ``stat`` per call; the file is parsed again only when it changed)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return self.current
        stamp = (info.st_mtime_ns, info.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.current = parse_server_set(self.path.read_text(encoding="utf-8"))
                self.error = None
            except (OSError, ValueError) as err:
                self.error = f"{self.path}: {err}"
        return self.current


def endpoint_of(url: str) -> str:
    """``http://host:port`` -> ``host:port`` (pure)."""
    return url.split("://", 1)[-1].rstrip("/")


def get_server_set(prefill_urls: Sequence[str], decode_urls: Sequence[str], router: str | None) -> ServerSet:
    """The ServerSet of these servers' base URLs (pure): prefill first, then decode."""
    prefill = tuple(endpoint_of(u) for u in prefill_urls)
    return ServerSet(prefill + tuple(endpoint_of(u) for u in decode_urls), prefill, router)
