"""Write real torchao 0.9 training checkpoints: ``torchao09_delayed.pt`` (delayed scaling) and
``torchao09_dynamic_fsdp.pt`` (dynamic scaling with float8 FSDP weight wrappers).

Unlike the Transformer Engine fixtures this one is produced by the real library: torchao 0.9.0
(the last release with delayed scaling) runs on CPU with ``emulate=True``. It is committed
(~10 KB) because torchao 0.9 is not a project dependency. To regenerate::

    pip install --no-deps --target /tmp/torchao09 torchao==0.9.0
    PYTHONPATH=/tmp/torchao09 python samples/te-fixtures/make_torchao_fixture.py

The model is two Linear layers trained for a few SGD steps on inputs of growing magnitude;
``sync_float8_amax_and_scale_history`` runs after every backward, as torchao's docs require.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

OUT = Path(__file__).with_name("torchao09_delayed.pt")
OUT_DYNAMIC = Path(__file__).with_name("torchao09_dynamic_fsdp.pt")


def main() -> int:
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import CastConfig, ScalingType
    from torchao.float8.float8_linear_utils import sync_float8_amax_and_scale_history

    torch.manual_seed(0)
    delayed = CastConfig(scaling_type=ScalingType.DELAYED)
    config = Float8LinearConfig(cast_config_input=delayed, cast_config_weight=delayed,
                                cast_config_grad_output=delayed, emulate=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    convert_to_float8_training(model, config=config)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        x = torch.randn(8, 32) * (1 + step)
        model(x).square().mean().backward()
        sync_float8_amax_and_scale_history(model)
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), OUT)
    print(f"torchao {torchao.__version__}: wrote {OUT} ({OUT.stat().st_size} bytes)")

    # dynamic scaling (torchao's default): no FP8 state; with enable_fsdp_float8_all_gather the
    # weights are saved as WeightWithDynamicFloat8CastTensor wrappers
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=True, emulate=True))
    torch.save(model.state_dict(), OUT_DYNAMIC)
    print(f"wrote {OUT_DYNAMIC} ({OUT_DYNAMIC.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
