"""headwise.QKVLayout and QKVManifest (SPEC section 2): spans, fuse/split, manifest."""

import dataclasses

import pytest
import torch

import headwise
from headwise import QKVLayout, QKVManifest

# The immutable asymmetric fixture of seeds/002: B=2, Q=3, K=4, D_m=6, H=2, D_qk=3, D_v=2.
ASYM = dict(num_q_heads=2, num_kv_heads=2, head_dim=3, v_head_dim=2)
D_MODEL = 6

LAYOUTS = [
    pytest.param(QKVLayout(**ASYM), id="asym-H2-Dqk3-Dv2"),
    pytest.param(QKVLayout(**ASYM, order=("v", "q", "k")), id="asym-vqk"),
    pytest.param(QKVLayout(8, 2, 4), id="gqa-8-2"),
    pytest.param(QKVLayout(6, 1, 4, 3, order=("k", "v", "q")), id="mqa-kvq"),
    pytest.param(QKVLayout(6, 3, 4, 2, interleave="kv_group"), id="kv-group"),
    pytest.param(QKVLayout(4, 4, 5, interleave="kv_group"), id="kv-group-mha"),
]


def test_asymmetric_fixture_spans_and_parameter_count():
    layout = QKVLayout(**ASYM)
    assert layout.num_rows == layout.out_features == 16
    assert layout.spans == {"q": (0, 6), "k": (6, 12), "v": (12, 16)}
    # Fused QKV weight and bias, plus W_O [D_m, H*D_v] and its bias: 142 parameters.
    qkv = layout.num_rows * D_MODEL + layout.num_rows
    w_o = D_MODEL * layout.num_q_heads * layout.v_head_dim + D_MODEL
    assert qkv == 112 and qkv + w_o == 142
    assert layout.head_spans() == {"q": ((0, 3), (3, 6)), "k": ((6, 9), (9, 12)), "v": ((12, 14), (14, 16))}


def test_spec_example_spans():
    assert QKVLayout(8, 8, 64, 48).spans == {"q": (0, 512), "k": (512, 1024), "v": (1024, 1408)}


def test_any_role_order():
    layout = QKVLayout(**ASYM, order=("k", "v", "q"))
    assert layout.spans == {"q": (10, 16), "k": (0, 6), "v": (6, 10)}
    assert layout.head_offsets() == (10, 13, 0, 3, 6, 8)


def test_gqa_spans():
    layout = QKVLayout(32, 8, 128)
    assert layout.group_size == 4
    assert layout.spans == {"q": (0, 4096), "k": (4096, 5120), "v": (5120, 6144)}


def test_kv_group_interleave():
    layout = QKVLayout(4, 2, 3, 2, interleave="kv_group")
    # Each group: 2 query heads (6 rows), its K head (3), its V head (2) = 11 rows.
    assert layout.num_rows == 22
    assert layout.head_offsets() == (0, 3, 11, 14, 6, 17, 9, 20)
    assert layout.spans == {"q": ((0, 6), (11, 17)), "k": ((6, 9), (17, 20)), "v": ((9, 11), (20, 22))}
    assert not layout.is_contiguous
    assert sorted(layout.row_index.tolist()) == list(range(22))


def test_head_offsets_of_role_subsets():
    layout = QKVLayout(4, 2, 3, 2, interleave="kv_group")
    assert layout.head_offsets(("q",)) == (0, 3, 6, 9)
    # K and V rows in packing order with the Q rows removed: K0 V0 K1 V1.
    assert layout.head_offsets(("k", "v")) == (0, 5, 3, 8)
    assert layout.rows(("k", "v")) == (6, 7, 8, 9, 10, 17, 18, 19, 20, 21)


def test_immutable_and_hashable():
    layout = QKVLayout(**ASYM)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.num_q_heads = 4
    assert layout == QKVLayout(2, 2, 3, 2) and hash(layout) == hash(QKVLayout(2, 2, 3, 2))
    assert layout != QKVLayout(2, 2, 3, 2, order=("k", "q", "v"))
    assert QKVLayout(2, 2, 3).v_head_dim == 3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_split_byte_exact_round_trip(layout, dtype):
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(layout.role_rows(r), D_MODEL, generator=gen).to(dtype) for r in "qkv"]
    biases = [torch.randn(layout.role_rows(r), generator=gen).to(dtype) for r in "qkv"]
    parts[0][0, 0] = -0.0  # signed zero survives
    weight, bias = layout.fuse(*parts, *biases)
    assert weight.shape == (layout.num_rows, D_MODEL) and bias.shape == (layout.num_rows,)
    for (w, b), pw, pb in zip(layout.split(weight, bias), parts, biases):
        assert torch.equal(w.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           pw.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        assert torch.equal(b, pb)
    # And the other way: split then fuse gives the fused bytes back.
    flat = [t for pair in layout.split(weight, bias) for t in pair]
    again_w, again_b = layout.fuse(*flat[0::2], *flat[1::2])
    assert torch.equal(again_w, weight) and torch.equal(again_b, bias)
    (_, nb), _, _ = layout.split(weight)
    assert nb is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_spans_tile_the_packed_axis(layout):
    spans = sorted(s for per_role in layout.head_spans().values() for s in per_role)
    pos = 0
    for start, end in spans:
        assert start == pos
        pos = end
    assert pos == layout.num_rows


def test_fused_rows_hold_the_right_heads():
    # Coordinate-coded rows: row value = 100*role + 10*head + j, checked through the spans.
    layout = QKVLayout(4, 2, 3, 2, interleave="kv_group")
    parts = []
    for ri, r in enumerate("qkv"):
        w = layout.width(r)
        rows = [[100 * ri + 10 * h + j] for h in range(layout.num_heads(r)) for j in range(w)]
        parts.append(torch.tensor(rows, dtype=torch.float32))
    weight, _ = layout.fuse(*parts)
    for ri, r in enumerate("qkv"):
        for h, (a, b) in enumerate(layout.head_spans()[r]):
            assert weight[a:b, 0].tolist() == [100 * ri + 10 * h + j for j in range(b - a)]


class TestLayoutErrors:
    def test_kv_heads_not_dividing_q_heads(self):
        with pytest.raises(ValueError, match="num_kv_heads"):
            QKVLayout(6, 4, 8)

    def test_non_positive(self):
        for kw, name in [(dict(num_q_heads=0), "num_q_heads"), (dict(head_dim=0), "head_dim"),
                         (dict(v_head_dim=-1), "v_head_dim"), (dict(num_kv_heads=1.5), "num_kv_heads")]:
            args = dict(num_q_heads=2, num_kv_heads=1, head_dim=4)
            args.update(kw)
            with pytest.raises(ValueError, match=name):
                QKVLayout(**args)

    def test_bad_order(self):
        with pytest.raises(ValueError, match="order"):
            QKVLayout(2, 2, 4, order=("q", "q", "v"))
        with pytest.raises(ValueError, match="order"):
            QKVLayout(2, 2, 4, order=("q", "k"))
        with pytest.raises(ValueError, match="order"):
            QKVLayout(2, 2, 4, order=("k", "q", "v"), interleave="kv_group")

    def test_bad_interleave(self):
        with pytest.raises(ValueError, match="interleave"):
            QKVLayout(2, 2, 4, interleave="head")

    def test_weight_rows_disagree(self):
        layout = QKVLayout(**ASYM)
        with pytest.raises(ValueError, match="weight has 18 rows but the layout packs 16"):
            layout.split(torch.zeros(18, D_MODEL))
        with pytest.raises(ValueError, match="bias"):
            layout.split(torch.zeros(16, D_MODEL), torch.zeros(15))
        with pytest.raises(ValueError, match="weight"):
            layout.validate(torch.zeros(16))

    def test_fuse_part_shapes(self):
        layout = QKVLayout(**ASYM)
        q, k, v = torch.zeros(6, 6), torch.zeros(6, 6), torch.zeros(4, 6)
        with pytest.raises(ValueError, match="v_w"):
            layout.fuse(q, k, torch.zeros(6, 6))
        with pytest.raises(ValueError, match="k_w"):
            layout.fuse(q, torch.zeros(6, 5), v)
        with pytest.raises(ValueError, match="all of q_b, k_b, v_b"):
            layout.fuse(q, k, v, q_b=torch.zeros(6))


class TestManifest:
    def setup_method(self):
        gen = torch.Generator().manual_seed(3)
        self.layout = QKVLayout(**ASYM)
        self.q, self.k = torch.randn(6, 6, generator=gen), torch.randn(6, 6, generator=gen)
        self.v = torch.randn(4, 6, generator=gen)
        self.qb, self.kb, self.vb = (torch.randn(n, generator=gen) for n in (6, 6, 4))
        self.manifest = QKVManifest.from_separate(self.layout, self.q, self.k, self.v, self.qb, self.kb, self.vb)

    def test_correct_fused_weight_passes(self):
        weight, bias = self.layout.fuse(self.q, self.k, self.v, self.qb, self.kb, self.vb)
        self.layout.validate(weight, bias, manifest=self.manifest)
        assert self.layout.manifest(weight, bias) == self.manifest

    def test_swapped_q_k_spans_caught_by_manifest_not_shapes(self):
        # Q and K have equal widths: the swapped checkpoint has every shape right.
        weight, bias = self.layout.fuse(self.k, self.q, self.v, self.kb, self.qb, self.vb)
        good, _ = self.layout.fuse(self.q, self.k, self.v)
        assert weight.shape == good.shape
        self.layout.validate(weight, bias)  # shapes alone pass
        with pytest.raises(ValueError, match="fused role order mismatch: the q span of weight .* holds the manifest's k"):
            self.layout.validate(weight, bias, manifest=self.manifest)

    def test_reinterpreted_order_caught(self):
        weight, bias = self.layout.fuse(self.q, self.k, self.v, self.qb, self.kb, self.vb)
        other = QKVLayout(**ASYM, order=("k", "q", "v"))
        with pytest.raises(ValueError, match="layout mismatch"):
            other.validate(weight, bias, manifest=self.manifest)

    def test_modified_rows_and_bias_caught(self):
        weight, bias = self.layout.fuse(self.q, self.k, self.v, self.qb, self.kb, self.vb)
        tampered = weight.clone()
        tampered[13, 2] += 1.0
        with pytest.raises(ValueError, match="v span"):
            self.layout.validate(tampered, bias, manifest=self.manifest)
        with pytest.raises(ValueError, match="bias"):
            self.layout.validate(weight, None, manifest=self.manifest)
        bad_bias = bias.clone()
        bad_bias[0] = 9.0
        with pytest.raises(ValueError, match="q span of bias"):
            self.layout.validate(weight, bad_bias, manifest=self.manifest)


def test_public_names():
    for name in ("QKVLayout", "QKVManifest", "qkv_project", "q_project", "kv_project",
                 "from_multihead_attention", "from_hf_attention"):
        assert hasattr(headwise, name)
