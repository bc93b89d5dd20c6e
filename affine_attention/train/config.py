"""The typed training configuration: one dataclass per TOML table ([model], [variant], [data], [optim],
[schedule], [train], [kd], [compare]), every key with its default; loading and checks are in config_load.py."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal


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
    arch: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
    vocab_size: int = 4096  # must cover the tokenizer (checked at training time)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # extra rope_parameters, e.g. Llama 3's {rope_type="llama3", ...}
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
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
    name streamed with `datasets` (needs network)."""

    kind: Literal["corpus", "files", "hub"] = "corpus"
    split: str = "train"  # corpus: "train" or "validation"; hub/files: the datasets split name
    paths: list[str] = field(default_factory=list)  # files: *.txt (one document per file), *.jsonl/*.json, *.parquet
    name: str = ""  # hub: dataset name, e.g. "HuggingFaceFW/fineweb-edu"
    subset: str = ""  # hub: configuration name, e.g. "sample-10BT"
    revision: str = ""  # hub: git revision (pin it for reproducible runs)
    text_field: str = "text"


@dataclass
class DataConfig:
    tokenizer: str = "default"  # "default" (packaged 4096 BPE), a local folder, a hub name, a *.gguf file or an alias
    seq_len: int = 128
    separator: str = ""  # document separator token; "" = the tokenizer's eos token
    # Per-document attention in packed rows (position_ids restart after each separator; transformers' packing
    # signal, also for the KD teacher). Off by default: the paper describes plain concatenate-and-chunk packing, and
    # the presets compare variants on that setting; turn it on for padding-free per-document training.
    document_mask: bool = False
    shuffle: bool = True  # corpus and files sources: reshuffle packed sequences every epoch (hub streams keep order)
    train: SourceConfig = field(default_factory=SourceConfig)
    eval: SourceConfig = field(default_factory=lambda: SourceConfig(split="validation"))
    eval_sequences: int = 32  # held-out sequences (the first ones of the eval source, in order)
    eval_batch: int = 8
    probe_sequences: int = 2  # fixed batch for the query-key logit probe (the first eval sequences)
    token_cache_dir: str = "~/.cache/affine_attention/tokens"  # tokenised corpus/files arrays; "" disables


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    decay_embeddings: bool = False  # see optim.py: embeddings (and a head tied to them) get no decay by default
    clip_grad_norm: float = 1.0  # 0 disables clipping (the pre-clip norm is logged either way)


@dataclass
class ScheduleConfig:
    kind: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps decays
    decay_shape: Literal["linear", "1-sqrt"] = "1-sqrt"  # wsd decay shape
    min_lr_ratio: float = 0.0  # the factor reached at the end of the decay (wsd, cosine)


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step over all ranks and micro-batches
    micro_batch: int = 16  # sequences per forward on one rank; accumulation = global / (micro * world)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun
    activation_checkpointing: bool = False
    compile: bool = False
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    out_dir: str = ""  # "" -> runs/train-<timestamp>
    log_every: int = 10  # plain progress lines when stderr is not a terminal
    eval_every: int = 100  # held-out loss and the query-key logit probe; 0 = only at the end
    checkpoint_every: int = 0  # 0 = only the final checkpoint
    keep_checkpoints: int = 2  # newest N step checkpoints kept (the final one is always kept)


@dataclass
class KDConfig:
    """Knowledge distillation: loss = kd_alpha * T^2 KL(teacher_T || student_T) + (1 - kd_alpha) * CE."""

    enabled: bool = False
    teacher: str = ""  # local folder, hub name, *.gguf file, or the alias "smollm2-135m-instruct-gguf"
    teacher_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    temperature: float = 1.0
    kd_alpha: float = 1.0
    top_k: int = 0  # 0: full-vocabulary KL (live teacher only); k > 0: teacher renormalised on its top k
    cache: bool = False  # store the teacher's top-k logits on disk once, reuse them in every run on the same data
    cache_dir: str = "~/.cache/affine_attention/teacher-logits"
    cache_shard_sequences: int = 256


@dataclass
class CompareConfig:
    variants: list[str] = field(default_factory=lambda: ["softmax", "sink", "affine"])
    seeds: int = 1
    options: dict = field(default_factory=dict)  # per-variant options, e.g. {affine = {activation = "sigmoid"}}


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
