"""rlrun_api: the RLRun contract both sides share (constants, the CRD and its defaults, CEL, P:D sizing,
document loading, validation); it imports neither the operator nor the runtime."""

__version__ = "0.1.0"
