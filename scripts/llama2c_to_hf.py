#!/usr/bin/env python3
"""Converts a llama2.c version-0 checkpoint (e.g. stories260K.bin) into a Hugging Face
Llama checkpoint directory: config.json and model.safetensors (or N shards with
model.safetensors.index.json). Needs python3 and numpy only.

    scripts/llama2c_to_hf.py stories260K.bin OUT_DIR [--dtype f32|f16|bf16] [--shards N]
        [--tokenizer tok512.bin]

--tokenizer also writes OUT_DIR/tokenizer.json from llama2.c's tokenizer file (the same ids
and pieces in the SentencePiece form scripts/hf_tokenizer_fixture.py writes), so the
converted directory decodes its ids to the same text.

llama2.c rotates adjacent pairs (2i, 2i+1) of each head with RoPE; Hugging Face's Llama
rotates (i, i + head_dim/2) ("rotate_half"). The q and k projection rows are permuted per
head so that the converted model computes the same function: new row i = old row 2i,
new row i + head_dim/2 = old row 2i + 1 (what Hugging Face's own conversion script does).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def to_dtype_bytes(a, dtype):
    """Little-endian bytes of float array `a` stored as F32, F16 or BF16 (round to nearest even)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "F32":
        return a.astype("<f4").tobytes()
    if dtype == "F16":
        return a.astype("<f2").tobytes()
    if dtype == "BF16":
        u = a.view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
        return r.tobytes()
    raise ValueError("dtype " + dtype)


def stored_values(a, dtype):
    """What a reader gets back from `a` stored as `dtype` (float64)."""
    a = np.asarray(a, dtype=np.float32)
    if dtype == "F32":
        return a.astype(np.float64)
    if dtype == "F16":
        return a.astype(np.float16).astype(np.float64)
    b = np.frombuffer(to_dtype_bytes(a, "BF16"), dtype="<u2").astype(np.uint32) << 16
    return b.view(np.float32).reshape(a.shape).astype(np.float64)


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, float array, dtype) in file order; raw=(name, bytes, dtype, shape)."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for t in tensors:
        if len(t) == 4:
            name, b, dtype, shape = t
        else:
            name, a, dtype = t
            b, shape = to_dtype_bytes(a, dtype), list(np.shape(a))
        header[name] = {"dtype": dtype, "shape": [int(s) for s in shape],
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        f.write(b"".join(blobs))


def write_checkpoint(out_dir, config, tensors, shards=1):
    """config.json plus the tensors in `shards` files (an index when more than one)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if shards <= 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
        return
    weight_map = {}
    for s in range(shards):
        name = "model-%05d-of-%05d.safetensors" % (s + 1, shards)
        part = tensors[s::shards]
        write_safetensors(os.path.join(out_dir, name), part)
        for t in part:
            weight_map[t[0]] = name
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def permute_rope(w, n_heads):
    """Rows of a q/k projection from llama2.c's interleaved pairs to rotate_half's halves."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def read_llama2c(path):
    with open(path, "rb") as f:
        raw = f.read()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    w = np.frombuffer(raw, dtype="<f4", offset=28)
    hd = dim // heads
    kv = kv_heads * hd
    p = 0

    def take(*shape):
        nonlocal p
        n = int(np.prod(shape))
        a = w[p:p + n].reshape(shape)
        p += n
        return a

    m = {"emb": take(vocab, dim), "rms_att": take(layers, dim), "wq": take(layers, dim, dim),
         "wk": take(layers, kv, dim), "wv": take(layers, kv, dim), "wo": take(layers, dim, dim),
         "rms_ffn": take(layers, dim), "w1": take(layers, hidden, dim),
         "w2": take(layers, dim, hidden), "w3": take(layers, hidden, dim),
         "rms_final": take(dim)}
    take(seq_len, hd)  # freq_cis, unused
    m["wcls"] = m["emb"] if shared else take(vocab, dim)
    if p != w.size:
        raise SystemExit("%s: %d floats left over: not a version-0 llama2.c checkpoint" % (path, w.size - p))
    cfg = dict(dim=dim, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
               vocab=vocab, seq_len=seq_len, shared=shared)
    return cfg, m


def convert(src, out_dir, dtype="F32", shards=1, permute=True):
    """permute=False skips the q/k permutation (tests/hf_test.py: that model must differ)."""
    c, m = read_llama2c(src)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c["dim"], "intermediate_size": c["hidden"],
        "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"],
        "max_position_embeddings": c["seq_len"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": c["shared"], "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    t = [("model.embed_tokens.weight", m["emb"], dtype)]
    for l in range(c["layers"]):
        pre = "model.layers.%d." % l
        t += [(pre + "input_layernorm.weight", m["rms_att"][l], dtype),
              (pre + "self_attn.q_proj.weight",
               permute_rope(m["wq"][l], c["heads"]) if permute else m["wq"][l], dtype),
              (pre + "self_attn.k_proj.weight",
               permute_rope(m["wk"][l], c["kv_heads"]) if permute else m["wk"][l], dtype),
              (pre + "self_attn.v_proj.weight", m["wv"][l], dtype),
              (pre + "self_attn.o_proj.weight", m["wo"][l], dtype),
              (pre + "post_attention_layernorm.weight", m["rms_ffn"][l], dtype),
              (pre + "mlp.gate_proj.weight", m["w1"][l], dtype),
              (pre + "mlp.up_proj.weight", m["w3"][l], dtype),
              (pre + "mlp.down_proj.weight", m["w2"][l], dtype)]
    t.append(("model.norm.weight", m["rms_final"], dtype))
    if not c["shared"]:
        t.append(("lm_head.weight", m["wcls"], dtype))
    write_checkpoint(out_dir, config, t, shards)


def read_llama2c_tokenizer(path, vocab_size):
    """llama2.c's tokenizer file: int32 max length, then per token float score, int32 length,
    bytes. Returns the pieces."""
    raw = open(path, "rb").read()
    at, pieces = 4, []
    for _ in range(vocab_size):
        _, n = struct.unpack("<fi", raw[at:at + 8])
        pieces.append(raw[at + 8:at + 8 + n].decode("utf-8"))
        at += 8 + n
    if at != len(raw):
        raise ValueError("%s: %d trailing bytes after %d tokens" % (path, len(raw) - at, vocab_size))
    return pieces


def write_tokenizer(tok_path, out_dir, vocab_size):
    from hf_tokenizer_fixture import from_llama2c_pieces
    doc = from_llama2c_pieces(read_llama2c_tokenizer(tok_path, vocab_size))
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--tokenizer", help="llama2.c tokenizer file (tok512.bin): also write tokenizer.json")
    a = ap.parse_args()
    convert(a.checkpoint, a.out_dir, a.dtype.upper(), a.shards)
    if a.tokenizer:
        write_tokenizer(a.tokenizer, a.out_dir, read_llama2c(a.checkpoint)[0]["vocab"])
    print("wrote", a.out_dir)


if __name__ == "__main__":
    sys.exit(main())
