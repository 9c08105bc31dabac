"""Weight updates: bit-exact round trips, and every corruption or wrong base is rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomrl.weights import (
    CodecOptions,
    WeightUpdate,
    WeightUpdateError,
    apply_update,
    encode_update,
    state_digest,
)
from loomrl.weights.manifest import MODE_BITMAP, MODE_DENSE, MODE_SAME, MODE_SPARSE, bits_view

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ALL_DTYPES = DTYPES + [torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
FORCE = {
    "auto": CodecOptions(),
    "sparse": CodecOptions(sparse_max=1.0, dense_min=1.01),
    "bitmap": CodecOptions(sparse_max=0.0, dense_min=1.01),
    "dense": CodecOptions(sparse_max=0.0, dense_min=0.0),
}
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included) of ``dtype``."""
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=shape).astype(bool))
    t = torch.empty(shape, dtype=dtype)
    bits = bits_view(t)  # shares memory with t
    bits[:] = rng.integers(
        0, np.iinfo(bits.dtype).max, size=bits.size, dtype=bits.dtype, endpoint=True
    )
    return t


def perturb(rng: np.random.Generator, t: torch.Tensor, fraction: float) -> torch.Tensor:
    """A copy of ``t`` with about ``fraction`` of its elements changed (1.0: all of them)."""
    out = t.clone()
    bits = bits_view(out)
    if bits.size == 0 or fraction == 0:
        return out
    mask = np.ones(bits.size, bool) if fraction >= 1 else rng.random(bits.size) < fraction
    flips = rng.integers(
        1, np.iinfo(bits.dtype).max, size=int(mask.sum()), dtype=bits.dtype, endpoint=True
    )
    if t.dtype == torch.bool:
        flips = np.ones_like(flips)
    bits[mask] ^= flips
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and np.array_equal(bits_view(a[k]), bits_view(b[k]))
        for k in a
    )


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@st.composite
def state_pairs(draw, dtypes=DTYPES):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base, new = {}, {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(dtypes))
        shape = draw(shapes)
        fraction = draw(st.sampled_from([0.0, 1.0, 0.01, 0.3, 0.7]))
        base[f"t{i}"] = random_tensor(rng, shape, dtype)
        new[f"t{i}"] = perturb(rng, base[f"t{i}"], fraction)
    return base, new


@PROPERTY
@given(pair=state_pairs(ALL_DTYPES), force=st.sampled_from(sorted(FORCE)))
def test_delta_round_trip_is_bit_exact(pair, force):
    base, new = pair
    update = encode_update(base, new, version=2, base_version=1, options=FORCE[force])
    received = WeightUpdate.from_bytes(update.to_bytes())
    state = clone(base)
    apply_update(state, received, have_version=1)
    assert same_bits(state, new)
    assert received.digest == state_digest(new) == state_digest(state)


@PROPERTY
@given(pair=state_pairs(ALL_DTYPES))
def test_full_round_trip_is_bit_exact(pair):
    _, new = pair
    update = encode_update(None, new, version=5, base_version=None)
    assert update.is_full and all(e.mode == "raw" for e in update.tensors)
    state: dict[str, torch.Tensor] = {}
    apply_update(state, WeightUpdate.from_bytes(update.to_bytes()))
    assert same_bits(state, new)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fraction,mode",
    [(0.0, MODE_SAME), (0.005, MODE_SPARSE), (0.35, MODE_BITMAP), (1.0, MODE_DENSE)],
)
def test_mode_follows_density(dtype, fraction, mode):
    rng = np.random.default_rng(0)
    base = {"w": random_tensor(rng, (400, 300), dtype)}
    new = {"w": perturb(rng, base["w"], fraction)}
    update = encode_update(base, new, version=1, base_version=0)
    assert update.tensors[0].mode == mode
    state = clone(base)
    apply_update(state, WeightUpdate.from_bytes(update.to_bytes()))
    assert same_bits(state, new)


def test_manifest_describes_every_tensor():
    rng = np.random.default_rng(1)
    base = {"a": random_tensor(rng, (5, 4), torch.bfloat16), "s": torch.tensor(1.5)}
    new = {"a": perturb(rng, base["a"], 0.5), "s": torch.tensor(2.5)}
    update = encode_update(base, new, version=8, base_version=7)
    manifest = WeightUpdate.from_bytes(update.to_bytes()).manifest()
    assert (manifest["version"], manifest["base_version"], manifest["codec"]) == (8, 7, "xor-zstd")
    assert manifest["digest"] == state_digest(new)
    assert manifest["base_digest"] == state_digest(base)
    by_name = {t["name"]: t for t in manifest["tensors"]}
    assert by_name["a"]["shape"] == [5, 4] and by_name["a"]["dtype"] == "torch.bfloat16"
    assert by_name["s"]["shape"] == [] and by_name["s"]["changed"] == 1
    assert all(isinstance(t["checksum"], int) for t in manifest["tensors"])


def test_new_and_reshaped_tensors_travel_raw_inside_a_delta():
    rng = np.random.default_rng(2)
    base = {
        "a": random_tensor(rng, (6,), torch.float32),
        "b": random_tensor(rng, (3,), torch.float16),
    }
    new = {
        "a": random_tensor(rng, (2, 3), torch.float32),
        "b": base["b"].clone(),
        "c": random_tensor(rng, (4,), torch.bfloat16),
    }
    update = encode_update(base, new, version=1, base_version=0)
    assert {e.name: e.mode for e in update.tensors} == {"a": "raw", "b": "same", "c": "raw"}
    state = clone(base)
    apply_update(state, update)
    assert same_bits(state, new | {})


@pytest.fixture(scope="module")
def delta_case():
    rng = np.random.default_rng(3)
    base = {
        "w": random_tensor(rng, (64, 32), torch.bfloat16),
        "v": random_tensor(rng, (100,), torch.float32),
        "h": random_tensor(rng, (40,), torch.float16),
        "d": random_tensor(rng, (50,), torch.bfloat16),
    }
    new = {
        "w": perturb(rng, base["w"], 0.02),
        "v": perturb(rng, base["v"], 0.4),
        "h": base["h"].clone(),
        "d": perturb(rng, base["d"], 1.0),
    }
    delta = encode_update(base, new, version=4, base_version=3)
    full = encode_update(None, new, version=4, base_version=None)
    return base, new, delta, full


def _rejects(state: dict[str, torch.Tensor], data: bytes) -> None:
    before = clone(state)
    with pytest.raises(WeightUpdateError):
        apply_update(state, WeightUpdate.from_bytes(data))
    assert same_bits(state, before)


@PROPERTY
@given(
    which=st.sampled_from(["delta", "full"]),
    pos=st.floats(0, 1, exclude_max=True),
    xor=st.integers(1, 255),
)
def test_any_byte_flip_is_rejected_and_state_unchanged(delta_case, which, pos, xor):
    base, _, delta, full = delta_case
    data = bytearray((delta if which == "delta" else full).to_bytes())
    data[int(pos * len(data))] ^= xor
    _rejects(clone(base), bytes(data))


@PROPERTY
@given(which=st.sampled_from(["delta", "full"]), cut=st.floats(0, 1, exclude_max=True))
def test_any_truncation_is_rejected(delta_case, which, cut):
    base, _, delta, full = delta_case
    data = (delta if which == "delta" else full).to_bytes()
    _rejects(clone(base), data[: int(cut * len(data))])


def test_every_single_byte_flip_of_a_delta_is_rejected(delta_case):
    base, _, delta, _ = delta_case
    data = delta.to_bytes()
    state = clone(base)
    for pos in range(len(data)):
        corrupted = bytearray(data)
        corrupted[pos] ^= 0x5A
        with pytest.raises(WeightUpdateError):
            apply_update(state, WeightUpdate.from_bytes(bytes(corrupted)))
    assert same_bits(state, base)


def test_delta_against_the_wrong_base_is_rejected(delta_case):
    base, new, delta, _ = delta_case
    with pytest.raises(WeightUpdateError, match="does not apply to version 2"):
        apply_update(clone(base), delta, have_version=2)
    with pytest.raises(WeightUpdateError, match="base digest"):
        apply_update(clone(base), delta, have_digest="0" * 32)
    rng = np.random.default_rng(9)
    wrong = {k: perturb(rng, v, 0.01) if k == "w" else v.clone() for k, v in base.items()}
    _rejects(wrong, delta.to_bytes())  # no version given: the checksums catch it
    _rejects(clone(new), delta.to_bytes())  # already at the new version
    missing = {k: v.clone() for k, v in base.items() if k != "v"}
    _rejects(missing, delta.to_bytes())


def test_digest_mismatch_is_rejected(delta_case):
    base, _, delta, _ = delta_case
    forged = WeightUpdate(
        delta.version,
        delta.base_version,
        delta.codec,
        delta.tensors,
        "f" * 32,
        delta.payload,
        delta.base_digest,
    )
    _rejects(clone(base), forged.to_bytes())


def test_apply_writes_in_place():
    rng = np.random.default_rng(4)
    base = {"w": random_tensor(rng, (1000,), torch.bfloat16)}
    new = {"w": perturb(rng, base["w"], 0.01)}
    state = clone(base)
    storage = state["w"].data_ptr()
    changed = apply_update(state, encode_update(base, new, version=1, base_version=0))
    assert changed == ["w"] and state["w"].data_ptr() == storage
    assert same_bits(state, new)


def test_real_adamw_steps_give_small_bf16_deltas():
    """fp32 masters, AdamW at an RL learning rate, published in bf16: a few % of the
    elements change per step and the delta is >= 50x smaller than the full weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x, y = torch.randn(128, 256), torch.randn(128, 64)
    published = [{k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}]
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        published.append({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})
    for old, new in zip(published, published[1:], strict=False):
        update = encode_update(old, new, version=1, base_version=0)
        assert update.changed_fraction < 0.05
        assert update.nbytes < update.model_nbytes / 50
        state = clone(old)
        apply_update(state, update)
        assert same_bits(state, new)
