"""The roles' shared bootstrap: the config loader (the CLI's document loader behind --config) and the one
bad-input report every role's main uses."""

from __future__ import annotations

import pytest
import yaml

from rlrun_api import constants
from rlrun_runtime.role import RoleConfigError, load_rlrun, load_spec, role_main
from vllm_role import tiny_rlrun

HEADER = f"apiVersion: {constants.API_VERSION}\nkind: {constants.KIND}\nmetadata: {{name: r}}\n"


@pytest.mark.parametrize("text, needle", [
    ("spec: [unclosed\n", r"is not valid YAML at line \d+, column \d+ .*; fix the syntax"),
    (HEADER + "spec: {model: {name: a}, model: {name: b}}\n", r"key 'model' appears twice .*keep only one"),
    ("apiVersion: v1\nkind: ConfigMap\n", r"not an RLRun; set apiVersion: rlrun.dev/v1alpha1 and kind: RLRun"),
    ("", r"holds no YAML document"),
    (HEADER + "spec: {}\n---\n" + HEADER + "spec: {}\n", r"holds 2 RLRun documents; a role reads exactly one per file"),
    (HEADER, r"no `spec` mapping; pass an RLRun YAML"),
    (HEADER + "spec: [1]\n", r"no `spec` mapping"),
])
def test_bad_config_names_the_flag_and_the_fix(tmp_path, text, needle):
    path = tmp_path / "rlrun.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RoleConfigError, match=needle) as info:
        load_rlrun(path)
    assert str(info.value).startswith(f"--config {path}: ")


def test_unreadable_config_names_the_flag(tmp_path):
    with pytest.raises(RoleConfigError, match=r"--config .*absent.yaml: cannot read it .*; pass the RLRun YAML"):
        load_rlrun(tmp_path / "absent.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RoleConfigError, match=r"is not UTF-8 text"):
        load_rlrun(tmp_path / "binary.yaml")


def test_good_config_is_defaulted_and_dates_stay_strings(tmp_path):
    rlrun = tiny_rlrun()
    rlrun["metadata"]["annotations"] = {"created": "2026-01-02"}
    path = tmp_path / "rlrun.yaml"
    path.write_text(yaml.safe_dump(rlrun).replace("'2026-01-02'", "2026-01-02"), encoding="utf-8")
    loaded = load_rlrun(path)
    assert loaded["metadata"]["annotations"]["created"] == "2026-01-02"  # as kubectl would send it
    spec = load_spec(path)
    assert spec["algorithm"]["batchSize"] == 16  # the file's value
    assert spec["weightSync"]["transport"] == "filesystem"  # a CRD default the file leaves out


def test_role_main_turns_bad_input_into_one_line_and_exit_2(capsys):
    @role_main("demo")
    def main(argv: list[str]) -> int:
        if argv == ["bad"]:
            raise RoleConfigError("environment variable X is not set; set it")
        if argv == ["boom"]:
            raise RuntimeError("not a config problem")
        return len(argv)

    assert main(["a", "b"]) == 2 and capsys.readouterr().err == ""
    assert main(["bad"]) == 2
    assert capsys.readouterr().err == "rlrun-runtime demo: environment variable X is not set; set it\n"
    with pytest.raises(RuntimeError):  # anything else is not swallowed
        main(["boom"])
    assert main.__name__ == "main"
