"""The s4weights container: constants, writer, reader and manifest validation (docs/FORMAT.md)."""

from s4w_core.format.container import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    TRAILER_MAGIC,
    TRAILER_SIZE,
    ContainerReader,
    ContainerWriter,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "TRAILER_MAGIC",
    "TRAILER_SIZE",
    "ContainerReader",
    "ContainerWriter",
]
