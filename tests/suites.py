"""Which test files each CI environment runs (docs/testing.md). Environment 1 (newest transformers on torch 2.13)
runs every file; environment 2 (the GPU machine's torch 2.11 and the lowest supported transformers) runs only the
files whose results can differ between torch or transformers versions. Every test_*.py file is in exactly one set
(tests/test_suites.py), so a new file is classified when it is added."""

# Modules of shared helpers whose names pytest also collects: they hold no tests.
HELPERS = frozenset({"test_hf_common.py", "test_train_helpers.py"})

# Torch internals (ops, kernel backends, autograd Functions, dynamo / AOTAutograd, Triton, torch.distributed, RNG
# and state-dict formats) or transformers internals (the attention seam, caches, masks, save / load, PEFT, config
# classes): run in both environments.
VERSION_SENSITIVE = frozenset({
    "test_analysis_capture.py", "test_analysis_masks.py", "test_attention_call.py", "test_backends.py",
    "test_bench_memory.py",
    "test_backends_cuda.py", "test_backends_flex.py", "test_backends_plan.py", "test_ssmax.py",
    "test_cache_integrity.py", "test_checkpoint_dcp.py", "test_cli_checks.py", "test_kd_chunked.py",
    "test_manifest_folders.py",
    "test_compare_lockstep_resume.py",
    "test_compile.py", "test_compile_ops.py", "test_compiled_key_runs.py", "test_cuda_traceable.py",
    "test_degenerate_inputs.py",
    "test_double_backward.py", "test_epilogue.py", "test_eval_cli.py", "test_eval_harness.py",
    "test_eval_perplexity.py", "test_families_enumerated.py", "test_gate_precision_nan.py",
    "test_gpu_check_dryrun.py", "test_gpu_session_dryrun.py", "test_hardening.py",
    "test_hf_convert.py", "test_hf_families.py", "test_hf_generate.py", "test_hf_peft.py", "test_hf_presets.py",
    "test_hf_saveload.py", "test_hf_smollm2.py", "test_hf_spec_metadata.py", "test_layouts.py", "test_long_runs.py",
    "test_mask_shapes.py", "test_masks_structured.py", "test_no_txs.py", "test_nonfinite_queries.py",
    "test_ops_errors.py", "test_ops_numerics.py", "test_ops_properties.py", "test_packing.py", "test_properties.py",
    "test_retrofit.py", "test_running_stats.py", "test_running_stats_protocol.py", "test_segment_sums.py",
    "test_stats_distributed.py", "test_teacher_sharded.py", "test_text_as_text.py", "test_train_checkpoint.py",
    "test_train_compile_ac.py",
    "test_train_distributed.py", "test_transformers_serve.py",
    "test_train_fsdp_precision.py", "test_train_kd.py", "test_train_resume.py", "test_triton_kernels.py",
    "test_user_paths.py", "test_variants.py", "test_variants_distributed.py", "test_vllm.py",
    "test_vllm_bf16.py", "test_vllm_lm_eval.py", "test_vllm_no_package.py", "test_vllm_serve.py", "test_vllm_sinks.py", "test_vllm_tp.py",
})

# Python logic over results (metrics, reports, plots, claims, configs, CLI wording, data packing, run folders, the
# import graph): what they check does not depend on the torch or transformers version, so environment 1 is enough.
VERSION_INDEPENDENT = frozenset({
    "test_analysis_metrics.py", "test_analyze_cli.py", "test_architecture.py", "test_claims.py", "test_cli.py",
    "test_compare_progress.py", "test_compare_shared_teacher.py",
    "test_compare_tasks.py", "test_config_validation.py", "test_corpus.py",
    "test_data_backcopy.py", "test_documented_commands.py", "test_dryrun.py", "test_e2e_compare.py",
    "test_eval_tasks_cli.py", "test_gradstats.py", "test_locks.py",
    "test_metrics_reader.py", "test_newcomer.py", "test_plots.py", "test_prepare_data.py", "test_report.py",
    "test_run_lock.py", "test_serving_sinks.py", "test_sink_probe.py", "test_stream_ranks.py", "test_suites.py",
    "test_train_compare.py",
    "test_train_config.py", "test_train_data.py", "test_vllm_api.py", "test_train_optim.py", "test_train_trainer.py",
})
