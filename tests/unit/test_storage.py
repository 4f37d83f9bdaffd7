"""Atomic writes to the run's storage (rlrun_runtime.storage)."""

from __future__ import annotations

import threading

import pytest

from rlrun_runtime.storage import RunStorage, atomic_directory, atomic_write_json, list_steps


def test_republished_directory_is_replaced_whole_and_never_missing(tmp_path):
    storage = RunStorage(tmp_path)
    target = storage.weights(3)
    with atomic_directory(target) as tmp:
        (tmp / "a.safetensors").write_text("old")
        (tmp / "only-old").write_text("x")
    seen_missing = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if not target.exists():
                seen_missing.append(True)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for round_ in range(20):
            with atomic_directory(target) as tmp:
                (tmp / "a.safetensors").write_text(f"new {round_}")
    finally:
        stop.set()
        watcher.join()
    assert seen_missing == []
    assert sorted(p.name for p in target.iterdir()) == ["a.safetensors"]
    assert (target / "a.safetensors").read_text() == "new 19"
    assert sorted(p.name for p in storage.weights_dir.iterdir()) == ["step-000003"]  # no temporaries left
    assert list_steps(storage.weights_dir) == [3]


def test_failed_publish_keeps_the_old_directory(tmp_path):
    target = RunStorage(tmp_path).weights(1)
    with atomic_directory(target) as tmp:
        (tmp / "w").write_text("good")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "w").write_text("half")
            raise RuntimeError("disk full")
    assert (target / "w").read_text() == "good"
    assert [p.name for p in target.parent.iterdir()] == ["step-000001"]


def test_atomic_json_leaves_no_temporary(tmp_path):
    path = tmp_path / "orchestrator" / "state.json"
    atomic_write_json(path, {"next_step": 4})
    atomic_write_json(path, {"next_step": 5})
    assert path.read_text() == '{"next_step":5}'
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]
