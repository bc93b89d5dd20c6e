"""The typed training configuration: one dataclass per TOML table ([model], [variant], [data], [optim],
[schedule], [train], [kd], [compare]), every key with its default; loading and cross-key checks are in config_load.py.

Every numeric key declares the values it may take where it is defined (`count` for integers, `real` for floats and
lists of floats: a `Range` in the field's metadata); `check_ranges` walks a config and refuses any value outside its
range with the key, the value and the range named. A new numeric key without a range fails the tests."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal

RANGE = "range"  # the field-metadata key of a numeric field's Range
_COUNT_WORDS = {2: "two", 3: "three"}


@dataclass(frozen=True)
class Range:
    """The values a numeric config key may take: an integer (`integer`) or a finite number, within the bounds given
    (ge: >=, gt: >, le: <=, lt: <); a list key holds `length` such values. `note` says what a special value means."""

    integer: bool
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    length: int | None = None
    note: str = ""

    def allows_one(self, x: Any) -> bool:
        if isinstance(x, bool) or not isinstance(x, int if self.integer else (int, float)):
            return False
        return ((self.integer or math.isfinite(x)) and (self.ge is None or x >= self.ge)
                and (self.gt is None or x > self.gt) and (self.le is None or x <= self.le)
                and (self.lt is None or x < self.lt))

    def allows(self, value: Any) -> bool:
        if self.length is None:
            return self.allows_one(value)
        return isinstance(value, list) and len(value) == self.length and all(map(self.allows_one, value))

    def describe(self) -> str:
        """The allowed values in words, e.g. "positive", "finite and > 0", "two numbers in [0, 1)"."""
        def num(x: float) -> str:
            return str(x) if isinstance(x, int) else f"{x:g}"

        lo = (f">= {num(self.ge)}", "[", self.ge) if self.ge is not None else \
            (f"> {num(self.gt)}", "(", self.gt) if self.gt is not None else None
        hi = (f"<= {num(self.le)}", "]", self.le) if self.le is not None else \
            (f"< {num(self.lt)}", ")", self.lt) if self.lt is not None else None
        if lo and hi:
            bounds = f"in {lo[1]}{num(lo[2])}, {num(hi[2])}{hi[1]}"
        elif self.integer and self.ge in (0, 1) and not hi:
            bounds = "positive" if self.ge == 1 else "positive or 0"
        else:
            bounds = (lo or hi)[0] if (lo or hi) else "any value"
        if self.length is not None:
            text = f"{_COUNT_WORDS.get(self.length, self.length)} {'integers' if self.integer else 'numbers'} {bounds}"
        else:
            text = bounds if self.integer else f"finite and {bounds}"
        return text + (f" ({self.note})" if self.note else "")

    def check(self, key: str, value: Any) -> None:
        """Raise ValueError naming `key`, `value` and the allowed values unless `value` is allowed."""
        if not self.allows(value):
            raise ValueError(f"{key} must be {self.describe()}, got {value!r}")


def _ranged(integer: bool, default: Any, default_factory: Any, bounds: dict[str, Any]) -> Any:
    return field(default=default, default_factory=default_factory, metadata={RANGE: Range(integer, **bounds)})


def count(default: Any = MISSING, **bounds: Any) -> Any:
    """A dataclass field holding an integer within `bounds` (see Range)."""
    return _ranged(True, default, MISSING, bounds)


def real(default: Any = MISSING, *, default_factory: Any = MISSING, **bounds: Any) -> Any:
    """A dataclass field holding a finite number (or, with length=, a list of them) within `bounds` (see Range)."""
    return _ranged(False, default, default_factory, bounds)


def field_range(cls: type, name: str) -> Range:
    """The declared Range of numeric field `name` of config dataclass `cls`."""
    return next(f.metadata[RANGE] for f in dataclasses.fields(cls) if f.name == name)


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Check every numeric field of config dataclass `cfg` (nested tables included) against its declared Range;
    the first value outside its range raises ValueError naming the dotted key, the value and the range."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_ranges(value, f"{prefix}{f.name}.")
        elif RANGE in f.metadata:
            f.metadata[RANGE].check(prefix + f.name, value)


@dataclass
class ModelConfig:
    """The student architecture, built from scratch with transformers (no network: every size is written here).

    preset names a row of the one architecture table, `affine_attention.hf.presets.PRESETS` (e.g. "llama-3.2-1b",
    the paper's 1B student): its sizes fill every key the [model] table does not set itself."""

    preset: str = ""
    # Continue from a pretrained model instead (a local transformers folder, a *.gguf file or "smollm2"): its
    # architecture, weights and (with data.tokenizer = "default") tokenizer come from it; set no other size here.
    init_from: str = ""
    # Convert so the model computes what it computed before (see affine_attention.convert). Unset: true with
    # init_from (a retrofit), false from scratch (the paper's initialisation).
    function_preserving: bool | None = None
    arch: str = "llama"  # a family of affine_attention.hf.families.FAMILIES (`affine-attention families`)
    vocab_size: int = count(4096, ge=1)  # must cover the tokenizer (checked at training time)
    hidden_size: int = count(128, ge=1)
    intermediate_size: int = count(384, ge=1)
    num_layers: int = count(4, ge=1)
    num_heads: int = count(4, ge=1)
    num_kv_heads: int = count(2, ge=1)
    head_dim: int = count(0, ge=0, note="0: hidden_size // num_heads")
    tie_embeddings: bool = True
    rope_theta: float = real(10000.0, gt=0)
    rope_scaling: dict = field(default_factory=dict)  # extra rope_parameters, e.g. Llama 3's {rope_type="llama3", ...}
    max_position_embeddings: int = count(2048, ge=1)
    rms_norm_eps: float = real(1e-6, gt=0)
    initializer_range: float = real(0.02, gt=0)  # std of the initial weights
    attention_bias: bool = False  # llama/mistral/qwen3 only; qwen2 always has q/k/v biases (transformers fixes it)
    extra: dict = field(default_factory=dict)  # passed to the transformers config unchanged (explicit escape hatch)


@dataclass
class VariantConfig:
    """The attention variant `train` uses (see affine_attention.variants); `compare` takes [compare].variants."""

    name: str = "affine"
    options: dict = field(default_factory=dict)  # typed options of the variant, validated by the variant registry


@dataclass
class SourceConfig:
    """Where documents come from. corpus: the embedded Shakespeare; files: local text/JSONL/parquet; hub: a dataset
    name streamed with `datasets` (needs network); tokens: a folder written by `affine-attention prepare-data`
    (paths = [that folder]; pre-tokenised shards, read memory-mapped)."""

    # backcopy: the synthetic Bigram-Backcopy task of [data.backcopy] (data_backcopy.py); split "train" and
    # "validation" draw disjoint sequence streams of the same task.
    kind: Literal["corpus", "files", "hub", "backcopy", "tokens"] = "corpus"
    split: str = "train"  # corpus, backcopy: "train" or "validation"; hub/files: the datasets split name
    paths: list[str] = field(default_factory=list)  # files: *.txt (one document per file), *.jsonl/*.json, *.parquet
    name: str = ""  # hub: dataset name, e.g. "HuggingFaceFW/fineweb-edu"
    subset: str = ""  # hub: configuration name, e.g. "sample-10BT"
    revision: str = ""  # hub: git revision (pin it for reproducible runs)
    text_field: str = "text"


@dataclass
class BackcopyConfig:
    """The Bigram-Backcopy task (Guo et al. 2024, arXiv 2410.13835), read only by a source of kind "backcopy": every
    sequence starts with BOS; tokens follow a fixed bigram chain, except that after one of the `triggers` most
    frequent tokens the next token copies the token before the trigger. A head solves it by attending to the
    previous token on triggers and nowhere useful elsewhere: the setting in which softmax forms a BOS sink."""

    # corpus: the bigram statistics of the `vocab` most frequent tokens of the embedded corpus (packaged tokenizer);
    # random: a seeded sparse chain, `branching` successors per token with Dirichlet(1) weights.
    transitions: Literal["corpus", "random"] = "corpus"
    vocab: int = count(64, ge=4)  # tokens besides BOS
    triggers: int = count(3, ge=1)  # the k most frequent tokens (under the chain's stationary start) trigger a copy
    branching: int = count(8, ge=1)  # random: successors per token
    seed: int = count(0, ge=0, le=2**32 - 1)  # the task (random chain); every run seed learns the same task


@dataclass
class DataConfig:
    tokenizer: str = "default"  # "default" (packaged 4096 BPE), a local folder, a hub name, a *.gguf file or an alias
    seq_len: int = count(128, ge=1)
    separator: str = ""  # document separator token; "" = the tokenizer's eos token
    # Per-document attention in packed rows (position_ids restart after each separator; transformers' packing
    # signal, also for the KD teacher). Off by default: the paper describes plain concatenate-and-chunk packing, and
    # the presets compare variants on that setting; turn it on for padding-free per-document training.
    document_mask: bool = False
    shuffle: bool = True  # corpus, files, tokens: reshuffle packed sequences every epoch (hub streams keep order)
    train: SourceConfig = field(default_factory=SourceConfig)
    eval: SourceConfig = field(default_factory=lambda: SourceConfig(split="validation"))
    eval_sequences: int = count(32, ge=1)  # held-out sequences (the first ones of the eval source, in order)
    eval_batch: int = count(8, ge=1)
    probe_sequences: int = count(2, ge=1)  # fixed batch for the query-key logit probe (the first eval sequences)
    token_cache_dir: str = "~/.cache/affine_attention/tokens"  # tokenised corpus/files arrays; "" disables
    backcopy: BackcopyConfig = field(default_factory=BackcopyConfig)


@dataclass
class OptimConfig:
    lr: float = real(1e-3, gt=0)
    weight_decay: float = real(0.1, ge=0)
    betas: list[float] = real(default_factory=lambda: [0.9, 0.95], ge=0, lt=1, length=2)
    eps: float = real(1e-8, gt=0)
    decay_embeddings: bool = False  # see optim.py: embeddings (and a head tied to them) get no decay by default
    clip_grad_norm: float = real(1.0, ge=0, note="0 disables clipping")  # the pre-clip norm is logged either way


@dataclass
class ScheduleConfig:
    kind: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int = count(100, ge=0)
    decay_fraction: float = real(0.2, ge=0, le=1)  # wsd: the last fraction of the steps decays
    decay_shape: Literal["linear", "1-sqrt"] = "1-sqrt"  # wsd decay shape
    min_lr_ratio: float = real(0.0, ge=0, le=1)  # the factor reached at the end of the decay (wsd, cosine)


@dataclass
class TrainConfig:
    steps: int = count(300, ge=1)
    global_batch: int = count(16, ge=1)  # sequences per optimizer step over all ranks and micro-batches
    micro_batch: int = count(16, ge=1)  # sequences per forward on one rank; accumulation = global / (micro * world)
    seed: int = count(0, ge=0, le=2**32 - 1)  # numpy and torch seeds are non-negative
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: bf16 on CUDA, fp32 on CPU. bf16 = autocast, and under FSDP2 bf16 parameters too (MixedPrecisionPolicy:
    # half the all-gather bytes; fp32 gradient reduction and fp32 master weights in the optimizer)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun
    activation_checkpointing: bool = False
    # Selective checkpointing: with activation_checkpointing, blocks 0, k, 2k, ... are recomputed, the others keep
    # their activations (train/blocks.py)
    activation_checkpointing_every: int = count(1, ge=1, note="1: every block")
    compile: bool = False  # torch.compile each decoder block (and the live teacher's), train/blocks.py
    # Tokens per chunk of the output layer and loss (train/kd_chunked.py): logits exist for this many tokens at a time,
    # never for a whole micro-batch (liger-kernel's fused linear losses): ~3 x 4 x chunk x vocab bytes at a time.
    loss_chunk_tokens: int = count(128, ge=0, note="0: all tokens of a micro-batch at once")
    threads: int = count(0, ge=0, note="0 keeps torch's default")  # torch intra-op threads
    out_dir: str = ""  # "" -> runs/train-<timestamp>
    log_every: int = count(10, ge=1)  # plain progress lines when stderr is not a terminal
    eval_every: int = count(100, ge=0, note="0: only at the end")  # held-out loss and the query-key logit probe
    checkpoint_every: int = count(0, ge=0, note="0: only the final checkpoint")
    keep_checkpoints: int = count(2, ge=1)  # newest N step checkpoints kept (the final one is always kept)
    async_checkpoint: bool = False  # step checkpoints written by a background thread (checkpoint_dcp.py)


@dataclass
class KDConfig:
    """Knowledge distillation: loss = kd_alpha * T^2 KL(teacher_T || student_T) + (1 - kd_alpha) * CE."""

    enabled: bool = False
    teacher: str = ""  # local folder, hub name, *.gguf file, or the alias "smollm2-135m-instruct-gguf"
    teacher_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    temperature: float = real(1.0, gt=0)
    kd_alpha: float = real(1.0, ge=0, le=1)  # the KD share of the loss
    top_k: int = count(0, ge=0)  # 0: full-vocabulary KL (live teacher only); k > 0: teacher renormalised on its top k
    cache: bool = False  # store the teacher's top-k logits on disk once, reuse them in every run on the same data
    cache_dir: str = "~/.cache/affine_attention/teacher-logits"
    cache_shard_sequences: int = count(256, ge=1)


@dataclass
class CompareConfig:
    variants: list[str] = field(default_factory=lambda: ["softmax", "sink", "affine"])
    seeds: int = count(1, ge=1)
    options: dict = field(default_factory=dict)  # per-variant options, e.g. {affine = {activation = "sigmoid"}}
    # With a live KD teacher: a seed's variants train in lockstep, one teacher forward per micro-batch for all of them
    # (every variant's model and optimizer in memory at once); false: one after another, the teacher run for each.
    share_teacher: bool = True


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    variant: VariantConfig = field(default_factory=VariantConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    kd: KDConfig = field(default_factory=KDConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_json(cfg: RunConfig) -> str:
    """The resolved config as canonical JSON (saved with each run and checkpoint; used for resume checks)."""
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)
