"""Golden tests of the vectorized IGPO advantage against the slow float64 reference, plus edge cases and errors."""

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import igpo.core.token_passes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from reference_advantage import random_batch, reference_advantage  # noqa: E402

from igpo.core.advantage import (  # noqa: E402
    AdvantageConfig,
    CurriculumConfig,
    WarmupGate,
    compute_igpo_advantage,
    curriculum_weights,
    masks_from_token_rewards,
)

TOL = 1e-5


@pytest.fixture(autouse=True, params=["kernels", "tensor_ops"])
def token_passes(request, monkeypatch):
    """Every test runs on both implementations of the [B, L] passes: the numba kernels (CPU float32/float64) and the
    tensor ops (CUDA, half precision)."""
    if request.param == "tensor_ops":
        monkeypatch.setattr(igpo.core.token_passes, "_use_kernels", lambda *tensors: False)
    return request.param


def _compare(batch, cfg, **kw):
    rewards, F, I, m, group, pen = batch
    adv, ret, metrics = compute_igpo_advantage(rewards, F, I, m, group, cfg, penalty=pen, **kw)
    ref = reference_advantage(
        rewards, F, I, m, group, norm_mode=cfg.norm_mode, gamma=cfg.gamma, norm_adv_by_std=cfg.norm_adv_by_std,
        ig_weight=cfg.ig_weight, adaptive_gamma_min_weight=cfg.adaptive_gamma_min_weight, epsilon=cfg.epsilon,
        norm_order=cfg.norm_order, norm_group=cfg.norm_group, penalty=pen, **kw,
    )
    assert torch.isfinite(adv).all()
    assert torch.equal(adv, ret)
    diff = (adv.double() - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff} for {cfg}"
    assert ref.abs().max() > 0  # the comparison is not vacuous
    return adv, metrics


CASES = [
    (mode, gamma, order, grouping, std)
    for mode, gamma, order, grouping, std in itertools.product(
        ("joint", "separate", "scaled_separate", "raw_ig"), (1.0, 0.95, 0.8), ("before_discount", "after_discount"),
        ("group", "group_turn"), (True, False)
    )
    if not (mode == "joint" and grouping == "group_turn")
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_golden_all_modes(case):
    mode, gamma, order, grouping, std = CASES[case]
    batch = random_batch(4, 4, 96, 9, seed=100 + case, penalty_frac=0.1,
                         padding_rows=1)
    cfg = AdvantageConfig(norm_mode=mode, gamma=gamma, norm_order=order, norm_group=grouping, norm_adv_by_std=std)
    _compare(batch, cfg)


@pytest.mark.parametrize("mode", ["joint", "separate", "scaled_separate", "raw_ig"])
@pytest.mark.parametrize(
    "kind",
    ["group_size_1", "all_equal_outcomes", "empty_ig", "continuous", "weights", "adaptive_gamma", "single_turn"],
)
def test_golden_edge_cases(mode, kind):
    kw, cfg_kw = {}, {}
    if kind == "group_size_1":
        batch = random_batch(6, 1, 64, 6, seed=1)
    elif kind == "all_equal_outcomes":
        batch = random_batch(4, 4, 64, 6, seed=2, outcome="equal")
    elif kind == "empty_ig":
        batch = random_batch(4, 3, 64, 6, seed=3, empty_ig=True, outcome="continuous")
    elif kind == "continuous":
        batch = random_batch(3, 5, 128, 12, seed=4, outcome="continuous", ig_zero_frac=0.3)
    elif kind == "weights":
        batch = random_batch(3, 4, 96, 8, seed=5)
        kw = dict(outcome_weight=0.7, ig_weight_schedule=0.6)
        cfg_kw = dict(ig_weight=1.7)
    elif kind == "adaptive_gamma":
        batch = random_batch(3, 4, 96, 8, seed=6)
        cfg_kw = dict(adaptive_gamma_min_weight=0.3)
    else:
        batch = random_batch(3, 4, 32, 1, seed=7)
    _compare(batch, AdvantageConfig(norm_mode=mode, **cfg_kw), **kw)


def test_group_size_one_gives_zero_without_ig():
    rewards, F, I, m, group, _ = random_batch(5, 1, 40, 4, seed=8, empty_ig=True)
    adv, _, _ = compute_igpo_advantage(rewards, F, I, m, group, AdvantageConfig(norm_mode="separate"))
    assert torch.count_nonzero(adv) == 0


def test_all_equal_outcomes_still_learn_from_ig():
    rewards, F, I, m, group, _ = random_batch(4, 4, 64, 6, seed=9, outcome="equal", ig_none_frac=0.0, ig_zero_frac=0.0)
    adv, _, metrics = compute_igpo_advantage(rewards, F, I, m, group, AdvantageConfig())
    assert metrics["igpo/all_same_outcome_ratio"] == 1.0
    assert adv[F].abs().max() < 1e-3  # outcome carries no signal ...
    assert adv.abs().max() > 0.1  # ... but IG does


def test_zero_ig_is_still_a_boundary():
    """A zero IG splits the segments (explicit mask), unlike a missing IG."""
    L = 10
    m = torch.ones(2, L, dtype=torch.bool)
    F = torch.zeros(2, L, dtype=torch.bool)
    F[:, -1] = True
    rewards = torch.zeros(2, L)
    rewards[:, -1] = torch.tensor([1.0, 0.0])
    I = torch.zeros_like(F)
    I[:, 4] = True
    cfg = AdvantageConfig(norm_mode="separate", gamma=0.5)
    with_zero, _, _ = compute_igpo_advantage(rewards, F, I, m, torch.tensor([0, 0]), cfg)
    without, _, _ = compute_igpo_advantage(rewards, F, torch.zeros_like(I), m, torch.tensor([0, 0]), cfg)
    # Row 0: outcome z = +1; first segment gets 0 + 0.5 * 1 with the zero-IG boundary, 1 without.
    assert with_zero[0, 0].item() == pytest.approx(0.5, abs=1e-5)
    assert without[0, 0].item() == pytest.approx(1.0, abs=1e-5)


def test_hand_computed_scaled_separate():
    """Two rollouts, one IG each: z(F) = ±1, z(I) = ±1, scale = 1; turn 0 gets z(I) + γ z(F)."""
    L = 6
    m = torch.ones(2, L, dtype=torch.bool)
    rewards = torch.zeros(2, L)
    rewards[:, 2] = torch.tensor([0.4, -0.2])
    rewards[:, -1] = torch.tensor([0.0, 1.0])
    F, I = masks_from_token_rewards(rewards, m)
    adv, _, metrics = compute_igpo_advantage(rewards, F, I, m, torch.tensor([5, 5]), AdvantageConfig())
    z = 1 / (1 + 1e-6)
    assert adv[0, :3].tolist() == pytest.approx([z - 0.95 * z] * 3, abs=1e-5)
    assert adv[0, 3:].tolist() == pytest.approx([-z] * 3, abs=1e-5)
    assert adv[1, 0].item() == pytest.approx(-z + 0.95 * z, abs=1e-5)
    assert metrics["igpo/ig_scale"] == pytest.approx(1.0, abs=1e-4)


def test_masks_from_token_rewards():
    r = torch.tensor([[0.0, 0.3, 0.0, 1.0, 0.0], [0.2, 0.0, 0.0, 0.0, 0.0], [0.0] * 5])
    m = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0] * 5]).bool()
    F, I = masks_from_token_rewards(r, m)
    assert F.nonzero().tolist() == [[0, 3], [1, 2]]
    assert I.nonzero().tolist() == [[0, 1], [1, 0]]


def _edge_rewards(B: int, length: int, *, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse random token rewards and a response mask with the edge cases: row 0 without tokens, row 1 cut at half,
    a -0.0 reward (not a reward) in row 2, a NaN (a reward) on row 3's last token."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(B, length, generator=gen, dtype=dtype) * (torch.rand(B, length, generator=gen) < 0.3)
    m = torch.rand(B, length, generator=gen) < 0.7
    m[0] = False
    m[1, length // 2:] = False
    r[2, 0] = -0.0
    r[3, length - 1] = float("nan")
    return r, m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 63, 64, 200])
def test_masks_from_token_rewards_edge_values(dtype, length):
    """Both implementations against the definition: NaN counts as a reward (the finiteness check must see it), -0.0
    does not, rewards outside the response mask or after its last token are ignored, rows without tokens get none."""
    B = 6
    r, m = _edge_rewards(B, length, seed=length, dtype=dtype)
    last = (length - 1) - m.flip(1).to(torch.uint8).argmax(1)
    expected_f = torch.zeros_like(m)
    for i in range(B):
        if m[i].any():
            expected_f[i, last[i]] = True
    expected_i = m & ~expected_f & (r != 0)
    F, I = masks_from_token_rewards(r, m)
    assert torch.equal(F, expected_f) and torch.equal(I, expected_i)
    assert not I[2, 0]


def test_metrics_present_and_consistent():
    batch = random_batch(4, 4, 64, 6, seed=10)
    rewards, F, I, m, group, _ = batch
    adv, metrics = _compare(batch, AdvantageConfig())
    assert metrics["igpo/ig_total_positions"] == I.sum().item()
    assert metrics["igpo/f1_total_positions"] == F.sum().item()
    assert metrics["igpo/num_groups"] == 4
    valid = adv[m].double()
    assert metrics["igpo/adv_abs_mean"] == pytest.approx(valid.abs().mean().item(), abs=1e-5)
    assert metrics["igpo/adv_std"] == pytest.approx(valid.std(unbiased=False).item(), abs=1e-5)
    assert metrics["igpo/raw_ig_mean"] == pytest.approx(rewards[I].double().mean().item(), abs=1e-6)
    for key in ("igpo/ig_scale", "igpo/effective_gamma_mean", "igpo/num_turns_max", "igpo/adv_positive_ratio"):
        assert math.isfinite(metrics[key])


def _simple():
    r, F, I, m, group, _ = random_batch(2, 2, 16, 3, seed=11)
    return r, F, I, m, group


def test_errors():
    r, F, I, m, group = _simple()
    cfg = AdvantageConfig()
    with pytest.raises(ValueError, match="shape"):
        compute_igpo_advantage(r[:, :-1], F, I, m, group, cfg)
    with pytest.raises(ValueError, match="group"):
        compute_igpo_advantage(r, F, I, m, group[:-1], cfg)
    bad = r.clone()
    bad[F.nonzero()[0].tolist()] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        compute_igpo_advantage(bad, F, I, m, group, cfg)
    pen = torch.zeros_like(r)
    pen[0, 0] = float("inf")
    with pytest.raises(ValueError, match="penalty contains NaN"):
        compute_igpo_advantage(r, F, I, m, group, cfg, penalty=pen)
    # Entries that are not reward positions are never read, so they cannot leak into the advantages.
    off = r.clone()
    off[~(F | I)] = float("nan")
    assert torch.isfinite(compute_igpo_advantage(off, F, I, m, group, cfg)[0]).all()
    with pytest.raises(ValueError, match="overlap"):
        compute_igpo_advantage(r, F, F, m, group, cfg)
    with pytest.raises(ValueError, match="outside response_mask"):
        compute_igpo_advantage(r, F, I, torch.zeros_like(m), group, cfg)
    with pytest.raises(ValueError, match="bool"):
        compute_igpo_advantage(r, F.float(), I, m, group, cfg)
    with pytest.raises(RuntimeError, match="non-finite"):
        huge = r.clone()
        huge[F] = torch.tensor([3e38, -3e38, 3e38, -3e38])[: int(F.sum())]
        compute_igpo_advantage(huge, F, I, m, group, AdvantageConfig(norm_mode="joint", norm_adv_by_std=False),
                               outcome_weight=1e300)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(norm_mode="grpo"), "norm_mode='grpo'"),
        (dict(norm_order="later"), "norm_order"),
        (dict(norm_group="turn"), "norm_group"),
        (dict(norm_mode="joint", norm_group="group_turn"), "group_turn"),
        (dict(gamma=1.5), "gamma"),
        (dict(adaptive_gamma_min_weight=1.0), "adaptive_gamma_min_weight"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(ig_weight=float("nan")), "ig_weight"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        AdvantageConfig(**kw)


def test_warmup_gate_latch_and_state():
    gate = WarmupGate(threshold=0.5, ema_alpha=0.5)
    assert gate.update(0.2) is False  # ema 0.2
    assert gate.update(1.0) is True  # ema 0.6 -> graduates
    assert gate.update(0.0) is True  # one-way latch although ema falls to 0.3
    state = gate.state_dict()
    restored = WarmupGate(threshold=0.5, ema_alpha=0.5)
    restored.load_state_dict(state)
    assert restored.active and restored.ema == pytest.approx(0.3)
    fresh = WarmupGate(threshold=0.5, ema_alpha=0.5)
    fresh.load_state_dict({"ema": 0.1, "graduated": False})
    assert fresh.update(0.1) is False
    assert WarmupGate(threshold=0.0).active
    with pytest.raises(ValueError, match="not finite"):
        gate.update(float("nan"))


def test_curriculum_weights():
    cfg = CurriculumConfig(enabled=True)
    assert curriculum_weights(0, 10, cfg) == (0.5, 1.0)
    assert curriculum_weights(5, 10, cfg) == pytest.approx((0.75, 0.75))
    assert curriculum_weights(50, 10, cfg) == (1.0, 0.5)
    assert curriculum_weights(3, 10, CurriculumConfig()) == (1.0, 1.0)
    with pytest.raises(ValueError, match="total_steps"):
        curriculum_weights(1, 0, cfg)


def test_response_mask_with_holes_matches_reference():
    """Masked-out tokens inside segments (e.g. tool tokens in an assistant-only mask) get 0, like the reference."""
    rewards, F, I, m, group, _ = random_batch(3, 4, 80, 6, seed=12)
    holes = torch.rand(m.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    m = m & (~holes | F | I)
    _compare((rewards, F, I, m, group, None), AdvantageConfig(gamma=0.8))


def _tool_spans_masked(m, F, I, pen, seed, span=(20, 160), count=8):
    """Mask out runs of tokens (tool responses in an assistant-only mask), never a reward position."""
    gen = torch.Generator().manual_seed(seed)
    m = m.clone()
    keep = F | I | (pen != 0 if pen is not None else torch.zeros_like(F))
    B, L = m.shape
    for i in range(B):
        for _ in range(count):
            a = int(torch.randint(0, L, (1,), generator=gen))
            m[i, a:a + int(torch.randint(span[0], span[1], (1,), generator=gen))] = False
    return m | keep  # reward positions stay valid response tokens


@pytest.mark.parametrize("L", [1, 7, 33, 96, 257, 2048])
@pytest.mark.parametrize("layout", ["plain", "tool_spans", "offset_view", "float64"])
def test_token_layouts_match_reference(L, layout):
    """Every token-grid path: block widths 1..32 (L odd, 33, 96, 2048), long segments with whole blocks outside the
    mask (tool spans), inputs that are views at a storage offset, and float64 rewards/penalties."""
    rewards, F, I, m, group, pen = random_batch(3, 4, L, min(L, 25), seed=L, penalty_frac=0.2, padding_rows=1)
    # -0.0 is not a penalty position (it compares equal to 0), although its bits are not zero.
    pen = torch.where((pen == 0) & (torch.arange(L) % 3 == 0), torch.tensor(-0.0), pen)
    if layout == "tool_spans":
        m = _tool_spans_masked(m, F, I, pen, seed=L)
    elif layout == "offset_view":
        pad = lambda t: torch.cat([torch.zeros_like(t[:1]), t])[1:]  # noqa: E731
        rewards, F, I, m, pen = (pad(t) for t in (rewards, F, I, m, pen))
        assert rewards.storage_offset() == L
    elif layout == "float64":
        rewards, pen = rewards.double(), pen.double()
    adv, _ = _compare((rewards, F, I, m, group, pen), AdvantageConfig(gamma=0.9))
    assert adv.dtype == rewards.dtype
    assert torch.count_nonzero(adv[~m]) == 0


def test_token_metrics_count_masked_tokens_per_segment():
    """adv_* metrics weight each segment by its response tokens, also when whole blocks of it are masked out."""
    rewards, F, I, m, group, pen = random_batch(2, 4, 1024, 12, seed=21, penalty_frac=0.2)
    m = _tool_spans_masked(m, F, I, pen, seed=21)
    adv, metrics = _compare((rewards, F, I, m, group, pen), AdvantageConfig())
    valid = adv[m].double()
    assert metrics["igpo/adv_abs_mean"] == pytest.approx(valid.abs().mean().item(), abs=1e-5)
    assert metrics["igpo/adv_std"] == pytest.approx(valid.std(unbiased=False).item(), abs=1e-5)
    assert metrics["igpo/adv_positive_ratio"] == pytest.approx((valid > 0).double().mean().item(), abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    batch = random_batch(4, 4, 512, 20, seed=22, penalty_frac=0.2)
    rewards, F, I, m, group, pen = batch
    cfg = AdvantageConfig(norm_group="group_turn")
    cpu, _, cpu_metrics = compute_igpo_advantage(rewards, F, I, m, group, cfg, penalty=pen)
    gpu, _, gpu_metrics = compute_igpo_advantage(*(t.cuda() for t in batch[:5]), cfg, penalty=pen.cuda())
    assert gpu.device.type == "cuda"
    assert (gpu.cpu().double() - cpu.double()).abs().max() <= TOL
    assert gpu_metrics.keys() == cpu_metrics.keys()
    for key, value in cpu_metrics.items():
        assert gpu_metrics[key] == pytest.approx(value, abs=1e-6), key


def test_nan_penalty_inside_a_long_block_is_rejected():
    """A NaN penalty anywhere in a block (here mid-segment, away from other boundaries) is found and rejected."""
    rewards, F, I, m, group, pen = random_batch(2, 2, 256, 3, seed=23, penalty_frac=0.5)
    bad = torch.zeros_like(rewards)
    bad[1, 37] = float("nan")
    m[1, 37] = True
    with pytest.raises(ValueError, match="penalty contains NaN"):
        compute_igpo_advantage(rewards, F, I, m, group, AdvantageConfig(), penalty=bad)


@pytest.mark.parametrize("length", [101, 8, 7])
def test_lengths_that_are_not_whole_words(length):
    """L not a multiple of 8 (the kernels read 8 tokens per word and pad a copy), boundaries at the last tokens."""
    batch = random_batch(3, 3, length, 5, seed=24 + length, penalty_frac=0.3)
    _compare(batch, AdvantageConfig(norm_group="group_turn"))


def test_float64_and_half_precision_inputs():
    rewards, F, I, m, group, pen = random_batch(3, 3, 80, 6, seed=25, penalty_frac=0.3)
    ref, _, _ = compute_igpo_advantage(rewards, F, I, m, group, AdvantageConfig(), penalty=pen)
    wide, _, _ = compute_igpo_advantage(rewards.double(), F, I, m, group, AdvantageConfig(), penalty=pen.double())
    assert wide.dtype == torch.float64
    assert (wide - ref.double()).abs().max() < 1e-6
    half, _, _ = compute_igpo_advantage(rewards.bfloat16(), F, I, m, group, AdvantageConfig(), penalty=pen.bfloat16())
    assert half.dtype == torch.bfloat16
    exact = reference_advantage(rewards.bfloat16().float(), F, I, m, group, penalty=pen.bfloat16().float())
    assert (half.double() - exact).abs().max() < 2e-2  # bf16 output rounding


def test_more_boundaries_than_the_first_guess():
    """Every token a boundary: the kernels' output arrays grow past their initial capacity."""
    B, L = 2, 2048
    m = torch.ones(B, L, dtype=torch.bool)
    F = torch.zeros(B, L, dtype=torch.bool)
    F[:, -1] = True
    I = m & ~F
    rewards = torch.randn(B, L, generator=torch.Generator().manual_seed(26))
    _compare((rewards, F, I, m, torch.tensor([0, 0]), None), AdvantageConfig(gamma=0.8))


def test_cpu_float_inputs_take_the_kernels(token_passes, monkeypatch):
    """Both entry points reach the numba kernels on CPU float32 (a silent fall-back to tensor ops is ~3x slower)."""
    if token_passes != "kernels":
        pytest.skip("checks the kernel dispatch")
    calls = []
    for name in ("_find_kernel", "_spread_kernel"):
        kernel = getattr(igpo.core.token_passes, name)
        monkeypatch.setattr(igpo.core.token_passes, name,
                            lambda *args, _k=kernel, _n=name: calls.append(_n) or _k(*args))
    rewards, F, I, m, group, pen = random_batch(2, 2, 64, 4, seed=27, penalty_frac=0.3)
    compute_igpo_advantage(rewards, F, I, m, group, AdvantageConfig(), penalty=pen)
    assert calls == ["_find_kernel", "_spread_kernel"]


def test_masks_from_token_rewards_takes_the_kernel(token_passes, monkeypatch):
    """Stock verl's estimator call finds its masks in the numba kernel on CPU float32 (torch ops are ~5x slower)."""
    if token_passes != "kernels":
        pytest.skip("checks the kernel dispatch")
    calls = []
    kernel = igpo.core.token_passes._reward_masks_kernel
    monkeypatch.setattr(igpo.core.token_passes, "_reward_masks_kernel", lambda *args: calls.append(1) or kernel(*args))
    rewards, _, _, m, _, _ = random_batch(2, 2, 64, 4, seed=28)
    masks_from_token_rewards(rewards, m)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 13, 63, 64, 200])
def test_boundaries_from_token_rewards_match_the_masks(dtype, length):
    """The one-pass positions of stock verl's call equal find_boundaries on masks_from_token_rewards (holes in the
    mask, NaN, -0.0, rewards off the mask and after its last token, rows without tokens, L not a multiple of 8), and
    the rewards off the mask are counted with the first one's flat index."""
    from igpo.core.advantage import boundaries_from_token_rewards
    from igpo.core.token_passes import find_boundaries

    B = 7
    r, m = _edge_rewards(B, length, seed=100 + length, dtype=dtype)
    r[4] = 0.0
    r[4, length - 1] = 0.5
    m[4, length - 1] = False  # only off the mask
    F, I = masks_from_token_rewards(r, m)
    expected = find_boundaries(r, F, I, m, None)
    bounds, outside, first = boundaries_from_token_rewards(r, m)
    assert torch.equal(bounds.flat.cpu(), expected.flat.cpu()) and torch.equal(bounds.K.cpu(), expected.K.cpu())
    assert np.array_equal(bounds.r, expected.r, equal_nan=True)
    for name in ("is_f", "is_i", "in_mask"):
        assert np.array_equal(getattr(bounds, name), getattr(expected, name)), name
    assert bounds.pen is None
    off = ((r != 0) & ~m).view(-1)
    assert outside == int(off.sum()) > 0
    assert first == int(off.nonzero()[0])
    clean = torch.where(m, r, torch.zeros_like(r))
    assert boundaries_from_token_rewards(clean, m)[1:] == (0, -1)


def test_boundaries_from_token_rewards_past_the_first_guess():
    """Every token a reward: the one-pass kernel's output arrays grow past their initial capacity."""
    B, L = 2, 2048
    rewards = torch.randn(B, L, generator=torch.Generator().manual_seed(29))
    m = torch.ones(B, L, dtype=torch.bool)
    from igpo.core.advantage import boundaries_from_token_rewards

    bounds, outside, _ = boundaries_from_token_rewards(rewards, m)
    assert outside == 0 and bounds.K.tolist() == [L, L] and int(bounds.is_f.sum()) == B
    assert np.array_equal(bounds.r, rewards.double().view(-1).numpy())


def test_stock_estimator_takes_the_one_pass_kernel(token_passes, monkeypatch):
    """Stock verl's estimator call finds the reward positions in one kernel pass on CPU float32 and builds no masks
    (the masks and their search cost ~3x more), and writes the advantages in the spread kernel."""
    if token_passes != "kernels":
        pytest.skip("checks the kernel dispatch")
    from omegaconf import OmegaConf

    import igpo.integration.estimator

    calls = []
    for name in ("_token_reward_kernel", "_reward_masks_kernel", "_find_kernel", "_spread_kernel"):
        kernel = getattr(igpo.core.token_passes, name)
        monkeypatch.setattr(igpo.core.token_passes, name,
                            lambda *args, _k=kernel, _n=name: calls.append(_n) or _k(*args))
    rewards, _, _, m, group, _ = random_batch(2, 2, 64, 4, seed=30, ig_zero_frac=0.0)
    igpo.integration.estimator.igpo_advantage(rewards, m.long(), index=group.tolist(), config=OmegaConf.create({"igpo": {}}))
    assert calls == ["_token_reward_kernel", "_spread_kernel"]


def test_positions_built_for_another_layout_are_refused():
    from igpo.core.advantage import advantage_at_boundaries
    from igpo.core.token_passes import Boundaries

    m = torch.ones(2, 40, dtype=torch.bool)
    bounds = Boundaries.at(np.array([0, 1]), np.array([39, 39]), np.array([1.0, 0.0]), np.array([True, True]),
                           np.array([False, False]), None, m)
    for other in (torch.ones(2, 20, dtype=torch.bool), torch.ones(3, 40, dtype=torch.bool)):
        with pytest.raises(ValueError, match="another batch layout"):
            advantage_at_boundaries(bounds, other, torch.arange(other.shape[0]), AdvantageConfig())
    with pytest.raises(ValueError, match="integer array"):
        Boundaries.at(np.array([0.0]), np.array([3]), np.array([1.0]), np.array([True]), np.array([False]), None, m)


def test_two_outcomes_in_one_row_are_refused():
    from igpo.core.advantage import advantage_at_boundaries
    from igpo.core.token_passes import Boundaries

    m = torch.ones(2, 40, dtype=torch.bool)
    bounds = Boundaries.at(np.array([0, 0, 1]), np.array([10, 39, 39]), np.array([1.0, 0.0, 1.0]),
                           np.array([True, True, True]), np.array([False, False, False]), None, m)
    with pytest.raises(ValueError, match="more than one outcome position"):
        advantage_at_boundaries(bounds, m, torch.arange(2), AdvantageConfig())


@pytest.mark.parametrize("mode,order,group", [("joint", "before_discount", "group"),
                                              ("scaled_separate", "before_discount", "group_turn"),
                                              ("raw_ig", "before_discount", "group"),
                                              ("separate", "after_discount", "group")])
def test_no_penalty_and_no_weights_are_the_arithmetic_of_zeros_and_ones(mode, order, group):
    """Positions without penalties or pool weights (None) skip those arrays; the advantages are bit for bit those of
    an all-zero penalty and all-one weights, the sign of a zero included."""
    from igpo.core.advantage import advantage_at_boundaries
    from igpo.core.token_passes import Boundaries

    rewards, F, I, m, group_ids, _ = random_batch(4, 4, 96, 6, seed=3)
    rows, positions = torch.nonzero(F | I, as_tuple=True)
    rows, positions = rows.numpy(), positions.numpy()
    r = rewards[rows, positions].double().numpy()
    is_f, is_i = F[rows, positions].numpy(), I[rows, positions].numpy()
    cfg = AdvantageConfig(norm_mode=mode, norm_order=order, norm_group=group, gamma=0.9)
    bare = Boundaries.at(rows, positions, r, is_f, is_i, None, m)
    explicit = Boundaries.at(rows, positions, r, is_f, is_i, np.zeros(len(r)), m, weight=np.ones(len(r)))
    a, _, metrics_a = advantage_at_boundaries(bare, m, group_ids, cfg)
    b, _, metrics_b = advantage_at_boundaries(explicit, m, group_ids, cfg)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert metrics_a == metrics_b
    quiet, _, none = advantage_at_boundaries(bare, m, group_ids, cfg, with_metrics=False)
    assert torch.equal(quiet.view(torch.int32), a.view(torch.int32)) and none == {}
