"""Deliberate one-line breaks of the package, each run against the default-suite files that should catch it: a
check that the reduced (covering) suites still catch bugs. Prints one row per break; every file is restored.

    python scripts/mutation_check.py            # ~3 min on 2 cores; the table is in docs/testing.md
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (area: the break, file, the line's text, its broken text, default-suite files that must catch it)
BREAKS = [
    ("ops: affine combine uses out instead of mean of V", "affine_attention/ops/epilogue.py",
     "return torch.addcmul(torch.mul(out5, a), b, m5).reshape(out.shape)",
     "return torch.addcmul(torch.mul(out5, a), b, out5).reshape(out.shape)", ["tests/test_ops_numerics.py"]),
    ("ops: sink gate sigmoid(lse + s)", "affine_attention/ops/backends/__init__.py",
     "gate = torch.sigmoid(as_dtype(lse, acc) - as_dtype(sinks, acc)[None, :, None])",
     "gate = torch.sigmoid(as_dtype(lse, acc) + as_dtype(sinks, acc)[None, :, None])", ["tests/test_ops_numerics.py"]),
    ("ops: dense window mask off by one", "affine_attention/ops/masks.py", "m = m & (j > i - self.window)",
     "m = m & (j >= i - self.window)", ["tests/test_masks_structured.py", "tests/test_backends.py"]),
    ("seam: softcap dropped", "affine_attention/hf/attention.py",
     "kv_nonfinite=kv_nonfinite, softcap=softcap, model_sinks=s_aux)",
     "kv_nonfinite=kv_nonfinite, softcap=None, model_sinks=s_aux)", ["tests/test_hf_convert.py"]),
    ("families: layer reference q_proj (Phi-3 fused qkv)", "affine_attention/hf/layers.py",
     "ref = next(m.weight for m in attn.modules() if isinstance(m, nn.Linear))", "ref = attn.q_proj.weight",
     ["tests/test_hf_families.py"]),
    ("packing: every packed row one document", "affine_attention/hf/packing.py", "docs = docs.expand(B, T)",
     "docs = torch.zeros_like(docs).expand(B, T)", ["tests/test_packing.py"]),
    ("retrofit: affine alpha_ma at half the initial alpha", "affine_attention/variants/affine.py",
     "self.alpha_ma.fill_(a)", "self.alpha_ma.fill_(a * 0.5)", ["tests/test_retrofit.py"]),
    ("retrofit: sink starting logit -5", "affine_attention/variants/sink.py", "RETROFIT_SINK_LOGIT = -20.0",
     "RETROFIT_SINK_LOGIT = -5.0", ["tests/test_retrofit.py"]),
    ("variants: linear clipping slope 0.2", "affine_attention/variants/affine.py",
     "return (0.1 * x + 0.5).clamp(0.0, 1.0)", "return (0.2 * x + 0.5).clamp(0.0, 1.0)", ["tests/test_variants.py"]),
    ("running stats: EMA weights swapped", "affine_attention/variants/affine.py",
     "new = torch.lerp(mean, ma.to(dt), self.options.momentum)",
     "new = torch.lerp(ma.to(dt), mean, self.options.momentum)", ["tests/test_running_stats.py"]),
    ("covering: uncovered reports nothing", "tests/covering.py", "    return missing\n", "    return []\n",
     ["tests/test_suites.py"]),
    ("compile: NaN isolation's host check runs while tracing", "affine_attention/ops/attention.py",
     'eager_cpu = k.device.type == "cpu" and not torch.compiler.is_compiling()', 'eager_cpu = k.device.type == "cpu"',
     ["tests/test_compile.py"]),
]


def main() -> int:
    missed = 0
    for name, rel, line, broken, tests in BREAKS:
        path = ROOT / rel
        original = path.read_text()
        if line not in original:
            print(f"{name} | the line is gone from {rel}: update this script", flush=True)
            missed += 1
            continue
        path.write_text(original.replace(line, broken, 1))
        start = time.time()
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                                   *tests], cwd=ROOT, capture_output=True, text=True, timeout=900)
        finally:
            path.write_text(original)
        failed = [ln for ln in done.stdout.splitlines() if ln.startswith("FAILED")]
        missed += not failed
        print(f"{name} | {failed[0].split(' - ')[0] if failed else 'NOT CAUGHT'} | {time.time() - start:.0f} s",
              flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
