"""Serving converted checkpoints in inference engines: the vLLM plugin (serving/vllm.py), loaded by vLLM itself
through the `vllm.general_plugins` entry point. Importing this package imports no engine."""
