"""The LM head's Triton kernels (rlrun_runtime.logprob_kernels) against the chunk arithmetic they replace on GPU
and a float64 reference, run by Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set before Triton is
imported, so in a fresh process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json
import torch
from rlrun_runtime.logprob_kernels import logits_to_grad_, token_logprobs_and_lse
from rlrun_runtime.logprobs import _forward_chunk, _logits_to_grad_

torch.manual_seed(0)
rows = []
for dtype in (torch.bfloat16, torch.float32):
    for temperature in (1.0, 0.7):
        logits = (torch.randn(6, 9000) * 4).to(dtype)
        logits[1, 5000:] = -1e4  # a row whose tail is far below its maximum
        targets = torch.tensor([0, 8999, 4096, 17, 4095, 4097])  # both ends and around the 4,096-column blocks
        logprobs, lse = token_logprobs_and_lse(logits, targets, temperature)
        x = logits.double() / temperature
        want_lse = torch.logsumexp(x, -1)
        want_logprobs = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - want_lse
        chunk_logprobs, chunk_lse = _forward_chunk(logits, targets, temperature, torch.float32)
        grad_out = torch.randn(6)
        got, chunk = logits.clone(), logits.clone()
        logits_to_grad_(got, targets, chunk_lse, grad_out, temperature)
        _logits_to_grad_(chunk, targets, chunk_lse, grad_out, temperature, torch.float32)
        onehot = torch.nn.functional.one_hot(targets, 9000).double()
        want_grad = grad_out.double().unsqueeze(-1) * (onehot - torch.softmax(x, -1)) / temperature
        rows.append({
            "dtype": str(dtype), "temperature": temperature,
            "lse_vs_float64": float((lse.double() - want_lse).abs().max()),
            # relative beyond magnitude 1: row 1's target logprob is near -1e4, where float32's unit is 1e-3
            "logprobs_vs_float64": float(((logprobs.double() - want_logprobs).abs()
                                          / want_logprobs.abs().clamp(min=1)).max()),
            "logprobs_vs_chunks": float(((logprobs - chunk_logprobs).abs() / chunk_logprobs.abs().clamp(min=1)).max()),
            "grad_vs_chunks": float(((got.float() - chunk.float()).abs() / (chunk.float().abs() + 1e-30)).max()),
            "grad_vs_float64": float((got.double() - want_grad).abs().max() / want_grad.abs().max()),
            "grad_dtype": str(got.dtype),
            "target_grad_positive": bool((got.float().gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                                          * grad_out).min() > 0),
        })
# ChunkedTokenLogprobs with the kernels (as on a GPU: kernels_usable forced) against the chunk arithmetic
import rlrun_runtime.logprobs as logprobs_module
from rlrun_runtime.logprobs import chunked_token_logprobs

hidden = torch.randn(40, 32, dtype=torch.float32, requires_grad=True)
weight = torch.randn(5000, 32, dtype=torch.float32, requires_grad=True)
targets = torch.randint(0, 5000, (40,))
grads = {}
for kernels in (False, True):
    logprobs_module.kernels_usable = lambda logits: True
    values = chunked_token_logprobs(hidden, weight, targets, 0.8, chunk=16, kernels=kernels)
    (values * torch.linspace(-1, 2, 40)).sum().backward()
    grads[kernels] = (values.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
wiring = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads[True], grads[False])]
rows.append({"wiring": wiring})
empty = torch.zeros(0, 9000)
rows.append({"empty": [t.shape[0] for t in token_logprobs_and_lse(empty, torch.zeros(0, dtype=torch.long), 1.0)]})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "api"), str(ROOT / "runtime")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_logprobs_and_lse_match_float64_and_the_chunk_arithmetic(results):
    for row in results[:-2]:
        # float32 accumulation over 9,000 columns of logits up to ~|20|: rounding near 1e-6; a wrong sum is off by
        # far more (one block of 4,096 columns missed: about log(9000 / 4904) = 0.6)
        assert row["lse_vs_float64"] < 2e-5, row
        assert row["logprobs_vs_float64"] < 2e-5, row
        assert row["logprobs_vs_chunks"] < 2e-5, row


def test_gradient_overwrites_the_logits_as_the_chunk_arithmetic_does(results):
    for row in results[:-2]:
        assert row["grad_dtype"] == row["dtype"]  # written back in place, in the logits' dtype
        # bf16 output: the two may round one unit apart (2**-7 relative); float32: float32 rounding
        assert row["grad_vs_chunks"] <= (2 ** -7 if "bfloat16" in row["dtype"] else 1e-5), row
        assert row["grad_vs_float64"] < (1e-2 if "bfloat16" in row["dtype"] else 1e-5), row
        assert row["target_grad_positive"], row  # raising a sampled token's logit raises its logprob


def test_chunked_token_logprobs_through_the_kernels_equals_the_chunk_arithmetic(results):
    """The autograd function's kernel path (kept logits, kernels forced usable) against its chunk path: the
    logprobs and the gradients of the hidden states and of the weight, float32."""
    values, hidden, weight = results[-2]["wiring"]
    assert values < 1e-6 and hidden < 1e-5 and weight < 1e-5, results[-2]


def test_no_rows_launch_nothing(results):
    assert results[-1] == {"empty": [0, 0]}
