"""Sparse optimizer kernels against torch.optim (dense) and a numpy reference of the formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from embedding_store.errors import ConfigError, InvalidArgumentError
from embedding_store.optimizers import SGD, Adagrad, Adam, optimizer_from_dict

R, DIM, STEPS = 40, 8, 5
ROWS = np.array([31, 3, 17, 0, 39, 8, 22], dtype=np.int64)  # a scattered subset of the table


def _setup(optimizer, seed: int = 0):
    rng = np.random.default_rng(seed)
    weights = rng.uniform(-0.5, 0.5, (R, DIM)).astype(np.float32)
    state = optimizer.initial_state(R, DIM)
    grads = [rng.standard_normal((len(ROWS), DIM)).astype(np.float32) for _ in range(STEPS)]
    return weights, state, grads


def _run_ours(optimizer, weight_bound=None):
    weights, state, grads = _setup(optimizer)
    before = weights.copy()
    for g in grads:
        optimizer.apply(weights, state, ROWS, g, weight_bound)
    untouched = np.setdiff1d(np.arange(R), ROWS)
    np.testing.assert_array_equal(weights[untouched], before[untouched])
    return weights, state, grads, before


def _run_torch(make_optimizer, before, grads):
    param = torch.nn.Parameter(torch.from_numpy(before[ROWS].copy()))
    opt = make_optimizer([param])
    for g in grads:
        opt.zero_grad()
        param.grad = torch.from_numpy(g.copy())
        opt.step()
    return param.detach().numpy()


def test_sgd_matches_torch() -> None:
    ours = SGD(lr=0.05, weight_decay=0.1)
    weights, _, grads, before = _run_ours(ours)
    expected = _run_torch(lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.1), before, grads)
    assert np.abs(weights[ROWS] - expected).max() <= 1e-6


def test_adagrad_matches_torch() -> None:
    ours = Adagrad(lr=0.05, initial_accumulator_value=0.1, eps=1e-6, weight_decay=0.05)
    weights, state, grads, before = _run_ours(ours)
    expected = _run_torch(
        lambda p: torch.optim.Adagrad(
            p, lr=0.05, lr_decay=0, weight_decay=0.05, initial_accumulator_value=0.1, eps=1e-6
        ),
        before,
        grads,
    )
    assert np.abs(weights[ROWS] - expected).max() <= 1e-6
    untouched = np.setdiff1d(np.arange(R), ROWS)
    assert np.all(state[untouched] == np.float32(0.1))


def test_adam_matches_torch() -> None:
    ours = Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    weights, state, grads, before = _run_ours(ours)
    expected = _run_torch(
        lambda p: torch.optim.Adam(
            p, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, amsgrad=False
        ),
        before,
        grads,
    )
    assert np.abs(weights[ROWS] - expected).max() <= 1e-6
    assert np.all(state[ROWS, 2 * DIM] == STEPS)  # per-row step count
    assert np.all(state[np.setdiff1d(np.arange(R), ROWS)] == 0)


def test_adam_bias_correction_is_per_row() -> None:
    """A row updated for the first time is corrected with t=1, whatever other rows did."""
    opt = Adam(lr=0.1)
    weights = np.zeros((2, 2), dtype=np.float32)
    state = opt.initial_state(2, 2)
    g = np.ones((1, 2), dtype=np.float32)
    for _ in range(3):
        opt.apply(weights, state, np.array([0]), g)
    opt.apply(weights, state, np.array([1]), g)
    # first Adam step moves by lr * m_hat / (sqrt(v_hat) + eps) = lr * 1 / (1 + eps)
    np.testing.assert_allclose(weights[1], [-0.1, -0.1], rtol=1e-6)
    assert state[0, 4] == 3 and state[1, 4] == 1


def _numpy_adagrad(weights, state, grads, lr, m, eps, wd, shared):
    w = weights.astype(np.float64)
    acc = state.astype(np.float64)
    for g in grads:
        for i, r in enumerate(ROWS):
            gi = g[i].astype(np.float64) + wd * w[r]
            if shared:
                acc[r, 0] = m * acc[r, 0] + np.mean(gi * gi)
                w[r] -= lr * gi / (math.sqrt(acc[r, 0]) + eps)
            else:
                acc[r] = m * acc[r] + gi * gi
                w[r] -= lr * gi / (np.sqrt(acc[r]) + eps)
    return w, acc


@pytest.mark.parametrize("shared", [False, True])
def test_adagrad_momentum_and_vectorwise_shared_match_formula(shared: bool) -> None:
    ours = Adagrad(
        lr=0.03,
        initial_accumulator_value=0.2,
        g_square_momentum=0.9,
        eps=1e-4,
        weight_decay=0.02,
        vectorwise_shared=shared,
    )
    assert ours.state_width(DIM) == (1 if shared else DIM)
    weights, state, grads = _setup(ours)
    expected_w, expected_acc = _numpy_adagrad(weights, state, grads, 0.03, 0.9, 1e-4, 0.02, shared)
    for g in grads:
        ours.apply(weights, state, ROWS, g)
    assert np.abs(weights - expected_w).max() <= 1e-6
    assert np.abs(state - expected_acc).max() <= 1e-6


@pytest.mark.parametrize(
    "optimizer", [SGD(lr=1.0), Adagrad(lr=1.0), Adam(lr=1.0)], ids=["sgd", "adagrad", "adam"]
)
def test_weight_bound_clamps(optimizer) -> None:
    weights = np.full((4, 3), 0.05, dtype=np.float32)
    state = optimizer.initial_state(4, 3)
    grads = np.array([[100.0, -100.0, 0.0], [-100.0, 100.0, 0.0]], dtype=np.float32)
    optimizer.apply(weights, state, np.array([1, 2]), grads, 0.1)
    assert np.abs(weights).max() <= np.float32(0.1)
    assert weights[1, 0] == np.float32(-0.1) and weights[1, 1] == np.float32(0.1)
    assert weights[2, 0] == np.float32(0.1) and weights[2, 1] == np.float32(-0.1)
    assert weights[1, 2] == np.float32(0.05)  # zero gradient, inside the bound
    assert np.all(weights[[0, 3]] == np.float32(0.05))


def test_rows_of_minus_one_are_skipped() -> None:
    opt = SGD(lr=1.0)
    weights = np.zeros((2, 2), dtype=np.float32)
    opt.apply(weights, opt.initial_state(2, 2), np.array([-1, 1]), np.ones((2, 2), np.float32))
    assert weights.tolist() == [[0, 0], [-1, -1]]


def test_state_widths_and_initial_state() -> None:
    assert SGD().state_width(16) == 0
    assert Adagrad().state_width(16) == 16
    assert Adagrad(vectorwise_shared=True).state_width(16) == 1
    assert Adam().state_width(16) == 33
    assert SGD().initial_state(3, 16).shape == (3, 0)
    init = Adagrad(initial_accumulator_value=0.5).initial_state(3, 4)
    assert init.dtype == np.float32 and init.shape == (3, 4) and np.all(init == 0.5)
    assert np.all(Adam().initial_state(2, 4) == 0)
    assert [o.name for o in (SGD(), Adagrad(), Adam())] == ["sgd", "adagrad", "adam"]


@pytest.mark.parametrize(
    "optimizer",
    [
        SGD(lr=0.5, weight_decay=0.1),
        Adagrad(g_square_momentum=0.5, vectorwise_shared=True, eps=1e-3),
        Adam(betas=(0.5, 0.75), eps=1e-5),
    ],
)
def test_dict_round_trip(optimizer) -> None:
    d = optimizer.to_dict()
    assert d["name"] == optimizer.name
    assert optimizer_from_dict(d) == optimizer
    legacy = {("type" if k == "name" else k): v for k, v in d.items()}
    assert optimizer_from_dict(legacy) == optimizer


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SGD(lr=-1), "sgd.lr"),
        (lambda: SGD(weight_decay=float("nan")), "sgd.weight_decay"),
        (lambda: Adagrad(g_square_momentum=0), "adagrad.g_square_momentum"),
        (lambda: Adagrad(g_square_momentum=1.5), "adagrad.g_square_momentum"),
        (lambda: Adagrad(initial_accumulator_value=-0.1), "adagrad.initial_accumulator_value"),
        (lambda: Adagrad(eps=-1), "adagrad.eps"),
        (lambda: Adagrad(vectorwise_shared="yes"), "adagrad.vectorwise_shared"),
        (lambda: Adam(betas=(1.0, 0.9)), r"adam.betas\[0\]"),
        (lambda: Adam(betas=(0.9, -0.1)), r"adam.betas\[1\]"),
        (lambda: Adam(betas=(0.9,)), "adam.betas"),
        (lambda: Adam(lr="fast"), "adam.lr"),
    ],
)
def test_invalid_parameters_name_the_field(make, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make()


def test_optimizer_from_dict_errors() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.name must be one of"):
        optimizer_from_dict({"name": "rmsprop"})
    with pytest.raises(ConfigError, match="unknown keys"):
        optimizer_from_dict({"name": "sgd", "momentum": 0.9})
    # "type" is an alias of "name": two different answers are a mistake, not a choice.
    with pytest.raises(
        ConfigError, match="optimizer has name 'sgd' and type 'adam': give one of them"
    ):
        optimizer_from_dict({"name": "sgd", "type": "adam", "lr": 0.1})
    assert optimizer_from_dict({"name": "sgd", "type": "sgd", "lr": 0.5}) == SGD(lr=0.5)


def test_apply_rejects_bad_arrays() -> None:
    opt = Adagrad()
    weights = np.zeros((4, 2), dtype=np.float32)
    state = opt.initial_state(4, 2)
    with pytest.raises(InvalidArgumentError, match="grads must be float32"):
        opt.apply(weights, state, np.array([0]), np.zeros((1, 2), dtype=np.float64))
    with pytest.raises(InvalidArgumentError, match=r"grads must have shape \[1, 2\]"):
        opt.apply(weights, state, np.array([0]), np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(InvalidArgumentError, match=r"state must be a float32 \[4, 2\]"):
        opt.apply(
            weights, np.zeros((4, 1), np.float32), np.array([0]), np.zeros((1, 2), np.float32)
        )
    with pytest.raises(InvalidArgumentError, match="rows must be < 4"):
        opt.apply(weights, state, np.array([4]), np.zeros((1, 2), dtype=np.float32))


@pytest.mark.parametrize(
    ("optimizer", "first_step"),
    [
        (SGD(lr=0.5), -0.5),
        (Adagrad(lr=0.5), -0.5 / (math.sqrt(0.01 + 1.0) + 1e-10)),
        (Adam(lr=0.5), -0.5 / (1.0 + 1e-8)),
    ],
    ids=["sgd", "adagrad", "adam"],
)
def test_rows_past_the_first_block_are_updated_like_the_first(optimizer, first_step) -> None:
    """The kernels walk the rows in blocks of 16 (loading the next block's rows while this one
    is computed): a batch of several blocks updates every listed row exactly once."""
    n = 53  # three whole blocks and a partial one
    rows = np.arange(n) * 37 % 70  # scattered, no repeats
    assert len(set(rows.tolist())) == n
    weights = np.zeros((70, 3), dtype=np.float32)
    state = optimizer.initial_state(70, 3)
    optimizer.apply(weights, state, rows, np.ones((n, 3), dtype=np.float32))
    # first Adam step: lr * m_hat / (sqrt(v_hat) + eps) with m_hat = v_hat = 1
    np.testing.assert_allclose(weights[rows], np.full((n, 3), first_step), rtol=1e-6)
    assert np.all(weights[rows] == weights[rows[0]])  # the same bits in every block
    assert np.all(state[rows] == state[rows[0]])
    untouched = np.setdiff1d(np.arange(70), rows)
    assert np.all(weights[untouched] == 0)
    np.testing.assert_array_equal(state[untouched], optimizer.initial_state(len(untouched), 3))


@pytest.mark.parametrize("betas", [(0.0, 0.0), (0.0, 0.9), (0.9, 0.0)])
def test_adam_with_a_zero_beta_matches_torch(betas: tuple[float, float]) -> None:
    """beta = 0 is allowed ([0, 1)): its bias correction 1 - 0**t is 1, as in torch, not a
    division by zero."""
    ours = Adam(lr=0.02, betas=betas, eps=1e-6)
    weights, _, grads, before = _run_ours(ours)
    expected = _run_torch(
        lambda p: torch.optim.Adam(p, lr=0.02, betas=betas, eps=1e-6), before, grads
    )
    assert np.isfinite(weights).all()
    assert np.abs(weights[ROWS] - expected).max() <= 1e-6


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SGD(lr=float("inf")), r"sgd\.lr must be in \[0, inf\), got inf"),
        (lambda: Adam(eps=float("inf")), r"adam\.eps must be in \[0, inf\), got inf"),
        (lambda: SGD(lr=True), r"sgd\.lr must be a number, got True"),
        (lambda: Adagrad(g_square_momentum=False), "adagrad.g_square_momentum must be a number"),
    ],
)
def test_infinite_and_boolean_parameters_are_refused(make, message: str) -> None:
    """Parameters are finite numbers: an infinite lr makes every row NaN, and a bool is no
    number (True would silently read as 1)."""
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize("optimizer", [Adagrad(), Adam()], ids=["adagrad", "adam"])
def test_apply_rejects_state_with_another_row_count(optimizer) -> None:
    """State holds one row per weights row: a shorter one would be indexed out of bounds."""
    weights = np.zeros((4, 2), dtype=np.float32)
    state = optimizer.initial_state(3, 2)
    width = optimizer.state_width(2)
    with pytest.raises(
        InvalidArgumentError,
        match=rf"state must be a float32 \[4, {width}\] array, got float32\[3, {width}\]",
    ):
        optimizer.apply(weights, state, np.array([0]), np.zeros((1, 2), np.float32))
    assert np.all(weights == 0)


def test_adam_check_state_refuses_negative_second_moments_and_steps() -> None:
    """Every column after the first moments (second moments and the step count) must be >= 0;
    the first moments may be negative."""
    opt = Adam()
    state = opt.initial_state(3, 2)  # columns: m0 m1 | v0 v1 | t
    state[:, :2] = -1.0
    opt.check_state(state, 2)
    state[2, 2] = -0.5  # the first second moment
    with pytest.raises(InvalidArgumentError, match=r"row 2 holds -0\.5"):
        opt.check_state(state, 2)
    state[2, 2] = 0.0
    state[1, 4] = -3.0  # the step count
    with pytest.raises(
        InvalidArgumentError, match=r"step counts must be >= 0, but row 1 holds -3\.0"
    ):
        opt.check_state(state, 2)


@pytest.mark.parametrize(
    "optimizer",
    [SGD(lr=1.0), Adagrad(lr=1.0), Adagrad(lr=1.0, vectorwise_shared=True), Adam(lr=1.0)],
    ids=["sgd", "adagrad", "adagrad-shared", "adam"],
)
def test_every_kernel_skips_rows_of_minus_one(optimizer) -> None:
    """-1 marks a row the shard does not hold: nothing is updated for it (not the last row,
    which -1 would index)."""
    weights = np.zeros((3, 2), dtype=np.float32)
    state = optimizer.initial_state(3, 2)
    optimizer.apply(weights, state, np.array([-1, 0, -1]), np.ones((3, 2), np.float32))
    assert np.all(weights[0] < 0)
    assert np.all(weights[1:] == 0)
    np.testing.assert_array_equal(state[1:], optimizer.initial_state(2, 2))


def test_apply_rejects_bad_weights_and_rows() -> None:
    opt = SGD()
    state = opt.initial_state(4, 2)
    grads = np.zeros((1, 2), np.float32)
    for weights in (np.zeros((4, 2), np.float64), np.zeros(8, np.float32), [[0.0, 0.0]]):
        with pytest.raises(InvalidArgumentError, match=r"weights must be a float32 \[R, dim\]"):
            opt.apply(weights, state, np.array([0]), grads)
    with pytest.raises(InvalidArgumentError, match=r"rows must be 1-D, got shape \[1, 1\]"):
        opt.apply(np.zeros((4, 2), np.float32), state, np.array([[0]]), grads)


def test_non_mapping_optimizer_and_string_betas_are_refused() -> None:
    with pytest.raises(ConfigError, match="optimizer must be a mapping, got list"):
        optimizer_from_dict(["sgd"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"adam\.betas must be a pair of numbers, got '09'"):
        Adam(betas="09")  # type: ignore[arg-type]


def test_adagrad_and_adam_by_hand_with_eps_outside_the_square_root() -> None:
    """Worked by hand with eps = 1 (so its placement shows): Adagrad accumulates first, then
    divides by sqrt(acc) + eps (not PERSIA's sqrt(acc_before + eps)); Adam divides by
    sqrt(v_hat) + eps with each row bias-corrected by its own step count."""
    one = np.array([0])
    weights, state = np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32)
    adagrad = Adagrad(lr=1.0, initial_accumulator_value=0.0, eps=1.0)
    adagrad.apply(weights, state, one, np.array([[3.0]], np.float32))
    assert (weights[0, 0], state[0, 0]) == (0.25, 9.0)  # 1 - 3 / (sqrt(9) + 1)
    adagrad.apply(weights, state, one, np.array([[4.0]], np.float32))
    assert (weights[0, 0], state[0, 0]) == (np.float32(0.25 - 4 / 6), 25.0)

    adam = Adam(lr=1.0, betas=(0.5, 0.75), eps=1.0)
    weights, state = np.ones((2, 1), np.float32), adam.initial_state(2, 1)
    two = np.array([[2.0]], np.float32)
    # t=1: m=1, v=1, m_hat=2, v_hat=4: w = 1 - 2 / (2 + 1)
    adam.apply(weights, state, one, two)
    assert weights[0, 0] == np.float32(1 / 3) and state[0].tolist() == [1.0, 1.0, 1.0]
    # t=2: m=1.5, v=1.75, m_hat=2, v_hat=4: w = 1/3 - 2 / (2 + 1) (from the float32 1/3
    # stored); row 1 (untouched so far) takes its first step in the same call,
    # bias-corrected with its own t=1
    adam.apply(weights, state, np.array([0, 1]), np.array([[2.0], [2.0]], np.float32))
    assert weights[:, 0].tolist() == [
        np.float32(float(np.float32(1 / 3)) - 2 / 3),
        np.float32(1 / 3),
    ]
    assert state.tolist() == [[1.5, 1.75, 2.0], [1.0, 1.0, 1.0]]
