"""FedAvg's aggregation and Local-only's isolation."""

from __future__ import annotations

import numpy as np
import pytest

from fedal.protocol import Message
from fedal.strategies import InvalidResult
from fedal.strategies.fedavg import weighted_average
from tests.helpers import in_process, toy_federation


def test_weighted_average_on_hand_built_inputs():
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(4, np.int64)}
    b = {"w": np.array([3.0, 6.0], np.float32), "n": np.array(9, np.int64)}
    out = weighted_average([a, b], [1, 3])
    np.testing.assert_allclose(out["w"], [2.5, 5.0])
    assert out["w"].dtype == np.float32
    assert out["n"].dtype == np.int64 and int(out["n"]) == 7  # floor(0.25*4 + 0.75*9)


def test_weights_whose_sum_overflows_keep_their_proportions():
    """Two clients claiming 1e308 samples each (finite, so valid): their sum is inf, and w / sum
    made every weight 0, a global model of zeros, with nothing said."""
    a = {"w": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32)}
    np.testing.assert_allclose(weighted_average([a, b], [1e308, 1e308])["w"], [2.0, 4.0])
    np.testing.assert_allclose(weighted_average([a, b], [1.7e308, 0.85e308])["w"], [5 / 3, 10 / 3], rtol=1e-6)


def test_one_round_is_the_data_weighted_mean_of_client_updates():
    server, clients, _ = toy_federation("fedavg", n_clients=3, tau=2)
    engine = in_process(server, clients)
    engine.run_round(0)
    # every client trained from the first client's initial weights, and the server holds their weighted mean
    per_client = [{k: v.detach().numpy() for k, v in c.model.state_dict().items()} for c in clients.values()]
    sizes = [len(c.y_train) for c in clients.values()]
    expected = weighted_average(per_client, sizes)
    for k in expected:
        np.testing.assert_allclose(server.global_weights[k], expected[k], rtol=1e-6)
    engine.run_round(1)
    assert server.metrics == {}  # round metrics were consumed by the engine


def test_init_phase_gives_every_client_the_same_start():
    server, clients, _ = toy_federation("fedavg", n_clients=3, tau=1)
    phase = server.begin_round(0)
    assert phase.phase == "init" and list(phase.tasks) == ["c0"]
    init = {"c0": clients["c0"].handle(phase.tasks["c0"])}
    train = server.collect(phase, init)
    assert train.phase == "train"
    ref = train.tasks["c0"].tensors
    for task in train.tasks.values():
        for k in ref:
            assert np.array_equal(task.tensors[k], ref[k])


def test_fedavg_rejects_mismatched_weights():
    server, clients, _ = toy_federation("fedavg", n_clients=2, tau=1)
    phase = server.begin_round(0)
    train = server.collect(phase, {"c0": clients["c0"].handle(phase.tasks["c0"])})
    good = clients["c1"].handle(train.tasks["c1"])
    bad = Message(dict(good.meta), {k: v for k, v in list(good.tensors.items())[:-1]})
    from fedal.strategies import InvalidResult

    with pytest.raises(InvalidResult, match="do not match"):
        server.validate(train, "c1", bad)
    no_count = Message({**good.meta, "num_samples": 0}, good.tensors)
    with pytest.raises(InvalidResult, match="num_samples"):
        server.validate(train, "c1", no_count)
    server.validate(train, "c1", good)


def test_local_only_exchanges_no_tensors_and_learns():
    server, clients, _ = toy_federation("local", n_clients=2, tau=20, lr=0.05)
    c = clients["c0"]
    before = c.evaluate(c.train_data.x, c.train_data.y)
    rec = in_process(server, clients).run_round(0)
    after = c.evaluate(c.train_data.x, c.train_data.y)
    assert after > before
    assert list(rec["phases"]) == ["local_train"] and rec["bytes_up"] < 500 and rec["bytes_down"] < 500


def test_server_refuses_results_from_unknown_clients_and_stale_rounds():
    server, clients, _ = toy_federation("fedal", n_clients=2, tau=1)
    from fedal.strategies import InvalidResult

    phase = server.begin_round(3)
    res = clients["c0"].handle(phase.tasks["c0"])
    with pytest.raises(InvalidResult, match="no task"):
        server.validate(phase, "intruder", res)
    stale = Message({**res.meta, "round": 2}, res.tensors)
    with pytest.raises(InvalidResult, match="round"):
        server.validate(phase, "c0", stale)


@pytest.mark.parametrize("strategy", ["fedavg", "fedhkd", "fedakd"])
def test_a_first_upload_in_a_dtype_no_model_has_is_refused(strategy):
    """The init upload defines the global model: one in float64 (or float16) would make every
    honest float32 upload after it a mismatch, so it is refused."""
    server, clients, _ = toy_federation(strategy, n_clients=2)
    phase = server.begin_round(0)
    (cid,) = phase.tasks
    genuine = clients[cid].handle(phase.tasks[cid])
    server.validate(phase, cid, genuine)
    for dtype in (np.float64, np.float16):
        widened = Message(genuine.meta, {k: v.astype(dtype) if v.dtype == np.float32 else v for k, v in genuine.tensors.items()})
        with pytest.raises(InvalidResult, match="float32 or int64"):
            server.validate(phase, cid, widened)
