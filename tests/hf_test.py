#!/usr/bin/env python3
"""CTest hf_checkpoints: the Hugging Face checkpoint reader (examples/llama2c/hf.hpp).

    hf_test.py KVEVICT_HF_TOOL STORIES260K_DIR WORK_DIR [LLAMA2C]

1. stories260K converted to the Hugging Face layout (scripts/llama2c_to_hf.py, one file and
   three shards) gives the llama2.c reader's logits to 1e-4 (skipped when the model
   directory is absent).
2. Random-weight checkpoints of each supported variant (GQA, tied, Qwen2 q/k/v biases,
   Llama attention_bias, Qwen3 q/k norm with head_dim != hidden/heads, llama3 and linear
   rope_scaling; F32, F16, BF16; sharded) match an independent numpy forward pass (whole
   sequence at once, float64, HF's cos/sin rotate_half form) to 1e-4.
3. Malformed or unsupported checkpoints give one line on stderr and exit status 2.
4. tokenizer.json decoding (examples/llama2c/hf_tokenizer.hpp) of generated fixtures
   (scripts/hf_tokenizer_fixture.py: byte-level BPE, SentencePiece-style, Metaspace) matches
   a reference decoder written here, whole and piece by piece; unsupported decoders fall
   back to ids with a warning; malformed files give one line and exit status 2; stories260K's
   tok512.bin converted to tokenizer.json decodes a stream as llama2.c's tokenizer does.
Exit 77 (CTest: skipped) without numpy.
"""
import json
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("hf_test.py: python3-numpy is not installed; skipping (scripts/install-deps.sh installs it)")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
from llama2c_to_hf import convert, write_safetensors  # noqa: E402
from hf_random_model import write_random  # noqa: E402
import hf_tokenizer_fixture as tokfix  # noqa: E402

TOOL, STORIES, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
LLAMA2C = sys.argv[4] if len(sys.argv) > 4 else ""
failures = []


def run(*args):
    return subprocess.run([TOOL, *args], capture_output=True, text=True)


def expect_ok(name, *args):
    r = run(*args)
    line = (r.stdout.strip() or r.stderr.strip())
    print("%-28s %s" % (name, line))
    if r.returncode != 0:
        failures.append("%s: exit %d: %s %s" % (name, r.returncode, r.stdout, r.stderr))


# --- the reference forward pass ------------------------------------------------------------
def rope_of(cfg):
    """(theta, scaling) from transformers v5's rope_parameters, else v4's two fields."""
    p = cfg.get("rope_parameters")
    if p is not None:
        return p.get("rope_theta", cfg.get("rope_theta", 10000.0)), p
    return cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling") or {}


def inv_freq(cfg):
    hd = cfg["head_dim"]
    theta, s = rope_of(cfg)
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        old, lo, hi, f = (s["original_max_position_embeddings"], s["low_freq_factor"],
                          s["high_freq_factor"], s["factor"])
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / f + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, blended, scaled)
    return inv


def reference_logits(cfg, w, tokens, record=None):
    T, D = len(tokens), cfg["hidden_size"]
    H, K, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    ang = np.outer(np.arange(T, dtype=np.float64), inv_freq(cfg))
    cos = np.cos(np.concatenate([ang, ang], axis=-1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], axis=-1))[:, None, :]

    def rope(x):
        rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
        return x * cos + rotated * sin

    mask = np.triu(np.ones((T, T), dtype=bool), k=1)
    x = w["model.embed_tokens.weight"][tokens]
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        h = rms(x, w[p + "input_layernorm.weight"])
        q = h @ w[p + "self_attn.q_proj.weight"].T + w.get(p + "self_attn.q_proj.bias", 0.0)
        k = h @ w[p + "self_attn.k_proj.weight"].T + w.get(p + "self_attn.k_proj.bias", 0.0)
        v = h @ w[p + "self_attn.v_proj.weight"].T + w.get(p + "self_attn.v_proj.bias", 0.0)
        q, k, v = q.reshape(T, H, hd), k.reshape(T, K, hd), v.reshape(T, K, hd)
        if p + "self_attn.q_norm.weight" in w:
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        if record is not None:
            record.append((q, k, v))
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s[:, mask] = -np.inf
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, H * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T + w.get(p + "self_attn.o_proj.bias", 0.0)
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    lm = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"]) @ lm.T


def expect_rejected(name, what, model_dir, cfg, w, tokens):
    """The engine's logits must differ (beyond tol) from the reference under `cfg`."""
    ref = os.path.join(WORK, "%s.%s.safetensors" % (name, what.replace(" ", "_")))
    write_safetensors(ref, [("tokens", tokens.astype(np.float32), "F32"),
                            ("logits", reference_logits(cfg, w, tokens).astype(np.float32), "F32")])
    r = run("check", model_dir, ref)
    print("%-28s %s (expected above tol)" % (name + " " + what, r.stdout.strip()))
    if r.returncode != 1:
        failures.append("%s: the %s reference was accepted" % (name, what))


def read_safetensors(path):
    """F32 tensors of a safetensors file as float64 arrays (the test's own reader)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<f4").reshape(t["shape"]).astype(np.float64)
    return out


BASE = dict(model_type="llama", hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2,
            head_dim=16, vocab=97, seq_len=128)
VARIANTS = [
    ("gqa_f32", dict(BASE), "F32", 1),
    ("tied_mha_f32", dict(BASE, kv_heads=4, tied=True), "F32", 1),
    ("qwen2_bias_bf16", dict(BASE, model_type="qwen2", qkv_bias=True, rope_theta=1e6), "BF16", 1),
    ("llama_attn_bias_f16", dict(BASE, qkv_bias=True, o_bias=True), "F16", 1),
    ("qwen3_qknorm_f32", dict(BASE, model_type="qwen3", qk_norm=True, head_dim=24, kv_heads=1),
     "F32", 1),
    ("rope_llama3_f32", dict(BASE, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), "F32", 1),
    ("rope_linear_f32", dict(BASE, rope_scaling={"type": "linear", "factor": 4.0}), "F32", 1),
    ("sharded_3_bf16", dict(BASE, layers=3), "BF16", 3),
    # More rows than Weight::kWidenRows (256): forward_block widens 16-bit matrices in slices.
    ("wide_bf16", dict(BASE, intermediate=300, vocab=600), "BF16", 1),
    # transformers v5: rope_theta and the scaling inside rope_parameters.
    ("rope_params_llama3_f32", dict(BASE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), "F32", 1),
    ("rope_params_theta_f32", dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
     "F32", 1),
    ("rope_params_and_v4_f32", dict(BASE, rope_theta=1e6, keep_v4=True, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}), "F32", 1),
    ("rope_params_theta_v4_f32", dict(BASE, rope_theta=1e6, keep_v4=True, rope_parameters={
        "rope_type": "linear", "factor": 2.0}), "F32", 1),
]


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    # 1. stories260K, llama2.c reader against the converted checkpoint.
    src = os.path.join(STORIES, "stories260K.bin")
    if os.path.exists(src):
        for shards in (1, 3):
            out = os.path.join(WORK, "stories260K_hf_%d" % shards)
            convert(src, out, "F32", shards)
            expect_ok("stories260K_hf shards=%d" % shards, "compare", src, out, "--tokens", "200")
        # Without the q/k permutation the logits differ: the comparison can fail.
        out = os.path.join(WORK, "stories260K_hf_unpermuted")
        convert(src, out, "F32", 1, permute=False)
        r = run("compare", src, out, "--tokens", "200")
        print("%-28s %s (expected above tol)" % ("stories260K_hf unpermuted", r.stdout.strip()))
        if r.returncode != 1:
            failures.append("stories260K without the q/k permutation was accepted")
    else:
        print("stories260K not found at %s: conversion check skipped" % src)

    # 2. variants against the numpy reference.
    rng = np.random.default_rng(7)
    for i, (name, spec, dtype, shards) in enumerate(VARIANTS):
        out = os.path.join(WORK, name)
        cfg, w = write_random(out, spec, seed=100 + i, dtype=dtype, shards=shards)
        if spec.get("rope_scaling") is None:
            cfg.pop("rope_scaling", None)
        tokens = rng.integers(0, spec["vocab"], size=40)
        qkv = []
        ref = reference_logits(cfg, w, tokens, qkv)
        write_safetensors(os.path.join(WORK, name + ".ref.safetensors"),
                          [("tokens", tokens.astype(np.float32), "F32"),
                           ("logits", ref.astype(np.float32), "F32")])
        expect_ok(name, "check", out, os.path.join(WORK, name + ".ref.safetensors"))
        expect_ok(name + " blocks of 16", "check", out, os.path.join(WORK, name + ".ref.safetensors"),
                  "--block", "16")
        if name in ("gqa_f32", "qwen3_qknorm_f32"):
            # The dumped trace (docs/traces.md) holds the reference's post-RoPE q, k, v.
            trace = os.path.join(WORK, name + ".trace.safetensors")
            expect_ok(name + " dump-trace", "dump", out, os.path.join(WORK, name + ".ref.safetensors"), trace)
            got = read_safetensors(trace)
            worst = max(float(np.abs(got["layers.%d.%s" % (l, n)] - x).max())
                        for l, t in enumerate(qkv) for n, x in zip("qkv", t))
            print("%-28s max abs diff %.3e against the reference's q, k, v" % (name + " trace", worst))
            if not worst <= 1e-4:
                failures.append(name + ": trace differs from the reference by %g" % worst)
        # The RoPE settings must matter: a reference without them is rejected.
        if spec.get("rope_scaling") is not None:
            expect_rejected(name, "unscaled", out, dict(cfg, rope_scaling=None), w, tokens)
        if spec.get("rope_parameters") is not None:
            expect_rejected(name, "default rope", out,
                            dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                            w, tokens)

    # 3. malformed and unsupported checkpoints.
    base = os.path.join(WORK, "gqa_f32")

    def variant(name, edit_config=None, edit_tensors=None, edit_bytes=None):
        out = os.path.join(WORK, "bad_" + name)
        shutil.copytree(base, out)
        if edit_config:
            path = os.path.join(out, "config.json")
            c = json.load(open(path))
            edit_config(c)
            json.dump(c, open(path, "w"))
        if edit_tensors:
            _, w = write_random(os.path.join(WORK, "tmp_" + name), dict(BASE), seed=100)
            t = [(k, v.astype(np.float32), "F32") for k, v in w.items()]
            t = edit_tensors(t)
            write_safetensors(os.path.join(out, "model.safetensors"), t)
        if edit_bytes:
            path = os.path.join(out, "model.safetensors")
            b = open(path, "rb").read()
            open(path, "wb").write(edit_bytes(b))
        return out

    def drop(name):
        return lambda t: [x for x in t if x[0] != name]

    def reshape(name):
        return lambda t: [(n, a.T if n == name else a, d) for n, a, d in t]

    def retype(name):
        def f(t):
            out = []
            for n, a, d in t:
                if n == name:
                    out.append((n, a.astype("<f8").tobytes(), "F64", list(a.shape)))
                else:
                    out.append((n, a, d))
            return out
        return f

    cases = [
        ("missing_tensor", dict(edit_tensors=drop("model.layers.1.mlp.up_proj.weight")),
         "model.layers.1.mlp.up_proj.weight' is missing"),
        ("wrong_shape", dict(edit_tensors=reshape("model.layers.0.self_attn.k_proj.weight")),
         "has shape [64, 32], expected [32, 64]"),
        ("unknown_dtype", dict(edit_tensors=retype("model.norm.weight")), "dtype F64"),
        ("rope_yarn", dict(edit_config=lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
         "rope_scaling' has type 'yarn'"),
        ("rope_llama3_incomplete", dict(edit_config=lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
         "rope_scaling.low_freq_factor' is missing"),
        ("truncated", dict(edit_bytes=lambda b: b[:-100]), "out of range"),
        ("unknown_field", dict(edit_config=lambda c: c.update(sliding_window_pattern=4)),
         "field 'sliding_window_pattern' is not supported"),
        ("mlp_bias", dict(edit_config=lambda c: c.update(mlp_bias=True)), "field 'mlp_bias' = true"),
        ("model_type", dict(edit_config=lambda c: c.update(model_type="gemma")), "model_type"),
        ("extra_tensor", dict(edit_tensors=lambda t: t + [("model.layers.0.mlp.extra", np.zeros(3, np.float32), "F32")]),
         "model.layers.0.mlp.extra' is not part of"),
        ("bad_json", dict(edit_config=None, edit_bytes=None), "config.json: bad JSON at byte"),
        ("rope_params_theta_conflict",
         dict(edit_config=lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
         "'rope_theta' = 10000 conflicts with 'rope_parameters.rope_theta' = 500000"),
        ("rope_params_scaling_conflict",
         dict(edit_config=lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0},
                                             rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 10000.0})),
         "conflicts with 'rope_parameters'"),
        ("rope_params_unknown_key",
         dict(edit_config=lambda c: c.update(rope_parameters={"rope_type": "default",
                                                              "partial_rotary_factor": 0.5})),
         "'rope_parameters.partial_rotary_factor' is not supported"),
        ("rope_params_yarn",
         dict(edit_config=lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0})),
         "'rope_parameters' has type 'yarn'"),
        ("head_count", dict(edit_config=lambda c: c.update(num_key_value_heads=3)), "num_key_value_heads"),
    ]
    for name, edits, needle in cases:
        out = variant(name, **edits)
        if name == "bad_json":
            open(os.path.join(out, "config.json"), "w").write('{"model_type": "llama",')
        r = run("load", out)
        lines = r.stderr.strip().split("\n")
        ok = r.returncode == 2 and len(lines) == 1 and needle in lines[0]
        print("%-28s exit %d: %s" % ("bad_" + name, r.returncode, lines[0][:150]))
        if not ok:
            failures.append("bad_%s: expected exit 2 and one line containing %r, got exit %d: %r"
                            % (name, needle, r.returncode, r.stderr))

    # Missing shard named by the index.
    out = os.path.join(WORK, "sharded_3_bf16")
    os.remove(os.path.join(out, "model-00002-of-00003.safetensors"))
    r = run("load", out)
    print("%-28s exit %d: %s" % ("bad_missing_shard", r.returncode, r.stderr.strip()[:150]))
    if r.returncode != 2 or "model-00002-of-00003.safetensors" not in r.stderr or r.stderr.count("\n") != 1:
        failures.append("bad_missing_shard: %d %r" % (r.returncode, r.stderr))

    tokenizer_checks()

    if failures:
        print("FAILED:\n" + "\n".join(failures))
        return 1
    print("hf_test.py: all checks passed")
    return 0


# --- tokenizer.json ------------------------------------------------------------------------
def id_table(doc):
    """id -> token and the special ids of a tokenizer.json document."""
    v = doc["model"]["vocab"]
    table = {i: p[0] for i, p in enumerate(v)} if isinstance(v, list) else {i: t for t, i in v.items()}
    special = set()
    for a in doc.get("added_tokens") or []:
        table[a["id"]] = a["content"]
        if a.get("special"):
            special.add(a["id"])
    return table, special


def reference_decode(doc, ids):
    """The text tokenizers' decode(ids, skip_special_tokens=True) gives, for the three
    fixture forms (written independently of hf_tokenizer.hpp)."""
    table, special = id_table(doc)
    toks = [table[i] for i in ids if i in table and i not in special]
    kind = doc["decoder"]["type"]
    if kind == "ByteLevel":
        inverse = {c: b for b, c in tokfix.bytes_to_unicode().items()}
        raw = b"".join(bytes(inverse[c] for c in t) if all(c in inverse for c in t) else t.encode()
                       for t in toks)
        return raw.decode("utf-8", errors="replace")
    if kind == "Metaspace":
        text = [t.replace(tokfix.SPACE, " ") for t in toks]
        if text and text[0].startswith(" "):
            text[0] = text[0][1:]
        return "".join(text)
    # Llama-2's sequence: '▁' -> ' ', runs of <0xNN> to bytes, join, strip one leading space.
    out, run = [], b""
    for t in toks:
        t = t.replace(tokfix.SPACE, " ")
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            run += bytes([int(t[3:5], 16)])
            continue
        if run:
            try:
                out.append(run.decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\ufffd" * len(run))
            run = b""
        out.append(t)
    if run:
        try:
            out.append(run.decode("utf-8"))
        except UnicodeDecodeError:
            out.append("\ufffd" * len(run))
    text = "".join(out)
    return text[1:] if text.startswith(" ") else text


def tokenizer_checks():
    tdir = os.path.join(WORK, "tokenizers")
    os.makedirs(tdir)

    def write(name, doc):
        path = os.path.join(tdir, name + ".json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
        return path

    def decode(path, ids, *extra):
        r = subprocess.run([TOOL, "decode", path, ",".join(map(str, ids)), *extra],
                           capture_output=True)
        return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8")

    def check(name, doc, ids, held_back=""):
        path = write(name, doc)
        want = reference_decode(doc, ids)
        rc, got, err = decode(path, ids)
        rc2, inc, _ = decode(path, ids, "--incremental")
        # Piece by piece: the same text, minus a trailing incomplete character held back.
        ok = rc == 0 and rc2 == 0 and got == want and inc + held_back == want
        print("%-28s %r%s" % ("tokenizer " + name, got[:60], "" if ok else "  MISMATCH"))
        if not ok:
            failures.append("tokenizer %s: got %r (exit %d, %s), incremental %r, expected %r"
                            % (name, got, rc, err.strip(), inc, want))

    bl = tokfix.byte_level()
    vb = {t: i for t, i in bl["model"]["vocab"].items()}
    B = lambda raw: vb[tokfix.byte_level_token(raw)]  # noqa: E731
    n = len(vb)
    # " Hello w" "ö" "rld" emoji in two tokens, newline, <|endoftext|> (special: skipped),
    # <tool> (added, not special: shown), " 世界", bytes 0xC3 0xA9 one by one (é).
    ids = [B(b" Hello"), B(b" w"), B("\u00f6".encode()), B(b"rld"), B(b" "), B(b"\xf0\x9f"),
           B(b"\x98\x80"), B(b".\n\n"), B(b"\n"), n, n + 1, B(" \u4e16\u754c".encode()), B(b"\xc3"), B(b"\xa9")]
    check("byte_level", bl, ids)
    want = reference_decode(bl, ids)
    if "\U0001f600" not in want or "\u00e9" not in want or "<tool>" not in want or "endoftext" in want:
        failures.append("tokenizer byte_level: the reference decoded %r" % want)
    # A lone 0xFF byte mid-text and an emoji cut after its first half: U+FFFD; the cut one
    # is held back by the incremental decoder.
    check("byte_level_invalid", bl, [B(b" the"), B(b"\xff"), B(b" the"), B(b"\xf0\x9f")],
          held_back="\ufffd")
    sp = tokfix.sentencepiece()
    vs = sp["model"]["vocab"]
    S = lambda p: vs[p]  # noqa: E731
    ids = [1, S("\u2581Once"), S("\u2581upon"), S("\u2581a"), S("\u2581time"), S(","),
           S("\u2581"), 3 + 0xE2, 3 + 0x82, 3 + 0xAC, S("\u2581\u4e16\u754c"), S("\u00e9"), 2]
    check("sentencepiece", sp, ids)
    if reference_decode(sp, ids) != "Once upon a time, \u20ac \u4e16\u754c\u00e9":
        failures.append("tokenizer sentencepiece: the reference decoded %r" % reference_decode(sp, ids))
    # An invalid byte run (0xE2 then a piece): one U+FFFD per byte, as tokenizers does.
    check("sentencepiece_bad_bytes", sp, [S("\u2581the"), 3 + 0xE2, 3 + 0x82, S("\u2581a")])
    ms = tokfix.metaspace()
    check("metaspace_unigram", ms, [1, 2, 3, 4, 1, 5, 0])

    # Unsupported decoders: a warning line, the ids, exit 0.
    for name, dec in (("wordpiece", {"type": "WordPiece", "prefix": "##", "cleanup": True}),
                      ("regex_replace", {"type": "Sequence", "decoders": [
                          {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}]})):
        path = write("unsupported_" + name, dict(tokfix.sentencepiece(), decoder=dec))
        rc, got, err = decode(path, [1, 260, 261])
        print("%-28s exit %d: %s | %s" % ("tokenizer " + name, rc, got, err.strip()[:90]))
        if rc != 0 or got != "[1 260 261]" or err.count("\n") != 1 or "not supported" not in err:
            failures.append("tokenizer %s: exit %d, %r, %r" % (name, rc, got, err))

    # Malformed files: one line naming the problem, exit 2.
    sp_vocab = dict(tokfix.sentencepiece()["model"], vocab=dict(vs, extra=5))
    bad = [
        ("bad_json", '{"model": {"vocab": {"a": 0}}', "bad_json.json': bad JSON at byte"),
        ("no_model", {"decoder": None}, "has no object 'model'"),
        ("vocab_string", {"model": {"vocab": "x"}}, "model.vocab is string"),
        ("duplicate_id", dict(tokfix.sentencepiece(), model=sp_vocab), "already names"),
        ("negative_id", {"model": {"vocab": {"a": -1}}}, "id -1, expected 0..16777215"),
        ("decoder_not_object", dict(tokfix.sentencepiece(), decoder="ByteLevel"),
         "decoder = \"ByteLevel\", expected an object"),
        ("strip_two_chars", dict(tokfix.sentencepiece(), decoder={"type": "Strip", "content": "ab",
                                                                  "start": 1, "stop": 0}),
         "decoder.content = \"ab\", expected one character"),
        ("added_no_id", dict(tokfix.sentencepiece(), added_tokens=[{"content": "<s>"}]),
         "needs an integer 'id'"),
    ]
    for name, doc, needle in bad:
        path = os.path.join(tdir, "bad_" + name + ".json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(doc if isinstance(doc, str) else json.dumps(doc))
        rc, got, err = decode(path, [1, 2])
        lines = err.strip().split("\n")
        print("%-28s exit %d: %s" % ("tokenizer bad_" + name, rc, lines[0][-110:]))
        if rc != 2 or len(lines) != 1 or needle not in lines[0]:
            failures.append("tokenizer bad_%s: expected exit 2 and one line containing %r, got %d %r"
                            % (name, needle, rc, err))

    # stories260K's own tokenizer, converted: the same text as llama2.c's decoding of the pieces.
    tok = os.path.join(STORIES, "tok512.bin")
    if os.path.exists(tok):
        from llama2c_to_hf import read_llama2c_tokenizer
        pieces = read_llama2c_tokenizer(tok, 512)
        doc = tokfix.from_llama2c_pieces(pieces)
        path = write("stories260K", doc)
        rng = np.random.default_rng(3)
        # Text pieces, with valid byte-fallback runs between them ("\u00e9" as C3 A9, "\n").
        ids = [1]
        for x in rng.integers(259, 512, size=300):
            ids.append(int(x))
            if x % 17 == 0:
                ids += [3 + 0xC3, 3 + 0xA9]
            elif x % 13 == 0:
                ids.append(3 + 0x0A)
        # llama2.c's rule: pieces joined, '<0xNN>' pieces are raw bytes, the space after BOS dropped.
        raw = b""
        for prev, i in zip(ids, ids[1:]):
            p = pieces[i]
            if prev == 1 and p.startswith(" "):
                p = p[1:]
            raw += bytes([int(p[3:5], 16)]) if len(p) == 6 and p.startswith("<0x") else p.encode()
        want = raw.decode("utf-8")
        rc, got, err = decode(path, ids)
        print("%-28s %d chars, %s" % ("tokenizer stories260K", len(got),
                                      "same text as llama2.c" if got == want else "DIFFERENT"))
        if rc != 0 or got != want or "\u00e9" not in got:
            failures.append("tokenizer stories260K: %r vs %r" % (got[:200], want[:200]))
        # The llama2c demo on the converted directory prints llama2.c's text (greedy, full cache).
        if LLAMA2C and os.path.exists(LLAMA2C):
            conv = os.path.join(WORK, "stories260K_hf_tok")
            convert(os.path.join(STORIES, "stories260K.bin"), conv, "F32", 1)
            shutil.copy(path, os.path.join(conv, "tokenizer.json"))
            a = subprocess.run([LLAMA2C, "--model-dir", STORIES, "--steps", "300"], capture_output=True)
            b = subprocess.run([LLAMA2C, "--model-dir", conv, "--steps", "300"], capture_output=True)
            same = a.returncode == 0 and b.returncode == 0 and a.stdout == b.stdout and len(a.stdout) > 100
            print("%-28s %d bytes, %s" % ("llama2c on converted dir", len(b.stdout),
                                          "same text" if same else "DIFFERENT"))
            if not same:
                failures.append("llama2c text differs: %r / %r (%r)" % (a.stdout[:100], b.stdout[:100], b.stderr))
        else:
            print("llama2c binary not built: generated-text check skipped")

if __name__ == "__main__":
    sys.exit(main())
