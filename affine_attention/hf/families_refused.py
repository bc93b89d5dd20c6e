"""The transformers decoder families `convert` does not take, each with the reason the enumeration found
(hf/family_survey.py; tests/test_families_enumerated.py re-derives every verdict on the installed transformers), and
the model types that run a table family's class: data for `affine-attention families --all`, docs/families.md and
convert's refusal. After a transformers upgrade, `affine-attention families --survey` lists every verdict that differs
from these records."""
from __future__ import annotations

# Why a candidate family is refused, by reason key. Each is shown true by a test that forces one such family through
# the seam and watches what breaks (tests/test_families_enumerated.py).
REASONS = {
    "encoder_decoder": "the decoder of an encoder-decoder model: its layers cross-attend to encoder states, which "
                       "no variant computes",
    "cross_attention": "a BERT-style encoder stack run as a decoder, with optional cross attention to encoder "
                       "states and no model.layers of decoder layers",
    "multimodal": "a multimodal model (vision or audio encoders beside its language model, their attention under "
                  "the same implementation): convert its text model where transformers ships it as a family",
    "latent_attention": "multi-head latent attention (MLA): keys and values are decompressed from a low-rank latent, "
                        "which the seam's layer shapes and caches do not describe",
    "linear_or_state_space": "a hybrid stack with linear-attention or state-space layers beside softmax layers; "
                             "converting only its softmax layers is not checked exact, so the whole family is refused",
    "layout": "its attention is not laid out as model.layers[i].self_attn with an o_proj output projection, which "
              "the conversion and the retrofit address",
    "seam": "its attention function receives something the seam refuses or cannot honour",
    "unchecked": "no tiny model could be built from its config class with the standard size keys (family_survey's "
                 "TINY and SIZE_KEYS), so it was not checked and is not converted",
    "not_exact": "converted, it does not reproduce transformers' eager attention, or its retrofit does not keep the "
                 "logits",
}

NEWEST = "5.25"  # the transformers these records were taken on
LOWEST = "5.17"  # the lowest supported transformers
# Candidates of NEWEST that are none in LOWEST (not shipped yet, or attention not yet through the interface).
ABSENT_IN_LOWEST = (
    "apertus1p5_text", "bailing_hybrid", "beam", "codegen", "dory", "dots3_note", "dots3_note_text", "ergo",
    "exaone", "falcon", "flint", "gptj", "inkling2_loop_text", "inkling2_text", "internlm3", "iquestcoder",
    "kolibri1", "kolibri1_1", "lara_mini", "lfm3", "minicpm5_moe", "moss_transcribe_diarize", "param2moe",
    "sarvam_mla", "sarvam_moe",
)
# model type -> the table family whose model class it runs (with a config class of its own)
ALIASES = {"exaone": "llama", "internlm3": "llama", "iquestcoder": "llama", "param2moe": "glm4_moe",
           "sarvam_moe": "glm4_moe"}
# model type -> (reason key of REASONS, what was found)
REFUSED = {
    "axk1": ("latent_attention", "config.kv_lora_rank"),
    "axk2": ("latent_attention", "config.kv_lora_rank"),
    "bailing_hybrid": ("latent_attention", "config.kv_lora_rank"),
    "bamba": ("linear_or_state_space", "BambaMixer"),
    "bart": ("encoder_decoder", "BartConfig (is_encoder_decoder)"),
    "bert": ("cross_attention", "BertModel.encoder"),
    "bert-generation": ("cross_attention", "BertGenerationEncoder.encoder"),
    "bigbird_pegasus": ("encoder_decoder", "BigBirdPegasusConfig (is_encoder_decoder)"),
    "biogpt": ("layout", "BioGptForCausalLM has no model.layers"),
    "bitnet": ("not_exact", "retrofit 0.54"),
    "blenderbot": ("encoder_decoder", "BlenderbotConfig (is_encoder_decoder)"),
    "blenderbot-small": ("encoder_decoder", "BlenderbotSmallConfig (is_encoder_decoder)"),
    "blt": ("encoder_decoder", "BltConfig (decoder_config, encoder_config, global_config, patcher_config)"),
    "camembert": ("cross_attention", "CamembertModel.encoder"),
    "codegen": ("layout", "CodeGenForCausalLM has no model.layers"),
    "ctrl": ("layout", "CTRLLMHeadModel has no model.layers"),
    "data2vec-text": ("cross_attention", "Data2VecTextModel.encoder"),
    "dbrx": ("layout", "DbrxForCausalLM has no model.layers"),
    "deepseek_v2": ("latent_attention", "config.kv_lora_rank"),
    "deepseek_v3": ("latent_attention", "config.kv_lora_rank"),
    "deepseek_v32": ("latent_attention", "config.kv_lora_rank"),
    "deepseek_v4": ("latent_attention", "config.q_lora_rank"),
    "diffllama": ("not_exact", "retrofit 0.084"),
    "doge": ("seam",
        "ValueError: affine_attention expects a boolean 4D mask (True = may attend), got dtype torch.float32"),
    "dory": ("seam",
        "RuntimeError: The size of tensor a (15) must match the size of tensor b (12) at non-singleton dimension 3"),
    "dots3_note": ("multimodal", "Dots3NoteConfig (audio_config, text_config, vision_config)"),
    "dots3_note_text": ("latent_attention", "config.kv_lora_rank"),
    "electra": ("cross_attention", "ElectraModel.encoder"),
    "emu3": ("multimodal", "Emu3Config (text_config, vq_config)"),
    "ernie": ("cross_attention", "ErnieModel.encoder"),
    "falcon": ("layout", "FalconForCausalLM has no model.layers"),
    "falcon_h1": ("linear_or_state_space", "FalconH1Mixer"),
    "gemma3": ("multimodal", "Gemma3Config (text_config, vision_config)"),
    "gemma3n": ("multimodal", "Gemma3nConfig (audio_config, text_config, vision_config)"),
    "gemma4": ("multimodal", "Gemma4Config (audio_config, text_config, vision_config)"),
    "gemma4_unified": ("multimodal", "Gemma4UnifiedConfig (audio_config, text_config, vision_config)"),
    "git": ("multimodal", "GitConfig (vision_config)"),
    "glm4_moe_lite": ("latent_attention", "config.kv_lora_rank"),
    "glm_moe_dsa": ("latent_attention", "config.kv_lora_rank"),
    "gpt-sw3": ("layout", "GPT2LMHeadModel has no model.layers"),
    "gpt2": ("layout", "GPT2LMHeadModel has no model.layers"),
    "gpt_bigcode": ("layout", "GPTBigCodeForCausalLM has no model.layers"),
    "gpt_neox": ("layout", "GPTNeoXForCausalLM has no model.layers"),
    "gptj": ("layout", "GPTJForCausalLM has no model.layers"),
    "granitemoehybrid": ("linear_or_state_space", "GraniteMoeHybridMambaLayer"),
    "hrm_text": ("layout", "HrmTextForCausalLM has no model.layers"),
    "hy_v4": ("latent_attention", "config.kv_lora_rank"),
    "inkling2_loop_text": ("linear_or_state_space", "Inkling2LoopShortConvolution"),
    "inkling2_text": ("linear_or_state_space", "Inkling2ShortConvolution"),
    "inkling_text": ("linear_or_state_space", "InklingShortConvolution"),
    "jamba": ("linear_or_state_space", "JambaMambaDecoderLayer, JambaMambaMixer"),
    "jetmoe": ("layout", "a decoder layer without self_attn.o_proj"),
    "kimi_linear": ("latent_attention", "config.kv_lora_rank"),
    "kolibri1_1": ("seam", "layer types ['indexed_attention']"),
    "lara_mini": ("linear_or_state_space", "LaraMiniGatedDeltaNet"),
    "lfm2": ("layout", "a decoder layer without self_attn.o_proj"),
    "lfm2_moe": ("linear_or_state_space", "Lfm2MoeShortConv"),
    "lfm3": ("linear_or_state_space", "Lfm3ShortConv"),
    "llama4": ("multimodal", "Llama4Config (text_config, vision_config)"),
    "llama4_text": ("seam", "layer types ['chunked_attention']"),
    "longcat_flash": ("latent_attention", "config.kv_lora_rank"),
    "marian": ("encoder_decoder", "MarianConfig (is_encoder_decoder)"),
    "mbart": ("encoder_decoder", "MBartConfig (is_encoder_decoder)"),
    "mimo_v2_flash": ("seam",
        "ValueError: k and v must have the same shape (B, Hkv, S, D), got k (3, 4, 12, 16) and v (3, 4, 12, 128)"),
    "minicpm3": ("latent_attention", "config.kv_lora_rank"),
    "minimax": ("linear_or_state_space", "MiniMaxLightningAttention"),
    "minimax_m3_vl_text": ("seam",
        "ValueError: the MiniMaxM3VLAttention attention (MiniMaxM3VLAttention) passes ['block_indices'] to its ..."),
    "mllama": ("multimodal", "MllamaConfig (text_config, vision_config)"),
    "modernbert-decoder": ("layout", "a decoder layer without self_attn.o_proj"),
    "moshi": ("encoder_decoder", "MoshiConfig (audio_encoder_config, depth_decoder_config)"),
    "moss_transcribe_diarize": ("multimodal", "MossTranscribeDiarizeConfig (audio_config, text_config)"),
    "musicgen": ("encoder_decoder", "MusicgenConfig (audio_encoder, decoder, text_encoder)"),
    "musicgen_melody": ("encoder_decoder", "MusicgenMelodyConfig (audio_encoder, decoder, text_encoder)"),
    "nemotron_h": ("linear_or_state_space", "NemotronHMamba2Mixer"),
    "olmo_hybrid": ("linear_or_state_space", "OlmoHybridGatedDeltaNet, OlmoHybridLinearAttentionDecoderLayer"),
    "opt": ("layout", "OPTForCausalLM has no model.layers"),
    "pegasus": ("encoder_decoder", "PegasusConfig (is_encoder_decoder)"),
    "persimmon": ("layout", "a decoder layer without self_attn.o_proj"),
    "phi": ("layout", "a decoder layer without self_attn.o_proj"),
    "phi4_multimodal": ("multimodal", "Phi4MultimodalConfig (audio_config, vision_config)"),
    "plbart": ("encoder_decoder", "PLBartConfig (is_encoder_decoder)"),
    "qwen3_5": ("multimodal", "Qwen3_5Config (text_config, vision_config)"),
    "qwen3_5_moe": ("multimodal", "Qwen3_5MoeConfig (text_config, vision_config)"),
    "qwen3_5_moe_text": ("linear_or_state_space", "Qwen3_5MoeGatedDeltaNet"),
    "qwen3_5_text": ("linear_or_state_space", "Qwen3_5GatedDeltaNet"),
    "qwen3_next": ("linear_or_state_space", "Qwen3NextGatedDeltaNet"),
    "qwen4_exp": ("multimodal", "Qwen4ExpConfig (text_config, vision_config)"),
    "qwen4_exp_text": ("linear_or_state_space", "Qwen4ExpTextGatedDeltaNet"),
    "recurrent_gemma": ("linear_or_state_space",
        "RecurrentGemmaDecoderLayer, RecurrentGemmaForCausalLM, RecurrentGemmaMlp, RecurrentGemmaModel, ..."),
    "roberta": ("cross_attention", "RobertaModel.encoder"),
    "roberta-prelayernorm": ("cross_attention", "RobertaPreLayerNormModel.encoder"),
    "roc_bert": ("cross_attention", "RoCBertModel.encoder"),
    "sarvam_mla": ("latent_attention", "config.kv_lora_rank"),
    "whisper": ("encoder_decoder", "WhisperConfig (is_encoder_decoder)"),
    "xlm-roberta": ("cross_attention", "XLMRobertaModel.encoder"),
    "xlm-roberta-xl": ("cross_attention", "XLMRobertaXLModel.encoder"),
    "xmod": ("cross_attention", "XmodModel.encoder"),
    "youtu": ("latent_attention", "config.kv_lora_rank"),
    "zamba": ("linear_or_state_space", "ZambaMambaDecoderLayer, ZambaMambaMixer"),
    "zamba2": ("linear_or_state_space", "Zamba2MambaDecoderLayer, Zamba2MambaMixer"),
}


def unrecorded_message(model_type: str, installed: str) -> str:
    """Why `convert` does not take a family of the installed transformers that these records do not know (one it
    added after NEWEST): it has no verdict yet, and the survey gives one."""
    return (f"the {model_type} family has no verdict: these records were taken on transformers {NEWEST} and the "
            f"installed {installed} ships it as a new family; `affine-attention families --survey` checks it on this "
            "transformers (record its verdict in hf/families.py or hf/families_refused.py), or install "
            f"transformers<={NEWEST}")


def newer_than_records(installed: str) -> bool:
    """Whether transformers version `installed` (e.g. "5.26.0") is newer than the one these records were taken on."""
    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split(".")[:2])
    return key(installed) > key(NEWEST)


def refusal_message(model_type: str | None) -> str | None:
    """Why `convert` does not take a model of this transformers model type, or None when it is not refused (a family
    of the table, or a model type the installed transformers does not ship as a causal LM)."""
    if model_type not in REFUSED:
        return _unrecorded(model_type)
    reason, found = REFUSED[model_type]
    return f"the {model_type} family is refused: {REASONS[reason]} ({found}); docs/families.md lists every family"


def _unrecorded(model_type: str | None) -> str | None:
    """unrecorded_message for a causal-LM model type the installed transformers ships and no record names."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .families import FAMILIES

    known = {f.model_type for f in FAMILIES.values()} | set(ALIASES) | set(REFUSED)
    if model_type is None or model_type in known or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    return unrecorded_message(model_type, transformers.__version__)
