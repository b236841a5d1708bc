"""What convert reads and writes, checked before any hashing or model loading.

Everything here is cheap (a stat, an open, one small JSON file) and imports no torch, so a typo
in a path fails in milliseconds instead of after the source was hashed and a model loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fp8export.checkpoint.model_config import check_experts
from fp8export.checkpoint.source import Checkpoint, check_checkpoint_path
from fp8export.convert.config import ConvertConfig
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.manifest import MANIFEST_NAME
from fp8export.io.outputs import claim_output_folder


def check_inputs(cfg: ConvertConfig) -> None:
    """Raise Fp8ExportError when the checkpoint, ``--calib-data``, ``--calib-amax`` or the output
    location is unusable for what can be seen without reading the data."""
    from fp8export.calibration.amax_file import read_amax_file
    from fp8export.inputs.samples import check_data_file

    check_checkpoint_path(cfg.checkpoint)
    claim_output_folder(cfg.resolved_output, inputs=(cfg.checkpoint, cfg.calib_data,
                                                     cfg.calib_amax),
                        force=cfg.force, marker=MANIFEST_NAME)
    if cfg.calib_data is not None:
        check_data_file(cfg.calib_data)
    if cfg.calib_amax is not None:
        read_amax_file(cfg.calib_amax)  # one small JSON file, fully validated


def check_structure(ckpt: Checkpoint) -> None:
    """What the tensor names and config.json promise together, before any weight is read: a
    checkpoint that no loader accepts (an MoE layer missing an expert) is refused up front
    instead of being written as an FP8 folder nothing can load."""
    check_experts(ckpt.config, (t.name for t in ckpt.tensors()), ckpt.path)


def check_scale_range(kind: str, scales: Mapping[str, Any]) -> None:
    """Refuse scales an FP8 folder cannot hold: the folder reader (fp8dir/validate.py) refuses
    any scale outside ``MIN_SCALE .. MAX_SCALE`` as damaged, so a layer whose range lies beyond
    (weights scaled by 1e-20 or 1e20) would be written into a folder that nothing opens.
    ``kind``: "weight", "input" or "KV cache"; ``scales``: name -> scale (a number, or per
    channel / per block an array)."""
    import numpy as np

    from fp8export.fp8dir.validate import MAX_SCALE, MIN_SCALE
    from fp8export.numerics.fp8 import E4M3_MAX

    bad = []
    for name, scale in scales.items():
        low, high = float(np.min(scale)), float(np.max(scale))
        if low < MIN_SCALE or high > MAX_SCALE:
            edge = low if low < MIN_SCALE else high
            bad.append(f"{name} (amax {edge * E4M3_MAX:.3g}, scale {edge:.3g})")
    if bad:
        fix = ("keep them in high precision with --exclude GLOB" if kind == "weight" else
               "keep those layers in high precision with --exclude GLOB, or drop the "
               "activation ranges that gave them" if kind == "input" else
               "convert without --kv-cache fp8")
        raise Fp8ExportError(
            f"{len(bad)} {kind} scale(s) lie outside {MIN_SCALE:g} .. {MAX_SCALE:g} (amax "
            f"{MIN_SCALE * E4M3_MAX:.3g} .. {MAX_SCALE * E4M3_MAX:.3g}), the range an FP8 folder "
            f"can hold (its readers refuse others as damaged): {', '.join(bad[:6])}"
            f"{f' (and {len(bad) - 6} more)' if len(bad) > 6 else ''}. No real model's "
            f"tensors are that small or large; check the checkpoint, or {fix}.")


def check_written(folder: Path, output: Path) -> None:
    """The folder convert just wrote (``folder``, the hidden temporary sibling of ``output``)
    through the FP8-folder reader before it is published: what its consumers would refuse is
    never reported as a success. With torch already loaded (every path but the default one)
    that is :func:`~fp8export.fp8dir.reader.read_fp8_folder` itself; the default path runs
    without torch and applies the reader's checks of a folder convert wrote
    (:func:`~fp8export.fp8dir.validate.validate_folder`) to the scale values read with numpy.
    """
    import sys

    try:
        if "torch" in sys.modules and (folder / "config.json").exists():
            from fp8export.fp8dir.reader import read_fp8_folder

            read_fp8_folder(folder).close()
        else:
            _validate_without_torch(folder)
    except Fp8ExportError as exc:
        # the reader's own advice (re-run convert) does not apply to the run that wrote it
        why = str(exc).replace(str(folder), output.name).split(" Re-run `fp8export convert`")[0]
        raise Fp8ExportError(
            f"{output}: the folder convert wrote is one the FP8-folder reader refuses, so "
            f"nothing was written ({why.rstrip('.')}). This is a bug in fp8export: please "
            "report the command line.") from exc


def _validate_without_torch(folder: Path) -> None:
    import ml_dtypes
    import numpy as np

    from fp8export.checkpoint.hf_folder import open_hf_folder
    from fp8export.checkpoint.model_config import read_model_config
    from fp8export.checkpoint.safetensors_reader import pread_exact, read_header_spans
    from fp8export.fp8dir.manifest import read_manifest
    from fp8export.fp8dir.validate import SCALE_DTYPES, validate_folder
    from fp8export.io.guarded import WEIGHTS, open_input

    numpy_dtype = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    manifest = read_manifest(folder)
    config = read_model_config(folder)  # None: no config.json (its source had none)
    with open_hf_folder(folder) as ckpt:
        infos = {t.name: t for t in ckpt.tensors()}
    spans: dict[Path, dict[str, tuple[int, int]]] = {}

    def values(name: str):
        info = infos[name]
        if info.dtype not in SCALE_DTYPES:
            return [1.0]  # validate_folder refuses the dtype before it looks at values
        if info.file not in spans:
            spans[info.file] = read_header_spans(info.file)[2]
        begin, end = spans[info.file][name]
        buf = np.empty(end - begin, dtype=np.uint8)
        with open_input(info.file, WEIGHTS, root=folder) as f:
            if pread_exact(f.fileno(), buf, begin) != end - begin:
                raise Fp8ExportError(f"{info.file}: tensor {name!r} is cut short.")
        return buf.view(numpy_dtype[info.dtype]).astype(np.float64).reshape(-1)

    validate_folder(folder, manifest, config,
                    {n: (i.dtype, tuple(i.shape)) for n, i in infos.items()}, values)
