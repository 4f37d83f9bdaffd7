"""benchmarks/trainer_throughput.py: its case names, and a short CPU run of the host shape (the GPU figures come from
the H200 machine; benchmarks/README.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_env import get_env_without_torchrun

from benchmarks import trainer_throughput as tt

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case, expected", [
    ("packed16c", {"layout": "packed16", "compile": True, "compile_scope": "layer", "wrap_fsdp": True,
                   "checkpoint": False, "fold_clip": True}),
    ("packed16crw", {"layout": "packed16", "compile": True, "compile_scope": "stack", "wrap_fsdp": "root-only"}),
    ("packed16cnw", {"compile_scope": "stack", "wrap_fsdp": False}),
    ("packed64csf", {"layout": "packed64", "checkpoint": "selective", "flash": False}),
    ("lora-var16cp#2", {"layout": "var16", "lora_rank": 16, "fold_clip": False}),
])
def test_case_names_parse_into_their_switches(case, expected):
    spec = tt.parse_case(case)
    assert {k: spec[k] for k in expected} == expected


@pytest.mark.parametrize("case, message", [
    ("packed16w", "needs c"), ("packed16cw", "r or n"), ("packed16cnr", "exclude each other"),
    ("packed16cas", "exclude each other"), ("int8-packed16", "unknown case prefix"),
])
def test_bad_case_names_are_refused_by_name(case, message):
    with pytest.raises(ValueError, match=message):
        tt.parse_case(case)


@pytest.mark.timeout(300)
def test_the_host_shape_runs_a_step_on_cpu_with_the_same_loss_in_both_fsdp_layouts(tmp_path):
    """Two eager cases of the 28-layer host shape, one process: a real train_step each, whose losses agree (one
    FSDP2 unit per layer against the root's only, float32 on CPU), written to the --json file and printed."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer_throughput.py"), "--shape", "host",
                           "--device", "cpu", "--doc-len", "4", "--warmup", "1", "--steps", "2",
                           "--cases", "packed16,packed16r", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT, env=get_env_without_torchrun())
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    for name in ("packed16", "packed16r"):
        assert "error" not in cases[name], cases[name]
        assert cases[name]["tokens"] == 16 * 4 and cases[name]["step_s"] > 0 and len(cases[name]["losses"]) == 3
        assert cases[name]["trainable"] == cases[name]["params"]
    assert cases["packed16"]["losses"] == pytest.approx(cases["packed16r"]["losses"], rel=1e-5)
    assert cases["packed16"]["losses"][0] != cases["packed16"]["losses"][-1]  # the weights moved
    assert "packed16r" in proc.stdout
