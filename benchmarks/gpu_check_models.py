"""gpu_check's model rows: timed training steps (forward + backward of the loss) of converted models whose attention
needs more than plain causal: Gemma 2 (softcap, sliding layers) with right padding, Mistral (window) with right
padding, and Llama on packed documents (no cu_seq_lens) -- eager and compiled (fullgraph), every variant against the
unconverted model run the same way, with the backends that served its attention calls; the FA3 switch
(`torch.nn.attention.activate_flash_attention_impl("FA3")`) as an extra column where its package is installed.
torch is imported inside the functions (gpu_check_worker's rule: stdlib only at import time); this module imports the
worker's helpers, never the other way round (the worker runs whatever job table its script hands it).
"""
from __future__ import annotations

from gpu_check_worker import fmt, guarded, inject, optional_kernel, paired_times

MODEL_COLUMNS = ["model", "batch", "mode", "variant", "backends", "step ms", "step / unconverted",
                 "FA3 step / unconverted"]
CASES = (("gemma2", "softcap + right padding"), ("mistral", "window + right padding"),
         ("llama", "packed documents"))
VARIANTS = ("unconverted", "softmax", "sink", "affine")


def _sizes(family: str, quick: bool) -> tuple[dict, int, int]:
    """(config overrides, B, T): the family's tiny shape on the CPU dry run, a 2-layer 1024-wide model on a GPU (its
    compile time must fit a group's limit; Gemma 2's tiny layer_types are one sliding and one full layer)."""
    if quick:
        return {}, 2, 24
    sizes = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 4096}
    if family in ("gemma2", "mistral"):
        sizes["sliding_window"] = 512
    if family == "gemma2":
        sizes["query_pre_attn_scalar"] = 64
    return sizes, 4, 2048


def _batch(case: str, vocab: int, B: int, T: int, device) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    if case == "packed documents":  # one flattened row, position ids restarting per document (no cu_seq_lens)
        lengths = [T // 2, T // 4, T - T // 2 - T // 4]
        ids = torch.randint(0, vocab, (1, T), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        return {"input_ids": ids.to(device), "position_ids": pos.to(device), "labels": ids.to(device)}
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        attn[b, T - (b % 4 + 1) * T // 8:] = 0
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device),
            "labels": ids.masked_fill(attn == 0, -100).to(device)}


def served_backends(step) -> str:
    """The backends the dispatcher chose while `step` ran (at trace time for a compiled step: its first call)."""
    from affine_attention.ops import backends

    seen, real = [], backends.select

    def spy(call, backend=None):
        chosen = real(call, backend)
        seen.append(chosen.name)
        return chosen
    backends.select = spy
    try:
        step()
    finally:
        backends.select = real
    return ", ".join(sorted(set(seen))) or "—"


def fa3_times(device, measure) -> tuple[dict | None, str]:
    """(measure() run with torch's FA3 swapped in for FA2, "") or (None, why not): the FA3 cell of a row.

    torch lists FA3 (and FA4) whether or not their package is installed (they register at import), so availability
    is decided by importing what the swap needs, and the swap itself runs inside the same guard: a missing package
    costs this column, never the rows."""
    import torch

    why = optional_kernel(device, ("flash_attn_interface",))
    if why is not None:
        return None, why
    attention = torch.nn.attention
    try:
        attention.activate_flash_attention_impl("FA3")
    except Exception as e:  # noqa: BLE001  (an old torch without the switch, or a failed swap: the cell says which)
        return None, f"not available ({type(e).__name__}: {e})"
    try:
        return measure(), ""
    finally:
        attention.restore_flash_attention_impl()


def model_rows(args, rec, device, job: dict) -> None:
    """One (model, batch, mode) group: every variant, each row recorded as soon as it is measured."""
    import torch

    import affine_attention
    from affine_attention.hf.presets import build_model

    family, case, modes = job["family"], job["case"], (job["mode"],)
    inject(args, job["id"], None, device)
    overrides, B, T = _sizes(family, args.quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    steps, served = {}, {}
    for mode in modes:
        for variant in VARIANTS:
            torch.manual_seed(0)
            model = build_model(f"tiny-{family}", device=str(device), dtype=dtype, **overrides).train()
            if variant != "unconverted":
                affine_attention.convert(model, variant)
            batch = _batch(case, model.config.vocab_size, B, T, device)
            run = model
            if mode == "compiled":  # fullgraph as users should; the dry run traces without inductor (CPU compile time)
                run = torch.compile(model, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")

            def step(run=run, model=model, batch=batch):
                loss = run(use_cache=False, **batch).loss
                loss.backward()
                model.zero_grad(set_to_none=True)
            served[(mode, variant)] = served_backends(step) if variant != "unconverted" else "transformers"
            steps[(mode, variant)] = step
    for mode in modes:
        group = {v: steps[(mode, v)] for v in VARIANTS}
        times = paired_times(group, "unconverted", device, args.repeats, args.warmup)
        fa3, fa3_note = fa3_times(device, lambda group=group: paired_times(
            group, "unconverted", device, args.repeats, args.warmup))
        for variant in VARIANTS:
            def row(variant=variant, mode=mode):
                inject(args, job["id"], f"{mode} {variant}", device)
                yield dict(job["key"], variant=variant, backends=served[(mode, variant)],
                           **{"step ms": fmt(times[variant][0] * 1e3, ".2f"),
                              "step / unconverted": fmt(times[variant][1], ".3f"),
                              "FA3 step / unconverted": fmt(fa3[variant][1], ".3f") if fa3 else
                              fa3_note})
            guarded(rec, device, "models", dict(job["key"], variant=variant), row)
