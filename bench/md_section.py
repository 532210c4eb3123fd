"""Replaces the generated section <!-- TAG:begin ... --> ... <!-- TAG:end --> of a markdown
file with `block` (appended when the file has none). Shared by the bench/run_*.sh reports."""
import re


def replace_section(mdpath, tag, block):
    text = open(mdpath).read()
    pat = re.compile(r"<!-- " + re.escape(tag) + r":begin.*?<!-- " + re.escape(tag) + r":end -->", re.S)
    text = pat.sub(lambda m: block, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    open(mdpath, "w").write(text)
