"""Round-trip properties of every compressor, and error feedback's bounded residual."""

from __future__ import annotations

import math

import pytest
import torch

from vatra.comm import Compressor, Memory, MomentumMemory, NoMemory, build_compressor
from vatra.comm.onebit import pack_bits, unpack_bits
from vatra.config import CommConfig
from vatra.errors import ConfigError
from vatra.registry import COMPRESSORS, import_object

SHAPES = [(1,), (7,), (33, 5), (4, 3, 11)]


def _registered(error_feedback: bool | None = None) -> list[str]:
    """Every built-in compressor that works tensor by tensor, as the registry lists them (powersgd is
    a DDP hook's state, tested in test_comm_lowrank), optionally only those with error feedback."""
    names = []
    for name in COMPRESSORS.names():
        cls = import_object(COMPRESSORS.builtins[name], COMPRESSORS.key)
        if not (isinstance(cls, type) and issubclass(cls, Compressor)):
            continue
        comp = build_compressor(CommConfig(method=name, ratio=0.05, levels=2))
        if error_feedback is None or comp.error_feedback == error_feedback:
            names.append(name)
    return names


def _grad(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _payload_bytes(payload: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


@pytest.mark.parametrize("method", _registered())
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_keeps_shape_dtype_and_payload_layout(method: str, shape: tuple[int, ...]) -> None:
    comp = build_compressor(CommConfig(method=method, ratio=0.1))
    x = _grad(shape)
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    assert y.shape == x.shape and y.dtype == x.dtype
    # the payload layout depends only on the shape: another tensor of that shape packs the same way
    other, _ = comp.compress(_grad(shape, seed=1))
    assert [(t.shape, t.dtype) for t in other] == [(t.shape, t.dtype) for t in payload]


def test_lossless_and_half_precision() -> None:
    x = _grad((257,))
    none, fp16, bf16 = (build_compressor(CommConfig(method=m)) for m in ("none", "fp16", "bf16"))
    assert torch.equal(none.decompress(*none.compress(x)), x)
    torch.testing.assert_close(fp16.decompress(*fp16.compress(x)), x, rtol=1e-3, atol=1e-3)  # 10-bit mantissa
    torch.testing.assert_close(bf16.decompress(*bf16.compress(x)), x, rtol=8e-3, atol=8e-3)  # 7-bit mantissa
    assert _payload_bytes(fp16.compress(x)[0]) * 2 == _payload_bytes(none.compress(x)[0])


def test_topk_keeps_exactly_the_largest() -> None:
    x = _grad((1000,))
    comp = build_compressor(CommConfig(method="topk", ratio=0.01))
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    kept = y != 0
    assert int(kept.sum()) == 10
    assert torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()
    assert _payload_bytes(payload) == 10 * (4 + 4)  # 1 % kept: int32 index + fp32 value


def test_a_sparsifier_above_one_in_32_sends_a_bitmask_instead_of_indices() -> None:
    x = _grad((1000,))
    comp = build_compressor(CommConfig(method="topk", ratio=0.25))
    payload, ctx = comp.compress(x)
    assert payload[0].dtype == torch.uint8 and _payload_bytes(payload) == 125 + 250 * 4
    y = comp.decompress(payload, ctx)
    kept = y != 0
    assert int(kept.sum()) == 250 and torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_randomk_sends_k_original_values() -> None:
    torch.manual_seed(0)
    x = _grad((50,))
    comp = build_compressor(CommConfig(method="randomk", ratio=0.2))
    y = comp.decompress(*comp.compress(x))
    kept = y != 0
    assert int(kept.sum()) == 10
    assert torch.equal(y[kept], x[kept])
    other = comp.decompress(*comp.compress(x)) != 0
    assert not torch.equal(kept, other)  # a fresh draw each call


def test_randomk_with_shared_draws_sends_only_values_that_sum_across_ranks() -> None:
    """In the DDP hook every rank's generator is seeded alike: the same indices, so only the values
    travel, and the sum of two ranks' payloads decompresses to the sum of their kept values."""
    a, b = _grad((50,)), _grad((50,))
    ranks = []
    for x in (a, b):
        comp = build_compressor(CommConfig(method="randomk", ratio=0.2))
        comp.shared = True
        comp.generator = torch.Generator().manual_seed(7)
        ranks.append(comp.compress(x))
    (pa, ca), (pb, cb) = ranks
    assert comp.sums and len(pa) == 1 and _payload_bytes(pa) == 10 * 4  # values only
    summed = comp.decompress([pa[0] + pb[0]], ca)
    kept = summed != 0
    assert int(kept.sum()) == 10 and torch.equal(kept, comp.decompress(pb, cb) != 0)
    torch.testing.assert_close(summed[kept], a[kept] + b[kept])


def test_onebit_bits_and_scale() -> None:
    bits = torch.rand(29) > 0.5
    assert torch.equal(unpack_bits(pack_bits(bits), 29), bits)
    x = _grad((1001,))
    comp = build_compressor(CommConfig(method="onebit"))
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    assert torch.equal(y >= 0, x >= 0)
    torch.testing.assert_close(y.abs(), torch.full_like(x, float(x.abs().mean())))
    assert _payload_bytes(payload) == math.ceil(1001 / 8) + 4


def test_onebit_row_scale() -> None:
    x = _grad((6, 50))
    x[2] = 0.0  # a unit that was inactive on the batch: its gradient row is zero
    comp = build_compressor(CommConfig(method="onebit", onebit_scale="row"))
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    assert torch.equal(y[2], torch.zeros(50))  # a per-tensor scale would send ±mean|x| there
    torch.testing.assert_close(y.abs().mean(dim=1), x.abs().mean(dim=1))
    assert torch.equal(y[x != 0] >= 0, x[x != 0] >= 0)
    assert _payload_bytes(payload) == math.ceil(300 / 8) + 6 * 4  # bits + one fp32 scale per row
    vector = _grad((33,))  # no rows: one scale
    assert _payload_bytes(comp.compress(vector)[0]) == math.ceil(33 / 8) + 4


def test_momentum_memory_is_momentum_sgd_when_everything_is_sent() -> None:
    """Uncompressed, the velocity sent is SGD's momentum buffer: u ← m·u + g."""
    mem = MomentumMemory(0.9, masking=False)
    buf = torch.zeros(20)
    for step in range(10):
        g = _grad((20,), seed=step)
        buf = 0.9 * buf + g if step else g.clone()
        torch.testing.assert_close(mem.accumulate(g, "w"), buf)


def test_momentum_correction_with_masking() -> None:
    """Σ sent + residual = Σ velocities (error feedback on the velocity), and the velocity is cleared
    where topk sent (momentum-factor masking)."""
    comp = build_compressor(CommConfig(method="topk", ratio=0.1))
    mem = MomentumMemory(0.9, masking=True)
    sent_sum = torch.zeros(100)
    for step in range(50):
        x = mem.compensate(_grad((100,), seed=step) + 0.3, "w")
        sent = comp.decompress(*comp.compress(x))
        mem.update(x, "w", sent)
        sent_sum += sent
        assert torch.equal(mem.velocity["w"][sent != 0], torch.zeros(int((sent != 0).sum())))
        assert torch.equal(mem.residuals["w"][sent != 0], torch.zeros(int((sent != 0).sum())))
    # masking drops the velocity of sent elements: what they would have added later is not owed
    assert sent_sum.abs().sum() > 0 and torch.isfinite(mem.residuals["w"]).all()
    unmasked = MomentumMemory(0.9, masking=False)
    velocity_sum = torch.zeros(100)
    sent_sum = torch.zeros(100)
    for step in range(50):
        x = unmasked.compensate(_grad((100,), seed=step) + 0.3, "w")
        velocity_sum += unmasked.velocity["w"]
        sent = comp.decompress(*comp.compress(x))
        unmasked.update(x, "w", sent)
        sent_sum += sent
    torch.testing.assert_close(sent_sum + unmasked.residuals["w"], velocity_sum, rtol=1e-4, atol=1e-3)


def test_qsgd_is_unbiased_and_bounded() -> None:
    torch.manual_seed(0)
    x = _grad((64,))
    comp = build_compressor(CommConfig(method="qsgd", levels=4))
    draws = torch.stack([comp.decompress(*comp.compress(x)) for _ in range(3000)])
    assert (draws.mean(0) - x).abs().max() < 0.05 * x.norm()
    # one quantisation step is ‖x‖/s: no draw is further than that from x
    assert (draws - x).abs().max() <= x.norm() / 4 + 1e-5
    assert comp.compress(x)[0][0].dtype == torch.int8
    assert not comp.error_feedback  # unbiased and not contractive: the plugin gives it no memory


@pytest.mark.parametrize("method", _registered(error_feedback=True))
def test_error_feedback_residual_stays_bounded(method: str) -> None:
    """Σ transmitted = Σ true gradients − final residual, and the residual does not grow with steps."""
    comp = build_compressor(CommConfig(method=method, ratio=0.05, levels=2))
    mem = Memory()
    torch.manual_seed(0)
    true_sum = torch.zeros(500)
    sent_sum = torch.zeros(500)
    norms = []
    for step in range(300):
        g = _grad((500,), seed=step) + 0.5  # a persistent direction plus noise
        x = mem.compensate(g, "w")
        sent = comp.decompress(*comp.compress(x))
        mem.update(x, "w", sent)
        true_sum += g
        sent_sum += sent
        norms.append(mem.residual_norm())
    torch.testing.assert_close(sent_sum + mem.residuals["w"], true_sum, rtol=1e-4, atol=1e-3)
    late, early = max(norms[200:]), max(norms[50:100])
    assert late <= 2.0 * early  # bounded: no drift over time (both 0 for a lossless method)
    # an element waits ~1/ratio = 20 steps to be sent: the residual stays ~20 gradients, 300 went by
    assert mem.residuals["w"].norm() < 0.15 * true_sum.norm()


def test_memory_drops_residual_of_a_rebuilt_bucket() -> None:
    mem = Memory()
    mem.update(torch.ones(4), ("b", 0), torch.zeros(4))
    assert torch.equal(mem.compensate(torch.zeros(4), ("b", 0)), torch.ones(4))
    assert torch.equal(mem.compensate(torch.zeros(6), ("b", 0)), torch.zeros(6))  # shape changed
    assert torch.equal(NoMemory().compensate(torch.ones(2), "k"), torch.ones(2))


def test_registry_names_and_config_errors() -> None:
    assert COMPRESSORS.names() == [
        "bf16",
        "fp16",
        "int8",
        "none",
        "onebit",
        "powersgd",
        "qsgd",
        "randomk",
        "topk",
    ]
    with pytest.raises(ConfigError, match="powersgd"):
        build_compressor(CommConfig(method="powersgd"))
    with pytest.raises(ValueError, match=r"comm\.topology"):
        CommConfig(method="powersgd", powersgd_impl="torch", topology="ring")
    assert CommConfig(method="powersgd", topology="ring").topology == "ring"  # vatra's composes
    # momentum correction needs a compressor with error feedback; it was silently ignored before
    for method in ("none", "qsgd", "powersgd"):
        with pytest.raises(ValueError, match=f"method '{method}'"):
            CommConfig(method=method, momentum_correction=True)
    with pytest.raises(ValueError, match=r"comm\.error_feedback = false does not"):
        CommConfig(method="topk", momentum_correction=True, error_feedback=False)
    assert CommConfig(method="fp16", momentum_correction=True).momentum_correction


def test_int8_is_a_quarter_of_fp32_with_per_row_scales_and_refuses_a_wrong_payload() -> None:
    comp = build_compressor(CommConfig(method="int8"))
    x = _grad((64, 33))
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    # rounding to nearest: each element within half a step of its row's scale (amax / 127)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((y - x).abs() <= step / 2 + 1e-7).all())
    assert _payload_bytes(payload) == 64 * 33 + 4 * 64  # 1 byte an element, 4 a row
    assert comp.error_feedback and not comp.stochastic
    with pytest.raises(ValueError, match="scales"):
        comp.decompress([payload[0], payload[1][:3]], ctx)
