"""One prefill -> decode KV hand-off sent straight to a pair of servers (not through the router), so that a
pair's first NIXL connection is paid before real requests use it: on CPU it took from 6 s to over 120 s and
outlasted the prefill's 30 s KV lease, while later hand-offs took 0.1-0.4 s (benchmarks/README.md, "The first
KV hand-off of a new prefill/decode pair")."""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Sequence

from rlrun_api import constants as c
from rlrun_api.prometheus import get_samples

HANDOFF_TIMEOUT_S = 240.0  # one request of a hand-off: a pair's first NIXL connection took up to over 120 s
METRICS_TIMEOUT_S = 10.0   # one GET of decode's /metrics (a loaded CPU server answers late)
PROMPT = "The KV cache of this prompt travels from prefill to decode."  # ~13 tokens: part of one KV block


class HandoffError(RuntimeError):
    """A hand-off request failed (HTTP error, timeout, or a prefill answer without ``kv_transfer_params``)."""


@dataclasses.dataclass(frozen=True)
class Handoff:
    """One hand-off's outcome: seconds end to end, and the decode server's NIXL counters' increase
    (``vllm:nixl_xfer_time_seconds`` count, ``vllm:nixl_num_failed_transfers``) over it.

    The counters are the server's, not the request's: exact while nothing else reaches that decode server (a
    joining decode server before it is routed to; the orchestrator's check, one hand-off at a time per decode
    server), best effort while it serves traffic (a joining prefill server's check of serving decode servers)."""

    prefill: str
    decode: str
    seconds: float
    transfers: float
    failed: float

    @property
    def ok(self) -> bool:
        """The decode server read KV over NIXL (a read that failed is recomputed on decode and counts as
        failed, not as a transfer; a failure counted meanwhile on a server with traffic does not refute it)."""
        return self.transfers >= 1


def get_handoff_pairs(prefill: Sequence[str], engines: Sequence[str]) -> list[tuple[str, str]]:
    """Every (prefill, decode) pair of engine base URLs (pure): ``engines`` lists every engine, prefill ones
    included; the decode engines are the others. Sorted, duplicates removed."""
    producers = sorted(set(prefill))
    consumers = sorted(set(engines) - set(producers))
    return [(p, d) for p in producers for d in consumers]


def get_joined_pairs(joined: str, prefill: Sequence[str], serving: Sequence[str]) -> list[tuple[str, str]]:
    """The (prefill, decode) pairs a server that ``joined`` a running P/D run needs checked (pure): with every
    decode server among ``serving`` when it is a prefill server (listed in ``prefill``), else with every
    prefill server among ``serving``. ``serving``: the engines whose pairs were checked already (the joiner
    itself, if listed, is left out). Sorted, duplicates removed."""
    producers = set(prefill)
    others = sorted(set(serving) - {joined})
    if joined in producers:
        return [(joined, d) for d in others if d not in producers]
    return [(p, joined) for p in others if p in producers]


def get_prefill_body(salt: str) -> dict[str, Any]:
    """The prefill request (pure): compute the prompt's KV and keep it for a remote decode, one token.

    ``salt`` is the request's ``cache_salt``, a fresh one per hand-off: should a block size ever be small
    enough for the prompt to fill a block, neither side finds it cached, so the KV still travels. The
    ``kv_transfer_params`` are the request side of vLLM's NixlConnector (``do_remote_decode``; what
    vllm-router's P/D mode sends to prefill)."""
    return {"model": c.SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0,
            "cache_salt": salt, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}}


def get_decode_body(salt: str, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The decode request (pure): the same prompt and salt, with the ``kv_transfer_params`` prefill answered
    (where its KV blocks are), one token."""
    return {"model": c.SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0,
            "cache_salt": salt, "stream": False, "kv_transfer_params": kv_transfer_params}


def _post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise HandoffError(f"POST {url}: HTTP {err.code}: {_body_of(err)}") from err
    except (OSError, ValueError, http.client.HTTPException) as err:  # timeouts, resets, a cut or non-JSON answer
        raise HandoffError(f"POST {url}: {type(err).__name__}: {err}") from err
    if not isinstance(answer, dict):
        raise HandoffError(f"POST {url}: the answer is not a JSON object: {str(answer)[:200]}")
    return answer


def _body_of(err: urllib.error.HTTPError) -> str:
    try:
        return repr(err.read()[:200])
    except (OSError, http.client.HTTPException):
        return "(no body)"


def read_nixl_counts(decode_url: str, timeout_s: float = METRICS_TIMEOUT_S) -> tuple[float, float]:
    """(KV transfers, failed KV transfers) a decode server has counted (its ``/metrics``).

    Raises:
        HandoffError: ``/metrics`` did not answer or is not a Prometheus exposition.
    """
    try:
        with urllib.request.urlopen(f"{decode_url}/metrics", timeout=timeout_s) as response:
            samples = get_samples(response.read().decode())
    except (OSError, ValueError, http.client.HTTPException) as err:
        raise HandoffError(f"GET {decode_url}/metrics: {type(err).__name__}: {err}") from err
    return (samples.get(f"{c.VLLM_METRIC_NIXL_TRANSFER_SECONDS}_count", 0.0),
            samples.get(f"{c.VLLM_METRIC_NIXL_FAILED_TRANSFERS}_total", 0.0))


def send_handoff(prefill_url: str, decode_url: str, timeout_s: float) -> Handoff:
    """Send one hand-off from ``prefill_url`` to ``decode_url`` (server base URLs) and wait for it.

    ``timeout_s`` bounds each of the two requests. The decode one is what waits for a first connection: vLLM
    0.32's NixlConnector connects decode to prefill (ZMQ handshake, then UCX endpoints) on the first request
    that pairs them, and on CPU prefill's UCX accepted that TCP connection up to minutes after decode's
    ``connect()`` (the benchmark record quotes the UCX debug log).

    Raises:
        HandoffError: a request failed or timed out, or prefill answered without ``kv_transfer_params``.
    """
    salt = f"kv-handoff-{uuid.uuid4().hex}"
    started = time.monotonic()
    transfers, failed = read_nixl_counts(decode_url)
    answer = _post_json(f"{prefill_url}/v1/completions", get_prefill_body(salt), timeout_s)
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise HandoffError(f"{prefill_url} answered without kv_transfer_params: is it a kv_producer?")
    _post_json(f"{decode_url}/v1/completions", get_decode_body(salt, params), timeout_s)
    transfers_after, failed_after = read_nixl_counts(decode_url)
    return Handoff(prefill_url, decode_url, time.monotonic() - started, transfers_after - transfers,
                   failed_after - failed)
