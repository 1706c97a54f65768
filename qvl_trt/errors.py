"""The error hierarchy. A QvlError is the user's to fix: the CLI prints it on one line and
exits non-zero. Anything else is a bug and keeps its traceback."""


class QvlError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""

    exit_code = 1


class DependencyError(QvlError):
    """An optional package needed for this step is not installed."""


class ConfigError(QvlError):
    """A GPU profile, option or build configuration is invalid."""


class CheckpointError(QvlError):
    """The model checkpoint is missing, corrupt or not a dense Qwen3-VL."""


class PlanError(QvlError):
    """The checkpoint does not fit the GPU profile's limits."""


class InputError(QvlError):
    """A request is malformed: corrupt or oversized image, prompt too long, bad options."""


class FieldError(InputError):
    """A request is malformed in one field, which `field` names (the gateway answers with it
    as OpenAI's `param`)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class LimitError(InputError):
    """A request is above one of the deployment's size bounds (its preprocessing model's
    parameters): too large rather than malformed."""


class EngineLimitError(InputError):
    """A request is above a limit its build was sized for (images, videos or frames, visual
    tokens, prompt tokens, room to generate): another build of the same checkpoint with larger
    limits may take it."""


class UnavailableError(QvlError):
    """A model cannot take the request now (it is unloading or not ready); sending it again
    later may succeed."""


class BusyError(UnavailableError):
    """A model is full: every batch slot and queue place of its LLM is taken (or the request
    waited longer than the deployment allows for a slot); sending it again later may
    succeed."""


class StepError(QvlError):
    """Another model of the deployment answered with an error: its text, with its kind's
    marker first (triton/contract.py ErrorKind.relay), is passed on as it is."""


class RequestError(QvlError):
    """A server answered a request with an error (or did not answer)."""


class ServerError(QvlError):
    """tritonserver did not start or stopped unexpectedly."""


class BuildError(QvlError):
    """A build stage failed or cannot run here."""


class StageUnavailable(BuildError):
    """A stage stopped because this machine lacks what it needs; the build can be resumed
    elsewhere."""

    exit_code = 3
