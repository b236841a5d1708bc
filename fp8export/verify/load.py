"""verify's load stage: the runners opened and activated, the same model checked on both sides,
the candidate folder's format read, the reference's tokenizer and the evaluation samples."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from fp8export._progress import info, stage
from fp8export.errors import Fp8ExportError
from fp8export.runners.base import Runner
from fp8export.verify.config import VerifyConfig


@dataclass
class Session:
    """What verify opened: the three runners (``floor``: the fp32 reference, or None), the
    candidate's kind and FP8-folder format, the reference's tokenizer (None: none; False:
    refused) and the notes gathered for the report, in order."""

    cfg: VerifyConfig
    kind: str
    reference: Runner
    candidate: Runner
    floor: Runner | None
    folder_format: Any = None  # fp8dir.reader.FolderFormat of an FP8-folder candidate
    tokenizer: Any = None
    notes: list[str] = field(default_factory=list)
    decision: Any = None  # streaming.plan.Decision: whole, spread or layer streaming
    streamed: bool = False  # the torch models stream layer by layer (verify/streamed.py)

    def runners(self) -> list[Runner]:
        return [r for r in (self.reference, self.candidate, self.floor) if r is not None]


@dataclass
class Inputs:
    """The reference's config and task, the samples and the head that turns outputs to logits."""

    config: dict[str, Any]
    task: str
    samples: Any  # inputs.samples.Samples
    data_info: dict[str, Any]
    head: str


def open_session(cfg: VerifyConfig, kind: str, measure_floor: bool) -> Session:
    """The runners for ``cfg`` (not yet active) and the candidate folder's format; the plan
    decides whether the torch models run whole, spread or layer by layer."""
    from fp8export.placement import parse_max_memory, resolve_device
    from fp8export.verify.candidates import open_candidate, open_reference
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    if kind in ("onnx", "engine") and cfg.data is not None:
        refuse_media(cfg, kind)
    max_memory = parse_max_memory(cfg.max_memory) or None
    decision = _decide(cfg, kind, measure_floor, resolve_device(cfg.device))
    if decision is not None and decision.mode == "layers":
        session = _streamed_session(cfg, kind, measure_floor, decision)
    else:
        if decision is not None and decision.mode == "whole":
            max_memory = None  # the plan keeps them whole
        reference = open_reference(cfg.reference, dtype=str(cfg.reference_dtype),
                                   device=str(cfg.device), max_memory=max_memory)
        floor = open_reference(cfg.reference, dtype=FLOOR_DTYPE, device=str(cfg.device)) \
            if measure_floor else None
        candidate = open_candidate(cfg.candidate, backend=str(cfg.backend),
                                   device=str(cfg.device),
                                   dtype="bf16" if kind == "fp8-folder"
                                   else str(cfg.reference_dtype),
                                   fp8_mode=cfg.fp8_mode, max_memory=max_memory,
                                   ort_opt_level=cfg.ort_opt_level, kv_cache=cfg.kv_cache,
                                   attention=cfg.attention)
        session = Session(cfg, kind, reference, candidate, floor)
        if cfg.noise_floor and decision is not None and decision.mode == "spread":
            session.notes.append("No noise floor: --max-memory spreads the model over devices, "
                                 "leaving no room for the fp32 copy it needs.")
    session.decision = decision
    if kind == "fp8-folder":
        session.folder_format = fp8_folder_format(cfg.candidate, session.notes)
    return session


def refuse_media(cfg: VerifyConfig, kind: str) -> None:
    """An ONNX graph or engine takes token ids only (export-onnx traces the model on text):
    data naming images or audio would feed the reference pixels the candidate never sees."""
    from fp8export.inputs.samples import media_kinds

    kinds = media_kinds(cfg.data)
    if kinds:
        what = "an ONNX graph" if kind == "onnx" else "a TensorRT engine"
        raise Fp8ExportError(
            f"{cfg.data}: names {' and '.join(kinds)} files, but the candidate {cfg.candidate} "
            f"is {what}, which takes token ids only (export-onnx traces the language model on "
            "text). Verify it with text-only data, and the FP8 folder with the "
            f"{' and '.join(kinds)} data.")


def _decide(cfg: VerifyConfig, kind: str, measure_floor: bool, device: str):
    """The plan's decision for the torch models of this run (None: a Keras reference, which
    runs whole)."""
    from fp8export.distributed import join
    from fp8export.models import checkpoint_bytes
    from fp8export.placement import parse_max_memory
    from fp8export.runners.keras_runner import is_keras_file
    from fp8export.streaming.plan import decide

    comm = join(device)
    if is_keras_file(cfg.reference):
        return None
    ref_size = 4 if str(cfg.reference_dtype) == "fp32" else 2
    weights = checkpoint_bytes(cfg.reference, ref_size)
    if measure_floor:
        weights += checkpoint_bytes(cfg.reference, 4)
    if kind == "fp8-folder":
        weights += checkpoint_bytes(cfg.candidate, None)
    elif kind == "hf-folder":
        weights += checkpoint_bytes(cfg.candidate, ref_size)
    return decide(weights, device, parse_max_memory(cfg.max_memory), cfg.offload, comm)


def _streamed_session(cfg: VerifyConfig, kind: str, measure_floor: bool, decision) -> Session:
    from fp8export.runners.streamed import StreamedFp8Runner, StreamedTorchRunner
    from fp8export.verify.candidates import open_candidate, open_reference
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    if cfg.attention != "bf16" or cfg.kv_cache != "auto":
        raise Fp8ExportError(
            f"{cfg.candidate}: --kv-cache {cfg.kv_cache} / --attention {cfg.attention} compare "
            "several configurations of the whole candidate model, and this run streams the "
            f"models layer by layer ({decision.reason}). Drop those options (the folder runs "
            "with the KV cache it declares), or give the device room with --max-memory / "
            "--offload none.")
    open_reference(cfg.reference)  # the reference's checks (not an FP8 folder, not a graph)
    device = decision.device
    reference = StreamedTorchRunner(cfg.reference, dtype=str(cfg.reference_dtype),
                                    device=device, name="reference")
    floor = StreamedTorchRunner(cfg.reference, dtype=FLOOR_DTYPE, device=device,
                                name="reference-fp32") if measure_floor else None
    if kind == "fp8-folder":
        open_candidate(cfg.candidate, backend=str(cfg.backend))  # the backend fits the kind
        candidate = StreamedFp8Runner(cfg.candidate, dtype="bf16", device=device,
                                      mode=cfg.fp8_mode, name="candidate")
    elif kind == "hf-folder":
        candidate = StreamedTorchRunner(cfg.candidate, dtype=str(cfg.reference_dtype),
                                        device=device, name="candidate")
    else:  # a graph or an engine runs batch by batch beside the streamed reference
        candidate = open_candidate(cfg.candidate, backend=str(cfg.backend), device=device,
                                   fp8_mode=cfg.fp8_mode, ort_opt_level=cfg.ort_opt_level)
    session = Session(cfg, kind, reference, candidate, floor)
    session.streamed = True
    session.notes.append(f"Layer streaming ({decision.reason}): the models ran one decoder "
                         "layer (block) at a time, weights read from the shards; the metrics "
                         "equal the whole-model run's.")
    return session


def activate(session: Session, running: contextlib.ExitStack) -> None:
    """Load the runners into ``running`` (reference first: the candidate gets the devices'
    memory it left) and check that both sides are the same model."""
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    cfg, ref, cand = session.cfg, session.reference, session.candidate
    with stage(f"loading the reference {cfg.reference} (torch, {cfg.reference_dtype})"):
        running.enter_context(ref)
    if ref.placement is not None and cand.max_memory:
        # --max-memory holds both models: the candidate gets what the reference left
        cand.max_memory = ref.placement.remaining(cand.max_memory)
    with stage(f"loading the candidate {cfg.candidate} ({session.kind}, {cand.backend})"):
        running.enter_context(cand)
    if session.floor is not None:
        with stage(f"loading the reference again in {FLOOR_DTYPE} (the noise floor)"):
            running.enter_context(session.floor)
    check_same_model(ref.config, cand.config, cfg.reference, cfg.candidate)
    fp8_path = cand.fp8_path()
    if fp8_path is not None:
        info(f"candidate runs: {fp8_path}")


def load_inputs(session: Session) -> Inputs:
    """The evaluation samples, fitted to the (active) reference; the data's note recorded."""
    from fp8export.inputs.eval_data import load_verify_samples
    from fp8export.models import task_of

    cfg, ref = session.cfg, session.reference
    samples, data_info = load_verify_samples(cfg.data, cfg.reference,
                                             ref.data_config() or ref.config,
                                             samples=cfg.samples, seq_len=cfg.seq_len,
                                             tokenizer=session.tokenizer or None)
    if data_info.get("note"):
        session.notes.append(data_info["note"])
        info(data_info["note"])
    return Inputs(ref.config, task_of(ref.config), samples, data_info, ref.output_activation)


def check_same_model(ref_cfg: dict, cand_cfg: dict, reference, candidate) -> None:
    """Refuse a candidate whose config names another model than the reference's."""
    ref_layers, cand_layers = _keras_layers(ref_cfg), _keras_layers(cand_cfg)
    if ref_layers is not None and cand_layers is not None and ref_layers != cand_layers:
        diff = next((a, b) for a, b in zip(ref_layers + [None], cand_layers + [None],
                                           strict=False) if a != b)
        raise Fp8ExportError(
            f"reference {reference} and candidate {candidate} are different Keras models "
            f"(first difference: {diff[0]} vs {diff[1]}). Verify the candidate against the "
            "checkpoint it was converted from.")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "model_type"):
        a, b = ref_cfg.get(key), cand_cfg.get(key)
        if a is not None and b is not None and a != b:
            raise Fp8ExportError(
                f"reference {reference} and candidate {candidate} are different models: "
                f"{key} is {a!r} vs {b!r}. Verify the candidate against the checkpoint it was "
                "converted from.")


def _keras_layers(config: dict) -> list | None:
    """(name, class, options) of each layer of a Keras config; None for other configs."""
    from fp8export.keras_model.config import is_keras_config, parse_keras_config

    if not is_keras_config(config):
        return None
    return [(s.name, s.kind, s.options) for s in parse_keras_config(config, "config").layers]


def fp8_folder_format(folder, notes: list[str]):
    """What the candidate folder is, as the one reader found it (``FolderFormat``: producer,
    dialect, granularity, activations); what its dialect means for loaders, noted."""
    from fp8export.config import OutputFormat
    from fp8export.fp8dir.formats import format_notes
    from fp8export.fp8dir.reader import read_fp8_folder
    from fp8export.keras_model.config import is_keras_config

    with read_fp8_folder(folder) as opened:
        fmt, keras, found = opened.format, is_keras_config(opened.config), opened.loaders
    if found is not None and not keras:  # which engines run what verify runs, and which not
        notes.extend(found.notes())
        if not found.ok:
            notes.append("no engine loads this folder as written: the verdict is of what its "
                         "config declares, as fp8export's FP8 runtime runs it")
    known = {str(f): f for f in OutputFormat}
    if fmt.ours and fmt.dialect in known and not keras:
        notes.extend(f"{note} verify ran it with fp8export's torch FP8 runtime, which applies "
                     "its scales as vLLM does."
                     for note in format_notes(known[fmt.dialect], block=fmt.granularity == "block"))
    return fmt


@contextlib.contextmanager
def reference_tokenizer(cfg: VerifyConfig, notes: list[str]):
    """The reference's tokenizer, opened (in its limited child process) before the models load
    and loading while they do; with text data a hostile one fails at its first use, before any
    batch runs. One child serves the samples' encoding and the report's decoding. None without
    a tokenizer; with token-id data, a tokenizer that is refused only costs the report its
    decoded text (said in a note; False): it is awaited here, where that is decided.
    """
    from fp8export.inputs.eval_data import tokenizer_folder
    from fp8export.inputs.samples import TEXT_SUFFIXES
    from fp8export.inputs.tokenizer import has_tokenizer, open_tokenizer

    folder = tokenizer_folder(cfg.reference)
    if not has_tokenizer(folder):
        yield None
        return
    text = cfg.data is None or cfg.data.suffix.lower() in TEXT_SUFFIXES
    try:
        tokenizer = open_tokenizer(folder, for_file=cfg.data)
        if not text:
            tokenizer.facts  # noqa: B018 - loaded, or refused now
    except Fp8ExportError as exc:
        if text:
            raise
        info(f"Note: the report shows token ids instead of text: {exc}")
        notes.append(f"The report shows token ids instead of text: {exc}")
        yield False  # tried and refused: not opened again for the report
        return
    with tokenizer:
        yield tokenizer

