"""``rlrun local FILE``: run a whole RLRun on this machine from the manifests the operator would apply.

Steps: validate the file (exit 2 with ``FILE: path: message`` lines, before anything starts); check the
environment and the model path (exit 2 naming the field and the fix); render the manifests with
``rlrun_operator.render.render`` (namespace "local"); turn them into processes (``local.plan``: same
commands and env as the pods, hosts -> 127.0.0.1, ports -> free loopback ports, ConfigMap -> a file,
PVC -> the output directory); build the model once (``tiny_model.ensure_model``) so the roles do not race
on it; start every role under the supervisor (``local.processes``) with a live progress display
(``local.progress``); when the orchestrator finishes, record each inference server's ``/metrics`` and
weight version in ``DIR/inference-metrics/``, stop the rest, copy the last published weights to
``DIR/final/`` and draw ``DIR/plot.png``.

Exit status: 0 the run succeeded; 1 a role failed (named, with its last log lines; checkpoints stay on
disk for ``--resume``); 2 bad input; 130/143 interrupted by SIGINT/SIGTERM, 141 when the reader of its
output went away (every child is stopped).

Threads: a laptop or CI machine has few cores shared by vLLM, the trainer, the router and the
orchestrator, so every role gets ``OMP_NUM_THREADS=1`` (and MKL/OpenBLAS likewise) unless the caller's
environment sets them; vLLM's CPU worker binds its own OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TextIO

from rlrun_api import constants as c

from .plan import LOCAL_HOST, LocalPaths, LocalPlan, PlanError, get_local_plan
from ..storage import RunStorage, atomic_directory, atomic_write_text, list_steps

if TYPE_CHECKING:
    from rlrun_api.views import AutoscalingView

    from .scaling import ScalablePlan

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
LOCAL_NAMESPACE = "local"
DEFAULT_OUTPUT_ROOT = Path("outputs")

# Defaults for every role's environment (the caller's environment wins): one compute thread per role on
# a small shared machine, unbuffered logs, no tokenizer thread pools.
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
# Entries of the output directory that mean "a run already wrote here" (see docs/runtime-contract.md).
RUN_STATE_ENTRIES = ("metrics.jsonl", "rollouts", "weights", "checkpoints", "orchestrator")
# DIR/inference-metrics/: each inference server's /metrics and weight version as the run ends
# (record_inference_metrics).
INFERENCE_METRICS_DIR = "inference-metrics"
INFERENCE_METRICS_TIMEOUT_S = 10.0  # per GET; a server busy with its last requests may answer slowly on CPU


class LocalInputError(ValueError):
    """Bad user input found before anything starts; the message names the field (or option) and the fix."""


def build_parser() -> argparse.ArgumentParser:
    """Options of ``rlrun local``."""
    parser = argparse.ArgumentParser(
        prog="rlrun local",
        description="Run an RLRun on this machine: the same commands and env as the operator's pods, with "
                    "service hosts on 127.0.0.1 and free ports, the ConfigMap as a file and the output "
                    "directory as the shared storage.")
    parser.add_argument("file", metavar="FILE", help="RLRun YAML file (one document)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where metrics.jsonl, rollout samples, checkpoints, final/ weights, plot.png and "
                             "logs/ go (default outputs/<metadata.name>/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue a run in an output directory that already holds one, from its latest "
                             "checkpoint")
    parser.add_argument("--grace-seconds", type=float, default=15.0,
                        help="seconds the roles get to exit after SIGTERM before SIGKILL (default 15)")
    return parser


# --- input checks (pure apart from reading the file and probing paths) -----------------------------

def load_run(file: str) -> dict[str, Any]:
    """Read, validate and default the RLRun in ``file``; metadata.namespace becomes "local".

    Raises:
        LocalInputError: unreadable file, not exactly one RLRun, validation errors (one
            ``FILE: path: message`` line each), or spec.suspend set.
    """
    from rlrun_api import documents, spec, validation

    try:
        run = documents.get_single(documents.load_documents(file), file, "rlrun local")
    except documents.SpecFileError as exc:
        raise LocalInputError(str(exc)) from None
    errors = validation.validate(run)
    if errors:
        raise LocalInputError("\n".join(f"{file}: {error}" for error in errors))
    rlrun = spec.apply_defaults(run)
    if rlrun["spec"].get("suspend"):
        raise LocalInputError(f"{file}: spec.suspend: true scales every role to zero, so nothing would run; "
                              "set it to false to run the run locally")
    rlrun.setdefault("metadata", {})["namespace"] = LOCAL_NAMESPACE
    return rlrun


def check_environment(file: str, run_spec: Mapping[str, Any]) -> None:
    """Load ``spec.environment`` the way the orchestrator will.

    Raises:
        LocalInputError: the environment cannot be loaded (unknown name, missing package, bad args).
    """
    from ..environments import load_environment

    try:
        load_environment(dict(run_spec["environment"]))
    except ValueError as exc:
        message = str(exc)
        if not message.startswith("spec.environment"):
            message = f"spec.environment: {message}"
        raise LocalInputError(f"{file}: {message}") from None


def check_gpus(file: str, run_spec: Mapping[str, Any], visible_gpus: int) -> None:
    """Every GPU the spec asks for per pod must be visible here (pure: the caller counts the GPUs).

    Raises:
        LocalInputError: naming spec.trainer.gpusPerNode or spec.inference.gpusPerReplica and the fix.
    """
    wanted = {"spec.trainer.gpusPerNode": int(run_spec["trainer"]["gpusPerNode"]),
              "spec.inference.gpusPerReplica": int(run_spec["inference"]["gpusPerReplica"])}
    short = [f"{field}: {count}" for field, count in wanted.items() if count > visible_gpus]
    if short:
        raise LocalInputError(
            f"{file}: {', '.join(short)} GPU(s) per pod, but this machine shows {visible_gpus}; set "
            "spec.trainer.gpusPerNode: 0 and spec.inference.gpusPerReplica: 0 to run on CPU "
            "(examples/rlrun-tiny.yaml does), or run it on a cluster")


def count_gpus() -> int:
    """CUDA devices torch can see here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def get_model_path(run_spec: Mapping[str, Any], output_dir: Path) -> Path | None:
    """The local directory ``spec.model.name`` points to, or None for rlrun-tiny and Hugging Face ids (pure).

    A name is a path when it starts with ``/``, ``.`` or ``~``. A path under spec.storage.mountPath is
    on the run's storage, which is ``output_dir`` locally.
    """
    name = str(run_spec["model"]["name"])
    if name == c.TINY_MODEL_NAME or not name.startswith(("/", ".", "~")):
        return None
    mount = str(run_spec["storage"]["mountPath"]).rstrip("/")
    if mount and (name == mount or name.startswith(mount + "/")):
        return output_dir / name[len(mount):].lstrip("/")
    return Path(name).expanduser()


def check_model(file: str, run_spec: Mapping[str, Any], output_dir: Path) -> None:
    """Raises LocalInputError when spec.model.name is a path without an HF model (no config.json)."""
    path = get_model_path(run_spec, output_dir)
    if path is not None and not (path / "config.json").is_file():
        raise LocalInputError(
            f"{file}: spec.model.name: {run_spec['model']['name']!r} is not a model directory (no config.json "
            f"in {path}); point it to a Hugging Face-format directory, or use a Hugging Face id or "
            f"{c.TINY_MODEL_NAME}")


def has_run_state(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds the state of an earlier run (RUN_STATE_ENTRIES)."""
    return any((output_dir / entry).exists() for entry in RUN_STATE_ENTRIES)


def check_output_dir(output_dir: Path, resume: bool) -> None:
    """Raises LocalInputError when ``output_dir`` holds a run and ``--resume`` was not given, or is a file."""
    if output_dir.exists() and not output_dir.is_dir():
        raise LocalInputError(f"--output-dir: {output_dir} is a file; pass a directory")
    if not resume and has_run_state(output_dir):
        raise LocalInputError(
            f"--output-dir: {output_dir} already holds a run (metrics, weights or checkpoints); pass --resume "
            "to continue it from its latest checkpoint, or choose another --output-dir")


def get_base_env(environ: Mapping[str, str], bin_dir: Path) -> dict[str, str]:
    """Environment every role starts from: ``environ`` + THREAD_ENV defaults, ``bin_dir`` first on PATH (pure).

    ``bin_dir`` is the directory of this Python (the virtual environment's ``bin``), so the rendered
    commands ``torchrun`` and ``rlrun-runtime`` resolve to this installation.
    """
    env = dict(environ)
    for key, value in THREAD_ENV.items():
        env.setdefault(key, value)
    path = env.get("PATH", "")
    if str(bin_dir) not in path.split(os.pathsep):
        env["PATH"] = os.pathsep.join([str(bin_dir), path]) if path else str(bin_dir)
    return env


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default ip_local_port_range, when the file cannot be read
FIXED_PORTS_LOW = 10000  # FreePorts' lowest port (below: many well-known services' ports)


def get_ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), from which it picks every port-0 bind and outgoing
    connection's port; Linux's default when ``path`` cannot be read (another OS)."""
    try:
        first, last = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return first, last


class FreePorts:
    """Port allocator for ``get_local_plan``: free loopback ports below the kernel's ephemeral range, never the
    same twice.

    The kernel gives ports of its ephemeral range to every port-0 bind and outgoing connection, so a port taken
    from there at plan time can be handed to another process before the role binds it; a server that joins minutes
    later (autoscaling) lost its router's port that way ("Address already in use"). A port below the range is taken
    only by a program that picks it itself (a service's fixed port, another ``rlrun local``), so the window in
    which a role can lose its port shrinks to those; it is not closed (the role then fails to start and the run
    stops with its name). Each port is checked free when given out, by a bind on every IPv4 address (which a
    listener on any one address, or on all, refuses). ``rng`` picks the candidates (``random.Random()``);
    ``ephemeral`` overrides :func:`get_ephemeral_range`. Where the range leaves fewer than 1000 ports above
    :data:`FIXED_PORTS_LOW`, the kernel's own free ports are given instead.

    Raises (on call):
        RuntimeError: no free port in 200 tries.
    """

    def __init__(self, rng: random.Random | None = None, ephemeral: tuple[int, int] | None = None) -> None:
        self.given: set[int] = set()
        self.rng = rng or random.Random()
        first = (ephemeral or get_ephemeral_range())[0]
        self.span = (FIXED_PORTS_LOW, first) if first - FIXED_PORTS_LOW >= 1000 else None

    def __call__(self) -> int:
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("0.0.0.0", self.rng.randrange(*self.span) if self.span else 0))
                except OSError:  # taken now
                    continue
                port = sock.getsockname()[1]
            if port not in self.given:
                self.given.add(port)
                return port
        raise RuntimeError("no free loopback port found")


def get_plan(rlrun: dict[str, Any], output_dir: Path, environ: Mapping[str, str]) -> LocalPlan:
    """Render ``rlrun`` and translate the manifests (raises LocalInputError for render/plan errors)."""
    from rlrun_operator import render

    try:
        manifests = render.render(rlrun)
    except ValueError as exc:  # RenderError and SizingError name the field and the fix
        raise LocalInputError(str(exc)) from None
    try:
        return get_local_plan(manifests, FreePorts(), LocalPaths(output_dir),
                              get_base_env(environ, Path(sys.executable).parent))
    except PlanError as exc:
        raise LocalInputError(f"cannot run locally: {exc}") from None


def is_autoscaled(run_spec: Mapping[str, Any]) -> bool:
    """spec.autoscaling.enabled on a disaggregated run (the only kind the autoscaler scales)."""
    return bool(run_spec["autoscaling"]["enabled"]) and bool(run_spec["inference"]["disaggregation"]["enabled"])


def get_scalable_plan(rlrun: dict[str, Any], output_dir: Path, environ: Mapping[str, str]
                      ) -> tuple["ScalablePlan", "AutoscalingView", FreePorts]:
    """The plan of an autoscaled run (``local.scaling``): a process for every server each pool may grow to
    within the local policy, the initial ones started; the local policy; the port allocator (new routers
    take ports from it, never one the plan holds for a spare server).

    Raises:
        LocalInputError: render/plan errors, a transport other than filesystem, pools that do not fit the
            local maximum (each names the field and the fix).
    """
    from rlrun_api.views import AutoscalingView
    from rlrun_operator import render

    from .scaling import LocalScalingError, get_local_policy, split_plan, widen_pools

    run_spec = rlrun["spec"]
    transport = run_spec["weightSync"]["transport"]
    if transport != "filesystem":
        raise LocalInputError(f"spec.weightSync.transport: {transport!r} pushes weights to a fixed set of servers; "
                              "rlrun local scales servers only with transport: filesystem (or set "
                              "spec.autoscaling.enabled: false)")
    try:
        policy = get_local_policy(AutoscalingView.from_spec(run_spec))
        manifests, initial = widen_pools(render.render(rlrun), policy)
    except ValueError as exc:  # RenderError, SizingError, LocalScalingError name the field and the fix
        raise LocalInputError(str(exc)) from None
    ports = FreePorts()
    try:
        plan = get_local_plan(manifests, ports, LocalPaths(output_dir),
                              get_base_env(environ, Path(sys.executable).parent))
        scalable = split_plan(plan, initial, output_dir / c.LOCAL_SERVERS_FILE)
    except (PlanError, LocalScalingError) as exc:
        raise LocalInputError(f"cannot run locally: {exc}") from None
    return scalable, policy, ports


def missing_commands(plan: LocalPlan) -> list[str]:
    """argv[0]s of the plan that are not found on the processes' PATH."""
    missing = []
    for process in plan.processes:
        if shutil.which(process.argv[0], path=process.env.get("PATH")) is None and process.argv[0] not in missing:
            missing.append(process.argv[0])
    return missing


# --- after the run ---------------------------------------------------------------------------------

def record_inference_metrics(plan: LocalPlan, directory: Path,
                             timeout_s: float = INFERENCE_METRICS_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """Write what each inference server reports while it still runs (the run's outcome is decided).

    For every process of an inference pool (``constants.POOL_COMPONENTS``), reached on its
    ``RLRUN_INFERENCE_PORT``: ``directory/<pod>.prom``, its ``GET /metrics`` exposition as served (vLLM's
    counters are cumulative: the decode server's ``vllm:nixl_xfer_time_seconds_count`` counts every KV
    transfer of the run), and its entry in ``directory/servers.json``, which is returned:
    ``{pod: {"component", "url", "weight_version" (GET /weight_info's string, None when unread), "error"
    (None, or why a GET failed)}}``. A server that does not answer within ``timeout_s`` has only its
    error recorded. Never raises: a failure to write is returned as the entries' error too.
    """
    import http.client
    import urllib.request

    def get(url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()

    servers: dict[str, dict[str, Any]] = {}
    for process in plan.processes:
        port = process.env.get(c.ENV_INFERENCE_PORT)
        if process.component not in c.POOL_COMPONENTS or not port:
            continue
        url = f"http://{LOCAL_HOST}:{port}"
        entry: dict[str, Any] = {"component": process.component, "url": url, "weight_version": None, "error": None}
        try:
            text = get(f"{url}/metrics")
            atomic_write_text(directory / f"{process.name}.prom", text.decode("utf-8", errors="replace"))
            entry["weight_version"] = str(json.loads(get(f"{url}/weight_info"))["weight_version"])
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:  # URLError is an OSError
            entry["error"] = f"{type(exc).__name__}: {exc}"
        servers[process.name] = entry
    if servers:
        try:
            atomic_write_text(directory / "servers.json", json.dumps(servers, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            for entry in servers.values():
                entry["error"] = entry["error"] or f"servers.json not written: {exc}"
    return servers


def publish_final(storage: RunStorage, final_dir: Path) -> int | None:
    """Copy the newest ``weights/step-N`` to ``final_dir`` atomically; returns N (None when there is none)."""
    steps = list_steps(storage.weights_dir)
    if not steps:
        return None
    source = storage.weights(steps[-1])
    with atomic_directory(final_dir) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
    return steps[-1]


def write_plot(storage: RunStorage, path: Path, title: str) -> Path | None:
    """plot.png from metrics.jsonl; None when there is nothing to plot."""
    from .progress import parse_metrics_lines
    from ..plot import render_plot

    try:
        rows = parse_metrics_lines(storage.metrics_file.read_text(encoding="utf-8"))
        return render_plot(rows, path, title=title)
    except (OSError, ValueError):
        return None


def _print_summary(out: TextIO, storage: RunStorage, output_dir: Path, final_step: int | None,
                   plot: Path | None) -> None:
    from .progress import get_reward_summary, parse_metrics_lines, render_summary

    try:
        rows = parse_metrics_lines(storage.metrics_file.read_text(encoding="utf-8"))
    except OSError:
        rows = []
    summary = get_reward_summary(rows)
    if summary is not None:
        print(render_summary(summary), file=out)
    if final_step is not None:
        print(f"final weights (step {final_step}): {output_dir / 'final'}", file=out)
    if plot is not None:
        print(f"plot: {plot}", file=out)
    print(f"metrics: {storage.metrics_file}; logs: {output_dir / 'logs'}", file=out)


# --- main -----------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``rlrun local FILE [--output-dir DIR] [--resume]``; returns the exit status (see module docstring)."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        rlrun = load_run(args.file)
        run_spec = rlrun["spec"]
        name = rlrun["metadata"]["name"]
        output_dir = (args.output_dir or DEFAULT_OUTPUT_ROOT / name).resolve()
        check_environment(args.file, run_spec)
        check_gpus(args.file, run_spec, count_gpus())
        check_model(args.file, run_spec, output_dir)
        check_output_dir(output_dir, args.resume)
        if args.grace_seconds < 0:
            raise LocalInputError("--grace-seconds: must be >= 0")
        scaling = get_scalable_plan(rlrun, output_dir, os.environ) if is_autoscaled(run_spec) else None
        plan = scaling[0].plan if scaling else get_plan(rlrun, output_dir, os.environ)
    except LocalInputError as exc:
        print(str(exc), file=err)
        return EXIT_INVALID
    missing = missing_commands(plan)
    if missing:
        print(f"rlrun local: {', '.join(missing)} not found on PATH; install the runtime "
              "(pip install -e '.[runtime]') into this Python's environment", file=err)
        return EXIT_INVALID
    for warning in plan.warnings:
        print(f"warning: {warning}", file=err)
    return run_plan(plan, run_spec, name, output_dir, args.resume, args.grace_seconds, out, err, scaling=scaling)


def get_role_error(log: Path) -> str | None:
    """The last ``rlrun-runtime ROLE: ...`` error line a role wrote to its log, if any.

    Roles report user errors as one such line (and exit 2); torchrun's own traceback that follows a
    failed trainer would otherwise bury it.
    """
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    errors = [line.strip() for line in lines if re.match(r"\s*rlrun-runtime [a-z-]+: ", line)
              and "vllm.entrypoints" not in line]  # the inference role echoes its vLLM command that way too
    return errors[-1] if errors else None


def run_plan(plan: LocalPlan, run_spec: Mapping[str, Any], name: str, output_dir: Path, resume: bool,
             grace_seconds: float, out: TextIO, err: TextIO,
             scaling: tuple["ScalablePlan", "AutoscalingView", FreePorts] | None = None) -> int:
    """Write the config, build the model, run the processes with progress, then publish final/ and the plot.
    ``scaling`` (from :func:`get_scalable_plan`): run the local autoscaler (``local.scaler``) beside them."""
    from .processes import Supervisor, become_subreaper
    from .progress import ProgressDisplay

    storage = RunStorage(output_dir)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    outcome = None
    previous: dict[int, Any] = {}
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        for path, text in plan.files.items():
            atomic_write_text(path, text)
        resume_step = None
        if resume:
            checkpoints = list_steps(storage.checkpoints_dir)
            resume_step = checkpoints[-1] if checkpoints else 0
            print(f"resuming {name} in {output_dir}: "
                  + (f"latest checkpoint is step {checkpoints[-1]}" if checkpoints else "no checkpoint yet, "
                     "starting from step 0"), file=out)
        print(f"preparing the model for {name} ({run_spec['model']['name']}) ...", file=out, flush=True)
        from ..tiny_model import ensure_model

        ensure_model(run_spec["model"]["name"], storage)
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        become_subreaper()
        print(f"starting {len(plan.processes)} processes ({', '.join(p.name for p in plan.processes)}); "
              f"logs in {output_dir / 'logs'}", file=out, flush=True)
        print("waiting for the inference servers and the first batch (vLLM starts in about 30-150 s on CPU) ...",
              file=out, flush=True)
        orchestrators = plan.by_component(c.COMPONENT_ORCHESTRATOR)
        port = orchestrators[0].env.get(c.ENV_METRICS_PORT) if orchestrators else None
        supervisor = Supervisor(plan.processes, cwd=Path.cwd(), grace_seconds=grace_seconds)
        orchestrator_metrics = f"http://{LOCAL_HOST}:{port}/metrics" if port else None
        scaler = calls = None
        if scaling is not None:
            from ..weights import get_transport
            from .scaler import LocalScaler, SupervisorCalls

            calls = SupervisorCalls()
            scaler = LocalScaler(scaling[0], scaling[1], get_transport(run_spec["weightSync"]["transport"], storage),
                                 calls.call, scaling[2], orchestrator_metrics, output_dir / c.LOCAL_SCALING_FILE)
            print(f"autoscaling: at most {scaling[1].max_replicas} inference servers here (prefill "
                  f"{scaling[1].prefill.min}-{scaling[1].prefill.max}, decode {scaling[1].decode.min}-"
                  f"{scaling[1].decode.max}); decisions in {output_dir / c.LOCAL_SCALING_FILE}"
                  + (" (dryRun: recorded, not applied)" if scaling[1].dry_run else ""), file=out, flush=True)
        display = ProgressDisplay(storage.metrics_file, orchestrator_metrics,
                                  int(run_spec["algorithm"]["maxSteps"]), [p.name for p in plan.processes], out,
                                  resume_step=resume_step, scaling=scaler.summary if scaler else None)
        supervisor.start()  # before the display's refresh thread exists (the children fork a clean process)
        scaler_stop = threading.Event()
        if scaler is not None:
            threading.Thread(target=scaler.run, args=(scaler_stop,), name="rlrun-local-scaler", daemon=True).start()

        def on_tick() -> None:
            if calls is not None:
                calls.run_pending(supervisor)
            display.update(supervisor.exits())

        def before_stop(_outcome: Any) -> None:
            scaler_stop.set()
            exited = supervisor.exits()
            live = tuple(p for p in supervisor.specs if p.name not in exited)
            record_inference_metrics(dataclasses.replace(plan, processes=live), output_dir / INFERENCE_METRICS_DIR)

        with display:
            try:
                outcome = supervisor.wait(stop, on_tick=on_tick, before_stop=before_stop)
            finally:
                scaler_stop.set()
            display.update(supervisor.exits())
    except KeyboardInterrupt:  # Ctrl-C while the model is being built: no role has started yet
        received.append(signal.SIGINT)
    except BrokenPipeError:  # the reader of our output went away (`| head`): the roles are stopped by now
        received.append(signal.SIGPIPE)
        out = open(os.devnull, "w")  # noqa: SIM115 (nothing more can reach the closed pipe)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    final_step = publish_final(storage, output_dir / "final") if outcome is not None and outcome.success else None
    plot = write_plot(storage, output_dir / "plot.png", title=name)
    if outcome is not None and outcome.success:
        print(f"run {name} succeeded: {outcome.reason}", file=out)
        _print_summary(out, storage, output_dir, final_step, plot)
        return EXIT_OK
    if received:
        print(f"rlrun local: interrupted by {signal.Signals(received[0]).name}; every role was stopped; "
              f"continue with --resume --output-dir {output_dir}", file=err)
        return 128 + received[0]
    assert outcome is not None
    print(f"rlrun local: run {name} failed: {outcome.reason}", file=err)
    if outcome.failed:
        log = next(p.log_path for p in plan.processes if p.name == outcome.failed)
        cause = get_role_error(log)
        if cause:  # the role's own one-line error (rlrun-runtime ROLE: field: what; fix), above any traceback
            print(f"cause: {cause}", file=err)
        print(f"last lines of {log}:", file=err)
        for line in outcome.log_tail:
            print(f"  {line}", file=err)
    print(f"every role was stopped; checkpoints stay in {storage.checkpoints_dir}; continue with --resume "
          f"--output-dir {output_dir}", file=err)
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
