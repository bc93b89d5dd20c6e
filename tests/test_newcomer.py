"""The stumbles of a first walk through the README (issue 35), each as what the user meets: `train --out DIR
--resume` with the run's own config, and the command-line ends of analyze, compare and report."""
from __future__ import annotations

import pytest
from test_train_helpers import cli_in_process, sets, tiny  # noqa: F401  (fixture)


def test_resume_uses_the_runs_saved_config_and_refuses_a_different_one(tiny, tmp_path):  # noqa: F811
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    run = tmp_path / "r"
    train(load_config("tiny", tiny + ["train.steps=2", "variant.name='sink'"]), run, log=lambda m: None)
    # The README's line, without repeating the run's --set flags.
    done = cli_in_process(["train", "--out", str(run), "--resume"])
    assert done.returncode == 0, done.stderr
    assert "already complete" in done.stderr
    # --set on top of the saved config: a key that changes nothing computed passes, any other is refused.
    assert cli_in_process(["train", "--out", str(run), "--resume", "--set", "train.log_every=5"]).returncode == 0
    changed = cli_in_process(["train", "--out", str(run), "--resume", "--set", "optim.lr=0.5"])
    assert changed.returncode != 0 and "different config (optim.lr" in changed.stderr
    # An explicitly given config is still checked against the run's, as before.
    other = cli_in_process(["train", "--out", str(run), "--resume", "--config", "tiny"])
    assert other.returncode != 0 and "different config" in other.stderr
    (tmp_path / "bare").mkdir()
    bare = cli_in_process(["train", "--out", str(tmp_path / "bare"), "--resume"])
    assert bare.returncode != 0 and "run's config is unknown" in bare.stderr


def test_analyze_uses_a_runs_own_data_or_refuses_with_the_reason(tiny, tmp_path, monkeypatch):  # noqa: F811
    import json

    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    probe = tmp_path / "probe"
    train(load_config("sink-probe", ["train.steps=2", "train.eval_every=2", "train.checkpoint_every=0"]), probe,
          log=lambda m: None)
    # The probe's data is a synthetic task analyze cannot regenerate: refused, pointing at the run's report.
    said = cli_in_process(["analyze", "--model", str(probe / "final"), "--sequences", "1"])
    assert said.returncode != 0 and "data.eval.kind = 'backcopy'" in said.stderr and "report" in said.stderr
    # Text in another vocabulary: refused by its share of unknown tokens (it was 94%, measured as attention).
    text = tmp_path / "plays.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 20)
    said = cli_in_process(["analyze", "--model", str(probe / "final"), "--data", str(text), "--length", "16"])
    assert said.returncode != 0 and "unknown to the model's tokenizer" in said.stderr

    # A text run: its own held-out file at its trained length, written under runs/ of the current folder.
    run = tmp_path / "text"
    train(load_config("tiny", tiny + ["train.steps=2"]), run, log=lambda m: None)
    monkeypatch.chdir(tmp_path)
    said = cli_in_process(["analyze", "--model", str(run / "final"), "--sequences", "1", "--chunk", "16"])
    assert said.returncode == 0, said.stderr
    (written,) = (tmp_path / "runs").glob("analyze-*/metrics.json")
    config = json.loads(written.read_text())["config"]
    seq_len = load_config("tiny", tiny).data.seq_len
    assert config["length"] == seq_len and config["data"].endswith("eval.jsonl")
    assert not (tmp_path / "analysis").exists()


def test_no_head_utilisation_heatmap_for_one_head_models(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from affine_attention.analysis.analyze import analyze
    from affine_attention.text.corpus import default_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                                 intermediate_size=64, vocab_size=4096)).save_pretrained(tmp_path / "m")
    default_tokenizer().save_pretrained(tmp_path / "m")
    result = analyze(str(tmp_path / "m"), sequences=1, length=32, out=tmp_path / "out", quiet=True)
    assert "head_mass" not in result["figures"] and "first_token_mass" in result["figures"]


def test_probe_triggers_are_shown_as_the_text_they_stand_for():
    from affine_attention.analysis.report_probe import probe_task, readable

    assert readable("Ċ") == "\n" and readable("Ġthe") == " the" and readable(",") == "," and readable("<s>") == "<s>"
    from affine_attention.train.config_load import load_config

    bc = probe_task(load_config("sink-probe").to_dict())
    assert [readable(bc.names[i]) for i in bc.triggers] == ["\n", ",", "."]  # the preset's comment names them so


def test_the_readmes_train_then_resume_continues_from_a_mid_run_checkpoint(tiny, tmp_path):  # noqa: F811
    """The README's pair `train --config tiny ... --out DIR`, then `train --out DIR --resume`: a run stopped after
    step 120 of 130 resumes from the preset's last periodic checkpoint (step 120), not from step 0."""
    from test_train_helpers import unfinish

    run = tmp_path / "sink"
    first = cli_in_process(["train", "--config", "tiny", *sets(tiny + ["train.steps=130"]), "--set",
                            "variant.name=sink", "--out", str(run)])
    assert first.returncode == 0, first.stderr
    unfinish(run)  # what a kill after the last periodic checkpoint leaves
    again = cli_in_process(["train", "--out", str(run), "--resume"])
    assert again.returncode == 0, again.stderr
    assert "starts over from step 0" not in again.stderr, again.stderr
    import json

    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("kind") == "train"]
    assert steps[-1] == 130 and steps.count(121) == 1 and min(s for s in steps if s > 120) == 121
    assert "step 120" in again.stderr or "step-00000120" in again.stderr, again.stderr


def test_a_variant_typo_in_compare_variants_is_refused_before_any_training(tiny, tmp_path):  # noqa: F811
    out = tmp_path / "cmp"
    done = cli_in_process(["compare", "--config", "tiny", *sets(tiny + ["train.steps=2"]), "--set",
                           "compare.variants=['softmax', 'afine']", "--out", str(out)])
    assert done.returncode == 2
    assert "error: compare.variants: unknown variant 'afine' (did you mean 'affine'?)" in done.stderr, done.stderr
    assert not out.exists()  # nothing trained, nothing written
