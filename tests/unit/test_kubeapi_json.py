"""kubeapi's JSON: orjson where it can, the stdlib where orjson refuses, the same parsed values either way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from rlrun_api.spec import apply_defaults
from rlrun_operator.kubeapi import dump_json, load_json
from rlrun_operator.reconcile import render

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlrun-tiny.yaml"


def test_a_runs_children_round_trip_as_the_stdlib_reads_them() -> None:
    rlrun = yaml.safe_load(EXAMPLE.read_text())
    rlrun["metadata"].update(namespace="default", uid="u-1", generation=1)
    children = render(apply_defaults(rlrun))
    assert len(children) > 5
    for child in children:
        raw = dump_json(child)
        assert json.loads(raw) == child and load_json(raw) == child
        assert len(raw) <= len(json.dumps(child, separators=(",", ":"), ensure_ascii=False).encode())  # compact


@pytest.mark.parametrize(("body", "expected"), [
    ({"replicas": 2 ** 70}, b'{"replicas":1180591620717411303424}'),  # beyond 64 bits: the stdlib writes it
    ({1: "a"}, b'{"1":"a"}'),                                          # a YAML map with an integer key
    ({"text": "r\u00e9sum\u00e9"}, '{"text":"r\u00e9sum\u00e9"}'.encode()),  # UTF-8, as the API server accepts
])
def test_dump_json(body: object, expected: bytes) -> None:
    assert dump_json(body) == expected


def test_load_json_reads_what_orjson_refuses_and_big_integers_as_the_api_server_does() -> None:
    assert load_json(b'{"x":1e400}')["x"] == math.inf              # beyond float64: the stdlib's infinity
    assert load_json(b'{"x":1180591620717411303424}')["x"] == pytest.approx(2.0 ** 70)  # a float64, as apimachinery
    with pytest.raises(ValueError):
        load_json(b"<html>")
