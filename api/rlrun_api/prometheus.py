"""Reading Prometheus text expositions (the orchestrator's and vLLM's /metrics), one rule for every reader.

The rule for a sample name that repeats (once per label set: vLLM labels its gauges by model name and
engine index, and by reason for the waiting queue): its values are **summed** (:func:`get_total`), so a
name reads as the total over its label sets; an unlabelled gauge is its own value. Every reader (the
operator's status and autoscaler, ``rlrun local``'s progress) goes through this module.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

from prometheus_client.parser import text_string_to_metric_families


class Sample(NamedTuple):
    """One sample line: its name (counters keep ``_total``), labels and value."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_samples(text: str) -> tuple[Sample, ...]:
    """Every sample of a Prometheus text exposition, in the order written (pure).

    prometheus_client's parser drops ``_total`` from counter *family* names only, so sample names keep it:
    readers match on sample names.

    Raises:
        ValueError: ``text`` is not in the exposition format.
    """
    return tuple(Sample(s.name, s.labels, float(s.value))
                 for family in text_string_to_metric_families(text) for s in family.samples)


def get_total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The rule for repeated samples: the sum of the samples called ``name`` whose labels include
    ``labels`` (0.0 when there is none)."""
    total = 0.0
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            total += sample.value
    return total


def get_totals(samples: Iterable[Sample]) -> dict[str, float]:
    """{sample name: :func:`get_total` of that name} for every name present, in one pass (pure)."""
    out: dict[str, float] = {}
    for sample in samples:
        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def count_samples(samples: Iterable[Sample], name: str) -> int:
    """How many samples are called ``name`` (one per label set, e.g. per vLLM engine)."""
    return sum(1 for sample in samples if sample.name == name)


def get_samples(text: str) -> dict[str, float]:
    """{sample name: total} of a Prometheus text exposition (:func:`get_totals` of :func:`parse_samples`).

    Raises:
        ValueError: ``text`` is not in the exposition format.
    """
    return get_totals(parse_samples(text))
