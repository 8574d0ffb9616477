"""User-facing errors: one clear line, no traceback, nothing lost."""


class SpecPilotError(Exception):
    """An error caused by input the user can fix (a spec, a checkpoint, a flag).

    The CLI prints ``error: <message>`` on one line and exits with status 2; library
    callers catch it like any exception.
    """


class SpecError(SpecPilotError):
    """A model.yaml that does not validate: the message names the file and the key."""

    def __init__(self, path, key: str, expected: str):
        where = f"{path}: {key}" if key else f"{path}"
        super().__init__(f"{where}: {expected}")
        self.path, self.key, self.expected = path, key, expected


class CheckpointError(SpecPilotError):
    """A missing, corrupt or mismatched checkpoint (safetensors, GGUF, index)."""


class DivergenceError(SpecPilotError):
    """Token forcing found a position where the system under test chose another token."""
