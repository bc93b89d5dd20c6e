"""Affine-Scaled Attention for PyTorch and Hugging Face transformers."""
