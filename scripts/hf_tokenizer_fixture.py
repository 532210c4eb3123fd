#!/usr/bin/env python3
"""Writes small Hugging Face tokenizer.json files for tests (examples/llama2c/hf_tokenizer.hpp
decodes them). Generated from scratch: no third-party vocabulary is copied. Python 3 only.

    scripts/hf_tokenizer_fixture.py OUT.json {byte_level,sentencepiece,metaspace}
    scripts/hf_tokenizer_fixture.py --fuzz-seeds   (writes fuzz/corpus/hf_tokenizer/)

byte_level     GPT-2 / Llama-3 / Qwen form: a BPE vocabulary of byte strings written through
               GPT-2's bytes-to-unicode table, decoder ByteLevel
sentencepiece  Llama-2 form: <unk> <s> </s>, the 256 <0xNN> byte-fallback tokens, pieces with
               '\u2581' for a space; decoder Sequence [Replace '\u2581' -> ' ', ByteFallback,
               Fuse, Strip one leading space]
metaspace      a Unigram vocabulary ([piece, score] pairs), decoder Metaspace

from_llama2c_pieces() turns llama2.c's tokenizer pieces (tok512.bin) into the sentencepiece
form (scripts/llama2c_to_hf.py --tokenizer uses it).
"""
import json
import sys

SPACE = "\u2581"  # SentencePiece's visible space


def bytes_to_unicode():
    """GPT-2's table: printable Latin-1 bytes map to themselves, the other 68 to 256, 257, ..."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_token(raw):
    t = bytes_to_unicode()
    return "".join(t[b] for b in raw)


# Byte strings of the byte-level fixture beyond the 256 single bytes (ids 256...).
BYTE_LEVEL_PIECES = [b" Hello", b" w", "\u00f6".encode(), b"rld", b"\xf0\x9f", b"\x98\x80",
                     " \u4e16\u754c".encode(), b" the", b".\n\n"]


def byte_level(added=True):
    vocab = {byte_level_token(bytes([b])): b for b in range(256)}
    for i, raw in enumerate(BYTE_LEVEL_PIECES):
        assert byte_level_token(raw) not in vocab, raw
        vocab[byte_level_token(raw)] = 256 + i
    n = len(vocab)
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
           "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "vocab": vocab,
                     "merges": []}}
    if added:
        doc["added_tokens"] = [
            {"id": n, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True},
            {"id": n + 1, "content": "<tool>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": False}]
    return doc


SENTENCEPIECE_PIECES = [SPACE + "Once", SPACE + "upon", SPACE + "a", SPACE + "time", ",",
                        SPACE + "the", "\u00e9", SPACE + "\u4e16\u754c", SPACE]


def sentencepiece(pieces=None):
    pieces = SENTENCEPIECE_PIECES if pieces is None else pieces
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = 3 + b
    for p in pieces:
        if p not in vocab:
            vocab[p] = len(vocab)
    special = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for c, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]},
            "pre_tokenizer": None, "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": True, "byte_fallback": True, "vocab": vocab, "merges": []}}


def metaspace():
    pieces = ["<unk>", SPACE + "Hello", SPACE + "world", "!", SPACE, "s"]
    return {"version": "1.0", "added_tokens": [
                {"id": 0, "content": "<unk>", "special": True}],
            "decoder": {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always",
                        "split": True},
            "model": {"type": "Unigram", "unk_id": 0,
                      "vocab": [[p, -float(i)] for i, p in enumerate(pieces)]}}


def from_llama2c_pieces(pieces):
    """llama2.c's pieces (ids 0..n-1: <unk>, <s>, </s>, 256 <0xNN> tokens, then text with ' '
    for SentencePiece's space) as a sentencepiece-form tokenizer.json with the same ids."""
    vocab = {}
    for i, p in enumerate(pieces):
        if i < 3:  # llama2.c writes BOS and EOS as "\n<s>\n" and "\n</s>\n"
            p = ("<unk>", "<s>", "</s>")[i]
        elif i < 259:
            assert p == "<0x%02X>" % (i - 3), (i, p)
        text = p if i < 259 else p.replace(" ", SPACE)
        assert text not in vocab, "duplicate piece %r" % text
        vocab[text] = i
    doc = sentencepiece([])
    doc["model"]["vocab"] = vocab
    return doc


def fuzz_seeds():
    """fuzz/fuzz_hf_tokenizer.cpp's seeds: 1 byte n, n uint16 ids, the JSON (compact)."""
    import os
    import struct
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "corpus",
                        "hf_tokenizer")
    os.makedirs(root, exist_ok=True)
    for name, doc, ids in (("byte_level", byte_level(), [256, 257, 258, 259, 260, 261, 265]),
                           ("sentencepiece", sentencepiece(), [1, 259, 260, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 2]),
                           ("metaspace", metaspace(), [1, 2, 3, 4, 0])):
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        with open(os.path.join(root, name), "wb") as f:
            f.write(bytes([len(ids)]) + b"".join(struct.pack("<H", i) for i in ids) + text)
        print(name, 1 + 2 * len(ids) + len(text), "bytes")
    return 0


def main():
    if sys.argv[1:] == ["--fuzz-seeds"]:
        return fuzz_seeds()
    if len(sys.argv) != 3 or sys.argv[2] not in ("byte_level", "sentencepiece", "metaspace"):
        print(__doc__)
        return 2
    doc = {"byte_level": byte_level, "sentencepiece": sentencepiece, "metaspace": metaspace}[sys.argv[2]]()
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
