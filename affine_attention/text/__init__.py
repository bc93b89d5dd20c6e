"""Text in: documents from files (txt / jsonl / parquet), a `datasets` source or the packaged corpus, read one way
for training, analysis and evaluation; no torch, no transformers."""
from .corpus import corpus_texts, default_tokenizer, default_tokenizer_path, load_corpus
from .encode import TEXT_RULE, encode_documents
from .read import documents, file_documents, read_documents

__all__ = ["TEXT_RULE", "corpus_texts", "default_tokenizer", "default_tokenizer_path", "documents", "encode_documents",
           "file_documents", "load_corpus", "read_documents"]
