"""benchmarks/pd_throughput.py's batches: the orchestrator's request bodies, one per group or one per rollout."""

import yaml

from benchmarks import pd_throughput
from tiny_qwen3 import make_tokenizer


def test_a_batch_is_one_request_per_group_or_one_per_rollout_with_the_same_seeds() -> None:
    rlrun = yaml.safe_load((pd_throughput.ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    tokenizer = make_tokenizer()
    per_group = pd_throughput.get_batch(rlrun, tokenizer, groups=3, n=8, first_task=5)
    per_rollout = pd_throughput.get_batch(rlrun, tokenizer, groups=3, n=1, first_task=5)
    assert [b["n"] for b in per_group] == [8] * 3 and [b["n"] for b in per_rollout] == [1] * 24
    for g, group in enumerate(per_group):
        rollouts = per_rollout[8 * g:8 * g + 8]
        assert {tuple(b["prompt"]) for b in rollouts} == {tuple(group["prompt"])}
        assert [b["seed"] for b in rollouts] == [group["seed"] + i for i in range(8)]  # vLLM's seed + i
        assert group["max_tokens"] == 8 and group["cache_salt"] == "policy-0"
