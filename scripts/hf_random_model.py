#!/usr/bin/env python3
"""Writes a random-weight Hugging Face Llama-family checkpoint (config.json and
safetensors) for tests and benchmarks. Needs python3 and numpy only.

    scripts/hf_random_model.py OUT_DIR [--layers 12 --hidden 768 --heads 12 --kv-heads 12
        --head-dim 64 --intermediate 3072 --vocab 32000 --dtype bf16 --seq-len 4096]

The weights are Gaussian (embedding std 1, projections std 1/sqrt(fan_in), norm weights
near 1), so activations and logits stay O(1); they carry no language. The 125M-class shape
above is what docs/benchmarks.md's decode-throughput row uses.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama2c_to_hf import write_checkpoint  # noqa: E402


def random_weights(spec, seed=0):
    """Float32 weights (a dict keyed by Hugging Face tensor name) for spec: a dict with
    model_type, hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied,
    qkv_bias, o_bias, qk_norm."""
    rng = np.random.default_rng(seed)
    D, F, L = spec["hidden"], spec["intermediate"], spec["layers"]
    H, K, hd, V = spec["heads"], spec["kv_heads"], spec["head_dim"], spec["vocab"]

    def lin(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n):
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32)}
    for l in range(L):
        p = "model.layers.%d." % l
        w[p + "input_layernorm.weight"] = norm(D)
        w[p + "self_attn.q_proj.weight"] = lin(H * hd, D)
        w[p + "self_attn.k_proj.weight"] = lin(K * hd, D)
        w[p + "self_attn.v_proj.weight"] = lin(K * hd, D)
        w[p + "self_attn.o_proj.weight"] = lin(D, H * hd)
        if spec.get("qkv_bias"):
            w[p + "self_attn.q_proj.bias"] = bias(H * hd)
            w[p + "self_attn.k_proj.bias"] = bias(K * hd)
            w[p + "self_attn.v_proj.bias"] = bias(K * hd)
        if spec.get("o_bias"):
            w[p + "self_attn.o_proj.bias"] = bias(D)
        if spec.get("qk_norm"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(D)
        w[p + "mlp.gate_proj.weight"] = lin(F, D)
        w[p + "mlp.up_proj.weight"] = lin(F, D)
        w[p + "mlp.down_proj.weight"] = lin(D, F)
    w["model.norm.weight"] = norm(D)
    if not spec.get("tied"):
        w["lm_head.weight"] = lin(V, D) * np.float32(4.0)
    return w


def config_of(spec):
    c = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[spec["model_type"]]],
        "model_type": spec["model_type"], "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"], "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"], "vocab_size": spec["vocab"],
        "max_position_embeddings": spec.get("seq_len", 4096),
        "rms_norm_eps": spec.get("eps", 1e-6), "rope_theta": spec.get("rope_theta", 10000.0),
        "rope_scaling": spec.get("rope_scaling"), "tie_word_embeddings": bool(spec.get("tied")),
        "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
    }
    if spec["model_type"] != "qwen2":
        c["attention_bias"] = bool(spec.get("o_bias"))
    if spec.get("rope_parameters") is not None:
        # transformers v5's form: theta and scaling in one object (keep_v4 keeps the old
        # fields beside it, as a checkpoint written for both versions may).
        c["rope_parameters"] = spec["rope_parameters"]
        if not spec.get("keep_v4"):
            del c["rope_theta"], c["rope_scaling"]
    return c


def write_random(out_dir, spec, seed=0, dtype="F32", shards=1):
    """Writes the checkpoint; returns (config, the float64 values a reader sees per tensor)."""
    from llama2c_to_hf import stored_values
    w = random_weights(spec, seed)
    config = config_of(spec)
    write_checkpoint(out_dir, config, [(k, v, dtype) for k, v in w.items()], shards)
    return config, {k: stored_values(v, dtype) for k, v in w.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model-type", default="llama", choices=["llama", "qwen2", "qwen3"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    spec = dict(model_type=a.model_type, hidden=a.hidden, intermediate=a.intermediate,
                layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                vocab=a.vocab, seq_len=a.seq_len, tied=a.tied,
                qkv_bias=a.model_type == "qwen2", qk_norm=a.model_type == "qwen3")
    w = random_weights(spec, a.seed)
    write_checkpoint(a.out_dir, config_of(spec), [(k, v, a.dtype.upper()) for k, v in w.items()])
    n = sum(v.size for v in w.values())
    print("wrote %s: %d parameters (%.1fM), %s" % (a.out_dir, n, n / 1e6, a.dtype))


if __name__ == "__main__":
    sys.exit(main())
