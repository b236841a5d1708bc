"""The Runner interface's optional capabilities: what a runner that has none of them says."""

import numpy as np

from fp8export.runners.base import Runner


class _Echo(Runner):
    backend = "echo"

    def _activate(self):
        pass

    def _infer(self, feed):
        return {"logits": np.asarray(feed["input_ids"], dtype=np.float32)}


def test_defaults_say_the_runner_has_no_capability():
    with _Echo() as runner:
        assert runner.config == {} and runner.data_config() is runner.config
        assert runner.max_memory is None and runner.placement is None
        assert runner.model is None and runner.manifest == {}
        assert runner.output_activation == "linear" and runner.fp8_path() is None
        out = runner.infer({"input_ids": np.ones((1, 2), dtype=np.int64)})
    assert out["logits"].shape == (1, 2)


def test_data_config_follows_the_config():
    runner = _Echo()
    runner.config = {"vocab_size": 7}
    assert runner.data_config() == {"vocab_size": 7}


def test_verify_asks_runners_through_the_interface():
    import re
    from pathlib import Path

    import fp8export.verify as verify

    probe = re.compile(r"getattr\(\s*[\w.]*(runner|ref|cand|floor)", re.I)
    probes = [p.name for p in Path(verify.__file__).parent.glob("*.py")
              if probe.search(p.read_text())]
    assert probes == []
    assert probe.search('getattr(cand_runner, "config", None)')
