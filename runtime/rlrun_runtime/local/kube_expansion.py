"""Kubernetes ``$(VAR)`` expansion of container env values, commands and arguments (pure).

A port of the kubelet's expansion (``k8s.io/kubernetes/third_party/forked/golang/expansion``, function
``Expand``), so that ``rlrun local`` turns a rendered pod into exactly the command line a node would run:

- ``$(NAME)`` is replaced by the value of NAME when NAME is defined; an undefined reference is left as
  written, ``$(NAME)``;
- ``$$`` is an escaped ``$``: ``$$(NAME)`` gives the literal text ``$(NAME)``;
- any other ``$`` (``$x``, a ``$(`` without its ``)``, a trailing ``$``) is kept as written.

For env values the defined names are the variables listed *earlier* in the same container (after
``envFrom``); for ``command`` and ``args`` they are all of the container's variables
(Kubernetes docs, "Define Dependent Environment Variables" and "Define a Command and Arguments for a
Container").
"""

from __future__ import annotations

from typing import Mapping

_OPERATOR = "$"
_OPENER = "("
_CLOSER = ")"


def _read_reference(rest: str) -> tuple[str, bool, int]:
    """What follows a ``$``: (text, is_variable_name, characters consumed). ``rest`` is never empty."""
    first = rest[0]
    if first == _OPERATOR:
        return _OPERATOR, False, 1
    if first == _OPENER:
        end = rest.find(_CLOSER, 1)
        if end != -1:
            return rest[1:end], True, end + 1
        return _OPERATOR + _OPENER, False, 1
    return _OPERATOR + first, False, 1


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Expand ``$(NAME)`` references in ``text`` from ``variables`` with the kubelet's rules (see module doc).

    Examples: ``expand("--port=$(P)", {"P": "8000"}) == "--port=8000"``;
    ``expand("$$(P)", {"P": "8000"}) == "$(P)"``; ``expand("$(MISSING)", {}) == "$(MISSING)"``.
    """
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == _OPERATOR and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            read, is_name, advance = _read_reference(text[cursor + 1:])
            if is_name:
                out.append(variables[read] if read in variables else f"$({read})")
            else:
                out.append(read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)
