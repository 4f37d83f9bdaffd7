"""rlrun operator: the RLRun API (CRD), its validation and rendering, the kopf operator and the `rlrun` CLI."""

__version__ = "0.1.0"
