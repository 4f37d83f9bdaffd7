"""benchmarks/recipe_sim.py: its seed ranges, its fifth-averages and a few simulated steps on the tiny model."""

import pytest
import yaml

from benchmarks import recipe_sim
from rlrun_api.spec import apply_defaults


def test_seed_ranges_and_lists() -> None:
    assert recipe_sim.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert recipe_sim.parse_seeds("5") == [5]
    for bad in ("a-b", "3-1"):
        with pytest.raises(ValueError):
            recipe_sim.parse_seeds(bad)


def test_summary_is_the_fifth_averages_of_rlrun_local() -> None:
    rewards = [0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.7, 0.9]
    rows = [{"step": i + 1, "reward_mean": r, "exact_match_rate": r / 2} for i, r in enumerate(rewards)]
    summary = recipe_sim.get_summary(rows)
    assert summary["first"] == pytest.approx(0.2) and summary["last"] == pytest.approx(0.8)
    assert summary["gain"] == pytest.approx(0.6) and summary["exact_last"] == pytest.approx(0.4)


def test_the_sampling_version_is_one_or_two_behind_by_the_lag() -> None:
    assert [recipe_sim.get_sampling_version(5, 1.9, d) for d in (0.0, 0.89, 0.9, 0.99)] == [2, 2, 3, 3]
    assert recipe_sim.get_sampling_version(5, 1.0, 0.0) == 3 and recipe_sim.get_sampling_version(5, 2.0, 0.99) == 2
    assert recipe_sim.get_sampling_version(2, 2.0, 0.0) == 0  # never below version 0


def test_a_short_simulation_is_deterministic_and_scores_real_rollouts(tmp_path) -> None:
    import torch

    from rlrun_runtime.tiny_model import build_tiny_model

    spec = apply_defaults(yaml.safe_load(recipe_sim.EXAMPLE.read_text()))["spec"]
    spec["algorithm"].update(batchSize=16, rolloutsPerPrompt=8)
    job = {"seed": 3, "spec": spec, "model": str(build_tiny_model(tmp_path / "model")), "lag": 2.0, "std": True,
           "steps": 4}
    threads = torch.get_num_threads()
    first, again = recipe_sim.simulate(job), recipe_sim.simulate(job)
    assert torch.get_num_threads() == threads  # restored for the rest of the test process
    assert first == again  # seeded sampling and staleness draws
    assert 0.0 < first["first"] < 1.0 and 0.0 <= first["exact_first"] <= first["first"]
    assert (first["seed"], first["lag"], first["std"]) == (3, 2.0, True)
    assert first["versions_behind"] == [0, 1, 2]  # steps 1 and 2 sample version 0, then 2 behind
