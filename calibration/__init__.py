"""Activation calibration (installed as ``fp8export.calibration``): observers and calibrators.

Modules (heavy imports stay inside functions, so importing a module here is cheap):

- :mod:`.observers`: forward pre-hooks and streaming statistics (absmax, bf16-exact histogram).
- :mod:`.calibrators`: ``max`` / ``percentile`` / ``mse`` / ``entropy`` behind one interface
  and a registry (``register_calibrator``, ``get_calibrator``).
- :mod:`.targets`: the linears to observe and their fused groups (groups are found and
  shared by ``fp8export.scales.groups``).
- :mod:`.observe`: ``observe`` / ``amaxes_from_stats`` (one pass, any calibrator).
- :mod:`.api`: the verbs, ``calibrate(CalibrateConfig)`` and ``calibrate_ranges`` (for
  ``convert``).
- :mod:`.amax_file`: ``write_amax_file`` / ``read_amax_file`` (``amax.json``).
- :mod:`.config`: ``CalibrateConfig``.
"""
