"""benchmarks/recipe_sim.py: its seed ranges, its fifth-averages and a few simulated steps on the tiny model."""

import pytest
import yaml

from benchmarks import recipe_sim
from rlrun_api.spec import apply_defaults


def test_seed_ranges_and_lists() -> None:
    assert recipe_sim.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert recipe_sim.parse_seeds("5") == [5]
    with pytest.raises(ValueError):
        recipe_sim.parse_seeds("a-b")


def test_summary_is_the_fifth_averages_of_rlrun_local() -> None:
    rows = [{"reward_mean": r, "exact_match_rate": r / 2} for r in [0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.7, 0.9]]
    summary = recipe_sim.get_summary(rows)
    assert summary["first"] == pytest.approx(0.2) and summary["last"] == pytest.approx(0.8)
    assert summary["gain"] == pytest.approx(0.6) and summary["exact_last"] == pytest.approx(0.4)


def test_a_short_simulation_is_deterministic_and_scores_real_rollouts(tmp_path) -> None:
    from rlrun_runtime.tiny_model import build_tiny_model

    spec = apply_defaults(yaml.safe_load(recipe_sim.EXAMPLE.read_text()))["spec"]
    spec["algorithm"].update(batchSize=32, rolloutsPerPrompt=8)
    job = {"seed": 3, "spec": spec, "model": str(build_tiny_model(tmp_path / "model")), "lag": 1.5, "std": True,
           "steps": 2}
    first, again = recipe_sim.simulate(job), recipe_sim.simulate(job)
    assert first == again  # seeded sampling and scheduling
    assert 0.0 < first["first"] < 1.0 and 0.0 <= first["exact_first"] <= first["first"]
    assert (first["seed"], first["lag"], first["std"]) == (3, 1.5, True)
