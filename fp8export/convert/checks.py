"""What convert reads and writes, checked before any hashing or model loading.

Everything here is cheap (a stat, an open, one small JSON file) and imports no torch, so a typo
in a path fails in milliseconds instead of after the source was hashed and a model loaded.
"""

from __future__ import annotations

from fp8export.checkpoint.source import check_checkpoint_path
from fp8export.convert.config import ConvertConfig
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
