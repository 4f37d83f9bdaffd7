"""Benchmark: a NIXL READ between two processes on this machine, by how the target's UCX progress thread runs.

Why: NIXL's Python agent starts its UCX progress thread with ``pthrDelay = 0`` (a spin); on a 2-core machine
the prefill/decode vLLM servers' threads took a core each (benchmarks/README.md, the P/D CI test). rlrun's
vLLM plugin (runtime/rlrun_runtime/vllm_plugin.py) gives the thread a pause instead; this measures whether a
READ still completes against an idle target, how fast, and what the idle agents cost in CPU.

Setup per mode: a target process registers 4 MiB of float32 DRAM with a NIXL agent (UCX backend), hands its
agent metadata and descriptors to the reader (this process), then idles ``--idle-s`` seconds (or polls
``get_new_notifs`` every 10 ms in the polling mode); the reader READs the whole buffer and checks its content.
Printed per mode: READ state and latency, and CPU seconds of both processes over the run (``os.times``).

    .venv/bin/python -m benchmarks.nixl_progress [--idle-s 20] [--read-timeout-s 15]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

ELEMENTS = 1 << 20  # 4 MiB of float32
MODES = {  # name: (progress thread on, its pause in microseconds or None for NIXL's 0, target polls)
    "progress thread, pause 0 (NIXL's default)": (True, None, False),
    "no progress thread, target idle": (False, None, False),
    "no progress thread, target polling every 10 ms": (False, None, True),
    "progress thread, pause 1000 us (rlrun on CPU)": (True, 1000, False),
}


def make_agent(name: str, thread: bool, delay_us: int | None) -> Any:
    """A NIXL agent with the UCX backend; ``delay_us`` set through rlrun's plugin wrapper when given."""
    import nixl._api as nixl_api

    from rlrun_runtime.vllm_plugin import get_delayed_agent

    if delay_us is not None and getattr(nixl_api.nixlBind.nixlAgent, "rlrun_delay_us", None) is None:
        nixl_api.nixlBind.nixlAgent = get_delayed_agent(nixl_api.nixlBind.nixlAgent, delay_us)
    return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(enable_prog_thread=thread, num_threads=4))


def reg_descs(agent: Any, buf: np.ndarray) -> Any:
    return agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")


def xfer_descs(agent: Any, buf: np.ndarray) -> Any:
    return agent.get_xfer_descs([(buf.ctypes.data, buf.nbytes, 0)], "DRAM")


def target(mode: tuple[bool, int | None, bool], out: Any, done: Any, idle_s: float) -> None:
    thread, delay_us, poll = mode
    agent = make_agent("target", thread, delay_us)
    buf = np.arange(ELEMENTS, dtype=np.float32)
    agent.register_memory(reg_descs(agent, buf))
    out.put((agent.get_agent_metadata(), agent.get_serialized_descs(xfer_descs(agent, buf))))
    deadline = time.monotonic() + idle_s
    while time.monotonic() < deadline:
        if poll:
            agent.get_new_notifs()
            time.sleep(0.01)
        else:
            time.sleep(0.2)
    done.get()


def run_mode(mode: tuple[bool, int | None, bool], idle_s: float, read_timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Queue()
    before = os.times()
    proc = ctx.Process(target=target, args=(mode, out, done, idle_s))
    proc.start()
    thread, delay_us, _ = mode
    agent = make_agent("reader", thread, delay_us)
    local = np.zeros(ELEMENTS, dtype=np.float32)
    agent.register_memory(reg_descs(agent, local))
    metadata, descs = out.get(timeout=120)
    remote_name = agent.add_remote_agent(metadata)
    started = time.monotonic()
    handle = agent.initialize_xfer("READ", xfer_descs(agent, local), agent.deserialize_descs(descs),
                                   remote_name, b"bench")
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR") and time.monotonic() - started < read_timeout_s:
        time.sleep(0.001)
        state = agent.check_xfer_state(handle)
    latency = time.monotonic() - started
    done.put(1)
    proc.join(timeout=idle_s + 60)
    after = os.times()
    return {"state": state, "latency_ms": latency * 1000, "ok": state == "DONE" and bool((local == np.arange(ELEMENTS, dtype=np.float32)).all()),
            "target_cpu_s": after.children_user + after.children_system - before.children_user
            - before.children_system,
            "reader_cpu_s": after.user + after.system - before.user - before.system}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=20.0, help="how long the target idles (s)")
    parser.add_argument("--read-timeout-s", type=float, default=15.0, help="give up on the READ after (s)")
    args = parser.parse_args()
    print(f"NIXL READ of {ELEMENTS * 4 >> 20} MiB between two processes, UCX backend, target idle {args.idle_s:.0f} s")
    for name, mode in MODES.items():
        r = run_mode(mode, args.idle_s, args.read_timeout_s)
        shown = f"{r['latency_ms']:.0f} ms" if r["state"] == "DONE" else f"not done after {r['latency_ms'] / 1000:.0f} s"
        print(f"  {name:48s} READ {r['state']:4s} {shown:>22s}  data ok {r['ok']}  CPU s: target "
              f"{r['target_cpu_s']:.1f}, reader {r['reader_cpu_s']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
