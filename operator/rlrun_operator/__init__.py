"""rlrun operator: the pure renderer (RLRun -> manifests), the apply and status logic, and the kopf operator."""
