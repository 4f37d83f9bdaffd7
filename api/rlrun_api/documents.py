"""RLRun documents from YAML files and text (pure apart from reading the file): one mapping per document,
a repeated key refused, every document checked to be an RLRun before anything else looks at it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlrun_api import constants


class SpecFileError(ValueError):
    """A spec file cannot be read as RLRun documents; the message names the file and what to change."""


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    """Read every YAML document of the file ``path`` and check that each one is an RLRun mapping.

    Empty documents (a trailing ``---``) are ignored. Returns at least one dict.

    Raises:
        SpecFileError: the file is missing or unreadable, not UTF-8, not YAML (a repeated key included),
            holds no document, or a
            document is not a mapping with ``apiVersion: rlrun.dev/v1alpha1`` and ``kind: RLRun``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecFileError(f"{path}: no such file; pass the path of an RLRun YAML file") from None
    except IsADirectoryError:
        raise SpecFileError(f"{path}: is a directory; pass the path of an RLRun YAML file") from None
    except UnicodeDecodeError:
        raise SpecFileError(f"{path}: is not UTF-8 text; save the RLRun as UTF-8 YAML") from None
    except OSError as exc:
        raise SpecFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return parse_documents(text, str(path))


def get_single(docs: list[dict[str, Any]], source: str, reader: str) -> dict[str, Any]:
    """The one RLRun of ``docs`` (read from ``source``), for a ``reader`` that takes one per file.

    Raises:
        SpecFileError: ``docs`` holds more than one document, e.g. "run.yaml: holds 2 RLRun documents; rlrun
            render reads exactly one per file".
    """
    if len(docs) != 1:
        raise SpecFileError(f"{source}: holds {len(docs)} RLRun documents; {reader} reads exactly one per file")
    return docs[0]


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping holds the same key twice (``key``; 1-based ``line`` of the repeat, ``first_line``)."""

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"duplicate key {key!r} at line {line} (first at line {first_line})")
        self.key = key
        self.line = line
        self.first_line = first_line


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a mapping with a repeated key raises DuplicateKeyError instead of
    silently keeping the last value (YAML 1.2 requires unique keys; kubectl refuses them too)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<" merge keys may repeat
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:  # by key, not by line: a flow mapping can repeat a key on one line
                    raise DuplicateKeyError(key, line, seen[key])
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader reports it itself
                continue
        return super().construct_mapping(node, deep)


# A plain scalar that looks like a date (``2026-01-02``) stays a string, as kubectl's YAML-to-JSON
# conversion keeps it: JSON has no date type, so a datetime.date could reach no API server.
UniqueKeyLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)


def parse_documents(text: str, source: str) -> list[dict[str, Any]]:
    """Parse YAML ``text`` into RLRun documents, as ``load_documents`` does; ``source`` names it in errors.

    Raises:
        SpecFileError: as ``load_documents``, less the file-system errors; also for a mapping that repeats
            a key (UniqueKeyLoader), naming the key and both lines.
    """
    path = source
    try:
        docs = [d for d in yaml.load_all(text, Loader=UniqueKeyLoader) if d is not None]
    except DuplicateKeyError as exc:
        raise SpecFileError(f"{path}: key {exc.key!r} appears twice in one mapping (line {exc.first_line} and "
                            f"line {exc.line}); keep only one of them") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise SpecFileError(f"{path}: nests too deeply to be read (thousands of levels); flatten it") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecFileError(f"{path}: is not valid YAML{where} ({problem}); fix the syntax") from None
    if not docs:
        raise SpecFileError(
            f"{path}: holds no YAML document; write an RLRun (see examples/rlrun-minimal.yaml)")
    for i, doc in enumerate(docs):
        where = f"{path}" if len(docs) == 1 else f"{path} (document {i + 1})"
        if not isinstance(doc, dict):
            raise SpecFileError(
                f"{where}: is a YAML {type(doc).__name__}, not a mapping; write an RLRun: a mapping with "
                f"apiVersion: {constants.API_VERSION}, kind: {constants.KIND}, metadata and spec")
        if doc.get("apiVersion") != constants.API_VERSION or doc.get("kind") != constants.KIND:
            raise SpecFileError(
                f"{where}: is apiVersion {doc.get('apiVersion')!r} kind {doc.get('kind')!r}, not an RLRun; "
                f"set apiVersion: {constants.API_VERSION} and kind: {constants.KIND}")
    return docs
