"""``convert``: checkpoint -> FP8 folder, composing the readers, scales, calibration and the
FP8 folder writer in named steps."""
