"""Activation calibration (installed as ``fp8export.calibration``): observers and calibrators."""
