"""Files and helpers the corrupt-input corpus is built from (split from make_corpus.py)."""

from __future__ import annotations

import json
import os
import struct
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Case:
    """One corpus case (see make_corpus.py for the meaning of each field)."""

    id: str
    reader: str  # which reader / stage the case aims at
    argv: list[str]
    expect: list[str]
    exit: int = 1
    marker: str | None = None
    outputs: list[str] = field(default_factory=list)
    note: str = ""
    # exit-0 fallback cases: [key path into fp8export.json, expected value] pairs
    manifest: list = field(default_factory=list)
    # text on stdin: "y" answers to any prompt, so a command that reads stdin runs the payload
    stdin: str | None = None
    # the case would hang or exhaust memory on a build without the guard: run it as a
    # separate process with a time and memory limit, never in the test process
    isolate: bool = False
    # files that must keep their bytes (path -> sha256), e.g. the checkpoint an output names
    unchanged: dict = field(default_factory=dict)
    # extra environment variables and process limits ("nofile", "fsize": soft = hard); either
    # makes the case run as a separate process (they cannot apply to the test process)
    env: dict = field(default_factory=dict)
    rlimits: dict = field(default_factory=dict)
    # paths that must not exist afterwards even when the command succeeds (files an output
    # must not carry)
    absent: list = field(default_factory=list)
TE_FIXTURES = REPO / "samples" / "te-fixtures" / "make_fixtures.py"

H = 16  # hidden size of the tiny Llama-shaped model
FFN = 32  # intermediate size
V = 64  # vocab


# ------------------------------------------------------------------------------- helpers

class _WriteMarker:
    """Pickles to ``os.system('touch MARKER')``: loading it with plain pickle writes MARKER."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def llama_tensors(seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """A one-layer Llama-shaped state dict (names as transformers saves them)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    p = "model.layers.0."
    t = {"model.embed_tokens.weight": w(V, H), "lm_head.weight": w(V, H),
         "model.norm.weight": torch.ones(H, dtype=dtype),
         p + "input_layernorm.weight": torch.ones(H, dtype=dtype),
         p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype)}
    for n, shape in [("self_attn.q_proj", (H, H)), ("self_attn.k_proj", (H // 2, H)),
                     ("self_attn.v_proj", (H // 2, H)), ("self_attn.o_proj", (H, H)),
                     ("mlp.gate_proj", (FFN, H)), ("mlp.up_proj", (FFN, H)),
                     ("mlp.down_proj", (H, FFN))]:
        t[p + n + ".weight"] = w(*shape)
    return t


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
    "intermediate_size": FFN, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": V, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "hidden_act": "silu", "rope_theta": 10000.0,
}


def hf_folder(path: Path, tensors: dict[str, torch.Tensor] | None = None, *,
              config: dict | None = None) -> Path:
    """A Hugging Face folder: config.json + model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or LLAMA_CONFIG, indent=1))
    save_file(tensors if tensors is not None else llama_tensors(), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def sharded_folder(path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Two shards + model.safetensors.index.json, as save_pretrained writes them."""
    tensors = tensors if tensors is not None else llama_tensors()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=1))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, group in shards.items():
        save_file({n: tensors[n] for n in group}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    write_index(path, weight_map)
    return path


def write_index(folder: Path, weight_map: dict, name: str = "model.safetensors.index.json"):
    (folder / name).write_text(json.dumps({"metadata": {"total_size": 0},
                                           "weight_map": weight_map}, indent=1))


def raw_safetensors(path: Path, header: dict | None, data: bytes = b"", *,
                    header_bytes: bytes | None = None, declared: int | None = None) -> Path:
    """Write a safetensors file byte by byte (8-byte LE header length, JSON header, data)."""
    h = header_bytes if header_bytes is not None else json.dumps(header).encode()
    n = len(h) if declared is None else declared
    path.write_bytes(struct.pack("<Q", n) + h + data)
    return path


def st_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def te_fixtures():
    """samples/te-fixtures/make_fixtures.py as module ``te_make_fixtures`` (TE's layouts)."""
    import importlib.util

    name = "te_make_fixtures"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TE_FIXTURES)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def tiny_h5(path: Path) -> Path:
    """A Keras-3-style .weights.h5 for one Dense layer (written with h5py, no Keras)."""
    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        g = f.create_group("layers/dense/vars")
        g.attrs["name"] = "dense"
        g.create_dataset("0", data=rng.standard_normal((H, 8)).astype("float32"))
        g.create_dataset("1", data=np.zeros(8, "float32"))
        for i in range(4):
            f.create_group(f"layers/pad{i}/vars").create_dataset(
                "0", data=rng.standard_normal((64, 64)).astype("float32"))
        f.create_group("optimizer/vars")
    return path


KERAS_CONFIG = {
    "module": "keras", "class_name": "Functional", "registered_name": "Functional",
    "config": {"name": "functional", "layers": [
        {"module": "keras.layers", "class_name": "InputLayer", "name": "input",
         "config": {"name": "input", "batch_shape": [None, H], "dtype": "float32"},
         "inbound_nodes": []},
        {"module": "keras.layers", "class_name": "Dense", "name": "dense",
         "config": {"name": "dense", "units": 8, "use_bias": True, "dtype": "float32"},
         "inbound_nodes": []},
    ], "input_layers": [["input", 0, 0]], "output_layers": [["dense", 0, 0]]},
}


def keras_members(folder: Path) -> list[tuple[str, bytes]]:
    h5 = tiny_h5(folder / "_member.weights.h5").read_bytes()
    (folder / "_member.weights.h5").unlink()
    return [("metadata.json", json.dumps({"keras_version": "3.15.0"}).encode()),
            ("config.json", json.dumps(KERAS_CONFIG).encode()), ("model.weights.h5", h5)]


def write_zip(path: Path, members, compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def onnx_model(path: Path, *, opset: int = 21, custom: bool = False) -> Path:
    """A small ONNX graph: FP8 Q/DQ MatMul (the export profile), optionally with a custom op."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((H, H)) * 0.1).astype("float32")
    scale = np.float32(np.abs(w).max() / 448)
    wq = numpy_helper.from_array((w / scale).astype("float32"), "w_f32")
    inits = [
        helper.make_tensor("w_scale", TensorProto.FLOAT, [], [float(scale)]),
        helper.make_tensor("x_scale", TensorProto.FLOAT, [], [0.01]),
        helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0.0]),
        wq,
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["w_f32", "w_scale", "zp"], ["w_q"], axis=1,
                         name="w_quant"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "zp"], ["w_dq"], axis=1,
                         name="w_dq"),
        helper.make_node("QuantizeLinear", ["x", "x_scale", "zp"], ["x_q"], axis=1, name="x_q"),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "zp"], ["x_dq"], axis=1,
                         name="x_dq"),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["h"], name="proj.MatMul"),
    ]
    opsets = [helper.make_opsetid("", opset)]
    if custom:
        nodes.append(helper.make_node("FusedEvil", ["h"], ["logits"], domain="com.evil",
                                      name="evil_plugin"))
        opsets.append(helper.make_opsetid("com.evil", 1))
    else:
        nodes.append(helper.make_node("Identity", ["h"], ["logits"], name="out"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, H])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4, H])], inits)
    model = helper.make_model(graph, opset_imports=opsets, producer_name="fp8export-corpus")
    model.ir_version = 10 if opset >= 21 else 8
    onnx.save(model, str(path))
    return path


def sha256_file(path) -> str:
    """A fingerprint of what is at ``path``: the sha256 of a regular file, "fifo" for a named
    pipe (never opened: that would block), the target of a symlink, a folder's entries with
    theirs. Equal fingerprints: nothing there was replaced."""
    import hashlib
    import stat

    p = Path(path)
    mode = os.lstat(p).st_mode
    if stat.S_ISLNK(mode):
        return f"link -> {os.readlink(p)}"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISDIR(mode):
        return "dir: " + ", ".join(f"{q.name}={sha256_file(q)}" for q in sorted(p.iterdir()))
    return hashlib.sha256(p.read_bytes()).hexdigest()


def fp8_folder(root: Path, name: str) -> Path:
    """A real FP8 folder, written by fp8export's own convert (in-process), to be damaged."""
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    src = root / "fp8-source"
    if not src.exists():
        hf_folder(src)
    out = root / name
    api.convert(ConvertConfig(checkpoint=src, output=out, scales="weights"))
    return out
