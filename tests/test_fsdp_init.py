"""The sharded trainer's meta-device start (``loomrl.training.fsdp_init``): from a model
folder each rank builds the model on the meta device, shards it and reads only its rows of
the safetensors; the result is the whole-model start's model bit for bit (tied embeddings
tied, rotary frequencies recomputed) and trains the same, and a rank's start-up peak stays
well under the whole model's size."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from spawned import end_rank
from step_checks import assert_same_step
from test_fsdp import TINY, _configs, _uneven_groups

pytestmark = pytest.mark.timeout(240)


def _save_untied_qwen2(folder: Path) -> None:
    """A Qwen2 (q/k/v biases) with its own output projection, saved with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from loomrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)


def _save_tiny_llama(folder: Path) -> None:
    from loomrl.models.tiny import build_tiny_model

    model, tok = build_tiny_model("llama", seed=3, **TINY)  # tied embeddings; 101 rows: uneven
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _meta_and_whole_rank(
    rank: int, world_size: int, rendezvous: str, folders: list, out: str, device: str = "cpu"
):
    """One rank (torch.multiprocessing.spawn): each folder's model started the meta way (the
    whole-model fallback made to fail) and the whole-model way; their logits, buffers and
    two train steps."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loomrl.config import ModelConfig
    from loomrl.models.loading import load_policy
    from loomrl.training.fsdp import ShardedTrainer, shard_model
    from loomrl.training.fsdp_init import start_sharded_model

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size)
    mesh = init_device_mesh(device.split(":")[0], (world_size,))
    shard = partial(shard_model, mesh=mesh, precision="fp32", reshard=True)
    ids = torch.tensor([[1, 5, 9, 13, 40, 7, 2], [3, 3, 8, 60, 99, 100, 4]], device=device)
    results = []
    for folder in folders:
        model_cfg = ModelConfig(path=folder, device=device)
        whole_start = "loomrl.training.fsdp_init.load_policy"
        with mock.patch(whole_start, side_effect=AssertionError("whole-model start")):
            meta, tok = start_sharded_model(model_cfg, torch.float32, shard)
        whole, _ = load_policy(model_cfg, dtype=torch.float32)
        shard(whole)
        with torch.no_grad():
            logits = [m(ids).logits for m in (meta, whole)]
        steps = []
        for model in (meta, whole):
            trainer = ShardedTrainer(
                model, tok, *_configs("token"), 1.0, rank=rank, world_size=world_size
            )
            steps.append([trainer.train_step(_uneven_groups()) for _ in range(2)])
        results.append(
            {
                "logits_equal": torch.equal(*logits),
                "buffers_equal": all(
                    torch.equal(a, b) for a, b in zip(meta.buffers(), whole.buffers())
                ),
                "tied": meta.lm_head.weight is meta.model.embed_tokens.weight,
                "config_tied": meta.config.tie_word_embeddings,
                "steps": steps,
            }
        )
    if rank == 0:
        torch.save(results, out)
    end_rank()


def _check_meta_against_whole(tmp_path, world_size: int, device: str, rel: float) -> None:
    """The two starts' logits equal; their train steps' loss and grad norm within ``rel`` (0: equal)."""
    import torch
    import torch.multiprocessing as mp

    from loomrl.runtime.group import new_rendezvous

    folders = [tmp_path / "llama", tmp_path / "qwen2"]
    _save_tiny_llama(folders[0])
    _save_untied_qwen2(folders[1])
    out = str(tmp_path / "rank0.pt")
    mp.spawn(
        _meta_and_whole_rank,
        (world_size, new_rendezvous("127.0.0.1"), [str(f) for f in folders], out, device),
        nprocs=world_size,
    )
    for result in torch.load(out, weights_only=False):
        assert result["logits_equal"] and result["buffers_equal"]
        assert result["tied"] == result["config_tied"]  # tied stays one parameter
        meta_steps, whole_steps = result["steps"]
        for got, want in zip(meta_steps, whole_steps):
            assert_same_step(got, want, ("train/loss", "train/grad_norm", "train/update_rms"), rel)
    assert [r["config_tied"] for r in torch.load(out, weights_only=False)] == [True, False]


def test_the_meta_start_is_the_whole_model_start_bit_for_bit_and_trains_the_same(tmp_path):
    _check_meta_against_whole(tmp_path, 2, "cpu", rel=0.0)


@pytest.mark.gpu
def test_the_meta_start_on_cuda_is_the_whole_model_start(tmp_path):
    """One NCCL rank on cuda:0: ``to_empty`` onto the GPU, the slices copied from the CPU
    (the steps under bf16 autocast, attention's backward free to sum in another order)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check_meta_against_whole(tmp_path, 1, "cuda:0", rel=1e-3)


def test_a_model_the_meta_start_cannot_load_is_named_and_starts_whole(tmp_path):
    import torch

    from loomrl.models.loading import build_meta_model, safetensors_files
    from loomrl.training.fsdp_init import meta_start_blocker

    _save_tiny_llama(tmp_path)
    files = safetensors_files(str(tmp_path))
    assert safetensors_files("tiny:llama") is None
    model = build_meta_model(str(tmp_path), torch.float32)
    assert model.lm_head.weight.is_meta and meta_start_blocker(model, files) is None
    renamed = {name.replace("model.", "base."): f for name, f in files.items()}
    assert "model.embed_tokens.weight" in meta_start_blocker(model, renamed)
    model.model.layers[0].register_buffer("mask", torch.ones(3, device="meta"), persistent=False)
    assert "model.layers.0 (LlamaDecoderLayer)" in meta_start_blocker(model, files)
    (tmp_path / "model.safetensors").unlink()
    assert safetensors_files(str(tmp_path)) is None


def test_a_folder_without_safetensors_and_a_tiny_spec_start_whole(tmp_path, caplog):
    import torch
    from safetensors.torch import load_file

    from loomrl.config import ModelConfig
    from loomrl.training.fsdp_init import start_sharded_model

    _save_tiny_llama(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    torch.save(stored, tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    sharded = []
    with caplog.at_level("WARNING", logger="loomrl.training.fsdp_init"):
        model, _ = start_sharded_model(
            ModelConfig(path=str(tmp_path), device="cpu"), torch.float32, sharded.append
        )
    assert "has no safetensors; every rank loads the whole model" in caplog.text
    assert sharded == [model] and not model.lm_head.weight.is_meta
    torch.testing.assert_close(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    caplog.clear()
    model, _ = start_sharded_model(
        ModelConfig(path="tiny:llama", device="cpu"), torch.float32, sharded.append
    )
    assert sharded[-1] is model and not caplog.text


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_rank(rank: int, world_size: int, rendezvous: str, folders: list, out: str):
    """One rank: the start-up peak resident set (``VmHWM`` after resetting it, minus the
    resident set then) of the meta start, then of the whole-model start (the meta model kept,
    so its memory is not reused), each after a warm-up start of a tiny model (imports, code)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loomrl.config import ModelConfig
    from loomrl.models.loading import load_policy
    from loomrl.training.fsdp import shard_model
    from loomrl.training.fsdp_init import start_sharded_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    shard = partial(
        shard_model, mesh=init_device_mesh("cpu", (world_size,)), precision="fp32", reshard=True
    )

    def meta(folder):
        return start_sharded_model(ModelConfig(path=folder, device="cpu"), torch.float32, shard)[0]

    def whole(folder):
        model = load_policy(ModelConfig(path=folder, device="cpu"), dtype=torch.float32)[0]
        shard(model)
        return model

    tiny, big = folders
    kept, peaks = [meta(tiny), whole(tiny)], {}
    for name, start in (("meta", meta), ("whole", whole)):
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM
        before = _status_bytes("VmRSS")
        kept.append(start(big))
        peaks[name] = _status_bytes("VmHWM") - before
    parts: list = [None] * world_size
    dist.all_gather_object(parts, peaks)
    if rank == 0:
        Path(out).write_text(json.dumps(parts))
    end_rank()


def _can_reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def test_a_ranks_start_up_peak_is_under_the_whole_models_size(tmp_path):
    """36M parameters (138 MiB in fp32, no tensor over 8 MiB): each of 2 ranks holds 69 MiB
    of shards; the meta start's peak stays under 3/4 of the model, the whole-model start's
    is above all of it (a rank held the whole model)."""
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM, LlamaConfig

    from loomrl.models.tiny import build_char_tokenizer
    from loomrl.runtime.group import new_rendezvous

    if not _can_reset_peak_rss():
        pytest.skip("needs /proc/self/clear_refs (Linux) to reset the peak resident set")
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(tmp_path / "big")
    build_char_tokenizer().save_pretrained(tmp_path / "big")
    del model
    _save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "peaks.json"
    folders = [str(tmp_path / "tiny"), str(tmp_path / "big")]
    mp.spawn(_peak_rank, (2, new_rendezvous("127.0.0.1"), folders, str(out)), nprocs=2)
    for peaks in json.loads(out.read_text()):
        assert peaks["meta"] < 0.75 * model_bytes, (peaks, model_bytes)
        assert peaks["whole"] > model_bytes, (peaks, model_bytes)
