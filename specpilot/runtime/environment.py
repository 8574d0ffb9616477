"""What every measurement records beside its numbers: machine, GPU, versions, date."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version


def environment() -> dict:
    import torch

    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("specpilot", "apache-tvm", "apache-tvm-ffi", "triton", "transformers"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            env["driver"] = None
    return env
