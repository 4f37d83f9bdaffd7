"""`rlrun-runtime ROLE ...`: the entry point of every container of a run, and of `rlrun local`.

Each role lives in its own module with a ``main(argv: list[str]) -> int``; importing is lazy so that a
role only pays for what it uses (the router never imports torch).
"""

from __future__ import annotations

import importlib
import sys

ROLES = {
    "inference": ("rlrun_runtime.inference", "vLLM OpenAI server (prefill, decode or both) with RL endpoints"),
    "router": ("rlrun_runtime.router", "vllm-router in front of the inference servers"),
    "orchestrator": ("rlrun_runtime.orchestrator", "the asynchronous rollout / weight-update loop"),
    "trainer": ("rlrun_runtime.trainer", "the policy-gradient trainer (run under torchrun)"),
    "make-tiny-model": ("rlrun_runtime.tiny_model", "build the tiny local model (no download)"),
    "local": ("rlrun_runtime.local", "run a whole RLRun on this machine"),
}


def _usage() -> str:
    lines = ["usage: rlrun-runtime ROLE [options]", "", "roles:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in ROLES.items()]
    lines.append("\n`rlrun-runtime ROLE --help` shows a role's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the role named by the first argument; returns the role's exit code (2 on bad usage)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    role, rest = args[0], args[1:]
    if role not in ROLES:
        print(f"rlrun-runtime: unknown role {role!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(ROLES[role][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
