"""Documents to token ids, one rule for training, evaluation and analysis: a document is text, so a special token's
string written in it (`<|endoftext|>`) is tokenised as the characters it is, and the only control tokens in a stream
are those the package inserts (the document separator)."""
from __future__ import annotations

from collections.abc import Sequence

#: Names the rule in cache keys (train.pretrained.tokenizer_fingerprint): token ids made under another rule (the
#: special-token strings of a document parsed into control tokens) differ for such documents.
TEXT_RULE = "special-token strings are text"


def encode_documents(tok, docs: Sequence[str]) -> list[list[int]]:
    """Token ids of each document: no special tokens added and none parsed from the text (transformers'
    split_special_tokens; the tokenizer's own setting is left as it was). tok: a transformers tokenizer."""
    # verbose=False: long documents exceed the tokenizer's model_max_length by design (they are packed or windowed).
    ids = tok(list(docs), add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
    return [list(x) for x in ids]
