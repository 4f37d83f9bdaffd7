"""The importance-sampled policy-gradient loss: a hand-computed example, ratio masking, invariance of the loss
and its gradients to micro-batch split, padding and rank split (through a real Qwen3 forward)."""

import math
import random

import pytest
import torch

from rlrun_runtime.logprobs import chunked_token_logprobs, install_logprob_head
from rlrun_runtime.loss import LossMetrics, metric_log_ratio_bound, policy_loss, policy_loss_on_device, token_logprobs
from rlrun_runtime.packing import (count_loss_tokens, count_on_policy_tokens, get_micro_batch, get_micro_batches,
                                   get_packed_micro_batches)
from rlrun_api.views import TrainerView
from rlrun_runtime.trainer import get_metrics_record, get_micro_batch_loss
from tiny_qwen3 import VOCAB, make_model

# One row: three in-band tokens, one token whose ratio exp(-3) = 0.0498 is below ratio_low 0.125, and a
# padding position (mask False) holding garbage that must not matter.
LT = [-1.0, -2.0, -0.5, -3.0, 50.0]
LI = [-1.0, -1.5, -0.5, 0.0, -90.0]
MASK = [True, True, True, True, False]
ADV = 2.0


def _hand_example(kl_coef):
    lt = torch.tensor([LT], requires_grad=True)
    loss, metrics = policy_loss(lt, torch.tensor([LI]), torch.full((1, 5), ADV), torch.tensor([MASK]),
                                total_loss_tokens=4, ratio_low=0.125, ratio_high=8.0, kl_coef=kl_coef)
    loss.backward()
    return loss, metrics, lt.grad[0].tolist()


def test_hand_computed_loss_and_gradient():
    loss, metrics, grad = _hand_example(kl_coef=0.0)
    # ratios 1, e^-0.5 = 0.60653066, 1, (masked); loss = -(2 * 1 + 2 * 0.60653066 + 2 * 1) / 4
    assert loss.item() == pytest.approx(-1.30326533, abs=1e-7)
    # d/dlt(-r * A / N) = -A * r / N; the masked token and the padding get exactly zero
    assert grad == pytest.approx([-0.5, -0.30326533, -0.5, 0.0, 0.0], abs=1e-7)
    # k3 = r - 1 - log r: 0, 0.10653066, 0, 2.04978707 (the masked token still counts in the metric)
    assert metrics.mismatch_kl == pytest.approx((0.10653066 + 2.04978707) / 4, abs=1e-7)
    assert metrics.masked_fraction == 0.25
    assert metrics.ratio_mean == pytest.approx((1 + 0.60653066 + 1 + 0.04978707) / 4, abs=1e-7)
    assert metrics.advantage_mean == pytest.approx(2.0)


def test_hand_computed_on_policy_mismatch_kl():
    # tokens 1 and 3 (k3 0.10653066 and 2.04978707) come from the held policy; the padding slot is never counted
    on_policy = torch.tensor([[False, True, False, True, True]])
    _, metrics = policy_loss(torch.tensor([LT]), torch.tensor([LI]), torch.full((1, 5), ADV), torch.tensor([MASK]),
                             total_loss_tokens=4, on_policy_mask=on_policy, total_on_policy_tokens=2)
    assert metrics.mismatch_kl_on_policy == pytest.approx((0.10653066 + 2.04978707) / 2, abs=1e-7)
    assert metrics.on_policy_fraction == 0.5
    assert metrics.mismatch_kl == pytest.approx((0.10653066 + 2.04978707) / 4, abs=1e-7)  # unchanged
    _, none = policy_loss(torch.tensor([LT]), torch.tensor([LI]), torch.full((1, 5), ADV), torch.tensor([MASK]), 4)
    assert (none.mismatch_kl_on_policy, none.on_policy_fraction) == (0.0, 0.0)
    with pytest.raises(ValueError, match="total_on_policy_tokens"):
        policy_loss(torch.tensor([LT]), torch.tensor([LI]), torch.full((1, 5), ADV), torch.tensor([MASK]), 4,
                    on_policy_mask=on_policy)


def test_metrics_record_separates_on_policy_kl_and_is_null_without_on_policy_samples():
    batch = {"samples": [{"reward": 1.0, "policy_version": 4}], "reward_mean": 1.0}
    mixed = LossMetrics(mismatch_kl=0.03, mismatch_kl_on_policy=2e-5, on_policy_fraction=0.25)
    record = get_metrics_record(6, batch, 0.0, mixed, 0.0, 1e-3, 10, 8, 0.0, 1.0, 0.0)
    assert (record["mismatch_kl"], record["mismatch_kl_on_policy"], record["on_policy_fraction"]) == (0.03, 2e-5, 0.25)
    stale = get_metrics_record(6, batch, 0.0, LossMetrics(mismatch_kl=0.03), 0.0, 1e-3, 10, 8, 0.0, 1.0, 0.0)
    assert stale["mismatch_kl_on_policy"] is None and stale["on_policy_fraction"] == 0.0


def test_metrics_record_copies_the_batch_files_truncation_and_failure_counters():
    batch = {"samples": [], "reward_mean": None, "truncated_rollouts": 5, "scorer_errors": 3,
             "dropped_truncated_samples": 2, "dropped_long_prompts": 1, "dropped_bad_token_ids_samples": 4}
    record = get_metrics_record(2, batch, 0.0, LossMetrics(), 0.0, 1e-3, 0, 0, 0.0, 0.0, 0.0)
    assert (record["truncated_rollouts"], record["scorer_errors"], record["dropped_truncated_samples"],
            record["dropped_long_prompts"], record["dropped_bad_token_ids_samples"]) == (5, 3, 2, 1, 4)
    older = get_metrics_record(2, {"samples": []}, 0.0, LossMetrics(), 0.0, 1e-3, 0, 0, 0.0, 0.0, 0.0)
    assert older["truncated_rollouts"] is None and older["scorer_errors"] is None  # batch files from before


def test_hand_computed_kl_penalty():
    loss, _, grad = _hand_example(kl_coef=0.1)
    # + 0.1 * 0.10653066 / 4 on the loss; + 0.1 * (r - 1) / 4 on token 1's gradient
    assert loss.item() == pytest.approx(-1.30060206, abs=1e-7)
    assert grad == pytest.approx([-0.5, -0.31310206, -0.5, 0.0, 0.0], abs=1e-7)


def test_ratio_band_masks_high_and_low_and_never_nans():
    lt = torch.tensor([[0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    # log ratios: 0 (in), log 9 (above 8), log 0.1 (below 0.125), 200 (overflows exp in float32)
    li = torch.tensor([[0.0, -math.log(9.0), -math.log(0.1), -200.0]])
    loss, metrics = policy_loss(lt, li, torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool), 4, 0.125, 8.0)
    loss.backward()
    assert loss.item() == pytest.approx(-0.25)
    assert lt.grad[0].tolist() == pytest.approx([-0.25, 0.0, 0.0, 0.0])
    assert torch.isfinite(lt.grad).all()
    assert metrics.masked_fraction == 0.75


def test_logged_metrics_stay_finite_when_a_log_ratio_overflows_float32():
    """issue 11 §2.5: exp(200) is inf in float32; the token is masked, and the metrics count it as exp(20)."""
    lt = torch.tensor([[0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    li = torch.tensor([[0.0, -math.log(9.0), -math.log(0.1), -200.0]])  # log ratios 0, log 9, log 0.1, 200
    assert torch.isinf(torch.exp(lt.detach() - li)).any()  # the input that overflowed the metrics before
    on_policy = torch.tensor([[False, False, False, True]])
    loss, metrics = policy_loss(lt, li, torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool), 4, 0.125, 8.0,
                                on_policy_mask=on_policy, total_on_policy_tokens=1)
    loss.backward()
    assert metric_log_ratio_bound(0.125, 8.0) == 20.0
    clamped_k3 = math.exp(20.0) - 1.0 - 20.0
    k3 = [0.0, 9.0 - 1.0 - math.log(9.0), 0.1 - 1.0 - math.log(0.1), clamped_k3]
    assert metrics.ratio_mean == pytest.approx((1.0 + 9.0 + 0.1 + math.exp(20.0)) / 4, rel=1e-12)
    assert metrics.mismatch_kl == pytest.approx(sum(k3) / 4, rel=1e-12)
    assert metrics.mismatch_kl_on_policy == pytest.approx(clamped_k3, rel=1e-12)
    assert all(math.isfinite(v) for v in metrics.as_tensor().tolist())
    assert loss.item() == pytest.approx(-0.25) and torch.isfinite(lt.grad).all()  # the loss is unchanged
    # the other direction (ratio underflows to 0) is clamped too, and a wide trust band widens the clamp
    _, low = policy_loss(torch.tensor([[-200.0]]), torch.tensor([[0.0]]), torch.ones(1, 1),
                         torch.ones(1, 1, dtype=torch.bool), 1)
    assert low.mismatch_kl == pytest.approx(math.exp(-20.0) - 1.0 + 20.0) and low.ratio_mean == pytest.approx(
        math.exp(-20.0))
    assert metric_log_ratio_bound(1e-12, 1e12) == pytest.approx(math.log(1e12))
    assert metric_log_ratio_bound(0.5, float("inf")) == 20.0


def test_temperature_logprobs_match_manual_softmax():
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    got = token_logprobs(logits, targets, temperature=0.7)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3, dtype=torch.bool), 3)


ON_POLICY = 5  # the version the trainer holds in these examples; samples alternate 5, 4, 3, ...


def _samples(count=7, seed=1):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))]
        completion = [rng.randrange(2, VOCAB) for _ in range(rng.randint(0 if i == 3 else 1, 9))]
        # near the model's own logprobs (about log 1/64) with noise, some leaving the trust band
        # (every 4th token claims probability 0.99 at inference: ratio ~ 1/64 / 0.99, below ratio_low)
        lps = [-0.01 if j % 4 == 3 else -math.log(VOCAB) + rng.uniform(-0.5, 0.5) for j in range(len(completion))]
        out.append({"prompt_ids": prompt, "completion_ids": completion, "inference_logprobs": lps,
                    "advantage": rng.uniform(-1, 1), "reward": 0.0, "policy_version": ON_POLICY - i % 3})
    return out


CFG = TrainerView(model_name="rlrun-tiny", model_revision=None, max_steps=1, micro_batch_size=1,
                  learning_rate=1e-3, weight_decay=0.0, max_grad_norm=1.0,
                  lr_schedule="constant", lr_warmup_steps=0, temperature=0.8, ratio_low=0.125, ratio_high=8.0,
                  kl_coef=0.05, checkpoint_interval=1, checkpoint_keep=1, dtype="float32", use_gpu=False,
                  nodes=1, gpus_per_node=0, fsdp=-1, ep=1, cp=1, lora_rank=0, quantization="none")


def _loss_and_grads(model, micro_batches, total, total_on_policy=0):
    model.zero_grad(set_to_none=True)
    loss_sum, metrics = 0.0, LossMetrics()
    for mb in micro_batches:
        loss, m = get_micro_batch_loss(model, mb, total, CFG, torch.device("cpu"), total_on_policy)
        loss.backward()
        loss_sum += loss.item()
        metrics = metrics + m
    return loss_sum, metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_loss_and_gradients_invariant_to_micro_batching_padding_and_ranks():
    model = make_model(seed=3)
    samples = _samples()
    total, total_on = count_loss_tokens(samples), count_on_policy_tokens(samples, ON_POLICY)
    full_loss, full_metrics, full_grads = _loss_and_grads(
        model, [get_micro_batch(samples, on_policy_version=ON_POLICY)], total, total_on)
    assert full_metrics.masked_fraction > 0  # the noisy example exercises the trust band
    # the on-policy KL is the k3 mean over the on-policy samples alone: the same metric on a batch of only them
    alone = [s for s in samples if s["policy_version"] == ON_POLICY]
    assert 0 < total_on < total and full_metrics.on_policy_fraction == pytest.approx(total_on / total)
    _, alone_metrics, _ = _loss_and_grads(model, [get_micro_batch(alone)], total_on)
    assert full_metrics.mismatch_kl_on_policy == pytest.approx(alone_metrics.mismatch_kl, rel=1e-6)
    assert full_metrics.mismatch_kl_on_policy != pytest.approx(full_metrics.mismatch_kl, rel=1e-2)
    assert any(g.abs().sum() > 0 for g in full_grads.values())
    splits = {
        "mbs=1": get_micro_batches(samples, 1, on_policy_version=ON_POLICY),
        "mbs=3": get_micro_batches(samples, 3, on_policy_version=ON_POLICY),
        # two data-parallel ranks, 2 samples per micro-batch, gradients summed over the ranks
        "2 ranks": get_micro_batches(samples, 2, rank=0, world_size=2, on_policy_version=ON_POLICY)
        + get_micro_batches(samples, 2, rank=1, world_size=2, on_policy_version=ON_POLICY),
        # extra padding: a 40-token dummy row of pure prompt widens every row of the micro-batch
        "padded": [get_micro_batch(samples + [{"prompt_ids": [5] * 40, "completion_ids": [],
                                               "inference_logprobs": [], "advantage": 0.0,
                                               "policy_version": ON_POLICY}], on_policy_version=ON_POLICY)],
    }
    for name, mbs in splits.items():
        loss, metrics, grads = _loss_and_grads(model, mbs, total, total_on)
        assert loss == pytest.approx(full_loss, abs=1e-6), name
        assert metrics.mismatch_kl == pytest.approx(full_metrics.mismatch_kl, abs=1e-6), name
        assert metrics.masked_fraction == pytest.approx(full_metrics.masked_fraction, abs=1e-9), name
        assert metrics.mismatch_kl_on_policy == pytest.approx(full_metrics.mismatch_kl_on_policy, abs=1e-6), name
        assert metrics.on_policy_fraction == pytest.approx(full_metrics.on_policy_fraction, abs=1e-9), name
        for key, grad in grads.items():
            torch.testing.assert_close(grad, full_grads[key], atol=2e-6, rtol=1e-4, msg=f"{name}: {key}")


@pytest.mark.parametrize("keep_bytes", [0, 1 << 20], ids=["recomputed", "kept"])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_logprobs_equal_the_full_logits_path_values_and_gradients(chunk, keep_bytes):
    """chunked_token_logprobs (float64 here, so the comparison is exact up to rounding) against
    token_logprobs over the full [N, V] logits: values, and gradients for the hidden states and the weight,
    with the logits recomputed in the backward and with them kept from the forward."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(11, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (11,), generator=gen)
    upstream = torch.randn(11, generator=gen, dtype=torch.float64)

    def grads(fn):
        hidden.grad = weight.grad = None
        values = fn()
        (values.double() * upstream).sum().backward()
        return values.detach().double(), hidden.grad.clone(), weight.grad.clone()

    for temperature in (1.0, 0.6):
        # token_logprobs works in float32; run the reference in float64 by hand for an exact comparison
        plain = grads(lambda: torch.log_softmax((hidden @ weight.t()) / temperature, -1)
                      .gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        chunked = grads(lambda: chunked_token_logprobs(hidden, weight, targets, temperature, chunk,
                                                       keep_bytes=keep_bytes))
        for got, expected in zip(chunked, plain):
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    # and the float32 path agrees with token_logprobs, the trainer's former path
    h32, w32 = hidden.detach().float(), weight.detach().float()
    torch.testing.assert_close(chunked_token_logprobs(h32, w32, targets, 0.6, chunk, keep_bytes=keep_bytes),
                               token_logprobs(h32 @ w32.t(), targets, 0.6), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(h32, w32, targets, 0.0)


def test_kept_logits_match_recomputed_ones_in_bf16_and_compiled_and_are_consumed_by_the_backward():
    """The kept-logits path (one matrix product, gradient written over the logits in place) against the
    recomputing one: bf16 weights as the trainer's compute copies, eager and compiled chunk arithmetic
    (compiled: one fused elementwise kernel per chunk); and a second backward through a graph whose logits
    were consumed raises instead of returning a wrong gradient."""
    gen = torch.Generator().manual_seed(7)
    hidden0 = torch.randn(37, 32, generator=gen).bfloat16()
    weight0 = (torch.randn(301, 32, generator=gen) * 0.2).bfloat16()
    targets = torch.randint(0, 301, (37,), generator=gen)
    upstream = torch.randn(37, generator=gen)
    results = {}
    for compiled in (False, True):
        for keep_bytes in (0, 1 << 20):
            hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
            values = chunked_token_logprobs(hidden, weight, targets, 0.7, 8, compiled, keep_bytes)
            (values * upstream).sum().backward()
            results[compiled, keep_bytes] = (values.detach(), hidden.grad.float(), weight.grad.float())
    # the exact values of the same bf16 inputs, in float64
    hidden, weight = hidden0.double().requires_grad_(), weight0.double().requires_grad_()
    values = torch.log_softmax((hidden @ weight.t()) / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (values * upstream.double()).sum().backward()
    exact = (values.detach(), hidden.grad, weight.grad)
    for key, got in results.items():
        for name, a, b in zip(("logprobs", "hidden grad", "weight grad"), got, exact):
            # bf16 logits and gradients: measured 1.0e-3, 4.1e-3 and 4.2e-3 of the largest value in every variant
            assert (a.double() - b).abs().max() <= 6e-3 * b.abs().max(), (key, name)
        torch.testing.assert_close(got[0], results[False, 0][0], atol=1e-6, rtol=0)  # the same logits
    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    values = chunked_token_logprobs(hidden, weight, targets, 1.0, 8, keep_bytes=1 << 20)
    values.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        values.sum().backward()


@pytest.mark.parametrize("keep_bytes", [0, 1 << 20], ids=["recomputed", "kept"])
def test_logprobs_under_cpu_autocast_backward_in_the_forward_dtype(keep_bytes):
    """An unwrapped bf16 model on CPU: float32 weights, the forward under CPU autocast, the backward outside it
    (as the Trainer runs them). The backward multiplies and recomputes in bf16 as the forward did (mixed dtypes
    used to fail in the kept path, and the recompute path rebuilt float32 logits against bf16 log-sum-exps)."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(21, 32, generator=gen).requires_grad_()
    weight = (torch.randn(97, 32, generator=gen) * 0.2).requires_grad_()
    targets = torch.randint(0, 97, (21,), generator=gen)
    upstream = torch.randn(21, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = chunked_token_logprobs(hidden, weight, targets, 0.7, 5, keep_bytes=keep_bytes)
    (values * upstream).sum().backward()
    h, w = hidden.detach().bfloat16().double().requires_grad_(), weight.detach().bfloat16().double().requires_grad_()
    exact = torch.log_softmax((h @ w.t()) / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (exact * upstream.double()).sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    for got, expected in ((values, exact), (hidden.grad, h.grad), (weight.grad, w.grad)):
        assert (got.double() - expected.detach()).abs().max() <= 1e-2 * expected.abs().max()


def test_kept_logits_fall_back_to_recomputing_when_their_allocation_runs_out_of_memory(monkeypatch):
    """The one [N, V] product that would keep every logit raises OutOfMemoryError (a full GPU at the step's
    peak): the head recomputes chunk by chunk instead, with the same values and gradients."""
    import rlrun_runtime.logprobs as logprobs

    gen = torch.Generator().manual_seed(3)
    hidden0, weight0 = torch.randn(13, 8, generator=gen), torch.randn(50, 8, generator=gen)
    targets = torch.randint(0, 50, (13,), generator=gen)
    linear, calls = logprobs.F.linear, []

    def linear_without_room(h, w):
        calls.append(h.shape[0])
        if h.shape[0] == 13:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return linear(h, w)

    results = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(logprobs.F, "linear", linear_without_room)
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        values = chunked_token_logprobs(hidden, weight, targets, 0.8, 4, keep_bytes=1 << 20)
        values.sum().backward()
        results.append((values.detach(), hidden.grad, weight.grad))
    assert calls[0] == 13 and set(calls[1:]) == {4, 1}  # tried once, then chunks in the forward and backward
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_on_device_metrics_equal_the_host_metrics():
    args = (torch.tensor([LT]), torch.tensor([LI]), torch.full((1, 5), ADV), torch.tensor([MASK]), 4, 0.125, 8.0,
            0.05, torch.tensor([[False, True, True, False, False]]), 2)
    loss, metrics = policy_loss(*args)
    loss_d, sums = policy_loss_on_device(*args)
    assert sums.dtype == torch.float64 and sums.shape == (6,)
    assert loss_d.item() == loss.item()
    assert LossMetrics.from_tensor(sums) == metrics
    assert metrics.mismatch_kl_on_policy > 0 and metrics.on_policy_fraction == 0.5


@pytest.mark.timeout(120)
def test_loss_and_gradients_invariant_to_packing():
    """With the trainer's LogprobHead and packed rows (several token budgets, two ranks), loss, metrics and
    gradients equal one padded micro-batch of every sample through the plain full-logits path."""
    plain = make_model(seed=3)
    model = make_model(seed=3)
    assert install_logprob_head(model)
    samples = _samples()
    total, total_on = count_loss_tokens(samples), count_on_policy_tokens(samples, ON_POLICY)
    full_loss, full_metrics, full_grads = _loss_and_grads(
        plain, [get_micro_batch(samples, on_policy_version=ON_POLICY)], total, total_on)
    splits = {
        f"budget {budget}": get_packed_micro_batches(samples, budget, on_policy_version=ON_POLICY)
        for budget in (1, 12, 30, 1000)
    }
    splits["2 ranks, budget 16"] = [mb for r in (0, 1) for mb in get_packed_micro_batches(
        samples, 16, rank=r, world_size=2, on_policy_version=ON_POLICY)]
    splits["padded 3, chunked head"] = get_micro_batches(samples, 3, on_policy_version=ON_POLICY)
    assert len(splits["budget 1000"]) == 1 and len(splits["budget 1"]) == len(samples)
    for name, mbs in splits.items():
        loss, metrics, grads = _loss_and_grads(model, mbs, total, total_on)
        assert loss == pytest.approx(full_loss, abs=1e-6), name
        for field in ("mismatch_kl", "masked_fraction", "ratio_mean", "mismatch_kl_on_policy", "on_policy_fraction"):
            assert getattr(metrics, field) == pytest.approx(getattr(full_metrics, field), abs=1e-6), (name, field)
        for key, grad in grads.items():
            torch.testing.assert_close(grad, full_grads[key], atol=2e-6, rtol=1e-4, msg=f"{name}: {key}")
