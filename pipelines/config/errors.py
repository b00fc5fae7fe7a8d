"""The one error type of configuration problems: ``ConfigError(field, message)``.

``str(e)`` is ``"<field>: <what is wrong>"``; the CLI prints ``config error: <that>`` as one line and exits 2.
"""

from __future__ import annotations

__all__ = ["ConfigError", "FieldError"]


class ConfigError(ValueError):
    """One bad field.  ``str(e)`` is ``"<field>: <what is wrong>"``; the CLI prints ``config error: <that>``."""

    def __init__(self, field_path: str, message: str):
        self.field = field_path
        self.problem = message
        super().__init__(f"{field_path}: {message}" if field_path else message)


class FieldError(ValueError):
    """Raised inside a validator: ``path`` is relative to the validated object (``"params.margin"``)."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(message)
