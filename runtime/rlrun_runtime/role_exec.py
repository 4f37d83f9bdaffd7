"""Hand a role's process over to the server it wraps (vLLM, vllm-router), or print its command (pure I/O)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence


def exec_server(role: str, command: Sequence[str], env: Mapping[str, str], dry_run: bool) -> int:
    """Log ``command`` to stderr, then replace this process with it (``os.execvpe``), so signals reach it.

    With ``dry_run`` the command is printed to stdout as a JSON list instead and 0 is returned.
    Without it the function does not return.
    """
    print(f"rlrun-runtime {role}: " + " ".join(command), file=sys.stderr, flush=True)
    if dry_run:
        print(json.dumps(list(command)))
        return 0
    os.execvpe(command[0], list(command), dict(env))
    raise AssertionError("unreachable: execvpe returned")
