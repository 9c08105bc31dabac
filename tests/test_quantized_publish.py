"""Publishing quantized weights (weight_sync.publish_quantized): the generator's quantized
layers are exactly a fresh quantization of the trainer's fp32 masters after every update, a
delta equals a full update, a full publish is about half the bytes of bf16, and the config
rejects the jobs that cannot take it."""

from __future__ import annotations

import copy

import pytest
import torch
from test_quantized import _logprobs

from loomrl.generation.hf import HFGenerator
from loomrl.job import Job
from loomrl.models import load_model_and_tokenizer
from loomrl.models.quantize import quantize_int8, quantize_linears
from loomrl.telemetry.metrics import read_metrics
from loomrl.weights.params import synced_params
from loomrl.weights.publisher import Publisher, Subscriber
from loomrl.weights.quantized import QuantizedPublish, scale_name
from loomrl.weights.transports.inproc import InprocTransport
from loomrl.weights.update import WeightUpdate, apply_update, encode_update, state_digest

from conftest import TINY_MODEL


@pytest.fixture(scope="module")
def trainer_model():
    return load_model_and_tokenizer(TINY_MODEL, seed=1)


def _step(master: torch.nn.Module, seed: int, size: float) -> None:
    """An optimizer-sized move of the fp32 masters (Adam moves each weight by about lr)."""
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in master.parameters():
            p.add_(size * torch.randn(p.shape, generator=rng))


def _pair(model, tok, *, codec: str = "delta", full_every: int = 3):
    """A quantized publisher of a copy of ``model`` (the trainer's masters) and a generator
    fed by it over an in-process transport."""
    master, transport = copy.deepcopy(model), InprocTransport()
    publisher = Publisher(
        transport.sender(),
        codec=codec,
        full_every=full_every,
        quantized=QuantizedPublish.of_model(master, "int8"),
    )
    gen = HFGenerator(
        copy.deepcopy(model),
        tok,
        subscriber=Subscriber(transport.receiver()),
        quantize="int8",
        publish_quantized=True,
    )
    return master, publisher, gen


def _expected_model(model, master: torch.nn.Module):
    """What the generator should run: the published bf16 of every unquantized tensor, and
    the Linear layers quantized from the fp32 masters."""
    fresh = copy.deepcopy(model)
    quantized = QuantizedPublish.of_model(master, "int8").names
    state = {
        k: v if k in quantized else v.to(torch.bfloat16).float()
        for k, v in synced_params(master).items()
    }
    fresh.load_state_dict(state, strict=False)
    quantize_linears(fresh, "int8")
    return fresh.eval()


def test_the_trainer_selects_the_weights_the_generator_quantizes(trainer_model):
    model, _ = trainer_model
    names = QuantizedPublish.of_model(model, "int8").names
    replaced = quantize_linears(copy.deepcopy(model), "int8").modules
    assert names == {f"{path}.weight" for path in replaced} and len(names) == 2 * 7


def test_quantized_layers_are_a_fresh_quantization_of_the_masters_after_every_update(
    trainer_model,
):
    model, tok = trainer_model
    master, publisher, gen = _pair(model, tok)
    kinds = []
    for version, size in enumerate([0.0, 1e-4, 3e-2, 1e-4, 1e-4, 0.0]):  # deltas and fulls
        _step(master, version, size)
        kinds.append(publisher.publish(synced_params(master), version)["weight_sync/is_full"])
        assert gen.apply_weights(version).version == version
        masters = synced_params(master)
        for path, layer in gen.quantized.modules.items():
            codes, scales = quantize_int8(masters[f"{path}.weight"])
            assert torch.equal(layer.inner.weight().int_repr(), codes)
            assert torch.equal(layer.inner.weight().q_per_channel_scales(), scales.double())
        assert torch.equal(
            _logprobs(gen.model, tok), _logprobs(_expected_model(model, master), tok)
        )
    assert kinds == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_a_delta_update_to_a_quantized_publishing_generator_equals_a_full_one(trainer_model):
    model, tok = trainer_model
    master, by_delta, gen_delta = _pair(model, tok, full_every=50)
    _, by_full, gen_full = _pair(model, tok, codec="full")
    for version in range(3):
        _step(master, 10 + version, 1e-4)
        sent = by_delta.publish(synced_params(master), version)
        gen_delta.apply_weights(version)
    by_full.publish(synced_params(master), 2)
    gen_full.apply_weights(2)
    assert sent["weight_sync/is_full"] == 0.0
    # a tiny model: the manifest weighs
    assert 0 < sent["weight_sync/bytes_sent"] < sent["weight_sync/bytes_full"]
    assert state_digest(gen_delta.mirror) == state_digest(gen_full.mirror)
    for a, b in zip(gen_delta.quantized.modules.values(), gen_full.quantized.modules.values()):
        assert torch.equal(a.inner.weight().int_repr(), b.inner.weight().int_repr())
    assert torch.equal(_logprobs(gen_delta.model, tok), _logprobs(gen_full.model, tok))


def test_a_full_quantized_publish_is_about_half_the_bytes_of_bf16(trainer_model):
    model, _ = trainer_model
    sizes = {}
    for quantized in (False, True):
        transport = InprocTransport()
        selected = QuantizedPublish.of_model(model, "int8")
        publisher = Publisher(transport.sender(), quantized=selected if quantized else None)
        publisher.publish(synced_params(model), 0)
        update = transport.receiver().receive(None)
        names = selected.names | {scale_name(n) for n in selected.names}
        sizes[quantized] = sum(e.nbytes for e in update.tensors if e.name in names)
        other = sum(e.nbytes for e in update.tensors if e.name not in names)
        sizes[quantized, "rest"] = other
    # int8 codes and one fp32 scale a row of 32 or 64 inputs: 1/2 + 2/in of the bf16 bytes
    assert 0.5 < sizes[True] / sizes[False] < 0.57
    assert sizes[True, "rest"] == sizes[False, "rest"]  # everything else stays bf16


def test_fp8_codes_go_through_the_delta_codec_bit_for_bit(trainer_model):
    model, _ = trainer_model
    master = copy.deepcopy(model)
    selected = QuantizedPublish.of_model(master, "fp8")  # the tiny model: dims of 32 and 64
    v0 = selected.cast(synced_params(master), torch.bfloat16)
    _step(master, 3, 1e-3)
    v1 = selected.cast(synced_params(master), torch.bfloat16)
    codes = [n for n in selected.names if v0[n].dtype == torch.float8_e4m3fn]
    assert len(codes) == 2 * 7 and all(v1[scale_name(n)].dtype == torch.float32 for n in codes)
    delta = encode_update(v0, v1, version=1, base_version=0)
    modes = {e.mode for e in delta.tensors if e.name in selected.names}
    assert modes - {"same"}, modes  # some codes changed, and went through the XOR codec
    mirror = {k: v.clone() for k, v in v0.items()}
    apply_update(mirror, WeightUpdate.from_bytes(delta.to_bytes()))
    assert state_digest(mirror) == state_digest(v1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_cuda_generator_loads_published_codes_as_they_are(kind):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from loomrl.models.quantize import quantizer

    model, tok = load_model_and_tokenizer(
        "tiny:llama?hidden_size=64&num_layers=2&num_heads=4&intermediate_size=128", seed=1
    )
    transport = InprocTransport()
    selected = QuantizedPublish.of_model(model, kind)
    publisher = Publisher(transport.sender(), codec="delta", quantized=selected)
    gen = HFGenerator(
        copy.deepcopy(model).to("cuda", torch.bfloat16),
        tok,
        subscriber=Subscriber(transport.receiver()),
        quantize=kind,
        publish_quantized=True,
    )
    for version in range(3):
        _step(model, version, 1e-3 if version else 0.0)
        publisher.publish(synced_params(model), version)
        gen.apply_weights(version)
        masters = synced_params(model)
        for path, layer in gen.quantized.modules.items():
            codes, scales = quantizer(kind)(masters[f"{path}.weight"])
            assert torch.equal(layer.qweight.cpu().view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(layer.scales.cpu().view(-1), scales)
        assert torch.isfinite(_logprobs(gen.model, tok)).all()


@pytest.mark.parametrize(
    "sections, match",
    [
        ({}, "generation.engine.quantize='none'"),
        ({"generation": {"engine": {"quantize": "int4"}}}, "quantize='int4'"),
        (
            {"generation": {"engine": {"type": "vllm", "quantize": "fp8"}}},
            "engine.type='vllm'",
        ),
        (
            {"generation": {"engine": {"quantize": "int8"}}, "model": {"lora": {"r": 4}}},
            "model.lora",
        ),
        (
            {"generation": {"engine": {"quantize": "int8"}}, "weight_sync_transport": "tensor"},
            "tensor lane",
        ),
    ],
)
def test_the_config_rejects_jobs_that_cannot_publish_quantized(tiny_job, sections, match):
    sections = dict(sections)
    transport = sections.pop("weight_sync_transport", "inproc")
    weight_sync = {"publish_quantized": True, "transport": transport}
    with pytest.raises(ValueError, match=match):
        tiny_job(weight_sync=weight_sync, **sections)


@pytest.mark.parametrize(
    "runtime, parallel",
    [
        ("local", "single"),
        pytest.param("process", "single", marks=pytest.mark.slow),  # ~20 s here
        # a sharded trainer publishes from gathered parameters, read once each in order
        pytest.param("process", "fsdp2", marks=[pytest.mark.slow, pytest.mark.timeout(240)]),
    ],
)
def test_a_quantized_publishing_job_runs(tiny_job, runtime, parallel):
    shards = {"type": parallel} | ({"dp_shard": 2} if parallel == "fsdp2" else {})
    cfg = tiny_job(
        generation={"engine": {"quantize": "int8"}},
        weight_sync={"publish_quantized": True, "codec": "delta"},
        trainer={"num_steps": 2, "parallel": shards},
        runtime=runtime,
    )
    result = Job(cfg).run()
    assert result.summary["trained"] == 2 * 4 * 4
    model, _ = load_model_and_tokenizer(TINY_MODEL, seed=0)
    selected = QuantizedPublish.of_model(model, "int8").names
    params = synced_params(model)
    want = sum(  # the trainer published int8 codes and fp32 scales, the rest bf16
        t.numel() + 4 * t.shape[0] if name in selected else 2 * t.numel()
        for name, t in params.items()
    )
    published = [r for r in read_metrics(result.run_dir) if "weight_sync/bytes_full" in r]
    assert published and all(r["weight_sync/bytes_full"] == want for r in published)


def test_a_device_layer_refuses_codes_of_another_kind():
    # copy_ would convert int8 codes into e4m3 values silently: a wrong model, no error
    from loomrl.models.quantize import DeviceQuantLinear

    layer = DeviceQuantLinear(torch.nn.Linear(32, 16), "fp8")  # its CUDA layer, built on a CPU
    before = layer.qweight.clone()
    codes, scales = quantize_int8(torch.randn(16, 32))
    with pytest.raises(ValueError, match="torch.int8 codes for a torch.float8_e4m3fn"):
        layer.load_quantized(codes, scales)
    assert torch.equal(layer.qweight.view(torch.uint8), before.view(torch.uint8))
