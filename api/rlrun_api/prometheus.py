"""Reading Prometheus text expositions (the orchestrator's and vLLM's /metrics), one rule for both sides."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def get_samples(text: str) -> dict[str, float]:
    """{sample name: value} of a Prometheus text exposition; samples sharing a name are summed (pure).

    A name repeats once per label set (vLLM labels its gauges by model name and engine index), so the sum is
    the total over them; an unlabelled gauge is its own value. prometheus_client's parser drops ``_total``
    from counter *family* names only, so sample names keep it: match on sample names.

    Raises:
        ValueError: ``text`` is not in the exposition format.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out
