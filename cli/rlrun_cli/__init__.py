"""rlrun_cli: the `rlrun` command (validate, render, crd, local), above rlrun_api, the operator and the runtime."""
