"""One data-parallel job for tests/test_distributed.py, launched by torchrun (or alone).

``run OUT SRC DATA OFFLOAD``: calibrate (entropy), convert (GPTQ, FP8 KV cache) and verify,
through the library as a user's script would, every output under OUT (rank 0 writes).
``cli ARGS...``: the fp8export command line; with ``FP8EXPORT_TEST_FAULT_RANK=R`` rank R fails
while building its second decoder layer (``FP8EXPORT_TEST_FAULT=hang``: it stops answering
instead), to check how the other ranks stop.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _fault() -> None:
    rank = os.environ.get("FP8EXPORT_TEST_FAULT_RANK")
    if rank is None or os.environ.get("RANK", "0") != rank:
        return
    from fp8export.errors import Fp8ExportError
    from fp8export.streaming import parts

    build = parts.CheckpointParts.build_layer

    def failing(self, i, device, values=None):
        if i == 1:
            if os.environ.get("FP8EXPORT_TEST_FAULT") == "hang":
                time.sleep(3600)
            raise Fp8ExportError(f"injected failure building layer {i}")
        return build(self, i, device, values)

    parts.CheckpointParts.build_layer = failing


def run(out: Path, src: Path, data: Path, offload: str) -> None:
    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.distributed import leave
    from fp8export.verify.config import VerifyConfig

    out.mkdir(parents=True, exist_ok=True)
    common = dict(calib_data=data, batch_size=3, device="cpu", offload=offload)
    api.calibrate(CalibrateConfig(checkpoint=src, output=out / "amax.json",
                                  calib_method="entropy", **common))
    api.convert(ConvertConfig(checkpoint=src, output=out / "fp8", weight_rounding="gptq",
                              kv_cache="fp8", **common))
    api.verify(VerifyConfig(reference=src, candidate=out / "fp8", data=data, batch_size=3,
                            seq_len=32, device="cpu", offload=offload, thresholds="loose",
                            report_dir=out / "report"))
    leave()


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5])
    else:
        _fault()
        from fp8export.cli import main

        sys.exit(main(sys.argv[2:]))
