"""``multipart/form-data`` bodies, as OpenAI's client sends ``client.videos.create``.

The body has already passed the size and time limits of ``app._read_body``; the standard library's MIME parser
splits it (no dependency for four text fields).  Every value arrives as text: the fields the JSON API takes as
numbers are converted here, so the one validator (``api.validate_video``) sees the same types either way and a
bad value gets the same 400 naming its field.  A file part (OpenAI's ``input_reference``, an image to start
from) is refused: this service generates from text only.
"""

from __future__ import annotations

from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from stepwatch.service.api import ApiError

INT_FIELDS = ("frames", "steps", "seed", "n")
FLOAT_FIELDS = ("guidance_scale",)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_form")


def parse_form(raw: bytes, content_type: str) -> dict[str, Any]:
    """The form's fields as a dict (numbers converted); a 400 for a body that is not a form of text fields."""
    if "boundary=" not in content_type:
        raise _bad("a multipart/form-data body needs a boundary in its Content-Type")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    msg = BytesParser(policy=HTTP).parsebytes(head + raw)
    if not msg.is_multipart():
        raise _bad("the body is not multipart/form-data")
    body: dict[str, Any] = {}
    for part in msg.iter_parts():
        name, value = _field(part)
        if name in body:
            raise _bad(f"field {name!r} appears twice", name)
        body[name] = _typed(name, value)
    return body


def _field(part: Message) -> tuple[str, str]:
    name = part.get_param("name", header="content-disposition")
    if not isinstance(name, str) or not name:
        raise _bad("a form part has no field name")
    if part.get_param("filename", header="content-disposition") is not None:
        raise _bad(f"{name!r}: file uploads are not supported (this service generates from text only)", name)
    payload = part.get_payload(decode=True)
    try:
        return name, payload.decode("utf-8") if isinstance(payload, bytes) else ""
    except UnicodeDecodeError:
        raise _bad(f"{name!r} is not UTF-8 text", name) from None


def _typed(name: str, value: str) -> Any:
    try:
        if name in INT_FIELDS:
            return int(value)
        if name in FLOAT_FIELDS:
            return float(value)
    except ValueError:
        kind = "an integer" if name in INT_FIELDS else "a number"
        raise ApiError(400, f"'{name}' must be {kind}, got {value[:40]!r}", name, "invalid_type") from None
    return value
