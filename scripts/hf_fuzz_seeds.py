#!/usr/bin/env python3
"""Writes the seed corpus of fuzz/fuzz_hf_checkpoint.cpp (fuzz/corpus/hf_checkpoint/):
tiny valid Hugging Face checkpoints as one input each (2-byte config length, config.json,
one safetensors shard). Needs python3 and numpy."""
import json
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_random_model import write_random  # noqa: E402

SEEDS = {
    "tiny_llama_f32": (dict(model_type="llama", hidden=8, intermediate=8, layers=1, heads=2,
                            kv_heads=1, head_dim=4, vocab=5, seq_len=16), "F32"),
    "tiny_qwen2_tied_bf16": (dict(model_type="qwen2", hidden=8, intermediate=4, layers=1, heads=2,
                                  kv_heads=2, head_dim=4, vocab=4, tied=True, qkv_bias=True,
                                  seq_len=16), "BF16"),
    "tiny_qwen3_f16": (dict(model_type="qwen3", hidden=4, intermediate=4, layers=1, heads=2,
                            kv_heads=1, head_dim=4, vocab=3, qk_norm=True, seq_len=16,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8}), "F16"),
    "tiny_llama_rope_parameters_f32": (dict(model_type="llama", hidden=8, intermediate=8, layers=1,
                                            heads=2, kv_heads=1, head_dim=4, vocab=5, seq_len=16,
                                            rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 500000.0}), "F32"),
}


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "corpus", "hf_checkpoint")
    os.makedirs(root, exist_ok=True)
    for name, (spec, dtype) in SEEDS.items():
        with tempfile.TemporaryDirectory() as d:
            write_random(d, spec, seed=1, dtype=dtype)
            cfg = json.dumps(json.load(open(os.path.join(d, "config.json"))), separators=(",", ":")).encode()
            shard = open(os.path.join(d, "model.safetensors"), "rb").read()
        with open(os.path.join(root, name), "wb") as f:
            f.write(struct.pack("<H", len(cfg)) + cfg + shard)
        print(name, 2 + len(cfg) + len(shard), "bytes")


if __name__ == "__main__":
    main()
