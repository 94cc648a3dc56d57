"""Weight deltas are exact: applied to the served copy they give the trainer's value cast to the served dtype, bit for
bit, in the smallest of three encodings; the checksum tells apart tensors one element apart."""

import pytest
import torch
from safetensors.torch import load, save

from contracts.weight_delta import (
    WeightsCopy,
    apply,
    checksum,
    encode,
    encode_all,
    from_tensors,
    raw_bits,
    to_tensors,
    weights_checksum,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def changed_count(served: torch.Tensor, new: torch.Tensor) -> int:
    """Elements whose bytes differ, one by one."""
    return sum(a != b for a, b in zip(raw_bits(served).tolist(), raw_bits(new).tolist(), strict=True))


def updated(served: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """A float32 trained value: ``served`` with a ``share`` of its elements moved by far more than their ulp."""
    generator = torch.Generator().manual_seed(seed)
    moved = torch.rand(served.shape, generator=generator) < share
    return served.float() + moved * (0.1 + torch.rand(served.shape, generator=generator))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("share", "expected"), [(0.0, "none"), (0.02, "sparse"), (0.9, "dense")])
def test_a_delta_applied_gives_the_trained_value_exactly_in_the_smallest_encoding(dtype, share, expected):
    served = (torch.randn(64, 48, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    trained = updated(served, share, seed=2)
    new = trained.to(dtype)
    delta = encode(served, trained)
    copy = served.clone()
    apply(delta, copy)
    assert torch.equal(raw_bits(copy), raw_bits(new))
    # the smallest of: nothing, int32 positions + values, the whole tensor
    changed, size = changed_count(served, new), served.element_size()
    smallest = "none" if changed == 0 else "sparse" if changed * (4 + size) < served.numel() * size else "dense"
    assert delta.encoding == smallest == expected
    assert delta.nbytes == {"none": 0, "sparse": changed * (4 + size), "dense": served.numel() * size}[smallest]


def test_sparse_positions_are_int32_and_a_change_at_each_end_lands_there():
    served = torch.zeros(10, 10, dtype=torch.bfloat16)
    trained = served.float()
    trained[0, 0], trained[9, 9] = 1.0, -2.0
    delta = encode(served, trained)
    assert delta.encoding == "sparse" and delta.indices.dtype == torch.int32
    assert delta.indices.tolist() == [0, 99]
    apply(delta, served)
    assert served[0, 0] == 1.0 and served[9, 9] == -2.0 and served.count_nonzero() == 2


def test_an_update_that_rounds_away_in_bf16_encodes_as_nothing_and_in_float32_moves_every_element():
    generator = torch.Generator().manual_seed(3)
    magnitude = 0.015 + 0.015 * torch.rand(128, 128, generator=generator)  # weights of about 0.02
    # float32 master weights as loaded from a bf16 checkpoint: each is a bf16 value
    weights = (magnitude * torch.sign(torch.randn(128, 128, generator=generator))).to(torch.bfloat16).float()
    step = 1e-6 * torch.sign(torch.randn(128, 128, generator=generator))  # an Adam step at lr 1e-6
    assert encode(weights.to(torch.bfloat16), weights + step).encoding == "none"
    assert encode(weights.clone(), weights + step).encoding == "dense"


def test_a_sign_of_zero_is_a_change():
    served = torch.zeros(8, dtype=torch.bfloat16)
    trained = served.float()
    trained[3] = -0.0
    delta = encode(served, trained)
    assert delta.encoding == "sparse" and delta.indices.tolist() == [3]
    apply(delta, served)
    assert torch.equal(raw_bits(served), raw_bits(trained.to(torch.bfloat16)))


def test_a_delta_of_another_dtype_or_size_is_refused():
    served = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        apply(encode(torch.zeros(4, 4), torch.ones(4, 4)), served)
    with pytest.raises(ValueError, match="shapes"):
        encode(served, torch.ones(4, 5))


def test_deltas_survive_a_safetensors_file():
    generator = torch.Generator().manual_seed(4)
    served = {f"layer.{i}.weight": torch.randn(32, 16, generator=generator).to(torch.bfloat16) for i in range(3)}
    shares = dict(zip(served, [0.0, 0.05, 1.0], strict=True))
    trained = {name: updated(tensor, shares[name], seed=5) for name, tensor in served.items()}
    deltas = {name: encode(served[name], trained[name]) for name in served}
    assert [d.encoding for d in deltas.values()] == ["none", "sparse", "dense"]
    read = from_tensors(load(save(to_tensors(deltas))))
    assert sorted(read) == ["layer.1.weight", "layer.2.weight"]  # the unchanged one is not in the file
    for name, tensor in served.items():
        apply(read.get(name, deltas[name]), tensor)
        assert torch.equal(raw_bits(tensor), raw_bits(trained[name].to(torch.bfloat16)))
    with pytest.raises(ValueError, match="layer.0.weight:values"):
        from_tensors({"layer.0.weight:values": torch.zeros(1)})


def naive_checksum(tensor: torch.Tensor) -> int:
    """The checksum's definition, word by word: sum of unsigned 16-bit words times their position + 1."""
    words = tensor.contiguous().reshape(-1).view(torch.int16).tolist()
    return sum((word & 0xFFFF) * (i + 1) for i, word in enumerate(words)) % 2**64


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_checksum_is_its_definition_and_tells_one_changed_element_or_a_swap(dtype):
    tensor = torch.randn(33, 7, generator=torch.Generator().manual_seed(6)).to(dtype)
    assert checksum(tensor) == naive_checksum(tensor)
    assert checksum(tensor.t().contiguous().t()) == checksum(tensor)  # the values, not the memory layout
    for position in (0, 100, tensor.numel() - 1):
        changed = tensor.clone().reshape(-1)
        raw_bits(changed)[position] += 1  # the next representable value
        assert checksum(changed) != checksum(tensor)
    swapped = tensor.clone().reshape(-1)
    swapped[[5, 6]] = swapped[[6, 5]]
    assert not torch.equal(swapped, tensor.reshape(-1)) and checksum(swapped) != checksum(tensor)
    assert weights_checksum({"a": checksum(tensor), "b": 1}) != weights_checksum({"a": checksum(swapped), "b": 1})
    assert weights_checksum({"a": 1, "b": 2}) == weights_checksum({"b": 2, "a": 1})


def test_the_checksum_sums_in_chunks_as_in_one(monkeypatch):
    tensor = torch.randn(1000).to(torch.bfloat16)
    whole = checksum(tensor)
    monkeypatch.setattr("contracts.weight_delta.CHECKSUM_CHUNK", 64)
    assert checksum(tensor) == whole == naive_checksum(tensor)


def test_a_copy_with_deltas_applied_has_the_new_weights_and_their_checksum():
    generator = torch.Generator().manual_seed(3)
    served = {name: torch.randn(16, 8, generator=generator).to(torch.bfloat16) for name in ("a.weight", "b.weight")}
    new = {"a.weight": updated(served["a.weight"], 0.1, seed=4).to(torch.bfloat16), "b.weight": served["b.weight"]}
    copy = WeightsCopy()
    copy.replace({name: tensor.clone() for name, tensor in served.items()})
    before = copy.checksum
    copy.apply(encode_all(copy.tensors, new))
    assert all(torch.equal(raw_bits(copy.tensors[name]), raw_bits(new[name])) for name in new)
    assert copy.checksum == weights_checksum({name: checksum(t) for name, t in new.items()}) != before
    with pytest.raises(ValueError, match="do not have: c.weight"):
        copy.apply({"c.weight": encode(served["a.weight"], new["a.weight"])})
