"""`rlrun`: validate and render RLRun files, print the CRD, and run an RLRun on this machine.

Commands (exit status 0 on success, 2 on bad input or usage, never a traceback for bad input):
  rlrun validate FILE...          schema + CEL + semantic checks (rlrun_api.validation)
  rlrun render FILE [-n NS] [--operator-namespace NS]
                                  the manifests the operator applies, as a multi-document YAML stream
  rlrun crd                       the CustomResourceDefinition, exactly as shipped
  rlrun local FILE [options]      hand over to the runtime package (`rlrun-runtime local`)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any, TextIO

from rlrun_api import __version__, constants, documents, names, spec, validation

EXIT_OK = 0
EXIT_INVALID = 2

# What `rlrun local` needs beyond rlrun_api and the operator (module names, checked without importing them).
RUNTIME_MODULES = ("rlrun_runtime", "rlrun_runtime.local", "torch", "vllm")
RUNTIME_INSTALL_HINT = (
    "rlrun local needs the runtime package (torch, vLLM); install it with\n"
    "    pip install -e '.[runtime]'\n"
    "from a checkout of rlrun, or run `make local` there (installs everything into .venv and runs the tiny "
    "example)."
)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `rlrun` (subcommands validate, render, crd, local; --version)."""
    parser = argparse.ArgumentParser(
        prog="rlrun", description="Asynchronous RL post-training of LLMs: the RLRun API and its tools.")
    parser.add_argument("--version", action="version", version=f"rlrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check RLRun files (schema, CEL rules, semantic checks)")
    p.add_argument("files", nargs="+", metavar="FILE", help="RLRun YAML file(s); - reads standard input")

    p = sub.add_parser(
        "render", help="print the Kubernetes manifests the operator applies for an RLRun",
        description="Print the Kubernetes manifests the operator creates for an RLRun, exactly as it POSTs them "
                    "(spec-hash annotation included). Only the ownerReferences to the RLRun are missing: they "
                    "need the RLRun's uid, which exists once the RLRun is applied, so the operator adds them then.")
    p.add_argument("file", metavar="FILE", help="RLRun YAML file (one document); - reads standard input")
    p.add_argument("-n", "--namespace", help="namespace of the run (default: metadata.namespace or 'default')")
    p.add_argument("--operator-namespace", default=constants.DEFAULT_OPERATOR_NAMESPACE,
                   help="namespace of the operator's pods, the only ones outside the run that the inference "
                        "NetworkPolicy admits (default: %(default)s, where the README installs the chart)")

    sub.add_parser("crd", help="print the RLRun CustomResourceDefinition")

    # `local` is dispatched in main() before parsing (argparse's REMAINDER drops a leading --help); it is
    # declared here so that `rlrun --help` lists it.
    sub.add_parser("local", help="run an RLRun on this machine (needs the runtime package); "
                                 "`rlrun local --help` shows its options")
    return parser


def read_documents(name: str) -> list[dict[str, Any]]:
    """RLRun documents of the file ``name``, or of standard input when ``name`` is "-".

    Raises:
        documents.SpecFileError: see documents.load_documents.
    """
    if name == "-":
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError:
            raise documents.SpecFileError("-: standard input is not UTF-8 text; pipe in RLRun YAML") from None
        return documents.parse_documents(text, "-")
    return documents.load_documents(name)


def run_validate(files: list[str], out: TextIO) -> int:
    """Print ``FILE: OK`` or one ``FILE: path: message`` line per error; 0 when every file is valid, else 2."""
    status = EXIT_OK
    for name in files:
        try:
            docs = read_documents(name)
        except documents.SpecFileError as exc:
            print(str(exc), file=out)
            status = EXIT_INVALID
            continue
        lines = []
        for i, doc in enumerate(docs):
            label = name if len(docs) == 1 else f"{name} (document {i + 1})"
            lines += [f"{label}: {err}" for err in validation.validate(doc)]
        print("\n".join(lines) if lines else f"{name}: OK", file=out)
        if lines:
            status = EXIT_INVALID
    return status


def prepare_for_render(rlrun: dict[str, Any], namespace: str | None) -> dict[str, Any]:
    """The defaulted RLRun with metadata.namespace set (``namespace``, else the file's, else "default").

    Raises:
        ValueError: ``namespace`` contradicts metadata.namespace of the file.
    """
    out = spec.apply_defaults(rlrun)
    metadata = out.setdefault("metadata", {})
    declared = metadata.get("namespace")
    if namespace and declared and namespace != declared:
        raise ValueError(f"metadata.namespace is {declared!r} but -n/--namespace is {namespace!r}; drop one "
                         "or make them equal")
    metadata["namespace"] = namespace or declared or "default"
    return out


def run_render(file: str, namespace: str | None, out: TextIO, err: TextIO,
               operator_namespace: str = constants.DEFAULT_OPERATOR_NAMESPACE) -> int:
    """Validate ``file`` (one RLRun) and print what the operator creates for it as a YAML stream:
    ``render.render()`` with apply.get_creatable's spec-hash annotation (ownerReferences are added at apply
    time, when the RLRun has a uid). Returns 0, or 2 on bad input."""
    if not names.DNS_1123_LABEL.match(operator_namespace):
        print(f"--operator-namespace {operator_namespace!r} is not a namespace name (lower-case letters, digits "
              "and '-', at most 63); pass the namespace the operator runs in", file=err)
        return EXIT_INVALID
    try:
        run = documents.get_single(read_documents(file), file, "rlrun render")
    except documents.SpecFileError as exc:
        print(str(exc), file=err)
        return EXIT_INVALID
    errors = validation.validate(run)
    if errors:
        for error in errors:
            print(f"{file}: {error}", file=err)
        return EXIT_INVALID
    try:
        rlrun = prepare_for_render(run, namespace)
    except ValueError as exc:
        print(f"{file}: {exc}", file=err)
        return EXIT_INVALID
    from rlrun_operator import apply, reconcile  # only this command needs the operator's modules
    from rlrun_operator.render import RenderError, render
    from rlrun_operator.render.config import dump_manifests

    try:
        manifests = render(rlrun, operator_namespace=operator_namespace)
    except RenderError as exc:  # a spec the renderer refuses (its message names the field and the fix)
        print(f"{file}: {exc}", file=err)
        return EXIT_INVALID
    # What the operator POSTs: the same objects with its spec-hash annotation and, on the pools, the size
    # fields they were sized from (apply.get_creatable).
    suspended = bool(rlrun["spec"].get("suspend"))
    sizes = reconcile.get_pool_sizes(rlrun["spec"])
    manifests = [apply.get_creatable(m, suspended, sizes) for m in manifests]
    out.write(dump_manifests(manifests))  # the ConfigMap's run config as a literal block, not an escaped string
    return EXIT_OK


def missing_runtime_modules() -> list[str]:
    """Modules of RUNTIME_MODULES that cannot be found (checked with importlib.util.find_spec, not imported)."""
    missing = []
    for name in RUNTIME_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def run_local(args: list[str], err: TextIO) -> int:
    """Hand ``args`` to ``rlrun_runtime.cli.main(["local", *args])``; 2 with install advice when it is missing."""
    missing = missing_runtime_modules()
    if missing:
        print(f"rlrun local: missing {', '.join(missing)}.\n{RUNTIME_INSTALL_HINT}", file=err)
        return EXIT_INVALID
    from rlrun_runtime import cli as runtime_cli  # present: missing_runtime_modules() found it

    return int(runtime_cli.main(["local", *args]) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rlrun` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["local"]:  # every later token, options included, belongs to `rlrun-runtime local`
            return run_local(argv[1:], sys.stderr)
        args = build_parser().parse_args(argv)
        if args.command == "validate":
            return run_validate(args.files, sys.stdout)
        if args.command == "render":
            return run_render(args.file, args.namespace, sys.stdout, sys.stderr, args.operator_namespace)
        sys.stdout.write(spec.crd_text())  # args.command == "crd"
        return EXIT_OK
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `rlrun render x.yaml | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
