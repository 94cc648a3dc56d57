import asyncio
import json
import logging

import httpx
import pytest

from contracts.errors import TridentError
from contracts.run_dir import Probe, write_probe
from orchestrator.serving.client import InferenceClient


def test_wait_ready_says_it_is_still_waiting_until_the_server_answers(caplog):
    answers = iter([503, 503, 200])
    client = InferenceClient("http://server", timeout_s=1)
    client.http = httpx.AsyncClient(
        base_url="http://server", transport=httpx.MockTransport(lambda request: httpx.Response(next(answers)))
    )
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        asyncio.run(client.wait_ready(timeout_s=60, notice_s=0.5))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("still waiting for the inference server at http://server (") for m in messages)
    assert messages[-1].startswith("inference server ready after")


def test_the_probe_tolerance_defaults_to_the_probes_own_by_its_dtype_wider_for_a_4bit_trainer_base(tmp_path):
    """A server whose logprobs of the probe are 0.07 off the trainer's: within the default for weights trained on a
    4-bit base (QLoRA, 0.1), beyond the default for a bfloat16 probe (or one that does not say its dtype: 5e-3) and
    a float32 one (1e-4), and beyond a tolerance the user set; 5e-4 off passes a bfloat16 probe, fails a float32."""
    token_ids, trained = [5, 6, 7, 8], [0.0, -1.0, -2.0, -3.0]
    offset = {"value": 0.07}

    def served(request: httpx.Request) -> httpx.Response:
        logprobs = [
            {str(t): {"logprob": lp + offset["value"]}} for t, lp in zip(token_ids[1:], trained[1:], strict=True)
        ]
        return httpx.Response(200, json={"prompt_logprobs": [None, *logprobs]})

    client = InferenceClient("http://server", timeout_s=1)
    client.http = httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(served))
    probes = {
        "qlora": Probe(token_ids, trained, base_in_4bit=True),
        "bf16": Probe(token_ids, trained, dtype="bfloat16"),
        "unsaid": Probe(token_ids, trained),
        "fp32": Probe(token_ids, trained, dtype="float32"),
    }
    for name, probe in probes.items():
        (tmp_path / name).mkdir()
        write_probe(tmp_path / name, probe)

    assert asyncio.run(client.check_probe(tmp_path / "qlora", 1, tolerance=None)) == pytest.approx(0.07)
    for name, default in (("bf16", "0.005"), ("unsaid", "0.005"), ("fp32", "0.0001")):
        with pytest.raises(
            TridentError, match=rf"by 0\.07 on average \(tolerance client.probe_tolerance = {default}\)"
        ):
            asyncio.run(client.check_probe(tmp_path / name, 1, tolerance=None))
    with pytest.raises(TridentError, match=r"= 0.06\): .* quantization error, .*set client.probe_tolerance above"):
        asyncio.run(client.check_probe(tmp_path / "qlora", 1, tolerance=0.06))
    offset["value"] = 5e-4
    assert asyncio.run(client.check_probe(tmp_path / "bf16", 1, tolerance=None)) == pytest.approx(5e-4)
    with pytest.raises(TridentError, match=r"by 0\.0005 on average \(tolerance client.probe_tolerance = 0.0001\)"):
        asyncio.run(client.check_probe(tmp_path / "fp32", 1, tolerance=None))


def test_an_image_probe_goes_with_its_image_and_must_come_back_expanded_as_the_trainers_processor_did(tmp_path):
    """A vision-language model's probe is sent as its prompt with one placeholder token and the image; the server's
    expansion of it must be the trainer's, position for position, or the logprobs would be compared off by some."""
    expanded, trained = [1, 9, 9, 9, 9, 2, 5, 6], [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    image = "data:image/png;base64,iVBORw0KGgo="
    write_probe(tmp_path, Probe(expanded, trained, image=image, prompt_ids=[1, 9, 2, 5, 6]))
    sent = []

    def server(expanded_ids: list[int]):
        def answer(request: httpx.Request) -> httpx.Response:
            sent.append(json.loads(request.content))
            logprobs = [{str(t): {"logprob": lp}} for t, lp in zip(expanded_ids[1:], trained[1:], strict=False)]
            return httpx.Response(200, json={"prompt_token_ids": expanded_ids, "prompt_logprobs": [None, *logprobs]})

        client = InferenceClient("http://server", timeout_s=1)
        client.http = httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(answer))
        return client

    assert asyncio.run(server(expanded).check_probe(tmp_path, 1, tolerance=1e-3)) == 0.0
    assert sent[0]["token_ids"] == [1, 9, 2, 5, 6] and sent[0]["return_token_ids"] is True
    assert sent[0]["content_parts"] == [{"type": "image_url", "url": image}]
    with pytest.raises(TridentError, match=r"^the server expands the probe's image into other tokens than the train"):
        asyncio.run(server([1, 9, 9, 9, 2, 5, 6]).check_probe(tmp_path, 1, tolerance=1e-3))
