"""``convert``: a checkpoint to an FP8 folder, in named steps over the readers, scales, calibration
and the FP8-folder writer; its config, named schemes and recipe files."""
