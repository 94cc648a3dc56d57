"""The server's tokens and logprobs are the trainer's: token in/token out, processed logprobs, and reloads."""

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from peft import LoraConfig, get_peft_model
from rollouts import build_samples
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes
from stale_weights import left_behind, trained_one_step
from transformers import AutoModelForCausalLM, AutoTokenizer

from contracts.errors import TridentError
from contracts.inference_api import adapter_name
from contracts.protocol import MicroBatch
from contracts.run_dir import PROBE_FILE, PROBE_TEXT, mark_stable
from inference.config import InferenceConfig
from inference.server import forks_cpu_processes
from orchestrator.config import EnvConfig, OrchestratorConfig, SamplingConfig
from orchestrator.serving.client import InferenceClient
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits
from trainer.export import probe_logprobs, save_weights
from trainer.model import packed_logprobs, use_packed_forward
from trainer.truncation import kept_tokens

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7


def rollout_samples(base_url: str, tiny_model_path: str, n: int = 4, sampling: dict | None = None):
    """Samples of ``n`` reverse-text rollouts of one prompt, as the orchestrator builds them (``[sampling]``
    ``sampling``, or temperature :data:`TEMPERATURE`)."""
    sampling = {"temperature": TEMPERATURE, **(sampling or {}), "max_tokens": 16}
    config = OrchestratorConfig(client={"base_url": base_url}, sampling=sampling)
    env = load_env(EnvConfig(id="reverse-text", args={"num_examples": 1}))
    task = next(iter(env.taskset.load()))

    async def run():
        async with env.serving():
            return await run_group(env, task, n, model_context(config, tiny_model_path), RolloutLimits.of(n))

    groups = [asyncio.run(run())]
    assert all(r.ok for r in groups[0]), [r.error for r in groups[0]]
    samples, *_ = build_samples(groups, weight_step=0)
    end_of_turn = AutoTokenizer.from_pretrained(tiny_model_path).convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    for rollout, sample in zip(groups[0], samples, strict=True):
        # a rollout is truncated exactly when its reply used all of max_tokens without ending its turn
        cut_off = sum(sample.loss_mask) == 16 and sample.token_ids[-1] not in end_of_turn
        assert rollout.truncated == cut_off
    return task, samples


def trainer_logprobs(model, samples) -> list[torch.Tensor]:
    use_packed_forward(model)
    with torch.no_grad():
        return [packed_logprobs(model, MicroBatch.pack([s]), TEMPERATURE) for s in samples]


def max_gap(model, samples) -> float:
    gaps = []
    for sample, logprobs in zip(samples, trainer_logprobs(model, samples), strict=True):
        mask = torch.tensor(sample.loss_mask)
        gaps.append((logprobs[mask] - torch.tensor(sample.inference_logprobs)[mask]).abs().max().item())
    return max(gaps)


def test_samples_are_the_servers_tokens_with_matching_logprobs(inference_server, tiny_model_path):
    task, samples = rollout_samples(inference_server, tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.data.prompt}],
        add_generation_prompt=True,
        enable_thinking=False,  # as the orchestrator renders: an empty think block opens the reply
        tokenize=True,
        return_dict=False,
    )
    for sample in samples:
        n_prompt = sample.loss_mask.index(True)
        # the prompt is exactly the chat template's rendering, and only the completion is trained
        assert sample.token_ids[:n_prompt] == prompt_ids
        assert all(sample.loss_mask[n_prompt:])
        assert 1 <= len(sample.token_ids) - n_prompt <= 16
        assert all(lp == 0.0 for lp in sample.inference_logprobs[:n_prompt])
    # processed logprobs (after temperature) equal the trainer's: the importance ratio starts at 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert max_gap(model, samples) < 1e-4


# Each truncation alone and all together, at a temperature where the tiny model's near-uniform distributions are
# peaked enough for min_p 0.05 to drop tokens (at 0.7 it keeps them all).
TRUNCATIONS = [{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"top_p": 0.9, "top_k": 20, "min_p": 0.05}]


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=lambda t: "+".join(t))
def test_truncated_sampling_is_replayed_exactly(inference_server, tiny_model_path, truncation):
    """The trainer scores each sampled token under the server's truncation: its logprobs equal the server's, while
    the full softmax's differ from them by the log of the kept mass, a real gap at every token."""
    sampling = SamplingConfig(temperature=0.2, max_tokens=16, **truncation)
    _, samples = rollout_samples(inference_server, tiny_model_path, n=2, sampling=sampling.model_dump())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    use_packed_forward(model)
    for sample in samples:
        micro_batch, mask = MicroBatch.pack([sample]), torch.tensor(sample.loss_mask)
        served = torch.tensor(sample.inference_logprobs)[mask]
        with torch.no_grad():
            replayed = packed_logprobs(model, micro_batch, 0.2, truncation=sampling.truncation)[mask]
            full = packed_logprobs(model, micro_batch, 0.2)[mask]
            logits = model(input_ids=torch.tensor([sample.token_ids])).logits[0, :-1][mask[1:]] / 0.2
        kept_mass = (logits.softmax(-1) * kept_tokens(logits, sampling.truncation)).sum(-1)
        assert (kept_mass < 0.999).all(), kept_mass  # the setting truncates at every tested token
        assert (replayed - served).abs().max() < 1e-4
        assert (full - served - kept_mass.log()).abs().max() < 1e-4


def test_reload_serves_new_weights(inference_server, tiny_model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)  # tied: changes the lm_head too
    save_weights(model, AutoTokenizer.from_pretrained(tiny_model_path), tmp_path / "step_7")

    async def reload_and_probe():
        client = InferenceClient(inference_server, timeout_s=60, model="trident/tiny-qwen3")
        try:
            seconds = await client.reload_weights(tmp_path / "step_7", 7)
            return seconds, await client.check_probe(tmp_path / "step_7", 7, tolerance=None)  # the default
        finally:
            await client.close()

    start = time.monotonic()
    seconds, probe_gap = asyncio.run(reload_and_probe())
    assert 0 < seconds <= time.monotonic() - start  # the server reports the time its reload took
    assert probe_gap < 1e-4  # the server's logprobs of the probe are the trainer's: it serves these weights
    _, samples = rollout_samples(inference_server, tiny_model_path)
    assert max_gap(model, samples) < 1e-4
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert max_gap(original, samples) > 1e-2


def test_probe_stops_a_run_whose_server_left_a_layer_a_step_behind(inference_server, tiny_model_path, tmp_path):
    """At the default tolerance: the server loads weights one debug-run step on except one layer's (as if that
    layer's tensors had not been loaded), the folder's probe is the trainer's (gap ~0.03; a correct reload's ~1e-6)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model, before = trained_one_step(tiny_model_path, seed=0)
    save_weights(left_behind(model, before, layer=1), tokenizer, tmp_path / "step_8")
    save_weights(model, tokenizer, tmp_path / "trained")
    shutil.copy(tmp_path / "trained" / PROBE_FILE, tmp_path / "step_8" / PROBE_FILE)

    async def reload_and_probe():
        client = InferenceClient(inference_server, timeout_s=60, model="trident/tiny-qwen3")
        try:
            await client.reload_weights(tmp_path / "step_8", 8)
            await client.check_probe(tmp_path / "step_8", 8, tolerance=None)
        finally:
            await client.close()

    with pytest.raises(TridentError, match=r"after reloading weights step 8, the server's logprobs of the probe"):
        asyncio.run(reload_and_probe())


def write_adapter(tiny_model_path: str, folder, seed: int):
    """A rank-8 peft adapter on the tiny model with random non-zero B (peft starts B at 0: a no-op)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    target = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=target))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)  # as the trainer writes it
    mark_stable(folder)
    return model


def test_lora_adapters_swap_under_versioned_names(inference_server, tiny_model_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    save_weights(original, tokenizer, tmp_path / "step_0")
    body = {"path": str(tmp_path / "step_0"), "step": 0}
    response = httpx.post(f"{inference_server}/reload_weights", json=body, timeout=60)
    assert response.status_code == 200, response.text  # the base the adapters apply to (other tests change it)
    token_ids = tokenizer.encode(PROBE_TEXT)
    base = probe_logprobs(original, token_ids)
    adapters = {step: write_adapter(tiny_model_path, tmp_path / f"step_{step}", seed=step) for step in (1, 2, 3)}

    async def served_logprobs(model: str) -> list[float]:
        client = InferenceClient(inference_server, timeout_s=60, model=model)
        try:
            return await client.prompt_logprobs(token_ids)
        finally:
            await client.close()

    def gap(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    for step, model in adapters.items():
        path = str((tmp_path / f"step_{step}").resolve())
        start = time.monotonic()
        response = httpx.post(f"{inference_server}/load_adapter", json={"path": path, "step": step}, timeout=60)
        assert response.status_code == 200, response.text
        assert 0 < response.json()["seconds"] <= time.monotonic() - start
        served = {"step": step, "path": path, "adapter": adapter_name(step)}
        assert httpx.get(f"{inference_server}/weights").json() == served
        logprobs = asyncio.run(served_logprobs(adapter_name(step)))
        assert gap(logprobs, probe_logprobs(model, token_ids)) < 1e-4  # the server applies exactly this adapter
        assert gap(logprobs, base) > 1e-2
    # step 2's adapter still serves under its name (rollouts started on it finish on it); step 1's name is gone,
    # so a request naming it cannot get an adapter two swaps old
    names = [m["id"] for m in httpx.get(f"{inference_server}/v1/models").json()["data"]]
    assert adapter_name(3) in names and adapter_name(2) in names and adapter_name(1) not in names
    previous = asyncio.run(served_logprobs(adapter_name(2)))
    assert gap(previous, probe_logprobs(adapters[2], token_ids)) < 1e-4
    body = {"model": adapter_name(1), "token_ids": token_ids, "sampling_params": {"max_tokens": 1}}
    assert httpx.post(f"{inference_server}/inference/v1/generate", json=body, timeout=60).status_code == 404
    assert gap(asyncio.run(served_logprobs("trident/tiny-qwen3")), base) < 1e-4  # the base model is untouched


def test_two_named_runs_share_the_server_each_served_exactly_its_own_adapters(
    inference_server, tiny_model_path, tmp_path
):
    """Runs a and b load adapters under their own names at once; each is served exactly (vLLM keeps every one
    resident); releasing a removes its adapters and leaves b's served."""
    token_ids = AutoTokenizer.from_pretrained(tiny_model_path).encode(PROBE_TEXT)
    loads = [("a", 1), ("b", 1), ("a", 2)]
    expected = {}
    for seed, (run, step) in enumerate(loads, start=11):
        folder = (tmp_path / run / f"step_{step}").resolve()
        expected[adapter_name(step, run)] = probe_logprobs(write_adapter(tiny_model_path, folder, seed), token_ids)
        body = {"path": str(folder), "step": step, "run": run}
        response = httpx.post(f"{inference_server}/load_adapter", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["adapter"] == adapter_name(step, run), response.text

    async def served_gaps() -> dict[str, float]:
        gaps = {}
        for name, logprobs in expected.items():
            client = InferenceClient(inference_server, timeout_s=60, model=name)
            try:
                served = await client.prompt_logprobs(token_ids)
            finally:
                await client.close()
            gaps[name] = max(abs(x - y) for x, y in zip(served, logprobs, strict=True))
        return gaps

    try:
        assert max(asyncio.run(served_gaps()).values()) < 1e-4
        shares = httpx.get(f"{inference_server}/runs").json()
        assert shares["a"]["adapter"] == adapter_name(2, "a") and shares["a"]["requests"] == 2  # a's two probes
        assert httpx.get(f"{inference_server}/weights").json()["adapter"] is None  # the unnamed run: untouched
        assert httpx.post(f"{inference_server}/release_run", json={"run": "a"}).json()["released"] is True
        assert set(httpx.get(f"{inference_server}/runs").json()) == {"b"}
        names = {m["id"] for m in httpx.get(f"{inference_server}/v1/models").json()["data"]}
        assert adapter_name(1, "b") in names and not {adapter_name(1, "a"), adapter_name(2, "a")} & names
        body = {"model": adapter_name(2, "a"), "token_ids": token_ids, "sampling_params": {"max_tokens": 1}}
        assert httpx.post(f"{inference_server}/inference/v1/generate", json=body, timeout=60).status_code == 404
        del expected[adapter_name(1, "a")], expected[adapter_name(2, "a")]
        assert asyncio.run(served_gaps())[adapter_name(1, "b")] < 1e-4
    finally:
        for run in ("a", "b"):
            httpx.post(f"{inference_server}/release_run", json={"run": run}, timeout=60)


def test_a_probe_sent_among_generating_requests_gets_exact_logprobs_and_the_server_survives(
    inference_server, tiny_model_path
):
    """The orchestrator probes a reload while the next step's rollouts generate: on a server with LoRA, vLLM would
    map the probe's prompt rows wrongly in a shared batch (on CPU its engine died); the server runs it alone."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    token_ids = tokenizer.encode(PROBE_TEXT)
    expected = probe_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), token_ids)
    rollout = {"model": "trident/tiny-qwen3", "token_ids": token_ids[:5], "sampling_params": {"max_tokens": 64}}

    async def probe_among_rollouts() -> tuple[list[int], list[float]]:
        client = InferenceClient(inference_server, timeout_s=120, model="trident/tiny-qwen3")
        try:
            rollouts = [asyncio.ensure_future(client.http.post("/inference/v1/generate", json=rollout))
                        for _ in range(16)]  # fmt: skip
            await asyncio.sleep(0.5)  # generating
            served = await client.prompt_logprobs(token_ids)
            return [response.status_code for response in await asyncio.gather(*rollouts)], served
        finally:
            await client.close()

    statuses, served = asyncio.run(probe_among_rollouts())
    assert statuses == [200] * 16
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-4
    assert httpx.get(f"{inference_server}/health", timeout=10).status_code == 200


def greedy_reply(base_url: str) -> list:
    """The tokens and logprobs of a greedy completion of the probe text: they change with any loaded weights."""
    body = {"model": "trident/tiny-qwen3", "prompt": PROBE_TEXT, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True))


@pytest.fixture(scope="module")
def spoiled_folders(tmp_path_factory, tiny_model_path) -> list[str]:
    """Weights folders marked STABLE that must not load: garbage, truncated, wrong shapes, unknown tensors, an
    adapter and a broadcast manifest that are not; and paths that are no weights folder at all."""
    root = tmp_path_factory.mktemp("spoiled")
    weights = load_file(f"{tiny_model_path}/model.safetensors")
    name = next(iter(weights))
    files = {
        "garbage": {"model.safetensors": b"\x00\xff" * 1000},
        "truncated": {"model.safetensors": (Path(tiny_model_path) / "model.safetensors").read_bytes()[:50_000]},
        "wrong-shape": {"model.safetensors": save_bytes(weights | {name: torch.zeros(3, 3)})},
        "unknown-tensor": {"model.safetensors": save_bytes({"../../evil": torch.zeros(2)})},
        "no-weights": {"config.json": b"{}"},
        "adapter": {"adapter_config.json": b"{}", "adapter_model.safetensors": b"junk"},
        "manifest": {"broadcast.json": b'{"host": "10.255.255.1", "port": "x"}'},
    }
    for folder, contents in files.items():
        (root / folder).mkdir()
        for file, data in contents.items():
            (root / folder / file).write_bytes(data)
        mark_stable(root / folder)
    (root / "loop").symlink_to(root / "loop")
    (root / "a-file").write_text("not a folder")
    return [str(root / p) for p in [*files, "loop", "a-file"]]


JSON = {"Content-Type": "application/json"}
NASTY_PATHS = ["", "/", ".", "..", "../../../../etc", "/etc/passwd", "/proc/self/environ", "/dev/zero", "~",
               "a\x00b", "x" * 5000, "/" + "a/" * 2000, "\ud800", "%2e%2e/%2e%2e", "C:\\Windows"]  # fmt: skip


def test_weight_routes_refuse_whatever_they_cannot_load_and_nothing_is_loaded(inference_server, spoiled_folders):
    """Fuzz ``/reload_weights`` and ``/load_adapter`` with what hypothesis draws (odd paths, spoiled weights
    folders, values of any JSON type, bodies that are no JSON): each is refused with a 4xx and a message, never
    a 500, and the server serves the same weights, token for token, afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    before, reply = httpx.get(f"{inference_server}/weights").json(), greedy_reply(inference_server)
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8,
    )
    paths = st.sampled_from(NASTY_PATHS + spoiled_folders) | st.text(max_size=50) | json_values
    steps = st.integers(-(2**70), 2**70) | json_values
    bodies = st.fixed_dictionaries({"path": paths, "step": steps}) | st.fixed_dictionaries({"path": paths})
    bodies |= json_values

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(["/reload_weights", "/load_adapter"]), body=bodies | st.binary(max_size=64))
    def refused(route, body):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{inference_server}{route}", content=content, headers=JSON, timeout=120)
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
        reply = response.json()  # vLLM's error format, or FastAPI's for a body it cannot parse: with the reason
        assert reply.get("detail") or reply["error"]["message"]

    refused()
    for folder in spoiled_folders + NASTY_PATHS:  # and each of these, on both routes, for sure
        for route in ("/reload_weights", "/load_adapter"):
            body = json.dumps({"path": folder, "step": 3})  # ASCII escapes: json= cannot send "\ud800"
            response = httpx.post(f"{inference_server}{route}", content=body, headers=JSON, timeout=120)
            assert 400 <= response.status_code < 500, (folder, route, response.text)
    assert httpx.get(f"{inference_server}/weights").json() == before
    assert greedy_reply(inference_server) == reply


def test_the_servers_engine_and_worker_are_forks_of_its_process_on_two_cores(session_server):
    """With two CPUs or fewer (CI's machine) vLLM's engine is a copy of the server's process and its worker a copy of
    the engine: each maps torch's library where the server does, which a process started afresh would not under
    address randomization. With more, vLLM spawns them (``cpu_process_start = "auto"``)."""
    port = int(session_server.rsplit(":", 1)[1])
    [listener] = {c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"}
    server = psutil.Process(listener)  # or a fork of it: forks keep its socket
    while server.cmdline()[0].startswith("VLLM::"):  # titled by vLLM
        server = server.parent()
    vllms = {p.cmdline()[0]: p.pid for p in server.children(recursive=True)}

    def torch_at(pid: int) -> str:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        return next(line.split()[0] for line in maps if line.endswith("/libtorch_cpu.so"))

    assert Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0"  # else spawned ones match too
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= vllms.keys(), vllms
    addresses = {torch_at(vllms["VLLM::EngineCore"]), torch_at(vllms["VLLM::Worker"]), torch_at(server.pid)}
    forked = forks_cpu_processes(InferenceConfig(), len(server.cpu_affinity()))
    assert len(addresses) == (1 if forked else 3), addresses
