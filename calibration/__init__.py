"""Activation calibration (installed as ``fp8export.calibration``): sample data through the model
with observers, calibrators (max, percentile, mse, entropy) → activation amaxes and amax.json."""
