"""`rlrun local`'s input checks, in process (``local.main``): a bad spec, environment, model path or output
directory, or GPUs this machine lacks, exit 2 with a line naming the field before anything starts."""

from __future__ import annotations

import io

import pytest
import yaml

from rlrun_runtime import local


def _write(tmp_path, rlrun, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(rlrun))
    return path


def _run_main(args):
    out, err = io.StringIO(), io.StringIO()
    code = local.main([str(a) for a in args], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_invalid_spec_exits_2_with_field_lines(tiny_example, tmp_path):
    tiny_example["spec"]["algorithm"]["batchSize"] = 60  # not a multiple of rolloutsPerPrompt 8
    path = _write(tmp_path, tiny_example)
    code, out, err = _run_main([path, "--output-dir", tmp_path / "o"])
    assert code == 2
    assert f"{path}: spec.algorithm.batchSize: " in err
    assert not (tmp_path / "o").exists()


def test_unknown_environment_exits_2(tiny_example, tmp_path):
    tiny_example["spec"]["environment"] = {"type": "reasoning-gym", "name": "no_such_dataset"}
    path = _write(tmp_path, tiny_example)
    code, _, err = _run_main([path, "--output-dir", tmp_path / "o"])
    assert code == 2 and f"{path}: spec.environment.name: 'no_such_dataset'" in err


def test_missing_model_path_exits_2(tiny_example, tmp_path):
    tiny_example["spec"]["model"]["name"] = str(tmp_path / "nowhere")
    path = _write(tmp_path, tiny_example)
    code, _, err = _run_main([path, "--output-dir", tmp_path / "o"])
    assert code == 2 and "spec.model.name:" in err and "no config.json" in err


def test_existing_run_needs_resume(tiny_example, tmp_path):
    out_dir = tmp_path / "o"
    (out_dir / "checkpoints").mkdir(parents=True)
    path = _write(tmp_path, tiny_example)
    code, _, err = _run_main([path, "--output-dir", out_dir])
    assert code == 2 and "--resume" in err and "--output-dir" in err


def test_gpu_specs_are_refused_before_anything_starts_on_a_machine_without_them():
    from rlrun_runtime.local import LocalInputError, check_gpus

    spec = {"trainer": {"gpusPerNode": 8}, "inference": {"gpusPerReplica": 1}}
    with pytest.raises(LocalInputError, match=r"spec.trainer.gpusPerNode: 8, spec.inference.gpusPerReplica: 1 "
                                              r"GPU\(s\) per pod, but this machine shows 0; set"):
        check_gpus("run.yaml", spec, visible_gpus=0)
    check_gpus("run.yaml", spec, visible_gpus=8)
    check_gpus("run.yaml", {"trainer": {"gpusPerNode": 0}, "inference": {"gpusPerReplica": 0}}, visible_gpus=0)
