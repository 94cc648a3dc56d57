"""The worker's weight receivers, picked by what each weights folder holds: files, a delta chain's entry, or a
manifest naming the transport its weights come over."""

from contracts.delta_chain import read_delta_info
from inference.transports.base import WeightReceiver
from inference.transports.delta_files import DeltaReceiver
from inference.transports.files import FileReceiver
from inference.transports.process_group import ProcessGroupReceiver
from inference.transports.shared_buffer import SharedBufferReceiver

SESSION_RECEIVERS = {"gloo": ProcessGroupReceiver, "nccl": ProcessGroupReceiver, "shared": SharedBufferReceiver}


class Receivers:
    """A worker's receivers: files for a folder without a manifest, the delta chain's for a folder with a chain
    entry, and one for the trainer session whose manifests it is given, made at the first of them (a new session's
    replaces it)."""

    def __init__(self):
        self.files = FileReceiver()
        self.delta = DeltaReceiver()
        self.session: ProcessGroupReceiver | SharedBufferReceiver | None = None

    def pick(self, manifest: dict | None, path: str) -> WeightReceiver:
        """The receiver of the weights in the folder ``path``, which ``manifest`` names (None: the folder's files,
        or its delta chain's). The others forget the copy they keep of what they loaded."""
        if manifest is None and self.session is not None:
            self.session.forget()
        if manifest is None and read_delta_info(path) is not None:
            return self.delta
        self.delta.forget()
        if manifest is None:
            return self.files
        if self.session is None or self.session.session != manifest["session"]:
            self.session = SESSION_RECEIVERS[manifest["backend"]](manifest)
        return self.session
