"""Long runs (issue 14, class 8): a 10,000-token cached generation with the affine running sum of V stays within
1e-4 (fp32) of a full forward at the end, and neither it nor a 2,000-step training run grows in memory. Both print
their resident set size (RSS) at the start and the end (run with -s to see it)."""
from __future__ import annotations

import psutil
import pytest
import torch
from transformers import DynamicCache

from test_train_helpers import tiny  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
TOKENS = 10_000
TOL = 1e-4
# Allowed RSS growth between the end of warm-up and the end: far below what one leaked tensor per step (or per
# token) would add over these runs, far above allocator noise.
GROWTH_MB = 48


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


@torch.no_grad()
def test_ten_thousand_cached_tokens_match_a_full_forward_and_memory_stays_flat():
    from test_hf_common import perturb, tiny as tiny_model

    model = tiny_model("llama", "affine", max_position_embeddings=TOKENS + 16)
    perturb(model)
    ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    warm = 500
    rss = {}
    last = None
    for t in range(TOKENS):
        last = model(ids[:, t:t + 1], position_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[:, -1]
        if t == warm:
            rss["start"] = _rss_mb()
    rss["end"] = _rss_mb()
    full = model(ids, position_ids=torch.arange(TOKENS)[None]).logits[:, -1]
    err = float((last - full).abs().max())
    print(f"\n10,000-token cached decoding (tiny affine Llama, fp32): max |logit error| at the end {err:.2e}; "
          f"RSS after {warm} tokens {rss['start']:.0f} MB, at the end {rss['end']:.0f} MB")
    assert err <= TOL
    # The KV cache itself grows by 2 layers x 2 (k, v) x 2 heads x 16 x 4 bytes = 512 bytes per token (5 MB).
    assert rss["end"] - rss["start"] <= GROWTH_MB


def test_two_thousand_training_steps_do_not_grow_in_memory(tiny, tmp_path, monkeypatch):
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import Trainer

    steps, warm = 2000, 200
    cfg = load_config("tiny", tiny + [f"train.steps={steps}", "train.eval_every=500", "train.checkpoint_every=500",
                                      "variant.name='affine'"])
    rss = {}
    step = Trainer.train_step

    def measured(self, s):
        step(self, s)
        if s + 1 == warm:
            rss["start"] = _rss_mb()
        if s + 1 == steps:
            rss["end"] = _rss_mb()

    monkeypatch.setattr(Trainer, "train_step", measured)
    result = Trainer(cfg, tmp_path / "run", log=lambda m: None).run()
    print(f"\n2,000-step training (tiny affine Llama, CPU): RSS after {warm} steps {rss['start']:.0f} MB, "
          f"after {steps} {rss['end']:.0f} MB; final train loss {result['final_train_loss']:.3f}")
    assert rss["end"] - rss["start"] <= GROWTH_MB
