"""Credential scrubbing: the one function between a secret and a client, the database or a log.

    redact = Redactor.for_settings(settings)
    redact("Incorrect API key provided: sk-proj-abc123...")  # "...provided: [REDACTED]"
    install_log_redaction(redact)                             # every log record, every handler

A provider's error message can echo the key it was sent (the server's own provider key); a
client can put a key in a request field. `Redactor` replaces, in any text:

- the exact values of the environment variables that hold keys: the ones the settings name
  (`api_key_env` of each upstream model, `judge.api_key_env`) and every variable named like a
  key holder (`*_API_KEY`, `*_TOKEN`, `*_SECRET`, `*_PASSWORD`, ...), plus the database URL's
  password;
- anything shaped like a credential: `sk-...` keys, `Bearer ...`, `api_key=...` / `"api_key":
  "..."` (and token, secret, password), well-known token prefixes (GitHub, Slack, Google, AWS,
  Hugging Face, JWTs), and long hex or base64 runs (40+ characters; uuids and ids are shorter).

It is applied where text leaves rlproxy's hands: provider errors before they become API errors
(`proxy.engines.upstream.to_api_error`), the error texts and params the store writes (`Store.open
(redact=...)`) and every log record (`install_log_redaction`). Message contents are not touched:
they are the client's data and the training data. This module imports nothing of rlproxy but its
settings.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.engine import make_url

from proxy.settings import Settings

MARK = "[REDACTED]"
MIN_SECRET_CHARS = 8
"""Shorter environment values are not treated as secrets: replacing them would mangle text."""

_KEY_HOLDER = re.compile(r"(API_?KEY|_KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.I)

# (pattern, replacement): a replacement keeps what names the secret and drops the secret.
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\b(Bearer)\s+[A-Za-z0-9._~+/=\-]{8,}", re.I), rf"\1 {MARK}"),
    (  # a header's whole value, scheme included: "Authorization: Basic dXNlcjpw..."
        re.compile(
            r"""(?ix)\b((?:proxy-)?authorization)(["']?\s*[:=]\s*["']?)(?:[a-z]+\s+)?[^\s"',;&}]+"""
        ),
        rf"\1\2{MARK}",
    ),
    (
        re.compile(
            r"""(?ix)
            \b((?:x-)?api[_-]?key|access[_-]?token|refresh[_-]?token|auth[_-]?token|api[_-]?token
               |client[_-]?secret|secret[_-]?key|secret|password|passwd)
            (["']?\s*[:=]\s*["']?)
            [^\s"',;&}]+
            """
        ),
        rf"\1\2{MARK}",
    ),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{8,}"), MARK),  # OpenAI, Anthropic (sk-ant-), ...
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"), MARK),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), MARK),  # Slack
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"), MARK),  # Google
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MARK),  # AWS access key ids
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}"), MARK),  # Hugging Face
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), MARK),  # JWT
    (re.compile(r"\b[0-9a-fA-F]{40,}\b"), MARK),  # hex secrets (a uuid hex is 32)
]
# Base64-ish runs: only those mixing upper case, lower case and digits (identifiers and paths
# do not; "/" is left out so that paths split into short runs).
_BASE64_RUN = re.compile(r"[A-Za-z0-9+_\-]{40,}={0,2}")


def _looks_random(run: str) -> bool:
    return (
        any(c.isupper() for c in run)
        and any(c.islower() for c in run)
        and any(c.isdigit() for c in run)
    )


class Redactor:
    """Scrubs credentials out of text; `redactor(text)` returns the text with each one replaced
    by `[REDACTED]`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Longest first, so a secret that contains another is replaced whole.
        self.secrets = sorted(
            {s for s in secrets if len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True
        )

    @classmethod
    def from_environ(
        cls,
        names: Iterable[str] = (),
        environ: Mapping[str, str] = os.environ,
        extra: Iterable[str] = (),
    ) -> Redactor:
        """The values of the variables `names` and of every variable named like a key holder."""
        wanted = set(names)
        values = [v for k, v in environ.items() if k in wanted or _KEY_HOLDER.search(k)]
        return cls([*values, *extra])

    @classmethod
    def for_settings(cls, settings: Settings, environ: Mapping[str, str] = os.environ) -> Redactor:
        """Every key the settings point at, plus the database password if the URL has one."""
        names = [t.api_key_env for t in settings.upstream_models.values() if t.api_key_env]
        if settings.judge.api_key_env:
            names.append(settings.judge.api_key_env)
        password = make_url(settings.resolved_database_url).password
        return cls.from_environ(names, environ, [str(password)] if password else [])

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, MARK)
        for pattern, replacement in _PATTERNS:
            text = pattern.sub(replacement, text)
        return _BASE64_RUN.sub(lambda m: MARK if _looks_random(m.group()) else m.group(), text)


def install_log_redaction(redact: Redactor) -> None:
    """Scrub every log record this process makes, whichever logger and handler it goes to
    (rlproxy's, uvicorn's, litellm's): its message, its arguments, its traceback."""
    make_record = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            _scrub_record(record, redact)
        except Exception as e:  # a log call must never raise; an unscrubbed text never passes
            record.msg = f"{MARK} (a log record that could not be scrubbed: {e!r})"
            record.args, record.exc_info, record.exc_text = (), None, None
        return record

    logging.setLogRecordFactory(factory)


def _scrub_record(record: logging.LogRecord, redact: Redactor) -> None:
    if isinstance(record.msg, str):
        record.msg = redact(record.msg)
    if isinstance(record.args, tuple) and record.args:
        args = tuple(_scrub_arg(a, redact) for a in record.args)
        if any(a is _UNSAFE for a in args):  # an object whose text holds a secret
            record.msg, record.args = redact(record.getMessage()), ()
        else:
            record.args = args
    elif isinstance(record.args, Mapping) and record.args:
        record.msg, record.args = redact(record.getMessage()), ()
    if record.exc_info and record.exc_info[0] is not None:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


_UNSAFE = object()


def _scrub_arg(arg: Any, redact: Redactor) -> Any:
    """A string argument scrubbed; another kind kept as it is unless its text holds a secret."""
    if isinstance(arg, str):
        return redact(arg)
    if isinstance(arg, int | float | bool) or arg is None:
        return arg
    text = str(arg)
    return arg if redact(text) == text else _UNSAFE
