"""kopf's memo of the operator, typed: what every handler shares and what each run remembers."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from rlrun_operator.config import OperatorConfig
from rlrun_operator.kubeapi import KubeApi
from rlrun_operator.reconcile import RunState


@dataclass
class OperatorMemo:
    """The memo kopf passes to the handlers (``kopf.operator(memo=OperatorMemo(config))``).

    kopf gives each RLRun its own shallow copy (``copy.copy``) of the operator's memo when it first sees the
    run, which is after the startup handler: ``config``, ``api``, ``http`` and ``clock`` are then the same
    objects for every run, ``run`` is the run's own (:func:`get_run_state` creates it on first use).

    Attributes:
        config: the operator's settings.
        api: the Kubernetes API client; the startup handler makes one unless the embedder gave one.
        http: the session the status timer scrapes /metrics with (opened at startup, closed at cleanup).
        clock: unix time in seconds for the autoscaler's decisions (an embedder may give a fake one).
        run: the run's RunState; None in the operator's own memo.
        refreshers: every run's status-refresh task (one set, shared by the per-run copies), cancelled at exit.
    """

    config: OperatorConfig
    api: KubeApi | None = None
    http: aiohttp.ClientSession | None = None
    clock: Callable[[], float] = time.time
    run: RunState | None = None
    refreshers: set[asyncio.Task[None]] = field(default_factory=set)


def complete_memo(memo: Any, config: OperatorConfig) -> None:
    """Give the operator's memo every OperatorMemo attribute before any run is seen (the startup handler).

    An OperatorMemo has them already. An embedder may instead pass kopf's plain ``kopf.Memo`` (a dict read
    by attribute, e.g. ``kopf.Memo(api=..., config=...)``): each OperatorMemo field it lacks (or holds as
    None) is set to OperatorMemo's default (``config``: the registry's), so the handlers read either alike.
    """
    if isinstance(memo, OperatorMemo):
        return
    defaults = OperatorMemo(config=config)
    for item in dataclasses.fields(OperatorMemo):
        if memo.get(item.name) is None:
            memo[item.name] = getattr(defaults, item.name)


def get_run_state(memo: OperatorMemo) -> RunState:
    """The run's :class:`RunState` in its memo, created on first use (kopf's per-run copy: see OperatorMemo)."""
    if memo.run is None:
        memo.run = RunState()
    return memo.run
