"""Weight update time, pause -> resume, push (``gloo``) versus ``filesystem``, on one real vLLM server on CPU.

Run from the repository root (takes the heavy lock itself is up to the caller)::

    flock /tmp/rlrun-heavy.lock .venv/bin/python -m benchmarks.weight_push --rounds 10
    flock /tmp/rlrun-heavy.lock .venv/bin/python -m benchmarks.weight_push --qwen3-0.6b --rounds 3

One server (transport gloo, so it runs rlrun's engine) serves the model; every round publishes a new
version through the push transport (which also writes ``weights/step-N``), then updates the server with
it twice through the one update sequence (``weights/update.py``): once pushed from memory, once reloaded
from the storage by the filesystem transport (push first in odd rounds, filesystem first in even ones). The figures are the sequence's own ``latency_ms`` (pause
sent -> resume answered), each round's latency, and their split: the median time of every engine call of
the update (``TIMED_CALLS``; the calls made alongside the pause, the push's join and session start among
them, overlap it, so "other" can be negative), the trainer's send of the buckets (it overlaps
``update_weights``) and the rest ("other": the store round trips of the push), and the engine's own split of
every push (the line
``rlrun gloo engine: update ...`` its worker prints: receive waited for, ``load_weights``, finalization). ``--qwen3-0.6b`` serves a random model of Qwen3-0.6B's shape in bfloat16
(~1.2 GB of safetensors written and re-read per filesystem load). The first line printed names the
``rlrun_runtime`` package the run imports (the server inherits ``PYTHONPATH``, so it loads the same tree):
with ``PYTHONPATH`` pointing at another checkout, the benchmark measures that checkout's code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import VLLMAdmin
from rlrun_runtime.weights.filesystem import FilesystemTransport
from rlrun_runtime.weights.push import PushTransport
from rlrun_runtime.weights.push_protocol import DEFAULT_BUCKET_BYTES
from rlrun_runtime.weights.update import update_engines


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def qwen3_06b_dir(path: Path) -> Path:
    """A random Qwen3-0.6B-shaped model (bfloat16, tied embeddings) with the tiny model's tokenizer files."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                         tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def start_server(config: Path, storage: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, **{constants.ENV_STORAGE_DIR: str(storage), constants.ENV_BIND_HOST: "127.0.0.1",
                              constants.ENV_VLLM_CPU_KVCACHE_SPACE: "1", constants.ENV_INFERENCE_PORT: str(port),
                              constants.ENV_INFERENCE_ROLE: "both"})
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlrun_runtime.cli", "inference", "--config", str(config)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        time.sleep(1)
    raise SystemExit("vLLM not healthy after 900 s")


def state_of(model_dir: Path, seed: int, dtype) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    state = {name: (p + (torch.randn(p.shape, generator=generator) * 1e-3).to(p.dtype)).contiguous()
             for name, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


# The engine calls inside one update (pause -> resume), in the order the update sequence makes them.
TIMED_CALLS = ("pause", "health", "worker_count", "init_weight_transfer_engine", "start_weight_update",
               "update_weights", "finish_weight_update", "reload_weights", "update_weight_version",
               "reset_prefix_cache", "resume")


def time_admin_calls(sink: dict[str, float]) -> None:
    """Wrap the :class:`VLLMAdmin` methods named in ``TIMED_CALLS`` (this process only) so that each call's
    wall time, in ms, adds up in ``sink[name]``: the split of one update's latency."""
    for name in TIMED_CALLS:
        original = getattr(VLLMAdmin, name)

        async def timed(self, *args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return await _original(self, *args, **kwargs)
            finally:
                sink[_name] = sink.get(_name, 0.0) + (time.perf_counter() - start) * 1000.0

        setattr(VLLMAdmin, name, timed)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--qwen3-0.6b", dest="big", action="store_true")
    parser.add_argument("--bucket-mib", type=int, default=0,
                        help="push bucket size in MiB (default: push_protocol.DEFAULT_BUCKET_BYTES)")
    args = parser.parse_args(argv)
    import torch

    import rlrun_runtime

    print(f"rlrun_runtime from {Path(rlrun_runtime.__file__).parent}", flush=True)

    with tempfile.TemporaryDirectory(prefix="rlrun-bench-push-") as tmp:
        root = Path(tmp)
        storage = root / "storage"
        if args.big:
            model, dtype, torch_dtype = str(qwen3_06b_dir(root / "qwen3-0.6b")), "bfloat16", torch.bfloat16
        else:
            model, dtype, torch_dtype = constants.TINY_MODEL_NAME, "float32", torch.float32
        rlrun = {"apiVersion": constants.API_VERSION, "kind": constants.KIND, "metadata": {"name": "bench"},
                 "spec": {"model": {"name": model, "dtype": dtype, "maxModelLen": 128},
                          "environment": {"type": "builtin", "name": "reverse-words", "seed": 0},
                          "trainer": {"gpusPerNode": 0}, "inference": {"gpusPerReplica": 0, "replicas": 1},
                          "weightSync": {"transport": "gloo"}}}
        config = root / "run.yaml"
        config.write_text(yaml.safe_dump(rlrun))
        os.environ.setdefault(constants.ENV_WEIGHT_PUSH_PORT, "0")
        proc, url = start_server(config, storage, root / "vllm.log")
        try:
            model_dir = Path(model) if args.big else storage / "model"
            template = root / "template"
            template.mkdir()
            for entry in model_dir.iterdir():
                if entry.is_file() and not entry.name.endswith((".safetensors", ".index.json")):
                    (template / entry.name).write_bytes(entry.read_bytes())
            bucket_bytes = args.bucket_mib * 2**20 if args.bucket_mib > 0 else DEFAULT_BUCKET_BYTES
            push = PushTransport(RunStorage(storage), bucket_bytes=bucket_bytes)
            filesystem = FilesystemTransport(RunStorage(storage))
            times: dict[str, list[float]] = {"push": [], "filesystem": []}
            splits: dict[str, list[dict[str, float]]] = {"push": [], "filesystem": []}
            sink: dict[str, float] = {}
            time_admin_calls(sink)
            publish_s = []
            previous = None
            for version in range(1, args.rounds + 1):
                state = state_of(model_dir, version, torch_dtype)
                start = time.perf_counter()
                push.publish(state, version, template)
                publish_s.append(time.perf_counter() - start)
                pair = (("push", push), ("filesystem", filesystem))
                # which goes first alternates: the first update of a process pays one-off costs (imports,
                # vLLM's first layerwise reload), which would otherwise always fall on the push
                for name, transport in (pair if version % 2 else pair[::-1]):
                    sink.clear()
                    update = asyncio.run(update_engines([url], version, transport, previous=previous))[0]
                    times[name].append(update.latency_ms)
                    split = dict(sink)
                    if name == "push" and push.service is not None and push.service.records:
                        # the trainer's send of every bucket (overlaps the engine's receive and load)
                        split["trainer send"] = push.service.records[max(push.service.records)].seconds * 1000.0
                    split["other"] = update.latency_ms - sum(sink.values())
                    splits[name].append(split)
                previous = version
            push.close()
            size = sum(p.stat().st_size for p in RunStorage(storage).weights(args.rounds).glob("*.safetensors"))
            print(f"model {'random Qwen3-0.6B shape, bf16' if args.big else 'rlrun-tiny, fp32'}, "
                  f"{size / 2**20:.1f} MiB per version, {args.rounds} rounds, buckets of "
                  f"{bucket_bytes / 2**20:g} MiB, fallbacks {push.fallbacks}")
            for name, values in times.items():
                later = values[1:] or values  # the first round carries the process's one-off costs
                print(f"{name:>10}: pause->resume p50 {statistics.median(values):8.1f} ms  "
                      f"p99 {percentile(values, 0.99):8.1f} ms  max {max(values):8.1f} ms  "
                      f"(rounds 2-{len(values)}: p50 {statistics.median(later):.1f}, "
                      f"p99 {percentile(later, 0.99):.1f})")
            print(f"   publish (hold + write to storage): median {statistics.median(publish_s) * 1000:.1f} ms")
            for name, rows in splits.items():
                keys = [k for k in (*TIMED_CALLS, "trainer send", "other") if any(k in row for row in rows)]
                print(f"{name:>10} split, median ms per round: "
                      + ", ".join(f"{k} {statistics.median(row.get(k, 0.0) for row in rows):.1f}" for k in keys))
            for name, values in times.items():
                print(f"{name:>10} per round, ms: " + " ".join(f"{v:.1f}" for v in values))
            # the engine's own split of each push (gloo_engine.finish_weight_update prints one line per update)
            for line in (root / "vllm.log").read_text(errors="replace").splitlines():
                if "rlrun gloo engine: update" in line:
                    print("    engine: " + line[line.index("rlrun gloo engine: ") + len("rlrun gloo engine: "):])
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
