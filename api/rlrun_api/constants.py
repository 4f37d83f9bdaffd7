"""Every port, label, annotation, env var and name rlrun uses, in one place.

The renderer writes these into manifests, the runtime roles read them back, the operator and
`rlrun local` agree on them. Nothing else in the code base spells them out.
"""

from types import MappingProxyType

# --- API -----------------------------------------------------------------------------------------
GROUP = "rlrun.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLRun"
PLURAL = "rlruns"

# --- The operator's own settings ---------------------------------------------------------------
OPERATOR_STATUS_INTERVAL_S = 5.0  # default seconds between status refreshes of a run (rlrun-operator --status-interval)

# Namespace of the operator's pods when it is not told otherwise: the README's `helm install -n rlrun-system`.
DEFAULT_OPERATOR_NAMESPACE = "rlrun-system"
# The operator's own namespace, set by the chart from the downward API (metadata.namespace).
ENV_OPERATOR_NAMESPACE = "RLRUN_OPERATOR_NAMESPACE"
# Where the operator finds Kubernetes credentials, like `kopf run`: set in every pod (in-cluster service
# account), else the kubeconfig files (first path used; default ~/.kube/config).
ENV_KUBERNETES_SERVICE_HOST = "KUBERNETES_SERVICE_HOST"
ENV_KUBECONFIG = "KUBECONFIG"
DEFAULT_KUBECONFIG = "~/.kube/config"

# --- Ports (container ports; `rlrun local` maps each to a free loopback port) ---------------------
INFERENCE_PORT = 8000          # vLLM OpenAI server: completions, /metrics and the RL admin endpoints
ROUTER_PORT = 8000             # vllm-router API
ROUTER_METRICS_PORT = 29000    # vllm-router Prometheus endpoint
ORCHESTRATOR_METRICS_PORT = 9090  # orchestrator progress metrics (read by the operator)
TRAINER_MASTER_PORT = 29500    # torchrun rendezvous (c10d) on trainer pod 0
NIXL_SIDE_CHANNEL_PORT = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT: NIXL handshake between prefill and decode
SERVICE_DISCOVERY_PORT = INFERENCE_PORT  # port vllm-router uses for pods it discovers
TRAINER_METRICS_PORT = 9091     # trainer rank 0: Prometheus metrics and liveness
WEIGHT_PUSH_PORT = 29600       # trainer rank 0: TCPStore rendezvous of the push weight transports (gloo, nccl)
WEIGHT_PUSH_PORT_NAME = "weight-push"  # its name on the trainer pods and Service (push transports only)
TRAINER_METRICS_PORT_NAME = "metrics"      # TRAINER_METRICS_PORT's name on the trainer pods (PodMonitor, NetworkPolicy)
OPERATOR_METRICS_PORT = 8080
OPERATOR_HEALTH_PORT = 8081

# --- Labels and annotations ---------------------------------------------------------------------
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "rlrun"
MANAGED_BY = "rlrun-operator"
OPERATOR_APP_NAME = "rlrun-operator"  # app.kubernetes.io/name of the operator's own pods (NetworkPolicy peer)
# Label every namespace carries (Kubernetes >= 1.22): how a NetworkPolicy selects one namespace by name.
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (Kubernetes >= 1.28)

ANNOTATION_PREFIX = "rlrun.dev"
ANNOTATION_SPEC_HASH = "rlrun.dev/spec-hash"          # hash of a child's rendered spec, to skip no-op writes
ANNOTATION_CONFIG_HASH = "rlrun.dev/config-hash"      # on pod templates: rolls pods when the run config changes
# On a scaled (inference/prefill/decode) Deployment of a suspended run: its replicas before suspend.
ANNOTATION_REPLICAS_BEFORE_SUSPEND = "rlrun.dev/replicas-before-suspend"
# On a scaled Deployment: the spec's size fields its replicas were last set from (canonical JSON, e.g.
# {"spec.inference.replicas":2}); a spec whose sizes differ from it resizes the pool (apply.plan_replicas).
ANNOTATION_APPLIED_SIZES = "rlrun.dev/applied-sizes"
FINALIZER = "rlrun.dev/finalizer"

# Components (values of app.kubernetes.io/component).
COMPONENT_TRAINER = "trainer"
COMPONENT_INFERENCE = "inference"
COMPONENT_PREFILL = "prefill"
COMPONENT_DECODE = "decode"
COMPONENT_ROUTER = "router"
COMPONENT_ORCHESTRATOR = "orchestrator"
COMPONENT_CONFIG = "config"
COMPONENT_STORAGE = "storage"
# The inference pools: one Deployment each, the scaled children (single pool, or prefill and decode).
POOL_COMPONENTS = (COMPONENT_INFERENCE, COMPONENT_PREFILL, COMPONENT_DECODE)

# --- Environment variables read by the runtime roles ---------------------------------------------
ENV_CONFIG = "RLRUN_CONFIG"                  # path of the RLRun YAML (the ConfigMap's file)
ENV_STORAGE_DIR = "RLRUN_STORAGE_DIR"        # shared storage: weights, rollouts, checkpoints
ENV_RUN_NAME = "RLRUN_RUN_NAME"
ENV_NAMESPACE = "RLRUN_NAMESPACE"
ENV_INFERENCE_ROLE = "RLRUN_INFERENCE_ROLE"  # prefill | decode | both
ENV_INFERENCE_PORT = "RLRUN_INFERENCE_PORT"
ENV_INFERENCE_ENDPOINTS = "RLRUN_INFERENCE_ENDPOINTS"  # comma-separated host:port; a host may resolve to many pods
# The prefill pool's part of ENV_INFERENCE_ENDPOINTS (P/D runs only): the orchestrator pauses those engines
# before the decode engines and resumes them last (runtime/rlrun_runtime/weights/update.py says why).
ENV_PREFILL_ENDPOINTS = "RLRUN_PREFILL_ENDPOINTS"
ENV_ROUTER_URL = "RLRUN_ROUTER_URL"          # http://host:port the orchestrator sends completions to
ENV_ROUTER_PORT = "RLRUN_ROUTER_PORT"
ENV_ROUTER_METRICS_PORT = "RLRUN_ROUTER_METRICS_PORT"
ENV_PREFILL_URLS = "RLRUN_PREFILL_URLS"      # static prefill URLs for the router (local runs; clusters discover pods)
ENV_DECODE_URLS = "RLRUN_DECODE_URLS"
ENV_WORKER_URLS = "RLRUN_WORKER_URLS"        # static worker URLs for the router when not disaggregated (local runs)
# `rlrun local` with autoscaling: a JSON file the orchestrator re-reads (by mtime) for the servers it reaches
# directly and the router it sends completions to, so that servers joining or leaving need no restart
# (runtime/rlrun_runtime/local/membership.py has its format). Unset in a cluster (DNS lists the pods there).
ENV_LOCAL_SERVERS_FILE = "RLRUN_LOCAL_SERVERS_FILE"
LOCAL_SERVERS_FILE = "local/servers.json"   # under the output directory
LOCAL_SCALING_FILE = "local/scaling.jsonl"  # one line per local autoscaler decision that acted or changed reason
ENV_ROUTER_DISCOVERY = "RLRUN_ROUTER_DISCOVERY"  # one of ROUTER_DISCOVERY_MODES
ROUTER_DISCOVERY_KUBERNETES = "kubernetes"  # the router watches the run's pods by label (in a cluster)
ROUTER_DISCOVERY_STATIC = "static"          # the router gets the engines' URLs from env (rlrun local)
ROUTER_DISCOVERY_MODES = (ROUTER_DISCOVERY_KUBERNETES, ROUTER_DISCOVERY_STATIC)
ENV_METRICS_PORT = "RLRUN_METRICS_PORT"      # orchestrator metrics port
ENV_NIXL_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
ENV_NIXL_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_POD_IP = "POD_IP"
ENV_NODE_RANK = "NODE_RANK"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_NNODES = "NNODES"
ENV_NPROC_PER_NODE = "NPROC_PER_NODE"
ENV_VLLM_DEV_MODE = "VLLM_SERVER_DEV_MODE"
ENV_VLLM_CPU_KVCACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"
# Read by rlrun's vLLM plugin (runtime/rlrun_runtime/vllm_plugin.py, which says why) in every vLLM process:
# the most an idle vLLM process sleeps on a lost shared-memory wake-up, in ms (vLLM 0.32's own bound is 5000),
# and the pause of NIXL's UCX progress thread between polls on CPU servers, in microseconds (NIXL's is 0: a spin).
ENV_VLLM_SHM_RECHECK_MS = "RLRUN_VLLM_SHM_RECHECK_MS"
VLLM_SHM_RECHECK_MS = 50
ENV_NIXL_PROGRESS_DELAY_US = "RLRUN_NIXL_PROGRESS_DELAY_US"
CPU_NIXL_PROGRESS_DELAY_US = 1000
ENV_TRAINER_METRICS_PORT = "RLRUN_TRAINER_METRICS_PORT"  # override of TRAINER_METRICS_PORT (local runs)
ENV_WEIGHT_PUSH_PORT = "RLRUN_WEIGHT_PUSH_PORT"  # override of WEIGHT_PUSH_PORT (local runs, tests; 0: any free port)
# The push weight transports (spec.weightSync.transport) and the vLLM weight-transfer backend each uses.
PUSH_TRANSPORTS = {"gloo": "gloo", "nccl": "nccl"}
# Address the inference, router and orchestrator servers listen on (default 0.0.0.0 in pods); `rlrun local`
# and the tests set 127.0.0.1 so that nothing listens beyond loopback.
# The Hugging Face hub cache (huggingface_hub, transformers and vLLM download model ids into it): rendered as
# <storage.mountPath>/MODEL_CACHE_DIR in every container of a run whose model.name is a Hugging Face id, unless
# spec.storage.modelCache is false (render.storage.get_model_cache_dir), so the trainer and every inference pod
# download a model once. Only the hub cache moves (not HF_HOME, which also holds a token file); spec.pod.env may
# override it.
ENV_HF_HUB_CACHE = "HF_HUB_CACHE"
MODEL_CACHE_DIR = "hf-cache"
DEFAULT_MODEL_CACHE = True  # spec.storage.modelCache when left out (no CRD schema default: see the CRD)
ENV_BIND_HOST = "RLRUN_BIND_HOST"
DEFAULT_BIND_HOST = "0.0.0.0"
# Values of RLRUN_INFERENCE_ROLE.
INFERENCE_ROLE_PREFILL = "prefill"  # vLLM kv_producer
INFERENCE_ROLE_DECODE = "decode"    # vLLM kv_consumer
INFERENCE_ROLE_BOTH = "both"        # no KV connector (disaggregation off)
INFERENCE_ROLES = (INFERENCE_ROLE_PREFILL, INFERENCE_ROLE_DECODE, INFERENCE_ROLE_BOTH)
# A stopping inference server (SIGTERM: scale-down, rollout, suspend) keeps serving what it has in flight for at
# most this long before it exits: vLLM's --shutdown-timeout drain mode, in which the engine also waits for the
# KV blocks a prefill server still holds for decode (vLLM's kv_lease_duration, 30 s by default), so a scale-down
# loses neither running rollouts nor KV transfers. The pod's grace period leaves vLLM time to tear down after it.
INFERENCE_DRAIN_SECONDS = 60
INFERENCE_TERMINATION_GRACE_SECONDS = INFERENCE_DRAIN_SECONDS + 30

# --- The role contract's env names -------------------------------------------------------------------
# Every variable rlrun sets in some container except OVERRIDABLE_ENV_NAMES (ENV_VLLM_CPU_KVCACHE_SPACE and
# ENV_HF_HUB_CACHE), defaults that spec.pod.env may override (it comes later in the env list; the kubelet keeps the last value of a name). spec.pod.env
# applies to every container, so it may name none of these (tests check that rendered containers set
# nothing else).
RESERVED_ENV_NAMES = frozenset({
    ENV_CONFIG, ENV_STORAGE_DIR, ENV_RUN_NAME, ENV_NAMESPACE, ENV_POD_IP,
    ENV_NNODES, ENV_NPROC_PER_NODE, ENV_NODE_RANK, ENV_MASTER_ADDR, ENV_MASTER_PORT,
    ENV_TRAINER_METRICS_PORT,
    ENV_INFERENCE_ROLE, ENV_INFERENCE_PORT, ENV_VLLM_DEV_MODE, ENV_NIXL_SIDE_CHANNEL_PORT,
    ENV_NIXL_SIDE_CHANNEL_HOST,
    ENV_ROUTER_DISCOVERY, ENV_ROUTER_PORT, ENV_ROUTER_METRICS_PORT,
    ENV_ROUTER_URL, ENV_INFERENCE_ENDPOINTS, ENV_PREFILL_ENDPOINTS, ENV_METRICS_PORT,
})
OVERRIDABLE_ENV_NAMES = frozenset({ENV_VLLM_CPU_KVCACHE_SPACE, ENV_HF_HUB_CACHE})

# --- Files -------------------------------------------------------------------------------------
CONFIG_MOUNT_DIR = "/etc/rlrun"
CONFIG_FILE_NAME = "rlrun.yaml"
CONFIG_PATH = f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE_NAME}"
# Size of the PersistentVolumeClaim rlrun creates when spec.storage.size is left out. Filled in by the
# renderer, not a CRD default: a schema default would also land in runs with storage.claimName, which
# refuse a size. (CRDs before this change defaulted it, so stored claimName runs may still carry it.)
DEFAULT_STORAGE_SIZE = "100Gi"

# --- Names ---------------------------------------------------------------------------------------
SERVED_MODEL_NAME = "policy"  # vLLM --served-model-name: the name requests use, whatever the weights
# Readiness of a prefill or decode server: GET INFERENCE_READY_PATH on its http port answers 200 only while it
# serves the version the orchestrator last loaded on every engine, which the orchestrator records in
# SERVING_VERSION_FILE under the shared storage (rlrun_runtime.weights.update, rlrun_runtime.vllm_plugin).
INFERENCE_READY_PATH = "/rlrun/ready"
SERVING_VERSION_FILE = "orchestrator/serving-version.json"
# The worker-extension method of rlrun_runtime.vllm_worker that the orchestrator calls through vLLM's
# POST /collective_rpc to reload weights in place (the name is the contract between the two processes).
VLLM_RELOAD_METHOD = "rlrun_reload_weights"
VLLM_EXPECTED_WEIGHTS_METHOD = "rlrun_expected_weights"  # worker method: what the model loads (push transports)
TINY_MODEL_NAME = "rlrun-tiny"  # spec.model.name that makes the runtime build the tiny local model


# --- Algorithm defaults applied by the views (no CRD schema default: see OrchestratorView) --------
# spec.algorithm.microBatchTokens when neither it nor the deprecated microBatchSize is set (the CRD's description
# says so: with a schema default, a deprecated microBatchSize set alone could not be told apart). 16 documents of
# 1024 tokens: the 0.6B trainer benchmark's row (benchmarks/README.md, trainer_throughput.py).
DEFAULT_MICRO_BATCH_TOKENS = 16384
DEFAULT_MAX_EMPTY_BATCHES = 3      # spec.algorithm.maxEmptyBatches: consecutive empty batches that fail the run
TRUNCATION_KEEP = "keep"           # spec.algorithm.truncation values (docs/orchestrator.md, "Truncation")
TRUNCATION_ZERO_REWARD = "zeroReward"
TRUNCATION_MASK = "mask"
TRUNCATION_POLICIES = (TRUNCATION_KEEP, TRUNCATION_ZERO_REWARD, TRUNCATION_MASK)
DEFAULT_TRUNCATION = TRUNCATION_KEEP
FINISH_REASON_LENGTH = "length"    # vLLM's finish_reason of a completion cut at max_tokens
# Where Kubernetes reads a container's termination message (the default terminationMessagePath); the
# orchestrator writes its fatal error there when the file exists (the kubelet creates it in every container).
TERMINATION_MESSAGE_PATH = "/dev/termination-log"

# --- Environments -------------------------------------------------------------------------------
BUILTIN_ENVIRONMENTS = ("reverse-words",)  # spec.environment.name values for type: builtin

# --- Pod security (rendered pods run as this non-root user; fsGroup makes the PVC writable) -------
RUNTIME_UID = 1000
RUNTIME_GID = 1000
# VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) rendered for CPU inference pods (gpusPerReplica 0);
# spec.pod.env may override it.
CPU_KVCACHE_SPACE_GIB = 1

# --- Child object names (`<metadata.name><suffix>`) and Kubernetes name limits --------------------
# Suffix of each child's name, by child (render.metadata.get_child_names names them from this). The inference
# NetworkPolicy shares the inference name on purpose.
CHILD_NAME_SUFFIXES = MappingProxyType({
    "config": "-" + COMPONENT_CONFIG,
    "storage": "-" + COMPONENT_STORAGE,
    "trainer": "-" + COMPONENT_TRAINER,
    "inference": "-" + COMPONENT_INFERENCE,
    "prefill": "-" + COMPONENT_PREFILL,
    "decode": "-" + COMPONENT_DECODE,
    "router": "-" + COMPONENT_ROUTER,
    "orchestrator": "-" + COMPONENT_ORCHESTRATOR,
    "network-policy": "-" + COMPONENT_INFERENCE,
    # Rendered only for the push weight transports (spec.weightSync.transport in PUSH_TRANSPORTS).
    "trainer-network-policy": "-" + COMPONENT_TRAINER,
})
CHILD_SUFFIXES = tuple(dict.fromkeys(CHILD_NAME_SUFFIXES.values()))  # each distinct suffix once
STATEFULSET_SUFFIXES = (CHILD_NAME_SUFFIXES["trainer"],)
DNS_LABEL_MAX_LENGTH = 63  # DNS-1035 label: Service names, label values (Kubernetes API conventions)
# A StatefulSet's pods carry controller-revision-hash=<name>-<10-char hash>, a label value (<= 63), so its
# name may have at most 52 characters (kubernetes/kubernetes issue 64023).
STATEFULSET_NAME_MAX_LENGTH = 52

# --- Metrics the orchestrator serves (the operator scrapes them into RLRun status) ----------------
METRIC_STEP = "rlrun_orchestrator_step"                          # last completed trainer step
METRIC_POLICY_VERSION = "rlrun_orchestrator_policy_version"      # version loaded by every inference server
METRIC_LAST_REWARD = "rlrun_orchestrator_last_reward"            # mean reward of the last batch
METRIC_WEIGHT_UPDATE_IN_FLIGHT = "rlrun_orchestrator_weight_update_in_flight"  # 1 while servers are paused
METRIC_MAX_STEPS = "rlrun_orchestrator_max_steps"
METRIC_STALLED_ENGINES = "rlrun_orchestrator_stalled_engines"  # engines silent >= ENGINE_STALL_AFTER_S
ENGINE_STALL_AFTER_S = 10.0  # an engine that has not answered the orchestrator this long is reported stalled
METRIC_ENGINES_OUT_OF_SERVICE = "rlrun_orchestrator_engines_out_of_service"  # left paused by a failed update
# Completions vLLM cut at max_tokens (finish_reason "length"), whatever spec.algorithm.truncation does with them.
METRIC_TRUNCATED_ROLLOUTS = "rlrun_orchestrator_truncated_rollouts"           # counter (exposed with _total)
# Prompts skipped before any request because they leave no room under model.maxModelLen; label reason.
METRIC_DROPPED_PROMPTS = "rlrun_orchestrator_dropped_prompts"                 # counter {reason="too_long"}
METRIC_SCORER_ERRORS = "rlrun_orchestrator_scorer_errors"                     # counter: env.score raised
# Consecutive batches without a trainable sample (spec.algorithm.maxEmptyBatches ends the run at that many).
METRIC_EMPTY_BATCH_STREAK = "rlrun_orchestrator_empty_batch_streak"           # gauge
# What the autoscaler reads from the orchestrator (operator/rlrun_operator/autoscale.py). Counters are
# exposed with _total; a 15 s scrape misses sub-second pauses, hence a counter and the last resume's time.
METRIC_WEIGHT_UPDATES = "rlrun_orchestrator_weight_updates"                   # counter: finished weight updates
METRIC_LAST_RESUME_TIME = "rlrun_orchestrator_last_resume_timestamp_seconds"  # gauge: unix time of the last resume
METRIC_DATA_WAIT_SECONDS = "rlrun_orchestrator_trainer_wait_seconds"          # counter: trainer waited for data
METRIC_GATE_WAIT_SECONDS = "rlrun_orchestrator_gate_wait_seconds"             # counter: generation held by the async gate
METRIC_WEIGHT_UPDATE_SECONDS = "rlrun_orchestrator_weight_update_seconds"     # histogram: pause->resume per engine
METRIC_WEIGHT_UPDATE_FAILURES = "rlrun_orchestrator_weight_update_failures"   # counter: rounds failed on some engine
METRIC_BATCH_STEP = "rlrun_orchestrator_batch_step"                           # gauge: last batch written
METRIC_ROLLOUTS = "rlrun_orchestrator_rollouts"                               # counter: completions scored
METRIC_GENERATED_TOKENS = "rlrun_orchestrator_generated_tokens"               # counter: completion tokens
METRIC_DROPPED_GROUPS = "rlrun_orchestrator_dropped_groups"                   # counter {reason}
METRIC_DROPPED_SAMPLES = "rlrun_orchestrator_dropped_samples"                 # counter {reason}
# Held-out evaluation (spec.evaluation; runtime/rlrun_runtime/evaluation.py). Labelled by sampling (greedy |
# sampled), so the gauges are absent until the first evaluation (an unlabelled gauge would read 0 before it).
METRIC_EVAL_REWARD = "rlrun_orchestrator_eval_reward"                         # gauge {sampling}: mean reward
METRIC_EVAL_POLICY_VERSION = "rlrun_orchestrator_eval_policy_version"         # gauge {sampling}: version evaluated
METRIC_EVALUATIONS = "rlrun_orchestrator_evaluations"                         # counter {result} (_total)
EVAL_RESULT_OK = "ok"                  # every request ran on the version recorded
EVAL_RESULT_MIXED = "mixed"            # a weight update overlapped every attempt (recorded, flagged)
EVAL_RESULT_FAILED = "failed"          # requests failed; nothing recorded, retried at the next version due
EVAL_SAMPLING_GREEDY = "greedy"        # spec.evaluation.sampling values
EVAL_SAMPLING_SAMPLED = "sampled"
EVAL_FILE_NAME = "eval.jsonl"          # on the run's storage, beside metrics.jsonl: one line per evaluation
# Held-out tasks are environment indices HELD_OUT_TASK_INDEX_BASE + i (training draws 0, 1, 2, ...), and a
# training task whose prompt equals a held-out one is skipped (counted in METRIC_DROPPED_PROMPTS{reason=held_out}).
HELD_OUT_TASK_INDEX_BASE = 1 << 40
DROPPED_PROMPT_HELD_OUT = "held_out"
# Experiment tracking (spec.tracking; runtime/rlrun_runtime/tracking.py): TensorBoard event files under
# <storage>/TENSORBOARD_DIR_NAME; the W&B API key, from the Secret spec.tracking.wandb.apiKeySecret names,
# rendered into the orchestrator container as ENV_WANDB_API_KEY (W&B's own variable).
TENSORBOARD_DIR_NAME = "tensorboard"
WANDB_DIR_NAME = "wandb"               # under <storage>/orchestrator: W&B's run directory (offline runs stay there)
ENV_WANDB_API_KEY = "WANDB_API_KEY"
DEFAULT_WANDB_API_KEY_SECRET_KEY = "WANDB_API_KEY"
TRACKING_STATE_FILE_NAME = "tracking.json"  # under <storage>/orchestrator: what the sinks have been given

# --- Metrics the trainer serves on TRAINER_METRICS_PORT (rank 0; also the probes' endpoint) ----------
METRIC_TRAINER_STEP = "rlrun_trainer_step"                          # last completed step = policy version
METRIC_TRAINER_LOSS = "rlrun_trainer_loss"
METRIC_TRAINER_MISMATCH_KL = "rlrun_trainer_mismatch_kl"
METRIC_TRAINER_TOKENS_PER_SECOND = "rlrun_trainer_tokens_per_second"
METRIC_TRAINER_WAIT_SECONDS = "rlrun_trainer_wait_seconds"          # time the last step waited for its batch

# --- Metrics vLLM serves (read by the autoscaler and the tests) -----------------------------------
# vLLM's queue depth, scraped from every inference pod by the autoscaler
VLLM_METRIC_WAITING = "vllm:num_requests_waiting"
VLLM_METRIC_RUNNING = "vllm:num_requests_running"
# Waiting requests by reason {reason="capacity"|"deferred"}; on a decode server "deferred" counts requests
# whose KV is still arriving from prefill (not decode load): the autoscaler reads decode's queue as capacity.
VLLM_METRIC_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
VLLM_WAITING_REASON_CAPACITY = "capacity"
VLLM_METRIC_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"                       # 0..1
# NixlConnector's stats on a decode server: one histogram observation per KV transfer, failed transfers
VLLM_METRIC_NIXL_TRANSFER_SECONDS = "vllm:nixl_xfer_time_seconds"                # histogram (_count: transfers)
VLLM_METRIC_NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"            # counter (exposed with _total)
VLLM_METRIC_REQUEST_SUCCESS = "vllm:request_success"                           # counter {finished_reason} (_total)
# Per finished request, the seconds vLLM's engine ran it: first scheduled -> last token (vLLM 0.32's RUNNING
# phase, v1/metrics/stats.py; = its prefill + decode phases). On a prefill server that is the prompt's prefill
# (one token); on a decode server the local last-token step after the KV arrived plus the decode. The queue
# phase (vllm:request_queue_time_seconds) is left out: on a decode server it also spans the KV transfer.
VLLM_METRIC_REQUEST_INFERENCE_SECONDS = "vllm:request_inference_time_seconds"  # histogram (_sum, _count)

# --- Metrics the operator serves (operator/rlrun_operator/metrics.py) -----------------------------
# What the operator exports about its autoscaler (per run; role = prefill | decode)
OPERATOR_METRIC_DESIRED_REPLICAS = "rlrun_operator_autoscaler_desired_replicas"  # gauge: replicas after the last decision
OPERATOR_METRIC_CURRENT_REPLICAS = "rlrun_operator_autoscaler_current_replicas"  # gauge: ready replicas observed
OPERATOR_METRIC_SCALING_DECISIONS = "rlrun_operator_autoscaler_decisions"         # counter {action, code} (_total)
# The operator's own health and what it re-exports per run (operator/rlrun_operator/metrics.py; the chart's
# dashboard and alert rules query these names: docs/monitoring.md)
OPERATOR_METRIC_RECONCILES = "rlrun_operator_reconciles"                  # counter {trigger} (_total)
OPERATOR_METRIC_STATUS_REFRESHES = "rlrun_operator_status_refreshes"      # counter {namespace, name} (_total)
OPERATOR_METRIC_RECONCILE_ERRORS = "rlrun_operator_reconcile_errors"      # counter {stage} (_total)
OPERATOR_METRIC_RECONCILE_SECONDS = "rlrun_operator_reconcile_duration_seconds"  # histogram
OPERATOR_METRIC_CHILD_WRITES = "rlrun_operator_child_writes"              # counter {action} (_total)
OPERATOR_METRIC_RUNS = "rlrun_operator_runs"                              # gauge {phase}: runs per status.phase
OPERATOR_METRIC_RUN_STEP = "rlrun_operator_run_step"                      # gauge {namespace, name}
OPERATOR_METRIC_RUN_POLICY_VERSION = "rlrun_operator_run_policy_version"  # gauge {namespace, name}
OPERATOR_METRIC_RUN_LAST_REWARD = "rlrun_operator_run_last_reward"        # gauge {namespace, name}
OPERATOR_METRIC_RUN_EVAL_REWARD = "rlrun_operator_run_eval_reward"        # gauge {namespace, name}: held-out
OPERATOR_METRIC_RUN_WEIGHT_UPDATE = "rlrun_operator_run_weight_update_in_flight"  # gauge {namespace, name}: 0/1
OPERATOR_METRIC_RUN_CONDITION = "rlrun_operator_run_condition"            # gauge {namespace, name, type}: 1 True, 0 not
OPERATOR_METRIC_QUEUE_DEPTH = "rlrun_operator_queue_depth"                # gauge {namespace, name, role}

# --- Events the operator posts on an RLRun ---------------------------------------------------------
# Events the autoscaler posts on its RLRun
EVENT_SCALED_PREFILL = "ScaledPrefill"
EVENT_SCALED_DECODE = "ScaledDecode"
EVENT_AUTOSCALER_DRY_RUN = "AutoscalerDryRun"
EVENT_REPLICAS_EDITED = "ReplicasEditedByHand"
# Events a reconcile posts when the spec's size fields change (apply.plan_replicas)
EVENT_RESIZED = "Resized"                                # a pool resized to the new spec
EVENT_RESIZE_LEFT_TO_AUTOSCALER = "ResizeLeftToAutoscaler"  # autoscaling on: the spec's sizes are not applied

# --- Autoscaling defaults applied by the views ------------------------------------------------------
# spec.autoscaling.thresholds without a CRD schema default (one would rewrite every run's ConfigMap on
# upgrade): views.AutoscalingView.from_spec applies these; docs/operator.md ("Autoscaling") says why each.
DEFAULT_MAX_KV_CACHE_USAGE = 0.8     # maxKvCacheUsage: 20 % KV headroom after a shrink
DEFAULT_GATED_FRACTION = 0.5         # gatedFraction: generation held most of the interval
DEFAULT_TRAINER_WAIT_FRACTION = 0.2  # trainerWaitFraction: the trainer idles a fifth of the time for data
# `rlrun local` with autoscaling: at most this many prefill + decode servers on one machine (each vLLM server
# on CPU takes one core and ~1.5 GiB; the spec's maxReplicas is capped to it, docs/local.md "Autoscaling").
LOCAL_MAX_INFERENCE_SERVERS = 3
# How long a local server that joins after a scale-up may take to start and load the current weights
# (vLLM starts in 30-90 s on a loaded 2-core machine) before it is stopped and the scale-up given up.
LOCAL_JOIN_TIMEOUT_S = 300.0
