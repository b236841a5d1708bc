"""Notes for the user, as typed values: a kind and a message.

Every stage collects notes (what a run decided, who cannot load its output, what it left out)
and the commands print them, the manifest and the reports record them. A :class:`Note` is its
message (a ``str``, so notes print, join and serialise as text everywhere) with a
:class:`NoteKind` that says what a summary does with it: a command that shows a note's fact on
a line of its own picks it by kind, never by recognising its text.
"""

from __future__ import annotations

from fp8export.config import StrEnum


class NoteKind(StrEnum):
    """What a note says, as far as a summary treats it apart from the others."""

    PLAIN = "plain"
    # how the quantized layers' inputs are quantized: convert's summary shows it on its
    # activations line
    ACTIVATIONS = "activations"
    # layers exported without a static input scale (weight-only DQ): export-onnx replaces
    # these by one sentence when no layer has an FP8 GEMM at all
    DYNAMIC_LAYERS = "dynamic-layers"
    # the GEMMs TensorRT would run in 16 bits: export-onnx's summary lists them itself
    SIXTEEN_BIT = "sixteen-bit"


class Note(str):
    """A message with a :class:`NoteKind` (immutable, like the ``str`` it is)."""

    kind: NoteKind

    def __new__(cls, message: str, kind: NoteKind | str = NoteKind.PLAIN) -> Note:
        note = super().__new__(cls, message)
        object.__setattr__(note, "kind", NoteKind(kind))
        return note

    def __setattr__(self, name, value):
        raise AttributeError(f"a Note is immutable ({name})")

    def __reduce__(self):  # pickled and copied as what it is, kind included
        return type(self), (str(self), self.kind)

    @property
    def message(self) -> str:
        return str(self)


def kind_of(note: str) -> NoteKind:
    """A note's kind; a plain string is a :data:`NoteKind.PLAIN` note."""
    return getattr(note, "kind", NoteKind.PLAIN)
