import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.formats import awq, gptq
from quantkit.packing import _to_int32, pack

SPEC_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble k holds column 8c + SPEC_ORDER[k]


def spec_unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned values [rows, 8 * words] read from the AutoAWQ GEMM description, not from our packer."""
    rows, words = packed.shape
    out = torch.empty(rows, words * 8, dtype=torch.int64)
    u = packed.to(torch.int64) & 0xFFFFFFFF
    for c in range(words):
        for k in range(8):
            out[:, 8 * c + SPEC_ORDER[k]] = (u[:, c] >> (4 * k)) & 0xF
    return out


def spec_pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Unsigned values [rows, n] -> int32 [rows, n / 8], written from the description."""
    rows, n = values.shape
    words = torch.zeros(rows, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for k in range(8):
            words[:, c] |= values[:, 8 * c + SPEC_ORDER[k]].to(torch.int64) << (4 * k)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def spec_pack_gptq(q_unsigned: torch.Tensor, zero_unsigned: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor):
    """GPTQ v1 tensors from unsigned q [out, in], zero [out, G], written from the description:
    input row 8i + k of column c in qweight[i, c] bits 4k..; zeros stored minus one."""
    out_f, in_f = q_unsigned.shape
    qweight = torch.zeros(in_f // 8, out_f, dtype=torch.int64)
    for r in range(in_f):
        qweight[r // 8] |= q_unsigned[:, r].to(torch.int64) << (4 * (r % 8))
    zt = (zero_unsigned - 1).t().to(torch.int64)  # [G, out]
    qzeros = torch.zeros(zt.shape[0], out_f // 8, dtype=torch.int64)
    for c in range(out_f):
        qzeros[:, c // 8] |= zt[:, c] << (4 * (c % 8))

    def i32(w):
        return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)

    return {"qweight": i32(qweight), "qzeros": i32(qzeros), "scales": scale.t().half(), "g_idx": g_idx.to(torch.int32)}


def random_linear(out_f=16, in_f=64, groups=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out_f, in_f), generator=g, dtype=torch.int8)
    zero = torch.randint(-8, 8, (out_f, groups), generator=g, dtype=torch.int8)
    scale = (torch.rand(out_f, groups, generator=g) + 0.01).half()
    return q, scale, zero


def test_one_word_holds_columns_in_autoawq_order():
    q = (torch.arange(8, dtype=torch.int8) - 8)[:, None].expand(8, 8).contiguous()  # [out 8, in 8]: q[c, r] = c - 8
    t = awq.to_awq(q, torch.ones(8, 1), None, "layer")
    # every input row holds unsigned value c for output column c, and nibble k holds column ORDER[k]
    assert t["qweight"].shape == (8, 1) and (t["qweight"].to(torch.int64) & 0xFFFFFFFF == 0x75316420).all()
    assert int(t["qzeros"][0, 0]) & 0xFFFFFFFF == 0x88888888  # symmetric: every zero point is 8


def test_exporter_matches_the_layout_description():
    q, scale, zero = random_linear()
    t = awq.to_awq(q, scale, zero, "layer")
    assert t["qweight"].shape == (64, 2) and t["qzeros"].shape == (2, 2) and t["scales"].shape == (2, 16)
    assert t["scales"].dtype == torch.float16 and t["qweight"].dtype == torch.int32
    assert torch.equal(spec_unpack_awq(t["qweight"]), q.t().to(torch.int64) + 8)
    assert torch.equal(spec_unpack_awq(t["qzeros"]), zero.t().to(torch.int64) + 8)
    assert torch.equal(t["scales"], scale.t())
    w = (spec_unpack_awq(t["qweight"]) - spec_unpack_awq(t["qzeros"]).repeat_interleave(32, 0)).float()
    assert torch.equal(
        w * t["scales"].float().repeat_interleave(32, 0),
        ((q - zero.repeat_interleave(32, 1)).float() * scale.float().repeat_interleave(32, 1)).t(),
    )


def test_importer_reads_tensors_packed_from_the_description():
    q, scale, zero = random_linear(seed=1)
    tensors = {"qweight": spec_pack_awq(q.t() + 8), "qzeros": spec_pack_awq(zero.t() + 8), "scales": scale.t()}
    q2, scale2, zero2, g_idx = awq.decode(tensors, "layer")
    assert torch.equal(q2, q) and torch.equal(scale2, scale) and torch.equal(zero2, zero) and g_idx is None


def test_gptq_importer_reads_tensors_packed_from_the_description():
    q, scale, zero = random_linear(seed=2)
    zero = zero.clamp(min=-7)  # v1 cannot hold unsigned zero 0
    g_idx = torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(3))
    tensors = spec_pack_gptq(q.to(torch.int64) + 8, zero.to(torch.int64) + 8, scale, g_idx)
    q2, scale2, zero2, g2 = gptq.decode(tensors, "layer")
    assert torch.equal(q2, q) and torch.equal(scale2, scale) and torch.equal(zero2, zero)
    assert torch.equal(g2, tensors["g_idx"])
    back = gptq.to_gptq(q2, scale2, zero2, 32, g2, "layer")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_awq_round_trip_and_per_channel():
    q, scale, zero = random_linear(out_f=24, in_f=40, groups=1, seed=4)
    t = awq.to_awq(q, scale, zero, "layer")
    q2, scale2, zero2, _ = awq.decode(t, "layer")
    assert torch.equal(q2, q) and torch.equal(scale2, scale) and torch.equal(zero2, zero)


def test_missing_qzeros_mean_zero_point_8():
    q, scale, _ = random_linear(seed=5)
    t = awq.to_awq(q, scale, None, "layer")
    del t["qzeros"]
    assert torch.equal(awq.decode(t, "layer")[2], torch.zeros(16, 2, dtype=torch.int8))


def test_gptq_nibble_15_is_refused():
    q, scale, zero = random_linear(seed=6)
    t = gptq.to_gptq(q, scale, zero.clamp(min=-7), 32, None, "layer")
    t["qzeros"][0, 0] |= 0xF
    with pytest.raises(QuantkitError, match="layer stores a qzeros nibble of 15"):
        gptq.decode(t, "layer")


def gptqmodel_v1(q, scale, zero, group_size):
    """GPTQ tensors as GPTQModel's v2 -> v1 export writes them: the true zeros (nibble = unsigned
    zero), then 0x11111111 subtracted from each int32 word, borrows and all."""
    t = gptq.to_gptq(q, scale, None, group_size, None, "layer")
    v2 = pack(zero.t().contiguous(), 4, dim=1).to(torch.int64)  # nibble = zero + 8, unsigned
    t["qzeros"] = _to_int32((v2 - 0x11111111) & 0xFFFFFFFF)
    return t


def test_gptqmodel_zeros_of_0_are_read_as_gptqmodel_reads_them():
    q, scale, zero = random_linear(out_f=16, in_f=64, groups=2, seed=7)
    zero[3, 0] = zero[0, 1] = zero[7, 1] = -8  # unsigned zero 0: the nibble wraps to 15 and borrows
    t = gptqmodel_v1(q, scale, zero, 32)
    assert torch.equal(gptq.decode(t, "layer", borrows=True)[2], zero)
    with pytest.raises(QuantkitError, match="qzeros nibble of 15"):  # nibble by nibble it is damaged
        gptq.decode(t, "layer")
    # without a zero of 0 there is no borrow, and both readings agree
    clean = gptqmodel_v1(q, scale, zero.clamp(min=-7), 32)
    assert torch.equal(gptq.decode(clean, "layer", borrows=True)[2], zero.clamp(min=-7))
    assert torch.equal(gptq.decode(clean, "layer")[2], zero.clamp(min=-7))


def test_only_gptqmodel_checkpoints_are_read_with_borrows():
    assert gptq.borrows({"quant_method": "gptq", "meta": {"quantizer": ["gptqmodel:7.6.0"]}})
    assert not gptq.borrows({"quant_method": "gptq", "meta": {"quantizer": ["optimum:1.0", "auto_gptq:0.7"]}})
    assert not gptq.borrows({"quant_method": "gptq"})


@pytest.mark.parametrize(
    "tensors,message",
    [
        ({"qweight": torch.zeros(64, 2, dtype=torch.int32), "scales": torch.ones(2, 8)}, "do not fit the AutoAWQ GEMM"),
        (
            {"qweight": torch.zeros(64, 2, dtype=torch.int32), "scales": torch.ones(3, 16)},
            "do not fit the AutoAWQ GEMM",
        ),
        (
            {
                "qweight": torch.zeros(64, 2, dtype=torch.int32),
                "scales": torch.ones(2, 16),
                "qzeros": torch.zeros(2, 3, dtype=torch.int32),
            },
            "do not fit the AutoAWQ GEMM",
        ),
    ],
)
def test_damaged_awq_tensors_are_refused(tensors, message):
    with pytest.raises(QuantkitError, match=message):
        awq.decode(tensors, "layer")


def test_scales_outside_float16_are_refused():
    q, _, _ = random_linear()
    with pytest.raises(QuantkitError, match="outside float16's range"):
        awq.to_awq(q, torch.full((16, 2), 1e6), None, "layer")
    with pytest.raises(QuantkitError, match="outside float16's range"):
        gptq.to_gptq(q, torch.full((16, 2), 1e-9), None, 32, None, "layer")


def test_config_reading():
    assert awq.unsupported({"quant_method": "awq", "bits": 4, "version": "gemm"}) is None
    assert awq.unsupported({"quant_method": "awq", "w_bit": 4, "version": "GEMM"}) is None  # AutoAWQ quant_config.json
    assert "'gemv' layout" in awq.unsupported({"bits": 4, "version": "gemv"})
    assert "8-bit" in awq.unsupported({"bits": 8, "version": "gemm"})
    assert awq.group_size({"q_group_size": 64}) == 64 and awq.group_size({"group_size": -1}) is None
    assert gptq.unsupported({"bits": 4, "checkpoint_format": "gptq"}) is None
    assert gptq.unsupported({"bits": 4, "format": "gptq"}) is None
    assert "'gptq_v2'" in gptq.unsupported({"bits": 4, "checkpoint_format": "gptq_v2"})
    assert "'marlin'" in gptq.unsupported({"bits": 4, "is_marlin_format": True})
    assert "3-bit" in gptq.unsupported({"bits": 3})
    assert gptq.group_size({"group_size": -1}) is None and gptq.group_size({"group_size": 32}) == 32
