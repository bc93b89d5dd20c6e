"""Standard softmax attention: the base every other variant differs from."""
from .base import AttentionVariant


class SoftmaxAttention(AttentionVariant):
    name = "softmax"
