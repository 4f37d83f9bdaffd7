"""rlrun runtime: the roles every RLRun pod runs (trainer, inference, router, orchestrator) and `rlrun local`."""

__version__ = "0.1.0"
