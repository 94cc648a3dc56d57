"""The worker's weight receivers, picked by what each weights folder holds: files, or a manifest naming the
transport its weights come over."""

from inference.transports.base import WeightReceiver
from inference.transports.files import FileReceiver
from inference.transports.process_group import ProcessGroupReceiver
from inference.transports.shared_buffer import SharedBufferReceiver

SESSION_RECEIVERS = {"gloo": ProcessGroupReceiver, "nccl": ProcessGroupReceiver, "shared": SharedBufferReceiver}


class Receivers:
    """A worker's receivers: files for a folder without a manifest, and one for the trainer session whose
    manifests it is given, made at the first of them (a new session's replaces it)."""

    def __init__(self):
        self.files = FileReceiver()
        self.session: ProcessGroupReceiver | SharedBufferReceiver | None = None

    def pick(self, manifest: dict | None) -> WeightReceiver:
        """The receiver of the weights ``manifest`` names (None: the folder's files)."""
        if manifest is None:
            return self.files
        if self.session is None or self.session.session != manifest["session"]:
            self.session = SESSION_RECEIVERS[manifest["backend"]](manifest)
        return self.session
