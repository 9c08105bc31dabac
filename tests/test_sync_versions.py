"""The synchronous rule, enforced: every request carries the minimum policy version it
needs and the generator waits for it, so with prefetch (updates applied in the background)
and with torch_dist (updates filed by a receiving thread) a max_staleness=0 run trains
every rollout at staleness 0 and drops none."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from loomrl.generation.hf import HFGenerator
from loomrl.job import Job
from loomrl.models import load_model_and_tokenizer
from loomrl.telemetry.metrics import read_metrics
from loomrl.types import GenerationRequest, SamplingParams
from loomrl.weights import encode_update
from loomrl.weights.publisher import Subscriber
from loomrl.weights.transports import make_transport

from conftest import TINY_MODEL


def _assert_synchronous(result, steps: int) -> None:
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["rollout/staleness_max"] == 0 for r in records)
    assert result.summary["dropped_stale"] == 0  # no group generated on an old version
    assert result.summary["trained"] == steps * 16


def test_sync_run_with_prefetch_generates_every_group_on_the_current_version(tiny_job):
    cfg = tiny_job(
        algorithm={"max_staleness": 0},
        weight_sync={"prefetch": True},
        trainer={"num_steps": 6},
        data={"eval": None},
    )
    _assert_synchronous(Job(cfg).run(), 6)


@pytest.mark.parametrize(
    "lane", [{"transport": "torch_dist"}, {"transport": {"type": "tensor", "mode": "broadcast"}}]
)
def test_sync_run_over_torch_dist_generates_every_group_on_the_current_version(tiny_job, lane):
    cfg = tiny_job(
        algorithm={"max_staleness": 0},
        runtime="process",
        weight_sync=lane,
        trainer={"num_steps": 4},
        data={"eval": None},
    )
    _assert_synchronous(Job(cfg).run(), 4)


def test_a_request_waits_for_the_version_it_needs(tmp_path):
    model, tok = load_model_and_tokenizer(TINY_MODEL)
    transport = make_transport("inproc")
    sender = transport.sender()
    gen = HFGenerator(model, tok, subscriber=Subscriber(transport.receiver(0), prefetch=True))
    state = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    sender.send(encode_update(None, state, version=0, base_version=None))
    request = GenerationRequest(
        tok("1+2=").input_ids, 1, SamplingParams(max_new_tokens=2), 0, min_version=1
    )
    later = threading.Timer(
        0.3, lambda: sender.send(encode_update(None, state, version=1, base_version=None))
    )
    later.start()
    t0 = time.perf_counter()
    (result,) = gen.generate([request])
    assert result.version == 1 and time.perf_counter() - t0 >= 0.25  # waited for version 1
    gen.weight_wait_timeout_s = 0.3
    request.min_version = 5
    with pytest.raises(TimeoutError, match="generator at version 1 waited 0.3 s for version 5"):
        gen.generate([request])
    gen.close()
