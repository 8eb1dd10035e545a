"""What both transports agree on, in one place: the exception <-> (HTTP status, error code,
user/server category) table and the one `tinker://` path parser.

Torch-free and free of the engine: the client, the HTTP layer, the server and the engine all
import it; it imports nothing of ours but `trio_widgets.errors`.
"""

from __future__ import annotations

from .errors import ERRORS, ErrorRow, Refusal, WireError, error_from_wire, not_found, row_of, wire_error
from .paths import SEGMENTS, TINKER_SCHEME, TinkerPath, parse_tinker_path, shown_path

#: The built-in tiny model every pool serves (trained from scratch here; no download).
DEFAULT_MODEL = "trio/tiny-llama-byte"
"""The built-in base model: a tiny Llama with a byte tokenizer, made locally (nothing is downloaded).

Example: `trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=16)`.
"""

__all__ = [
    "DEFAULT_MODEL", "ERRORS", "SEGMENTS", "TINKER_SCHEME", "ErrorRow", "Refusal", "TinkerPath", "WireError",
    "error_from_wire", "not_found", "parse_tinker_path", "row_of", "shown_path", "wire_error",
]
