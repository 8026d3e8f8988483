"""docs/protocol.md stays true by construction: its manifest, envelopes and per-strategy message
catalogues are compared with what the coordinator's and the agent's own code paths produce.

Each strategy runs a small deployment in memory: a real Run and real Agents, wired by
replacing only the two MQTT publish calls (the envelopes, chunking and manifests are the real
ones). Its strategy halves also run a toy federation in which one client misses phases, so the
optional tensors and keys (a client left out of an iteration) show up. The doc's fenced JSON
blocks that follow a `<!-- protocol-check: ... -->` comment must then describe exactly that, and
its hex dumps must be byte for byte what the encoder writes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.run import Run
from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from edge_agent.mqtt_link import status_payload
from fedal.data import ArrayDataset, content_hash
from fedal.models import build_model
from fedal.protocol import PROTOCOL_VERSION, Message, RunManifest, answering, decode, encode, split, topics
from fedal.protocol.envelope import SHORT_KEYS
from fedal.session.session import wire_result
from fedal.strategies import STRATEGIES, STRATEGY_NAMES, ServerContext, StrategyParams, get_strategy
from fedal.strategies.fedal import FedALServer
from fedal.strategies.public_rows import public_rows

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ROOT / "docs" / "protocol.md"
RUNTIME = ROOT / "docs" / "runtime.md"

K = 4  # classes of the toy deployments
B = 8  # public_batch_size (the public set has P = 20 rows)
P = 20
INPUT = (40,)
CLIENTS = ["pi-1", "pi-2", "pi-3"]
TRANSPORT_TASK = {"instance", "epoch", "seq"}
TRANSPORT_RESULT = {"epoch", "seq"}
COMMON = {"phase", "round", "iteration"}  # sent in tasks only: a result's are its task's (answering)


def models_for(strategy: str) -> list[str]:
    """Mixed architectures where the strategy allows them (FedDF: a group of two and one alone;
    FedProto: two of one feature width)."""
    spec = get_strategy(strategy)
    if spec.homogeneous_models:
        return ["mlp"] * 3
    return ["mlp", "cnn1d_wide" if spec.same_feature_dim else "cnn1d", "mlp"]


def toy_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, *INPUT)).astype(np.float32), rng.integers(0, K, n).astype(np.int64)


# -- the in-memory deployment -----------------------------------------------------------------

@dataclass
class Capture:
    """Every whole envelope that crossed the (in-memory) broker, decoded, in order."""

    strategy: str
    tasks: list[tuple[str, Message]] = field(default_factory=list)  # (client, task)
    results: list[tuple[str, Message]] = field(default_factory=list)  # with their task's phase, round, iteration
    wire: list[tuple[str, str, bytes]] = field(default_factory=list)  # ("task" | "result", client, whole envelope)
    manifests: list[dict] = field(default_factory=list)
    engine: Run | None = None
    agents: dict[str, Agent] = field(default_factory=dict)


def deploy(strategy: str, tmp: Path, rounds: int = 2, max_payload: int = 4096) -> Capture:
    """One run of `strategy`: a Run and three Agents joined by direct calls instead of a broker."""
    cap = Capture(strategy)
    spec = get_strategy(strategy)
    models = models_for(strategy)
    public_file = None
    if spec.uses_public_set:
        public_file = tmp / "public.npz"
        np.savez(public_file, x=toy_arrays(P, 99)[0])
    params = {"tau": 2, **({"public_batch_size": B} if spec.uses_public_set else {})}
    if strategy == "cfd":  # 8 bits (levels of 1/255, still u1): two steps move some, so its deltas carry new levels
        params["cfd_bits"] = 8
    cfg = CoordinatorConfig(
        run_id="doc", client_ids=CLIENTS, num_classes=K, public_file=public_file, state_dir=tmp / "state",
        run={"strategy": strategy, "rounds": rounds, "models": sorted(set(models)) if spec.homogeneous_models else None,
             "strategy_params": params},
        broker={"url": "mqtt://127.0.0.1:1", "max_payload": max_payload},
        phases={"start_timeout_s": 5},
    )
    engine = Run(cfg)
    engine.__dict__["global_test"] = None  # the dataset's common test set is not the toy data's shape
    cap.engine = engine
    for i, (cid, model) in enumerate(zip(CLIENTS, models)):
        ws = tmp / cid
        ws.mkdir()
        x, y = toy_arrays(24, i)
        np.savez(ws / "train.npz", x=x, y=y)
        extra = {}
        if i < 2:  # pi-3 has no test set: its evaluate result carries acc null
            np.savez(ws / "test.npz", x=toy_arrays(10, 50)[0], y=toy_arrays(10, 50)[1])
            extra["test_file"] = ws / "test.npz"
        if i == 0:
            np.savez(ws / "local.npz", x=toy_arrays(6, 60 + i)[0], y=toy_arrays(6, 60 + i)[1])
            extra["local_test_file"] = ws / "local.npz"
        agent = Agent(AgentConfig(client_id=cid, run_id="doc", model=model, seed=i, data_file=ws / "train.npz",
                                  public_file=public_file, workspace=ws, broker={"url": "mqtt://127.0.0.1:1",
                                                                                "max_payload": max_payload}, **extra))
        cap.agents[cid] = agent

        def publish_result(payload: bytes, cid=cid, agent=agent) -> int:
            cap.wire.append(("result", cid, payload))
            sent_ = decode(payload)
            key = (sent_.meta.get("epoch"), sent_.meta.get("seq"))
            task = next(t for c, t in reversed(cap.tasks) if c == cid and (t.meta["epoch"], t.meta["seq"]) == key)
            cap.results.append((cid, answering(sent_, task)))  # as the coordinator reads it
            sent = 0
            for part in split(payload, agent.config.broker.max_payload):
                engine.inbox.put((topics.result("doc", cid), part))
                sent += len(part)
            return sent

        agent.link.publish_result = publish_result

    def publish_task(cid: str, payload: bytes) -> int:
        cap.wire.append(("task", cid, payload))
        cap.tasks.append((cid, decode(payload)))
        agent = cap.agents[cid]
        sent = 0
        for part in split(payload, cfg.broker.max_payload):
            agent._dispatch(agent.link.task_topic, part)
            sent += len(part)
        return sent

    def publish_manifest(payload: bytes) -> None:
        manifest = json.loads(payload)
        cap.manifests.append(manifest)
        if manifest["state"] == "running":  # (a finished run would make every agent export ONNX)
            for agent in cap.agents.values():
                agent._dispatch(agent.link.manifest_topic, payload)

    def start(stop, warn_every_s=30) -> bool:
        engine.bus.connected.set()
        engine.inbox.put(("$connected", b""))
        for cid in CLIENTS:
            engine.inbox.put((topics.status("doc", cid), status_payload("online")))
        return True

    engine.bus.start, engine.bus.publish_task, engine.bus.publish_manifest = start, publish_task, publish_manifest
    engine.run()
    assert engine.state == "finished", engine.error
    for cid, agent in cap.agents.items():
        assert agent.counters["tasks"] > 0 and not agent.counters["rejected"] and not agent.counters["errors"], (
            cid, dict(agent.counters))
    assert not engine.counters.get("rejected") and not engine.counters.get("stale"), dict(engine.counters)
    return cap


def toy_left_out(strategy: str, rounds: int = 2) -> list[tuple[str, str, Message]]:
    """The strategy's halves over the wire encoding, with pi-2's results lost in the first two
    phases of round 0 and the second of round 1: what a client left out of a phase receives and
    sends next."""
    spec = get_strategy(strategy)
    params = StrategyParams(tau=2, public_batch_size=B).resolve(spec.preset)
    public_x = toy_arrays(P, 99)[0] if spec.uses_public_set else None
    clients = {}
    for i, (cid, model) in enumerate(zip(CLIENTS, models_for(strategy))):
        x, y = toy_arrays(24, i)
        clients[cid] = spec.client(cid, build_model(model, INPUT, K), ArrayDataset(x, y, K, cid), public_x, params, seed=i)
    server = spec.server(params, CLIENTS, ServerContext(num_classes=K, public_size=P, seed=0, public_x=public_x))
    seen, seq = [], 0
    for r in range(rounds):
        phase, position = server.begin_round(r), 0
        while phase is not None:
            results, seq = {}, seq + 1
            for cid, task in phase.tasks.items():
                task = decode(encode(task))
                result = answering(decode(encode(wire_result(clients[cid].handle(task), (0, seq)))), task)
                seen += [("task", cid, task), ("result", cid, result)]
                if cid == "pi-2" and (position < 2 if r == 0 else position == 1):
                    continue
                server.validate(phase, cid, result)
                results[cid] = result
            phase, position = server.collect(phase, results), position + 1
    return seen


# -- reading the doc ----------------------------------------------------------------------------

def doc_text() -> str:
    return PROTOCOL.read_text()


def checked_blocks(text: str) -> dict[str, str]:
    """The fenced JSON blocks right after a `<!-- protocol-check: NAME -->` comment, by NAME."""
    found = re.findall(r"<!-- protocol-check: ([^>]+?) -->\n```json\n(.*?)\n```", text, re.S)
    names = [n for n, _ in found]
    assert len(names) == len(set(names)), f"a protocol-check name is used twice: {names}"
    return dict(found)


def checked_table(text: str, name: str) -> list[list[str]]:
    """The rows (cells stripped) of the Markdown table right after `<!-- protocol-check: NAME -->`."""
    m = re.search(rf"<!-- protocol-check: {re.escape(name)} -->\n((?:\|.*\n)+)", text)
    assert m, f"no table marked {name!r} in {PROTOCOL}"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in m.group(1).splitlines()]
    return rows[2:]  # header and separator


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def marked_lists(text: str, name: str) -> list[list[str]]:
    return [ticked(body) for body in re.findall(rf"<!-- list:{name} -->(.*?)<!-- /list -->", text, re.S)]


# -- what the code produces ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    captured = {s: deploy(s, tmp_path_factory.mktemp(s)) for s in STRATEGY_NAMES}
    yield captured
    for cap in captured.values():  # their journals stay open otherwise, until some later test's garbage collection
        for agent in cap.agents.values():
            agent.journal.close()


@pytest.fixture(scope="module")
def left_out() -> dict[str, list[tuple[str, str, Message]]]:
    return {s: toy_left_out(s) for s in STRATEGY_NAMES}


def example_manifest(tmp: Path) -> tuple[str, str]:
    """The manifest a coordinator publishes for the doc's example configuration, and its instance."""
    x = ((np.arange(1000 * 40) % 256).astype(np.float32) / np.float32(255)).reshape(1000, 40)
    np.savez(tmp / "public.npz", x=x)
    cfg = CoordinatorConfig(run_id="demo", client_ids=["pi-1", "pi-2"], num_classes=10, public_file=tmp / "public.npz",
                            state_dir=tmp / "state", run={"strategy": "fedal", "rounds": 20},
                            api={"public_base_url": "http://192.168.1.10:8080"})
    engine = Run(cfg)
    engine._resume()  # what run() does first: it sets the instance
    return engine.manifest().to_json().decode(), engine.instance


def wire_dtype(arr: np.ndarray) -> str:
    """The dtype code a tensor travels under (numpy's, without the byte order)."""
    return arr.dtype.str[1:]


JSON_TYPES = {"int": {int}, "number": {int, float}, "number|null": {int, float, type(None)}, "string": {str},
              "bool": {bool}}


def model_state(strategy: str, cid: str) -> dict[str, np.ndarray]:
    model = build_model(models_for(strategy)[CLIENTS.index(cid)], INPUT, K)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def feature_width(strategy: str, cid: str) -> int:
    import torch

    model = build_model(models_for(strategy)[CLIENTS.index(cid)], INPUT, K)
    with torch.no_grad():
        return int(model.features(torch.zeros(1, *INPUT)).shape[1])


def dimension(text: str, symbols: dict[str, int]) -> int:
    """One dimension of a documented shape: a number, a symbol, or a symbol minus a number (`B-1`)."""
    name, _, minus = text.partition("-")
    base = symbols[name.strip()] if name.strip() in symbols else int(name)
    return base - int(minus) if minus else base


def check_message(strategy: str, cid: str, where: str, msg: Message, doc: dict, transport: set[str]) -> dict[str, set]:
    """Compare one message with its catalogue entry; returns which optional names it holds."""
    meta = {k: v for k, v in msg.meta.items() if k not in COMMON | transport}
    doc_meta = {k.rstrip("?"): v for k, v in doc["meta"].items()}
    assert set(meta) <= set(doc_meta), f"{where}: metadata {sorted(set(meta) - set(doc_meta))} not documented"
    for key in doc["meta"]:
        if not key.endswith("?"):
            assert key in meta, f"{where}: documented metadata {key!r} missing"
    for key, value in meta.items():
        assert type(value) in JSON_TYPES[doc_meta[key]], f"{where}: {key}={value!r} is not {doc_meta[key]}"
    state = model_state(strategy, cid)
    # D: CFD's distillation rows (cfd_public_rows unset: all P); C: its bitmap's bytes; m: the entries it marks
    symbols = {"B": B, "K": K, "P": P, "D": P, "C": (P * K + 7) // 8}
    if "cfd/changed" in msg.tensors:
        symbols["m"] = int(np.unpackbits(msg.tensors["cfd/changed"]).sum())
    doc_tensors = {k.rstrip("?"): v for k, v in doc["tensors"].items()}
    names: dict[str, list[str]] = {}
    for name in msg.tensors:
        if name in state:
            names.setdefault("<state_dict>", []).append(name)
        elif name.startswith("w/") and name[2:] in state:
            names.setdefault("w/<state_dict>", []).append(name)
        else:
            names.setdefault(name, []).append(name)
    assert set(names) <= set(doc_tensors), f"{where}: tensors {sorted(set(names) - set(doc_tensors))} not documented"
    for key in doc["tensors"]:
        if not key.endswith("?"):
            assert key in names, f"{where}: documented tensor {key!r} missing"
    for group, members in names.items():
        spec = doc_tensors[group]
        if spec == "native":
            prefix = "w/" if group.startswith("w/") else ""
            assert sorted(members) == sorted(prefix + k for k in state), f"{where}: {group} is not the whole model"
            for name in members:
                arr, ref = msg.tensors[name], state[name[len(prefix):]]
                assert (arr.dtype, arr.shape) == (ref.dtype, ref.shape), f"{where}: {name} is not native"
            continue
        dtype, shape = re.fullmatch(r"(\w+) \[(.*)\]", spec).groups()
        if "d" in shape:
            symbols["d"] = feature_width(strategy, cid)
        want = tuple(dimension(s.strip(), symbols) for s in shape.split(",") if s.strip())
        arr = msg.tensors[group]
        assert wire_dtype(arr) == dtype and arr.shape == want, (
            f"{where}: {group} is {wire_dtype(arr)} {list(arr.shape)}, the doc says {spec}")
    return {"meta": {k for k in meta}, "tensors": set(names)}


def round_pattern(pattern: str) -> re.Pattern:
    parts = []
    for token in pattern.split():
        name, op = re.fullmatch(r"([\w-]+)([?+]?)", token).groups()
        parts.append(f"(?:{name} ){op}")
    return re.compile("".join(parts))


def phase_is_train(strategy: str, phase: str) -> bool:
    """Which deadline the coordinator gives a phase: the strategy's declared kind (evaluate,
    the engine's own phase, is an exchange)."""
    return strategy in STRATEGIES and STRATEGIES[strategy].phases.get(phase) == "train"


# -- the checks ---------------------------------------------------------------------------------

def test_manifest_example_is_what_the_coordinator_publishes(tmp_path):
    published, instance = example_manifest(tmp_path)
    doc = checked_blocks(doc_text())["manifest-example"]
    documented_instance = json.loads(doc)["instance"]
    for value in (instance, documented_instance):
        assert re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]{8}", value), value
    # byte for byte, key order and separators included; only the random instance differs
    assert published.replace(instance, documented_instance) == doc


def test_manifest_field_table_lists_every_field_with_its_default():
    rows = checked_table(doc_text(), "manifest-fields")
    fields = RunManifest.model_fields
    assert [ticked(r[0])[0] for r in rows] == list(fields), "the table must list the fields in the wire order"
    for row in rows:
        name, required, absent = ticked(row[0])[0], row[2], row[3]
        assert required in ("yes", "no"), row
        assert (required == "yes") == fields[name].is_required(), f"{name}: required is {fields[name].is_required()}"
        if required == "no":
            assert json.loads(ticked(absent)[0]) == fields[name].default, f"{name}: default {fields[name].default!r}"
        else:
            assert absent == "", row


def test_strategy_lists_match_the_registry():
    text = doc_text()
    assert [sorted(lst) for lst in marked_lists(text, "strategies")] == [sorted(STRATEGY_NAMES)]
    public = sorted(s for s, spec in STRATEGIES.items() if spec.uses_public_set)
    lists = marked_lists(text, "public-set")
    assert len(lists) >= 2 and all(sorted(lst) == public for lst in lists), lists
    rows = checked_table(text, "strategies")
    assert sorted(ticked(r[0])[0] for r in rows) == sorted(STRATEGY_NAMES)
    for row in rows:
        spec = get_strategy(ticked(row[0])[0])
        assert row[1] == ("yes" if spec.uses_public_set else "no"), row
        assert row[2] == ("yes" if spec.homogeneous_models else "no"), row


def rounds_of(tasks: list[tuple[str, Message]]) -> dict[int, list[str]]:
    """Per round, its phases in the order they went out."""
    out: dict[int, list[str]] = {}
    last = None
    for _, task in tasks:
        step = (task.meta.get("epoch"), task.meta.get("seq"), task.meta["round"], task.phase, task.meta["iteration"])
        if step != last:
            out.setdefault(task.meta["round"], []).append(task.phase)
            last = step
    return out


def check_catalogue(strategy: str, doc: dict, captures: list[Capture], toy: list[tuple[str, str, Message]],
                    only: str | None = None) -> None:
    pattern = round_pattern(doc["round"])
    phases = doc["phases"]
    seen: dict[tuple[str, str], list[dict[str, set]]] = {}
    observed_phases = set()
    for cap in captures:
        def keep(m: Message) -> bool:  # a strategy's own phases, or only `evaluate`
            return m.phase == only if only else m.phase != "evaluate"

        tasks = [(c, m) for c, m in cap.tasks if keep(m)]
        results = [(c, m) for c, m in cap.results if keep(m)]
        for r, seq in rounds_of(tasks).items():
            assert pattern.fullmatch("".join(p + " " for p in seq)), f"{strategy} round {r}: {seq} is not {doc['round']!r}"
        by_step: dict[tuple, set[str]] = {}
        for cid, task in tasks:
            observed_phases.add(task.phase)
            by_step.setdefault((task.meta["epoch"], task.meta["seq"], task.phase), set()).add(cid)
        for (_, _, phase), receivers in by_step.items():
            want = {"all": set(CLIENTS), "first": {CLIENTS[0]}}[phases[phase]["to"]]
            assert receivers == want, f"{strategy} {phase}: tasks went to {sorted(receivers)}"
        for direction, msgs, transport in (("task", tasks, TRANSPORT_TASK), ("result", results, TRANSPORT_RESULT)):
            for cid, msg in msgs:
                assert msg.phase in phases, f"{strategy}: phase {msg.phase!r} is not documented"
                where = f"{strategy} {msg.phase} {direction} (deployment, {cid})"
                seen.setdefault((msg.phase, direction), []).append(
                    check_message(cap.strategy, cid, where, msg, phases[msg.phase][direction], transport))
    for direction, cid, msg in toy:
        where = f"{strategy} {msg.phase} {direction} (toy federation, {cid})"
        seen.setdefault((msg.phase, direction), []).append(
            check_message(strategy, cid, where, msg, phases[msg.phase][direction],
                          TRANSPORT_RESULT if direction == "result" else set()))
    assert observed_phases == set(phases), f"{strategy}: the code runs {sorted(observed_phases)}"
    for phase, entry in phases.items():
        assert entry["deadline"] == ("train" if phase_is_train(strategy, phase) else "ordinary"), (strategy, phase)
        for direction in ("task", "result"):
            holds = seen[(phase, direction)]
            for kind in ("meta", "tensors"):
                for name in entry[direction][kind]:
                    if name.endswith("?"):
                        present = [name[:-1] in h[kind] for h in holds]
                        assert any(present) and not all(present), (
                            f"{strategy} {phase} {direction}: {name!r} is documented as sometimes present, "
                            f"but it is {'always' if all(present) else 'never'} there")


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_phase_catalogue_matches_what_the_halves_send(strategy, runs, left_out):
    doc = json.loads(checked_blocks(doc_text())[f"phases {strategy}"])
    declared = getattr(get_strategy(strategy), "phases", None)
    if declared is not None:
        assert set(declared) == set(doc["phases"]), f"{strategy} declares the phases {sorted(declared)}"
    check_catalogue(strategy, doc, [runs[strategy]], left_out[strategy])


def test_evaluate_catalogue_matches_what_agents_answer(runs):
    doc = json.loads(checked_blocks(doc_text())["phases evaluate"])
    check_catalogue("evaluate", doc, list(runs.values()), [], only="evaluate")


def test_every_catalogue_is_checked():
    names = {n for n in checked_blocks(doc_text()) if n.startswith("phases ")}
    assert names == {f"phases {s}" for s in STRATEGY_NAMES} | {"phases evaluate"}


def test_protocol_keys_are_the_documented_ones(runs):
    """Tasks carry the protocol's keys under their wire names; results only (epoch, seq): the
    topic names run and client, the task the rest."""
    rows = checked_table(doc_text(), "protocol-keys")
    documented = {ticked(r[0])[0]: (ticked(r[1])[0], {w.strip() for w in r[2].split(",")}) for r in rows}
    assert {k: wire for k, (wire, _) in documented.items()} == SHORT_KEYS
    assert {k for k, (_, on) in documented.items() if "tasks" in on} == COMMON | TRANSPORT_TASK
    assert {k for k, (_, on) in documented.items() if "results" in on} == TRANSPORT_RESULT
    for cap in runs.values():
        tasks = {}
        for kind, cid, payload in cap.wire:
            version, meta, _ = msgpack.unpackb(payload, raw=False)
            assert version == PROTOCOL_VERSION == 2
            assert not set(meta) & {*SHORT_KEYS, "run", "client", "v"}, f"long or v1 keys on the wire: {sorted(meta)}"
            msg = decode(payload)
            if kind == "task":
                assert set(meta) >= {SHORT_KEYS[k] for k in COMMON | TRANSPORT_TASK}
                assert msg.meta["instance"] == cap.engine.instance
                tasks[(cid, msg.meta["epoch"], msg.meta["seq"])] = msg
            else:
                assert not set(msg.meta) & (COMMON | {"instance"}), f"a result resends {sorted(msg.meta)}"
                assert {SHORT_KEYS[k] for k in TRANSPORT_RESULT} <= set(meta)
                assert (cid, msg.meta["epoch"], msg.meta["seq"]) in tasks, "a result names a task its client got"


def wire_view(payload: bytes) -> list:
    """An envelope as the doc shows it: the MessagePack array, each tensor's bytes as "<bin N>"."""
    version, meta, tensors = msgpack.unpackb(payload, raw=False)
    return [version, meta, {k: [code, shape, f"<bin {len(data)}>"] for k, (code, shape, data) in tensors.items()}]


def prose_sizes(text: str, marker: str) -> tuple[int, int]:
    """The last "N bytes on the wire, D of them tensor data" before a marked block."""
    before = text[: text.index(f"<!-- protocol-check: {marker} -->")]
    total, data = re.findall(r"(\d+)\s+bytes\s+on\s+the\s+wire,\s+(\d+)\s+of\s+them\s+tensor\s+data", before)[-1]
    return int(total), int(data)


def hex_dump(text: str, name: str) -> bytes:
    """The bytes of the annotated hex dump after `<!-- protocol-check: NAME -->`: each line's leading
    hex pairs (an annotation follows two spaces or more)."""
    m = re.search(rf"<!-- protocol-check: {re.escape(name)} -->\n```text\n(.*?)\n```", text, re.S)
    assert m, f"no hex dump marked {name!r} in {PROTOCOL}"
    out = b""
    for line in m.group(1).splitlines():
        pairs = re.match(r"((?:[0-9a-f]{2} )*[0-9a-f]{2})(?: {2,}|$)", line)
        assert pairs, f"{name}: a line without bytes: {line!r}"
        out += bytes.fromhex(pairs.group(1))
    return out


def test_envelope_examples_are_what_the_code_encodes():
    """Section 5's envelopes, from a real FedAL server and client half (B = 4, K = 3, tau = 2)."""
    import torch

    text = doc_text()
    blocks = checked_blocks(text)
    instance = json.loads(blocks["manifest-example"])["instance"]
    params = StrategyParams(tau=2, public_batch_size=4).resolve(get_strategy("fedal").preset)
    public_x = toy_arrays(P, 99)[0]
    server = FedALServer(params, ["pi-1", "pi-2"], ServerContext(num_classes=3, public_size=P, seed=0))
    clients = {}
    for i, cid in enumerate(["pi-1", "pi-2"]):
        torch.manual_seed(i)
        x, y = toy_arrays(24, i)
        clients[cid] = get_strategy("fedal").client(cid, build_model("mlp", INPUT, 3), ArrayDataset(x, y % 3, 3, cid),
                                                    public_x, params, seed=i)

    def check(marker: str, payload: bytes) -> None:
        assert wire_view(payload) == json.loads(blocks[marker]), marker
        assert list(wire_view(payload)[1]) == list(json.loads(blocks[marker])[1]), f"{marker}: meta in writing order"
        assert prose_sizes(text, marker) == (len(payload), decode(payload).tensor_bytes()), marker

    phase = server.begin_round(0)
    results = {cid: clients[cid].handle(task) for cid, task in phase.tasks.items()}
    transfer = server.collect(phase, results)
    # what the coordinator publishes (RoundEngine.run_phase) for the second phase of a fresh run
    payload = encode(Message({**transfer.tasks["pi-1"].meta, "instance": instance, "epoch": 0, "seq": 2},
                             transfer.tasks["pi-1"].tensors))
    check("envelope transfer-task", payload)

    results = {cid: clients[cid].handle(decode(encode(task))) for cid, task in transfer.tasks.items()}
    check("envelope transfer-result", encode(wire_result(results["pi-1"], (0, 2))))  # what the agent sends

    last = server.collect(transfer, {cid: answering(r, transfer.tasks[cid]) for cid, r in results.items()})
    result = clients["pi-1"].handle(last.tasks["pi-1"])
    documented = json.loads(blocks["envelope last-transfer-result"])[1]
    diagnostics = {"loss_kd", "gnorm_kd", "gnorm_lf", "gnorm_adv"}
    assert set(result.meta) == COMMON | diagnostics and not result.tensors
    result.meta.update({k: documented[k] for k in diagnostics})  # the doc's round numbers; a float is 9 bytes whatever its value
    check("envelope last-transfer-result", encode(wire_result(result, (0, 3))))


def test_hex_dumps_are_what_the_code_encodes():
    """Section 5's byte-level examples: a local_train task as the coordinator publishes it for the
    manifest example's run, and a transfer result with the logits the doc shows."""
    text = doc_text()
    instance = json.loads(checked_blocks(text)["manifest-example"])["instance"]
    params = StrategyParams().resolve(get_strategy("fedal").preset)
    task = FedALServer(params, ["pi-1", "pi-2"], ServerContext(num_classes=10, public_size=1000, seed=0)).begin_round(0)
    sent = Message({**task.tasks["pi-1"].meta, "instance": instance, "epoch": 0, "seq": 1})
    dump = hex_dump(text, "hex local_train-task")
    assert dump == encode(sent) and decode(dump).meta == sent.meta

    logits = np.array([[1.5, -0.25, 0.0], [2.0, 0.5, -1.0]], dtype=np.float32)  # the doc's example values
    result = wire_result(Message({"phase": "transfer", "round": 0, "iteration": 0}, {"logits": logits}), (0, 2))
    dump = hex_dump(text, "hex transfer-result")
    assert dump == encode(result)
    assert np.array_equal(decode(dump).tensors["logits"], logits)


def test_public_rows_vectors_are_what_both_ends_compute():
    """Section 7's test vectors of the public rows, and the worked steps of the first one."""
    import hashlib

    text = doc_text()
    rows = checked_table(text, "public-rows")
    assert rows
    for row in rows:
        key, t, i, n, b = (int(c) for c in row[:5])
        assert [int(v) for v in re.findall(r"\d+", row[5])] == public_rows(key, t, i, n, b).tolist(), row
    steps = checked_table(text, "public-rows-steps")
    key, t, i, n = (int(v) for v in re.search(
        r"<!-- rows-steps: key (\d+), t (\d+), i (\d+), N (\d+) -->", text).groups())
    order = list(range(n))
    for k, step in enumerate(steps):
        hashed = f"fedal-rows/{key}/{t}/{i}/{k}"
        digest = hashlib.sha256(hashed.encode()).digest()[:8]
        draw = int.from_bytes(digest, "little")
        j = k + draw % (n - k)
        order[k], order[j] = order[j], order[k]
        assert step == [str(k), f"`{hashed}`", f"`{digest.hex(' ')}`", str(draw), str(j), str(order[k])], step
    assert [int(s[5]) for s in steps] == public_rows(key, t, i, n, len(steps)).tolist()


def test_runtime_data_file_recipe_makes_files_agents_and_coordinator_accept(tmp_path, monkeypatch):
    """docs/runtime.md's recipe, run as written, gives files the agent's and coordinator's loaders take."""
    from edge_agent.agent import load_npz_dataset
    from edge_agent.public_set import load_public_set

    text = RUNTIME.read_text()
    recipe = re.search(r"<!-- runtime-check: data-files -->\n```python\n(.*?)\n```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(recipe, "docs/runtime.md", "exec"), {})
    with np.load(tmp_path / "public.npz", allow_pickle=False) as z:  # as the coordinator reads its public_file
        public = np.ascontiguousarray(z["x"], dtype=np.float32)
    assert load_public_set(content_hash(public), tmp_path / "public.npz", None, tmp_path / "cache.npz").shape == public.shape
    test = load_npz_dataset(tmp_path / "test.npz", 10, "test")
    trains = [load_npz_dataset(f, 10, f.stem) for f in sorted(tmp_path.glob("train-*.npz"))]
    assert trains and all(d.input_shape == test.input_shape == public.shape[1:] for d in trains)
    build_model("mlp", trains[0].input_shape, 10)
    public_strategies = sorted(s for s, spec in STRATEGIES.items() if spec.uses_public_set)
    assert [sorted(lst) for lst in marked_lists(text, "public-set")] == [public_strategies]


def test_configuration_md_lists_every_strategy_parameter():
    """Every [strategy_params] key a results file holds has its row in docs/configuration.md's
    table (rows_seed and the FedProto keys were missing); `privacy` has its own section there."""
    from fedal.strategies import StrategyParams

    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Strategy parameters (`[strategy_params]`)", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", section, re.M))
    assert set(StrategyParams.model_fields) - {"privacy"} == documented


def test_configuration_md_presets_are_the_strategies_presets():
    """docs/configuration.md's Presets table lists every strategy with what its preset sets (seven
    strategies and FD's tau of 250 were missing)."""
    from fedal.strategies import STRATEGIES

    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Presets", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    header = next(line for line in section.splitlines() if line.startswith("| strategy"))
    columns = [c.strip() for c in header.strip("|").split("|")][1:-1]

    def value(cell: str):
        cell = cell.strip()
        return None if cell == "—" else {"true": True, "false": False}.get(cell, cell)

    documented = {}
    for cells in rows:
        name = cells[0].strip().strip("`")
        preset = {c: value(v) for c, v in zip(columns, cells[1:-1]) if value(v) is not None}
        own = cells[-1].strip()
        if own != "—":
            preset |= {k.strip(): value(v) for k, v in (item.split("=") for item in own.split(","))}
        documented[name] = preset
    assert list(documented) == list(STRATEGIES)
    for name, spec in STRATEGIES.items():
        want = {k: v if isinstance(v, bool) else float(v) for k, v in spec.preset.items()}
        got = {k: v if isinstance(v, bool) else float(v) for k, v in documented[name].items()}
        assert got == want, name
