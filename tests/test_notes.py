"""Notes as typed values (fp8export/notes.py): a message that is a str everywhere it goes, and a
kind that survives copying and pickling; the commands pick notes by kind."""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import asdict, dataclass, field

import pytest

from fp8export.notes import Note, NoteKind, kind_of


def test_a_note_is_its_message_with_a_kind():
    note = Note("weights only: activations are dynamic", NoteKind.ACTIVATIONS)
    assert note == "weights only: activations are dynamic" == note.message
    assert isinstance(note, str) and kind_of(note) is NoteKind.ACTIVATIONS
    assert kind_of("a plain string") is NoteKind.PLAIN and Note("x").kind is NoteKind.PLAIN
    with pytest.raises(AttributeError):
        note.kind = NoteKind.PLAIN


def test_kind_survives_copies_pickles_and_asdict_and_json_sees_text():
    @dataclass
    class Result:
        notes: list = field(default_factory=list)

    note = Note("TensorRT will run 2 quantized linear(s) in 16-bit", "sixteen-bit")
    for twin in (copy.deepcopy(note), pickle.loads(pickle.dumps(note)),
                 asdict(Result([note]))["notes"][0]):
        assert twin == note and kind_of(twin) is NoteKind.SIXTEEN_BIT
    assert json.loads(json.dumps({"notes": [note]})) == {"notes": [str(note)]}


def test_convert_summary_says_the_activations_once_with_their_granularity(tmp_path, run_cli,
                                                                           tiny_llama):
    r = run_cli("convert", tiny_llama, "-o", tmp_path / "o", "--scales", "weights",
                "--dynamic-activations", "tensor")
    assert r.exit_code == 0, r.output
    line = ("weights only (--scales weights): activations are dynamic; per-tensor FP8 scales "
            "are computed at run time")
    assert line in r.stdout.splitlines()
    assert "note: weights only" not in r.stdout
