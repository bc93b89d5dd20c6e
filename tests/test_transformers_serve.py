"""`transformers serve` on a converted checkpoint: its sequential path answers with generate's text (without the
logprobs asked for: transformers ignores that field), and its continuous
batching (paged kernels that compute plain softmax) is refused naming vLLM, never served as plain attention."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi", reason="transformers serve needs fastapi and uvicorn (the test extra installs them)")
pytest.importorskip("uvicorn", reason="transformers serve needs fastapi and uvicorn (the test extra installs them)")

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, str]:
    """A converted tiny Llama (affine) saved with the package's embedded tokenizer, and generate's greedy text."""
    from affine_attention import convert
    from affine_attention.text.corpus import default_tokenizer

    tok = default_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).eval()
    ids = tok(PROMPT, return_tensors="pt")
    plain_text = tok.decode(plain.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids.input_ids.shape[1]:])
    model = convert(plain, "affine")
    directory = tmp_path_factory.mktemp("served")
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.input_ids.shape[1]:])
    assert text != plain_text  # so a server computing plain softmax would fail the comparison below
    return directory, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(AssertionError):
    """`transformers serve` stopped before answering /health."""


def _serve(directory: Path, log: Path, *flags: str):
    port = _free_port()
    cli = Path(sys.executable).with_name("transformers")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen([str(cli), "serve", "--trust-remote-code", "--device", "cpu", "--port", str(port),
                             *flags, str(directory)], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"transformers serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    proc.kill()
    raise AssertionError(f"transformers serve did not start in 180 s:\n{log.read_text()[-3000:]}")


def _complete(port: int, directory: Path, **fields) -> tuple[int, dict | str]:
    body = json.dumps({"model": str(directory), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                       **fields}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _serve_and_complete(directory: Path, log: Path, *flags: str, **fields) -> tuple[int, dict | str]:
    """Start `transformers serve` with flags, send one completion request (with extra body fields), stop the
    server."""
    proc, port = _serve(directory, log, *flags)
    try:
        return _complete(port, directory, **fields)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_transformers_serve_answers_with_generates_text_and_no_logprobs(converted, tmp_path):
    """The text is generate's; the logprobs asked for are not returned: transformers serve lists `logprobs` among
    the OpenAI fields it does not support and ignores it with a warning (its limitation, documented in
    docs/huggingface.md; vLLM returns them)."""
    directory, expected = converted
    log = tmp_path / "serve.log"
    status, answer = _serve_and_complete(directory, log, logprobs=2)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == expected
    assert answer["choices"][0].get("logprobs") is None
    assert "Ignoring unsupported fields in the request: {'logprobs'}" in log.read_text()


def test_transformers_serve_refuses_continuous_batching_naming_vllm(converted, tmp_path):
    directory, _ = converted
    log = tmp_path / "serve.log"
    try:
        status, answer = _serve_and_complete(directory, log, "--continuous-batching")
    except ServerExited:  # transformers >= 5.25 loads the model at start: the refusal stops the server there
        pass
    else:  # older versions load it on the first request, which fails
        assert status == 500, answer
    assert "serve converted models with vLLM" in log.read_text()
