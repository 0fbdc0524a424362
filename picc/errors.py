"""The error type users see."""


class PiccError(Exception):
    """A user-facing error: one line, shown without a traceback (unless ``--debug``)."""
