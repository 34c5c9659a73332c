"""User-facing errors: one sentence that names the file, field or value and what was expected."""


class HetrainError(Exception):
    """An error caused by the user's input or environment; the CLI prints it as one line and exits 2."""

    exit_code = 2


class NoPlanError(HetrainError):
    """No parallel plan fits the model on the cluster; the message says why in the user's terms."""


class TransientError(HetrainError):
    """A failure that trying again may not repeat: a training process died, a store did not answer.

    The flows retry these and only these; every other HetrainError is the user's input or
    environment, which a retry meets again (a missing bucket, a plan that does not fit).
    """
