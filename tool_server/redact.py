"""Secret redaction for log records and error messages (defence in depth: code paths avoid secrets already)."""
from __future__ import annotations

import logging

MASK = "[REDACTED]"


class Redactor:
    def __init__(self, secrets: list[str]) -> None:
        # longest first, so a secret that contains another is masked whole
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text


class RedactingFilter(logging.Filter):
    """Attach to handlers: formats each record once, masks secrets, and freezes the result into ``msg``."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args = self.redactor(message), None
        if record.exc_text:
            record.exc_text = self.redactor(record.exc_text)
        return True
