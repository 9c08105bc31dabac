"""In-flight weight updates on the hf engine (generation.inflight_updates) and partial
rollouts (generation.partial_rollouts): per-token versions and log-probs against the two
weight sets stepped by hand, whole versions only at every forward, the staleness gate on
the oldest token's version, and the config keys."""

from __future__ import annotations

import asyncio
import copy
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from loomrl.config import ConfigError
from loomrl.control.buffer import RolloutBuffer
from loomrl.generation.hf import HFGenerator
from loomrl.job import Job, resume_job
from loomrl.models import load_model_and_tokenizer
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.checkpoint import latest_checkpoint, load_checkpoint
from loomrl.training.prefix import build_prefix_batch
from loomrl.training.step_stats import _Accumulator, add_current_version_stats
from loomrl.training.trainer import build_token_batch, token_logprobs
from loomrl.types import GenerationRequest, GenerationResult, Group, SamplingParams
from loomrl.weights import encode_update
from loomrl.weights.params import published_state
from loomrl.weights.publisher import Publisher, Subscriber
from loomrl.weights.transports import make_transport

from conftest import ROOT, TINY_MODEL, child_env, json_to_toml, tiny_job_raw

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=14)
PROMPT = "12+34="
SEED = 0


@pytest.fixture(scope="module")
def model_and_tok():
    return load_model_and_tokenizer(TINY_MODEL, seed=1)


def weight_sets(model, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` fp32 weight sets: the model's, then each one perturbed from the last."""
    rng = torch.Generator().manual_seed(0)
    states = [published_state(model, torch.float32)]
    for _ in range(count - 1):
        states.append(
            {k: v + 0.05 * torch.randn(v.shape, generator=rng) for k, v in states[-1].items()}
        )
    return states


def inflight_generator(model, tok, every: int, partial=False, prefetch=False, static=False):
    """An engine fed by an inproc transport, and the transport's sender."""
    transport = make_transport("inproc")
    gen = HFGenerator(
        copy.deepcopy(model),
        tok,
        subscriber=Subscriber(transport.receiver(0), prefetch=prefetch),
        publish_dtype="float32",
        static_cache=static,
        inflight_every_tokens=every,
        partial_rollouts=partial,
    )
    return gen, transport.sender()


def publish_on_forwards(gen, sender, states, on: dict[int, int]) -> list[int]:
    """Send version ``on[k]`` (full, fp32) through the transport while the engine's k-th
    forward runs (0: the prefill): the trainer publishing in the middle of a request."""
    calls = []

    def hook(module, args, kwargs):
        k = len(calls)
        calls.append(k)
        if k in on:
            v = on[k]
            sender.send(encode_update(None, states[v], version=v, base_version=None))

    gen.model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def load(model, state) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name].to(p.device))


@torch.no_grad()
def by_hand(model, tok, gen, states, switches: dict[int, int], recompute: bool):
    """Tokens, log-probs and versions of one sample stepped by hand: version 0 first, and
    from token ``t`` on (for each ``t`` in ``switches``) the weights of ``switches[t]``,
    either over the kept KV cache or with prompt + tokens so far prefilled again."""
    model = copy.deepcopy(model).to(gen.device)
    load(model, states[0])
    uniforms = gen._uniforms([SEED * 1_000_003], SAMPLING.max_new_tokens)
    ids, version = list(tok(PROMPT).input_ids), 0

    def forward(input_ids, start, cache):
        positions = torch.arange(start, start + len(input_ids), device=gen.device)[None]
        out = model(
            input_ids=torch.tensor([input_ids], device=gen.device),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits[:, -1, :].float(), out.past_key_values

    logits, cache = forward(ids, 0, None)
    tokens, logprobs, versions = [], [], []
    for step in range(SAMPLING.max_new_tokens):
        chosen, logp = HFGenerator._pick(logits, uniforms[step], SAMPLING)
        tokens.append(int(chosen))
        logprobs.append(float(logp))
        versions.append(version)
        if int(chosen) in gen.eos_ids or step == SAMPLING.max_new_tokens - 1:
            break
        if step + 1 in switches:
            version = switches[step + 1]
            load(model, states[version])
            if recompute:  # cut: prompt + tokens so far, prefilled by the new weights
                logits, cache = forward(ids + tokens, 0, None)
                continue
        logits, cache = forward([tokens[-1]], len(ids) + step, cache)
    return tokens, logprobs, versions


@pytest.mark.parametrize("static", [False, True], ids=["dynamic_cache", "static_cache"])
@pytest.mark.parametrize("partial", [False, True], ids=["kv_kept", "partial_rollout"])
def test_a_request_spanning_versions_matches_the_weight_sets_stepped_by_hand(
    model_and_tok, partial, static
):
    model, tok = model_and_tok
    states = weight_sets(model, 3)
    gen, sender = inflight_generator(model, tok, every=3, partial=partial, static=static)
    sender.send(encode_update(None, states[0], version=0, base_version=None))
    gen.apply_weights(0)
    # v1 is sent during forward 2 (token 2's), v2 during forward 7: the engine looks after
    # tokens 3, 6, 9 ... and applies each at its next look
    publish_on_forwards(gen, sender, states, {2: 1, 7: 2})
    (result,) = gen.generate([GenerationRequest(tok(PROMPT).input_ids, 1, SAMPLING, SEED)])
    assert len(result.token_ids[0]) > 9, "the sample ended before both updates (pick a seed)"
    expected_versions = [0] * 3 + [1] * 6 + [2] * (len(result.token_ids[0]) - 9)
    assert result.token_versions == [expected_versions]
    assert result.version == 0  # the oldest token's
    assert result.newest_version == 2 and gen.version == 2
    tokens, logprobs, versions = by_hand(model, tok, gen, states, {3: 1, 9: 2}, partial)
    assert result.token_ids[0] == tokens
    assert versions == expected_versions
    if static:  # (attention over the static cache's masked slots sums in another order)
        assert result.logprobs[0] == pytest.approx(logprobs, abs=1e-5)
    else:  # fp32, the same ops: bit for bit
        assert result.logprobs[0] == logprobs
    # and not what one version alone gives: the switch changed the log-probs
    _, only_v0, _ = by_hand(model, tok, gen, states, {}, partial)
    assert result.logprobs[0][3:] != pytest.approx(only_v0[3 : len(result.logprobs[0])], abs=1e-4)
    metrics = result.engine_metrics
    assert metrics["generation/inflight_updates"] == 2.0
    assert result.weight_apply_s > 0


def test_partial_rollouts_recompute_the_prefix_and_kept_kv_does_not(model_and_tok):
    """The two KV policies agree up to the switch and differ after it (the kept cache holds
    keys and values the old weights computed)."""
    model, tok = model_and_tok
    states = weight_sets(model, 2)
    out = {}
    for partial in (False, True):
        gen, sender = inflight_generator(model, tok, every=4, partial=partial)
        sender.send(encode_update(None, states[0], version=0, base_version=None))
        gen.apply_weights(0)
        sender.send(encode_update(None, states[1], version=1, base_version=None))
        (out[partial],) = gen.generate(
            [GenerationRequest(tok(PROMPT).input_ids, 1, SAMPLING, SEED)]
        )
    kept, cut = out[False], out[True]
    assert kept.token_versions[0][:5] == cut.token_versions[0][:5] == [0, 0, 0, 0, 1]
    assert kept.logprobs[0][:4] == cut.logprobs[0][:4]
    assert kept.logprobs[0][4] != pytest.approx(cut.logprobs[0][4], abs=1e-6)


def test_an_update_lands_under_traced_forwards(model_and_tok, monkeypatch):
    """Forwards run from TorchScript traces (runtime 'local' on a CPU) read the parameters
    an in-flight update writes in place."""
    from loomrl.generation.traced import KVForward
    from loomrl.models import traces

    monkeypatch.setattr(traces, "TRACE_BUDGET_S", 1e9)  # every shape traced on first use
    model, tok = model_and_tok
    states = weight_sets(model, 2)
    gen, sender = inflight_generator(model, tok, every=4)
    gen.trace = True
    gen._start_tracing()
    gen._traced = traces.ShapeTraces(
        KVForward(gen.model), what="forward", params_as_constants=True, trace_after=1
    )
    sender.send(encode_update(None, states[0], version=0, base_version=None))
    gen.apply_weights(0)
    sender.send(encode_update(None, states[1], version=1, base_version=None))
    (result,) = gen.generate([GenerationRequest(tok(PROMPT).input_ids, 1, SAMPLING, SEED)])
    assert result.engine_metrics["generation/traced_forwards"] > 0
    tokens, logprobs, versions = by_hand(model, tok, gen, states, {4: 1}, recompute=False)
    assert result.token_versions == [versions] and versions[3:5] == [0, 1]
    assert result.token_ids[0] == tokens and result.logprobs[0] == logprobs


@pytest.mark.gpu
def test_an_update_between_cuda_graph_replays_matches_the_weights_stepped_by_hand(model_and_tok):
    """On CUDA the decode step is one graph replay: the update lands between two replays, in
    place in the parameters the graph reads (fp32; log-probs to kernel rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, tok = model_and_tok
    states = weight_sets(model, 2)
    transport = make_transport("inproc")
    gen = HFGenerator(
        copy.deepcopy(model).to("cuda"),
        tok,
        subscriber=Subscriber(transport.receiver(0)),
        publish_dtype="float32",
        static_cache=True,
        cuda_graphs=True,
        inflight_every_tokens=4,
    )
    sender = transport.sender()
    sender.send(encode_update(None, states[0], version=0, base_version=None))
    gen.apply_weights(0)
    request = GenerationRequest(tok(PROMPT).input_ids, 1, SAMPLING, SEED)
    gen.generate([request])  # the graph captured, on version 0
    sender.send(encode_update(None, states[1], version=1, base_version=None))
    (result,) = gen.generate([request])
    n = len(result.token_ids[0])
    assert n > 4 and result.token_versions == [[0] * 4 + [1] * (n - 4)]
    tokens, logprobs, versions = by_hand(model, tok, gen, states, {4: 1}, recompute=False)
    assert result.token_ids[0] == tokens and versions == result.token_versions[0]
    assert result.logprobs[0] == pytest.approx(logprobs, abs=1e-3)
    assert result.engine_metrics["generation/cuda_graphs"] >= 1


def test_the_trainer_rescores_the_new_versions_tokens_exactly_only_when_the_prefix_is_recomputed(
    model_and_tok,
):
    """The parity the trainer measures at equal versions: after a cut (partial rollouts) a
    token's behaviour log-prob is the new version's over a prefix it computed itself, which
    the trainer's forward at that version reproduces; over a kept cache it is the new weights
    attending to keys and values the old ones computed, which no single version's forward
    gives: the gap the parity metrics then show for those tokens is the kept cache's."""
    model, tok = model_and_tok
    states = weight_sets(model, 2)
    trainer_model = copy.deepcopy(model)
    load(trainer_model, states[1])
    gaps = {}
    for partial in (False, True):
        gen, sender = inflight_generator(model, tok, every=3, partial=partial)
        sender.send(encode_update(None, states[0], version=0, base_version=None))
        gen.apply_weights(0)
        sender.send(encode_update(None, states[1], version=1, base_version=None))
        (result,) = gen.generate([GenerationRequest(tok(PROMPT).input_ids, 1, SAMPLING, SEED)])
        (group,) = Group.from_results(
            [(0, 0)], [tok(PROMPT).input_ids], [{"q": PROMPT}], "q", [result], None
        )
        batch = build_token_batch(list(group), [0.0], 1, tok.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(trainer_model, batch, temperature=SAMPLING.temperature)
        same = batch.same_version.float() * batch.target_mask
        assert same.sum() == len(result.token_ids[0]) - 3  # the tokens version 1 sampled
        gaps[partial] = float(((logp - batch.behaviour).abs() * same).max())
    assert gaps[True] < 1e-5 < 1e-3 < gaps[False]


def test_without_an_update_inflight_changes_nothing(model_and_tok):
    model, tok = model_and_tok
    (state,) = weight_sets(model, 1)
    requests = [
        GenerationRequest(tok(PROMPT).input_ids, 3, SAMPLING, SEED),
        GenerationRequest(tok("7+8=").input_ids, 2, SAMPLING, SEED + 1),
    ]
    results = []
    for every in (None, 1):
        gen, sender = inflight_generator(model, tok, every=every or 1)
        if every is None:
            gen.inflight = None
        sender.send(encode_update(None, state, version=0, base_version=None))
        gen.apply_weights(0)
        results.append(gen.generate(requests))
    for plain, inflight in zip(*results):
        assert inflight.token_ids == plain.token_ids and inflight.logprobs == plain.logprobs
        assert inflight.token_versions is None and inflight.version == plain.version == 0


def _fingerprint(model) -> tuple[float, ...]:
    return tuple(float(p.double().sum()) for p in model.parameters())


def test_every_forward_runs_on_one_whole_version_while_updates_stream_in(model_and_tok):
    """Deltas published from another thread while a batch decodes (prefetched and verified
    there, committed between steps here): every forward sees the weights of exactly one
    published version, the same at its end as at its start, and each token records the
    version of the forward that made its logits."""
    model, tok = model_and_tok
    states = weight_sets(model, 6)
    gen, _ = inflight_generator(model, tok, every=1, prefetch=True)
    transport = make_transport("inproc")
    gen.receiver.subscriber = Subscriber(transport.receiver(0), prefetch=True)
    publisher = Publisher(transport.sender(), codec="delta", publish_dtype="float32")
    publisher.publish(states[0], 0)
    gen.apply_weights(0)
    versions_of = {_fingerprint_state(gen.model, s): v for v, s in enumerate(states)}
    seen, go, first_sent = [], threading.Event(), threading.Event()

    def before(module, args):
        seen.append([_fingerprint(module)])
        if len(seen) == 2:  # the trainer starts publishing while the batch decodes
            go.set()
        if len(seen) == 10:  # (so that at least one update lands mid-request)
            first_sent.wait(10)
            time.sleep(0.1)  # the prefetch thread verifies it meanwhile

    gen.model.register_forward_pre_hook(before)
    gen.model.register_forward_hook(lambda m, a, o: seen[-1].append(_fingerprint(m)))

    def trainer():
        go.wait(10)
        for v in range(1, len(states)):
            publisher.publish(states[v], v)
            first_sent.set()
            time.sleep(0.02)

    thread = threading.Thread(target=trainer)
    sampling = SamplingParams(max_new_tokens=48)
    thread.start()
    results = gen.generate([GenerationRequest(tok(PROMPT).input_ids, 4, sampling, SEED)])
    thread.join()
    gen.close()
    forward_versions = []
    for start, end in seen:
        assert start == end, "the weights changed during a forward"
        assert start in versions_of, "a forward ran on weights of no published version"
        forward_versions.append(versions_of[start])
    (result,) = results
    per_token = result.token_versions or [[result.version] * len(r) for r in result.token_ids]
    for row in per_token:
        assert row == forward_versions[: len(row)]  # forward j made token j's logits
        assert row == sorted(row)
    assert gen.version >= max(forward_versions) and len(set(forward_versions)) >= 2


def _fingerprint_state(model, state) -> tuple[float, ...]:
    names = [n for n, _ in model.named_parameters()]
    return tuple(float(state[n].double().sum()) for n in names)


def test_a_rollout_is_as_stale_as_its_oldest_token():
    result = GenerationResult.from_columns(
        [[5, 6, 7, 8], [9, 10]],
        [[-1.0, -1.1, -1.2, -1.3], [-0.5, -0.6]],
        ["length", "stop"],
        ["a", "b"],
        version=4,
        token_versions=[[3, 3, 4, 4], [3, 3]],
    )
    assert result.version == 3 and result.newest_version == 4
    (group,) = Group.from_results([(0, 0)], [[1, 2]], [{"q": "x"}], "q", [result], None)
    assert group.min_version == 3 and group.versions == [3, 3]
    rows = list(group)
    assert rows[0].token_versions == [3, 3, 4, 4] and rows[0].behaviour_logprobs[2] == -1.2
    assert Group.of_rollouts(0, 0, rows).token_versions == group.token_versions
    # the trainer's batch keeps each token's own behaviour log-prob, aligned with its target
    batch = build_token_batch(rows, [1.0, -1.0], 4, pad_id=0)
    assert batch.behaviour[0, 1:5].tolist() == pytest.approx([-1.0, -1.1, -1.2, -1.3])
    # the parity metrics (trainer vs engine at equal versions) read the tokens of version 4
    assert batch.same_version.tolist() == [
        [False, False, False, True, True],
        [False, False, False, False, False],
    ]
    acc = _Accumulator()
    add_current_version_stats(acc, batch.same_version.float() * batch.target_mask, 6.0)
    assert acc.finish()["train/current_version_token_frac"] == pytest.approx(2 / 6)
    prefix = build_prefix_batch(rows, [1.0, -1.0], 4, pad_id=0)
    assert prefix.same_version.tolist() == [[False, False, True, True], [False] * 4]

    async def train_at(version: int):
        buffer, dropped = RolloutBuffer(max_staleness=1), []

        async def on_drop(g):
            dropped.append(g)

        await buffer.put_many([group])
        buffer.interrupt()
        return await buffer.take(1, version, on_drop), dropped

    batch, dropped = asyncio.run(train_at(4))
    assert batch.staleness == [1] and not dropped
    # at version 5 its newest tokens (4) would be fresh enough; its oldest (3) are not
    batch, dropped = asyncio.run(train_at(5))
    assert batch is None and dropped == [group]


def test_inflight_config_keys_and_refusals(tiny_job):
    gen = tiny_job().generation
    assert not gen.inflight_updates and not gen.partial_rollouts
    assert tiny_job(generation={"inflight_updates": True}).generation.inflight_every_tokens > 0
    with pytest.raises(ConfigError, match="set generation.inflight_updates=true too"):
        tiny_job(generation={"partial_rollouts": True})
    with pytest.raises(ConfigError, match="not built yet for the 'vllm' engine"):
        tiny_job(generation={"inflight_updates": True, "engine": "vllm"})
    with pytest.raises(ConfigError, match="inflight_every_tokens"):
        tiny_job(generation={"inflight_updates": True, "inflight_every_tokens": 0})


@pytest.mark.parametrize("partial", [False, True], ids=["kv_kept", "partial_rollout"])
def test_an_async_job_with_inflight_updates_trains_and_accounts(tiny_job, partial):
    cfg = tiny_job(
        generation={
            "max_new_tokens": 12,
            "inflight_updates": True,
            "inflight_every_tokens": 2,
            "partial_rollouts": partial,
        },
        algorithm={"max_staleness": 1},
        data={"eval": None},
    )
    result = Job(cfg).run()
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= 1 for r in records)
    assert all(math.isfinite(r["train/loss"]) for r in records)
    s = result.summary
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s[
        "in_flight"
    ] + s.get("dropped_zero_variance", 0)
    assert any(r.get("generation/inflight_updates", 0) > 0 for r in read_metrics(result.run_dir))


@pytest.mark.slow
def test_an_inflight_run_killed_mid_sequence_and_resumed_loses_and_duplicates_nothing(
    tmp_path, tiny_data
):
    """kill -9 of a local-runtime run while requests decode across versions (long
    completions, a look every 2 tokens), then ``loomrl resume``: every prompt trained once,
    the accounting closes."""
    train, _ = tiny_data
    raw = tiny_job_raw(
        tmp_path,
        train,
        None,
        generation={"max_new_tokens": 24, "inflight_updates": True, "inflight_every_tokens": 2},
        algorithm={"max_staleness": 2},
        trainer={"num_steps": 16},
        checkpoint={"every_steps": 3, "keep": 50},
    )
    job_file = tmp_path / "job.toml"
    job_file.write_text(json_to_toml(raw))
    run_dir = Path(raw["output_dir"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomrl.cli", "run", str(job_file)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    steps = lambda: [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]  # noqa: E731
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and max(steps(), default=0) < 7:
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None and int(last.name.split("_")[1]) < 16
    result = resume_job(run_dir)
    assert result.summary["steps"] == 16
    trained = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))["controller"]["stream"]
    trained = trained["trained"]
    assert len(trained) == 16 * 4 and len(set(trained)) == len(trained)
    assert (
        trained[: len(before := load_checkpoint(last)["controller"]["stream"]["trained"])] == before
    )
    s = result.summary
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert any(r.get("generation/inflight_updates", 0) > 0 for r in read_metrics(run_dir))
