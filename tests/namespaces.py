"""Whether a test may mount file systems in namespaces of its own (a small tmpfs that fills up, a read-only one)."""

import shutil
import subprocess


def user_namespaces() -> bool:
    """Whether unprivileged user and mount namespaces are available here (``unshare -rm true`` succeeds)."""
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-rm", "true"]).returncode == 0
