"""The trainer StatefulSet's rendered torchrun command on two nodes, emulated on this host (issue 12's CPU part).

``trainer.nodes: 2`` on CPU renders a StatefulSet of two pods; ``rlrun local``'s plan turns each pod into a
local process exactly as a kubelet would (``$(VAR)`` expansion, the node rank from the pod ordinal label,
pod 0's DNS name -> 127.0.0.1, the master port -> pod 0's local port). Two torchrun agents (``--nnodes 2``)
then rendezvous over gloo and train on synthetic batches. The two-node update must equal a one-node run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlrun_api import constants as c
from rlrun_runtime.local import get_plan, load_run
from rlrun_runtime.storage import RunStorage
from tiny_qwen3 import save_model_dir, save_moe_model_dir
from trainer_batches import write_batch

STEPS = 2


def assert_same_update(got: torch.Tensor, want: torch.Tensor, key: str, steps: int = STEPS) -> None:
    """Two runs' weights after the same AdamW steps (learning rate 1e-3), up to float summation order: all but one
    entry in a thousand within 2e-5, every entry within two steps' worth per step (2e-3 x steps).

    AdamW moves an entry by lr x m / (sqrt(v) + eps), eps 1e-8, which is close to lr x sign(g) whatever the
    gradient's scale, and swings on entries whose gradient is near eps: there summation-order noise becomes part of
    a step (on 2026-12-07 one q_proj entry of 16,384, gradient about 3e-9, moved 2.6e-4 against 2.0e-4), and a sign
    flip two steps. So the weights show that both runs took the same steps; the gradients themselves are compared
    through the losses, the gradient norms and :func:`assert_same_moments`."""
    diff = (got - want).abs()
    assert float(diff.max()) <= 2e-3 * steps, f"{key}: differs by {float(diff.max()):.2e}"
    assert float((diff > 2e-5 + 1e-4 * want.abs()).float().mean()) <= 1e-3, f"{key}: many entries differ"


def assert_same_moments(got: RunStorage, want: RunStorage, step: int, scratch: Path) -> None:
    """The AdamW first moments in two runs' step-``step`` checkpoints agree, parameter by parameter (within 1e-2
    relative, or 1e-3 of the tensor's largest moment). ``exp_avg`` is linear in the gradients (0.9 m + 0.1 g), so
    unlike the weights it shows any gradient error, a wrong scale included: a wrong mask or key order moved
    gradients by 1e-2 to 1.4 of their size (2026-12-07 mutations), while the runs' own differences stay near 5e-5
    of the largest moment (later steps' gradients are taken at weights the near-eps entries moved apart)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    moments = []
    for storage in (got, want):
        out = scratch / f"moments-{len(list(scratch.glob('moments-*.pt')))}.pt"
        dcp_to_torch_save(str(storage.checkpoint(step)), str(out))
        state = torch.load(out, weights_only=False)["optim"]["state"]
        moments.append({key: value["exp_avg"] for key, value in state.items()})
    assert moments[0].keys() == moments[1].keys() and moments[0]
    for key, expected in moments[1].items():
        torch.testing.assert_close(moments[0][key], expected, rtol=1e-2, atol=1e-3 * float(expected.abs().max()),
                                   msg=key)


def assert_runs_agree(got: RunStorage, want: RunStorage, step: int, scratch: Path) -> dict[str, torch.Tensor]:
    """Two runs trained alike up to ``step``: the same published weight keys, the same update
    (:func:`assert_same_update`), every step's loss and gradient norm within 1e-6 and the same AdamW first moments
    (:func:`assert_same_moments`). Returns ``got``'s published weights at ``step``."""
    weights = tuple(load_file(s.weights(step) / "model.safetensors") for s in (got, want))
    assert weights[0].keys() == weights[1].keys()
    for key in weights[1]:
        assert_same_update(weights[0][key], weights[1][key], key, steps=step)
    records = [[json.loads(line) for line in s.metrics_file.read_text().splitlines()] for s in (got, want)]
    assert [r["step"] for r in records[0]] == [r["step"] for r in records[1]] == list(range(1, step + 1))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in records[0]] == pytest.approx([r[key] for r in records[1]], abs=1e-6), key
    assert_same_moments(got, want, step, scratch)
    return weights[0]


def write_run(tmp: Path, model_dir: Path, nodes: int, cp: int = 1, ep: int = 1, packed: bool = False,
              max_steps: int = STEPS) -> Path:
    """An RLRun of ``nodes`` CPU trainer nodes with context- and expert-parallel degrees ``cp`` and ``ep``;
    ``packed`` (or cp > 1): packed rows of 32 tokens (several rows per step), else the padded micro-batches of 2
    samples; a checkpoint after step STEPS, training to ``max_steps``."""
    layout = {"microBatchTokens": 32} if packed or cp > 1 else {"microBatchSize": 2}
    suffix = (f"-cp{cp}" if cp > 1 else "") + (f"-ep{ep}" if ep > 1 else "")
    run = {
        "apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": f"multinode-{nodes}{suffix}"},
        "spec": {
            "model": {"name": str(model_dir), "dtype": "float32"},
            "environment": {"type": "builtin", "name": "reverse-words"},
            "algorithm": {"rolloutsPerPrompt": 4, "batchSize": 8, **layout, "maxSteps": max_steps,
                          "learningRate": 1e-3},
            "trainer": {"nodes": nodes, "gpusPerNode": 0, "checkpoint": {"intervalSteps": STEPS},
                        "parallelism": {"cp": cp, "ep": ep}},
        },
    }
    path = tmp / f"run-{nodes}{suffix}-{len(list(tmp.glob('run-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def run_trainer_pods(path: Path, output_dir: Path, timeout: float = 240, steps: int = STEPS
                     ) -> list[tuple[str, tuple[str, ...], str]]:
    """Start the plan's trainer pods (and nothing else) on batches 1..``steps``; (pod, argv, log) per pod."""
    plan = get_plan(load_run(str(path)), output_dir, dict(os.environ, OMP_NUM_THREADS="1"))
    for file, text in plan.files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    storage = RunStorage(output_dir)
    for step in range(1, steps + 1):
        write_batch(storage, step)
    pods = plan.by_component(c.COMPONENT_TRAINER)
    procs = []
    try:
        for pod in pods:
            pod.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(pod.log_path, "w") as log:
                procs.append(subprocess.Popen(list(pod.argv), env=dict(pod.env), stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results = [(pod.name, pod.argv, pod.log_path.read_text()) for pod in pods]
    codes = {name: proc.returncode for (name, _, _), proc in zip(results, procs)}
    for (name, _, log), proc in zip(results, procs):
        assert proc.returncode == 0, f"{name} exited {proc.returncode} (every pod: {codes}):\n{log[-3000:]}"
        # every rank finished, destroyed its process groups and ended without the interpreter's finalization
        assert "process groups destroyed; exiting" in log, f"{name}:\n{log[-3000:]}"
    return results


@pytest.mark.timeout(600)
def test_two_torchrun_agents_from_the_rendered_statefulset_train_like_one_node(tmp_path: Path) -> None:
    model_dir = save_model_dir(tmp_path / "model")
    two = run_trainer_pods(write_run(tmp_path, model_dir, nodes=2), tmp_path / "two")
    # The rendered command line, expanded per pod: node ranks 0 and 1 of two nodes, one gloo rank each,
    # both agents pointed at pod 0's local rendezvous port.
    assert [name for name, _, _ in two] == ["multinode-2-trainer-0", "multinode-2-trainer-1"]
    flags = [{a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--") and "=" in a}
             for _, argv, _ in two]
    assert [f["--node-rank"] for f in flags] == ["0", "1"]
    assert {f["--nnodes"] for f in flags} == {"2"} and {f["--nproc-per-node"] for f in flags} == {"1"}
    assert {f["--master-addr"] for f in flags} == {"127.0.0.1"} and len({f["--master-port"] for f in flags}) == 1
    assert two[0][1][0] == "torchrun" and two[0][1][-3:-1] == ("trainer", "--config")
    assert "world 2" in two[0][2]

    one = run_trainer_pods(write_run(tmp_path, model_dir, nodes=1), tmp_path / "one")
    assert "world 1" in one[0][2]
    two_storage, one_storage = RunStorage(tmp_path / "two"), RunStorage(tmp_path / "one")
    # Rank 0 alone publishes weights and metrics; every rank writes its shard of the checkpoint.
    steps = [json.loads(line)["step"] for line in two_storage.metrics_file.read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert sorted(p.name for p in two_storage.checkpoint(STEPS).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "rank-0.pt", "rank-1.pt", "trainer_state.json"]
    # The same update as one node (strided batch split, gradients averaged over the two ranks), up to
    # float summation order; and it moved the weights.
    two_weights = assert_runs_agree(two_storage, one_storage, STEPS, tmp_path)
    initial = load_file(model_dir / "model.safetensors")
    assert max((two_weights[k] - initial[k]).abs().max().item() for k in initial if k in two_weights) > 1e-4


@pytest.mark.timeout(600)
def test_context_parallel_ranks_split_each_packed_row_and_train_like_one_rank(tmp_path: Path) -> None:
    """``parallelism.cp: 2`` on two nodes: both ranks run the same packed rows, each half of every row's
    positions, attending to the whole row through gathered keys and values. The update must equal one rank
    running whole rows (same packing: one data-parallel rank in both)."""
    model_dir = save_model_dir(tmp_path / "model")
    two = run_trainer_pods(write_run(tmp_path, model_dir, nodes=2, cp=2), tmp_path / "cp")
    assert "world 2" in two[0][2] and "context-parallel degree 2" in two[0][2]
    one = run_trainer_pods(write_run(tmp_path, model_dir, nodes=1, packed=True), tmp_path / "one")
    assert "world 1" in one[0][2] and "context-parallel" not in one[0][2]
    cp_weights = assert_runs_agree(RunStorage(tmp_path / "cp"), RunStorage(tmp_path / "one"), STEPS, tmp_path)
    initial = load_file(model_dir / "model.safetensors")
    assert max((cp_weights[k] - initial[k]).abs().max().item() for k in initial if k in cp_weights) > 1e-4


@pytest.mark.timeout(600)
def test_expert_parallel_ranks_hold_half_the_experts_and_train_like_one_rank(tmp_path: Path) -> None:
    """``parallelism.ep: 2`` on two nodes with a mixture-of-experts model (4 experts, 2 per token): each rank
    holds 2 experts of every layer, and tokens go to the rank of their expert and back. The update (every
    expert's, published as the full HF checkpoint) must equal two data-parallel ranks holding every expert."""
    model_dir = save_moe_model_dir(tmp_path / "model")
    ep = run_trainer_pods(write_run(tmp_path, model_dir, nodes=2, ep=2, packed=True), tmp_path / "ep")
    assert "world 2" in ep[0][2] and "expert-parallel degree 2" in ep[0][2]
    dp = run_trainer_pods(write_run(tmp_path, model_dir, nodes=2, packed=True), tmp_path / "dp")
    ep_storage, dp_storage = RunStorage(tmp_path / "ep"), RunStorage(tmp_path / "dp")
    ep_weights = assert_runs_agree(ep_storage, dp_storage, STEPS, tmp_path)
    initial = load_file(model_dir / "model.safetensors")
    assert ep_weights.keys() == initial.keys()
    assert sum(".experts." in key for key in ep_weights) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    moved = {k for k in initial if ".experts." in k and (ep_weights[k] - initial[k]).abs().max() > 1e-4}
    assert len(moved) == 2 * 4 * 3  # every expert of both ranks learned
    # each rank wrote its checkpoint shard
    assert sorted(p.name for p in ep_storage.checkpoint(STEPS).iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]

    # Resume both runs from that checkpoint for one more step: each rank's experts and their AdamW moments
    # come back from its own shard, so the step equals the data-parallel run's (which resumes too).
    last = STEPS + 1
    for name, extra in (("ep", {"ep": 2}), ("dp", {})):
        pods = run_trainer_pods(write_run(tmp_path, model_dir, nodes=2, packed=True, max_steps=last, **extra),
                                tmp_path / name, steps=last)
        assert f"steps {last}..{last}" in pods[0][2], pods[0][2][-2000:]  # resumed, did not start over
    resumed = assert_runs_agree(ep_storage, dp_storage, last, tmp_path)
    moved = {k for k in initial if ".experts." in k and (resumed[k] - ep_weights[k]).abs().max() > 1e-5}
    assert len(moved) == 2 * 4 * 3  # every expert took the resumed step


@pytest.mark.timeout(900)
def test_expert_parallel_groups_with_replicas_train_like_data_parallel(tmp_path: Path) -> None:
    """``parallelism.ep: 2`` on four nodes: ranks 0-1 and 2-3 form two expert-parallel groups, each holding every
    expert once (2 per rank), so each expert shard has two replicas whose gradients are summed. The update must
    equal four data-parallel ranks holding every expert."""
    model_dir = save_moe_model_dir(tmp_path / "model")
    ep = run_trainer_pods(write_run(tmp_path, model_dir, nodes=4, ep=2, packed=True), tmp_path / "ep", timeout=400)
    assert "world 4" in ep[0][2] and "expert-parallel degree 2" in ep[0][2]
    dp = run_trainer_pods(write_run(tmp_path, model_dir, nodes=4, packed=True), tmp_path / "dp", timeout=400)
    ep_storage, dp_storage = RunStorage(tmp_path / "ep"), RunStorage(tmp_path / "dp")
    ep_weights = assert_runs_agree(ep_storage, dp_storage, STEPS, tmp_path)
    initial = load_file(model_dir / "model.safetensors")
    assert ep_weights.keys() == initial.keys()
    moved = {k for k in initial if ".experts." in k and (ep_weights[k] - initial[k]).abs().max() > 1e-4}
    assert len(moved) == 2 * 4 * 3  # every expert learned
    assert sorted(p.name for p in ep_storage.checkpoint(STEPS).iterdir() if p.suffix == ".distcp") == [
        f"__{r}_0.distcp" for r in range(4)]
    # resumed for two more steps, each replica reads its shard back (a shard is saved once, by one replica); the
    # second step's gradients carry every replica's resumed state (rank 0 alone publishes)
    last = STEPS + 2
    for name, extra in (("ep", {"ep": 2}), ("dp", {})):
        pods = run_trainer_pods(write_run(tmp_path, model_dir, nodes=4, packed=True, max_steps=last, **extra),
                                tmp_path / name, timeout=400, steps=last)
        assert f"steps {STEPS + 1}..{last}" in pods[0][2], pods[0][2][-2000:]
    resumed = assert_runs_agree(ep_storage, dp_storage, last, tmp_path)
    assert all((resumed[k] - ep_weights[k]).abs().max() > 1e-5 for k in initial if ".experts." in k)
