"""Differential privacy holds against the party it is for, the coordinator: an agent's noise and
sampling cannot be drawn again from any seed the coordinator knows; a round the coordinator
replays costs its epsilon again with fresh noise (the same noise on other inputs would cancel out
in the difference of the two releases); a target_epsilon cannot be planned for fewer rounds
than the run has without a budget; one non-finite sample cannot turn a release into NaN."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from fedal.data.public import content_hash
from fedal.privacy.settings import PrivacyParams
from fedal.privacy.statistics import clipped_class_sums
from fedal.privacy.training import PrivateTraining, clipped_sum
from fedal.protocol import RunManifest
from fedal.session import ClientSession
from fedal.sim.config import ConfigError, load_config
from fedal.strategies import StrategyParams
from tests.helpers import toy_federation

pytest.importorskip("opacus")

PRIVACY = {"noise_multiplier": 0.7, "max_grad_norm": 1.0}


def joined_agent(tmp_path, seed: int, **options) -> Agent:
    """An agent that joined a private FedAL run on its own data file (its `_setup`, as on a Pi)."""
    rng = np.random.default_rng(0)
    data = tmp_path / "train.npz"
    np.savez(data, x=rng.normal(size=(64, 40)).astype(np.float32), y=rng.integers(0, 10, 64))
    public = tmp_path / "public.npz"
    np.savez(public, x=rng.normal(size=(50, 40)).astype(np.float32))
    ws = tmp_path / f"ws-{seed}-{len(options)}-{len(list(tmp_path.iterdir()))}"
    config = AgentConfig(client_id="c0", run_id="dp", model="mlp", data_file=data, public_file=public,
                         workspace=ws, seed=seed, **options)
    ws.mkdir()
    agent = Agent(config)
    params = StrategyParams(tau=2, privacy=PrivacyParams(**PRIVACY))
    manifest = RunManifest(run_id="dp", strategy="fedal", strategy_params=params.model_dump(mode="json"),
                           num_classes=10, clients=["c0", "c1"], rounds=2, public_hash=content_hash(np.load(public)["x"]),
                           public_size=50, instance="i1")
    agent._setup(manifest)
    return agent


def test_an_agents_noise_cannot_be_drawn_again_from_its_seed(tmp_path):
    """The noise and the Poisson batches came from a generator seeded by the device's seed (0 by
    default; a simulation's client seed): a coordinator that knows it took the noise away."""
    first, second = joined_agent(tmp_path, seed=0), joined_agent(tmp_path, seed=0)
    assert first.client.private is not None and second.client.private is not None
    batches = [agent.client.private.batches(3) for agent in (first, second)]
    assert any(not torch.equal(a, b) for a, b in zip(*batches))  # two devices of one seed: other draws
    seeded = PrivateTraining(PrivacyParams(**PRIVACY), 64, 32, seed=(0 * 7919 + 0xD9))  # what the seed alone gives
    assert any(not torch.equal(a, b) for a, b in zip(seeded.batches(3), first.client.private.batches(3)))
    # the one machine of a test or demo may ask for the simulation's noise, and then gets it
    again = [joined_agent(tmp_path, seed=5, dp_seeded_noise=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*(agent.client.private.batches(3) for agent in again)))


def test_a_replayed_round_costs_epsilon_again_with_fresh_noise():
    """A coordinator that ran a round again (a step repeated, or a later epoch) took the client
    back to the round's start, privacy ledger and noise generator included: the replay drew the
    first run's noise again (on other inputs, the difference of two releases is noise-free) and
    epsilon did not grow, however often it was replayed."""
    from fedal.protocol import Message
    from tests.test_session_refused_replay import MemoryStore

    server, clients, _ = toy_federation("fedal", n_clients=2, tau=2, privacy=PRIVACY)
    client = clients["c0"]
    session = ClientSession("r", "c0", client, "inst", evaluate=lambda t: t, store=MemoryStore())
    seq = iter(range(1, 100))

    def send(task: Message, epoch: int) -> Message:
        return session.on_task(Message({**task.meta, "instance": "inst", "epoch": epoch, "seq": next(seq)},
                                       task.tensors)).received()

    task = server.begin_round(0).tasks["c0"]  # local training: private steps, then the logits uploaded
    first = send(task, 0)
    spent = client.private.epsilon()
    again = send(task, 1)  # the same step under a later epoch: a restarted coordinator's replay
    assert session.counters["round_replays"] == 1
    assert client.private.epsilon() > spent  # the replayed steps are counted again
    assert client.private.accountant.steps == 4
    assert any(not np.array_equal(first.tensors[k], again.tensors[k]) for k in first.tensors)  # fresh noise


def test_a_target_epsilon_planned_for_fewer_rounds_than_the_run_needs_a_budget():
    """planned_rounds 5 in a 20-round run calibrated the noise for 5 rounds: the clients ended at
    epsilon 6.65 for a target of 4, the docs saying "never above"."""
    with pytest.raises(ConfigError, match="planned_rounds 5 is fewer than the run's 20 rounds"):
        load_config(None, dict(strategy="fedal", rounds=20, privacy={"target_epsilon": 4.0, "planned_rounds": 5}))
    load_config(None, dict(strategy="fedal", rounds=20,
                           privacy={"target_epsilon": 4.0, "planned_rounds": 5, "epsilon_budget": 4.0}))
    load_config(None, dict(strategy="fedal", rounds=20, privacy={"target_epsilon": 4.0}))  # the run sets it


def test_a_non_finite_sample_adds_nothing_to_a_release():
    """clip / inf is 0 and inf * 0 is NaN: one such sample made its class's noisy sum NaN (and a
    DP-SGD step's gradient), whatever the noise."""
    values = torch.tensor([[1.0, 0.0], [float("inf"), 0.0], [float("nan"), 1.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0, 1, 1])
    release = clipped_class_sums(values, labels, 2, 1.0)
    assert torch.isfinite(release).all()
    assert torch.equal(release, torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 2.0]], dtype=torch.float64))
    grads = [torch.tensor([[3.0, 4.0], [float("inf"), 0.0]]), torch.tensor([[0.0], [1.0]])]
    summed = clipped_sum(grads, 1.0)
    assert all(torch.isfinite(s).all() for s in summed)
    assert torch.allclose(summed[0], torch.tensor([0.6, 0.8]), atol=1e-6) and summed[1].item() == 0.0


def test_a_huge_run_seed_builds_private_clients():
    """seed * 7919 overflowed the generator's 64 bits for client seeds above about 2.3e15: a run
    seed of 1e11 crashed building its clients."""
    _, clients, _ = toy_federation("fedal", tau=2, privacy=PRIVACY, seed=0)
    cls = type(clients["c0"])
    client = clients["c0"]
    big = cls("big", copy.deepcopy(client.model), client.train_data, client.public_x, client.params, seed=2**62 + 5)
    assert big.private is not None and len(big.private.batches(1)) == 1



def test_a_delta_not_below_one_over_n_is_warned_of(caplog):
    """A fixed delta of 1e-5 for a client of 200,000 samples: one of them may leak with
    probability delta, and no word said so."""
    PrivateTraining(PrivacyParams(**PRIVACY, delta=1e-5), 200_000, 32, seed=1)
    assert "is not below 1 / n for 200000 private samples" in caplog.text
    caplog.clear()
    PrivateTraining(PrivacyParams(**PRIVACY, delta=1e-5), 64, 32, seed=1)
    assert "1 / n" not in caplog.text


@pytest.mark.parametrize("restart_with", ["round", "journal", "phase"])
def test_a_restart_from_before_results_that_went_out_keeps_what_they_cost(tmp_path, one_torch_thread, restart_with):
    """durability = "round": a restart goes back to the round's start, whose results had gone out.
    The restored ledger did not count them, and the restored generator drew their noise again in
    the next round, on other inputs (the difference of two releases noise-free). Also when the
    restart runs under another durability (no journal to tell it the round was lost). The ledger,
    written before each result may leave, says what went out, whatever else the card holds."""
    import shutil

    from tests.helpers import in_process
    from tests.test_agent_journal import HOSTED, ThroughAgent, make_agent

    spent: list = []
    holder: dict = {}

    def on_applied(_payload, wire):
        agent = holder["agent"]
        if wire is not None and not spent and agent.session.round_no == 1:
            shutil.copytree(agent.workspace, tmp_path / "crashed")  # the card as a crash leaves it
            spent.append((agent.client.private.accountant.steps, agent.client.private.generator.get_state()))

    server, clients, _ = toy_federation("fedal", tau=2, privacy=PRIVACY)
    agent = holder["agent"] = make_agent(tmp_path / "ws", "round")
    agent.host(clients[HOSTED], "sim")
    engine = in_process(server, clients)
    engine.transport.sessions[HOSTED] = ThroughAgent(agent, on_applied)
    for r in range(2):
        engine.run_round(r)
    ((steps_out, generator_then),) = spent

    _, fresh, _ = toy_federation("fedal", tau=2, privacy=PRIVACY)
    restarted = make_agent(tmp_path / "crashed", restart_with)
    restarted.host(fresh[HOSTED], "sim")
    private = restarted.client.private
    assert private.accountant.steps == steps_out  # every step whose result went out, counted
    assert restarted.counters["ledger_restored"] == 1
    assert not torch.equal(private.generator.get_state(), generator_then)  # drawn afresh
