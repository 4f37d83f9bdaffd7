"""RLRun status from the children, the orchestrator's progress metrics and the generation (pure).

Phase (docs/operator.md has the table):
- Pending: no workload child exists yet (also while the spec is invalid and nothing was ever created).
- Initializing: children exist, but not every role has come up yet.
- Running: the trainer has all its pods ready, every inference pool and the router have at least one ready
  pod and the orchestrator Job has a ready pod; a run that was Running stays Running (Degraded=True) when a
  role loses pods.
- Suspended: spec.suspend is true.  Succeeded / Failed: the orchestrator Job's Complete / Failed condition
  (sticky: a finished run whose Job was removed stays Succeeded / Failed).
Ready=True only when the phase is Running, the last reconcile applied the current metadata.generation and
every role has desired == ready == updated > 0, "updated" counting only replicas of the controller's
current generation (observedGeneration == generation), as Kubernetes API conventions ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlrun_api import constants

PHASE_PENDING = "Pending"
PHASE_INITIALIZING = "Initializing"
PHASE_RUNNING = "Running"
PHASE_SUSPENDED = "Suspended"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"
TERMINAL_PHASES = (PHASE_SUCCEEDED, PHASE_FAILED)

REASON_INVALID_SPEC = "InvalidSpec"
# Status keys this module owns (others, e.g. scalingHistory, are never touched).
OWNED_KEYS = ("phase", "observedGeneration", "step", "policyVersion", "lastReward", "lastEvalReward",
              "lastEvalPolicyVersion", "startTime", "completionTime", "conditions", "replicas")

# The roles, named by their app.kubernetes.io/component.
TRAINER = constants.COMPONENT_TRAINER
INFERENCE = constants.COMPONENT_INFERENCE
PREFILL = constants.COMPONENT_PREFILL
DECODE = constants.COMPONENT_DECODE
ROUTER = constants.COMPONENT_ROUTER
ORCHESTRATOR = constants.COMPONENT_ORCHESTRATOR
# role (its status.replicas key) -> (kind, app.kubernetes.io/component)
ROLES: dict[str, tuple[str, str]] = {
    TRAINER: ("StatefulSet", TRAINER),
    INFERENCE: ("Deployment", INFERENCE),
    PREFILL: ("Deployment", PREFILL),
    DECODE: ("Deployment", DECODE),
    ROUTER: ("Deployment", ROUTER),
    ORCHESTRATOR: ("Job", ORCHESTRATOR),
}


@dataclass(frozen=True)
class Progress:
    """What the orchestrator's /metrics said (None where a metric was absent)."""

    step: int | None = None
    policy_version: int | None = None
    last_reward: float | None = None
    weight_update_in_flight: bool | None = None
    stalled_engines: int | None = None          # constants.METRIC_STALLED_ENGINES
    engines_out_of_service: int | None = None   # constants.METRIC_ENGINES_OUT_OF_SERVICE
    eval_reward: float | None = None            # constants.METRIC_EVAL_REWARD (held-out evaluation)
    eval_policy_version: int | None = None      # constants.METRIC_EVAL_POLICY_VERSION


def get_field(rlrun: Any, *keys: str) -> Any:
    """``rlrun[k1][k2]...``, or None where a level is missing or not a mapping (an invalid spec's status is
    computed too, and its fields may have any type)."""
    for key in keys:
        if not isinstance(rlrun, dict):
            return None
        rlrun = rlrun.get(key)
    return rlrun


def get_expected_roles(rlrun: dict[str, Any]) -> list[str]:
    """Roles a defaulted RLRun runs: trainer, prefill+decode or inference, router, orchestrator."""
    disaggregated = get_field(rlrun, "spec", "inference", "disaggregation", "enabled") is True
    pools = [PREFILL, DECODE] if disaggregated else [INFERENCE]
    return [TRAINER, *pools, ROUTER, ORCHESTRATOR]


def _job_condition(job: dict[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in job.get("status", {}).get("conditions") or [])


def get_role_replicas(obj: dict[str, Any]) -> dict[str, int]:
    """{desired, ready, updated} of a Deployment, StatefulSet or Job.

    Deployment/StatefulSet: desired = spec.replicas (default 1), ready = status.readyReplicas, updated =
    status.updatedReplicas counted only when status.observedGeneration == metadata.generation. Job: desired =
    spec.parallelism (default 1; 0 when suspended), ready = status.ready (pods ready; Kubernetes >= 1.24)
    or status.active; updated = ready (a Job whose template changed is replaced, never rolled).
    """
    spec, st = obj.get("spec") or {}, obj.get("status") or {}
    if obj.get("kind") == "Job":
        desired = 0 if spec.get("suspend") else int(spec.get("parallelism", 1))
        ready = int(st.get("ready", st.get("active", 0)) or 0)
        return {"desired": desired, "ready": ready, "updated": ready}
    desired = int(spec.get("replicas", 1))
    current = st.get("observedGeneration") == obj.get("metadata", {}).get("generation")
    return {"desired": desired, "ready": int(st.get("readyReplicas", 0) or 0),
            "updated": int(st.get("updatedReplicas", 0) or 0) if current else 0}


def find_role(workloads: list[dict[str, Any]], role: str) -> dict[str, Any] | None:
    """The workload of ``role`` among the run's Deployments/StatefulSets/Jobs (by kind and component label)."""
    kind, component = ROLES[role]
    for obj in workloads:
        labels = obj.get("metadata", {}).get("labels") or {}
        if obj.get("kind") == kind and labels.get(constants.LABEL_COMPONENT) == component:
            return obj
    return None


def _fully_ready(r: dict[str, int]) -> bool:
    return r["desired"] > 0 and r["ready"] == r["desired"] and r["updated"] == r["desired"]


def _role_condition(kind: str, roles: dict[str, dict[str, int]], names: list[str], suspended: bool,
                    ) -> tuple[str, str, str]:
    present = [n for n in names if n in roles]
    if suspended:
        return "False", "Suspended", "the run is suspended"
    if len(present) < len(names):
        return "False", "NotCreated", f"{kind}: " + ", ".join(n for n in names if n not in roles) + " not created"
    text = "; ".join(f"{n} ready {roles[n]['ready']}/{roles[n]['desired']}, updated {roles[n]['updated']}"
                     for n in present)
    if all(_fully_ready(roles[n]) for n in present):
        return "True", "AllReplicasReady", text
    return "False", "ReplicasNotReady", text


def get_phase(workloads: list[dict[str, Any]], roles: dict[str, dict[str, int]], expected: list[str],
              suspended: bool, old_phase: str | None) -> str:
    """The run's phase from its workloads (see the module docstring)."""
    job = find_role(workloads, ORCHESTRATOR)
    if job is not None and _job_condition(job, "Complete"):
        return PHASE_SUCCEEDED
    if job is not None and _job_condition(job, "Failed"):
        return PHASE_FAILED
    if job is None and old_phase in TERMINAL_PHASES:
        return old_phase  # the finished Job was removed (by hand or a TTL): the run stays finished
    if suspended:
        return PHASE_SUSPENDED
    if not workloads:
        return PHASE_PENDING
    up = all(r in roles for r in expected) and all(
        (_fully_ready(roles[r]) if r == TRAINER else roles[r]["ready"] >= 1) for r in expected)
    if up or (old_phase == PHASE_RUNNING and all(r in roles for r in expected)):
        return PHASE_RUNNING
    return PHASE_INITIALIZING


def get_conditions(old: list[dict[str, Any]], new: list[tuple[str, str, str, str]], generation: int | None,
                   now: str) -> list[dict[str, Any]]:
    """Conditions in API conventions from (type, status, reason, message) tuples; lastTransitionTime is
    kept from ``old`` when a condition's status did not change, else ``now``."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for ctype, status, reason, message in new:
        before = previous.get(ctype)
        changed = before is None or before.get("status") != status
        cond = {"type": ctype, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": now if changed else before.get("lastTransitionTime", now)}
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    return out


def get_status(rlrun: dict[str, Any], workloads: list[dict[str, Any]], progress: Progress | None, now: str,
               reconciled_generation: int | None, invalid: list[str] | None = None,
               failure: str | None = None) -> dict[str, Any]:
    """The RLRun status the operator wants (pure; compare with the old one via get_status_patch).

    Args:
        rlrun: the defaulted RLRun (metadata.generation, spec.suspend, spec.inference.disaggregation, and
            its current status for lastTransitionTime, startTime and sticky progress).
        workloads: the run's Deployments, StatefulSet and Job as the API server has them (with ``kind``).
        progress: the orchestrator's scraped metrics, or None when they could not be read (the last known
            step/policyVersion/lastReward/lastEvalReward/lastEvalPolicyVersion are then kept, as each is
            when its metric is absent: the evaluation gauges exist only after a run's first evaluation).
        now: RFC 3339 timestamp, e.g. "2026-01-01T00:00:00Z".
        reconciled_generation: metadata.generation of the spec last applied to the children, or None.
        invalid: "path: message" lines when the spec fails validation (Ready=False reason InvalidSpec).
        failure: the orchestrator's last termination message (why it exited non-zero), shown in the
            Degraded condition of a failed or restarted orchestrator.

    Returns:
        dict with the OWNED_KEYS that have a value.
    """
    old = rlrun.get("status") or {}
    generation = rlrun.get("metadata", {}).get("generation")
    suspended = get_field(rlrun, "spec", "suspend") is True
    expected = get_expected_roles(rlrun)
    roles = {}
    for role in ROLES:
        obj = find_role(workloads, role)
        if obj is not None:
            roles[role] = get_role_replicas(obj)
    phase = get_phase(workloads, roles, expected, suspended, old.get("phase"))
    pools = [r for r in expected if r in constants.POOL_COMPONENTS]
    role_conditions = [
        ("TrainerReady", *_role_condition(TRAINER, roles, [TRAINER], suspended)),
        ("InferenceReady", *_role_condition(INFERENCE, roles, pools, suspended)),
        ("RouterReady", *_role_condition(ROUTER, roles, [ROUTER], suspended)),
        ("OrchestratorReady", *_role_condition(ORCHESTRATOR, roles, [ORCHESTRATOR], suspended)),
    ]
    current = reconciled_generation is not None and reconciled_generation == generation
    all_ready = all(c[1] == "True" for c in role_conditions)
    if invalid:
        ready = ("False", REASON_INVALID_SPEC, "; ".join(invalid))
        progressing = ("False", REASON_INVALID_SPEC, "fix the spec; children are left as they are")
    elif phase in TERMINAL_PHASES or phase == PHASE_SUSPENDED:
        ready = ("False", phase, f"the run is {phase.lower()}")
        progressing = ("False", phase, f"the run is {phase.lower()}")
    elif not current:
        ready = ("False", "ReconcilePending", f"generation {generation} is not applied to the children yet")
        progressing = ("True", "Reconciling", f"applying generation {generation}")
    elif phase == PHASE_RUNNING and all_ready:
        ready = ("True", "AllRolesReady", "every role runs the current generation")
        progressing = ("True", "Training", "the orchestrator is driving the training loop")
    else:
        waiting = [c[0] for c in role_conditions if c[1] != "True"]
        ready = ("False", "RolesNotReady", "waiting for " + ", ".join(waiting))
        progressing = ("True", "RollingOut", "waiting for " + ", ".join(waiting))
    job = find_role(workloads, ORCHESTRATOR)
    stalled = (progress.stalled_engines or 0) if progress else 0
    paused = (progress.engines_out_of_service or 0) if progress else 0
    if phase == PHASE_FAILED:
        degraded = ("True", "OrchestratorFailed", "the orchestrator Job failed" + (f": {failure}" if failure else ""))
    elif phase == PHASE_RUNNING and stalled:
        degraded = ("True", "EngineStalled", f"{stalled} inference engine(s) have not answered the orchestrator "
                                             f"for {constants.ENGINE_STALL_AFTER_S:.0f} s or more (its log names them)")
    elif phase == PHASE_RUNNING and paused:
        degraded = ("True", "EngineOutOfService", f"{paused} inference engine(s) left paused by a failed weight "
                                                  "update (its log names them)")
    elif phase == PHASE_RUNNING and not all_ready and current:
        lost = [r for r in expected if r in roles and roles[r]["ready"] < roles[r]["desired"]]
        degraded = ("True", "ReplicasUnavailable", "fewer ready replicas than desired: " + ", ".join(lost)) \
            if lost else ("False", "AsExpected", "")
    elif job is not None and int((job.get("status") or {}).get("failed", 0) or 0) > 0 and phase not in TERMINAL_PHASES:
        degraded = ("True", "OrchestratorRestarted", f"orchestrator pods failed {job['status']['failed']} time(s)"
                    + (f"; last: {failure}" if failure else ""))
    else:
        degraded = ("False", "AsExpected", "")
    conditions = get_conditions(old.get("conditions") or [], [
        ("Ready", *ready), *role_conditions, ("Progressing", *progressing), ("Degraded", *degraded)],
        generation, now)
    status: dict[str, Any] = {"phase": phase, "conditions": conditions,
                              "replicas": {r: roles[r] for r in ROLES if r in roles}}
    if reconciled_generation is not None:
        status["observedGeneration"] = reconciled_generation
    if workloads:
        status["startTime"] = old.get("startTime") or now
    if phase in TERMINAL_PHASES:
        status["completionTime"] = old.get("completionTime") or now
    values = {"step": progress.step if progress else None,
              "policyVersion": progress.policy_version if progress else None,
              "lastReward": progress.last_reward if progress else None,
              "lastEvalReward": progress.eval_reward if progress else None,
              "lastEvalPolicyVersion": progress.eval_policy_version if progress else None}
    for key, value in values.items():
        if value is not None:
            status[key] = value
        elif old.get(key) is not None:
            status[key] = old[key]
    return status


def get_status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Merge patch turning ``old`` status into ``new`` for the OWNED_KEYS (None deletes a key; roles that
    disappeared from ``replicas`` are deleted too). Empty when nothing changed: then no write is made."""
    old = old or {}
    patch: dict[str, Any] = {}
    for key in OWNED_KEYS:
        if key not in new:
            if old.get(key) is not None:
                patch[key] = None
        elif old.get(key) != new[key]:
            if key == "replicas" and isinstance(old.get(key), dict):
                patch[key] = {**{r: None for r in old[key] if r not in new[key]}, **new[key]}
            else:
                patch[key] = new[key]
    return patch
