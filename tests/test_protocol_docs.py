"""docs/protocol.md stays true by construction: its manifest, envelopes and per-strategy message
catalogues are compared with what the coordinator's and the agent's own code paths produce.

Each strategy runs a small deployment in memory: a real Run and real Agents, wired by
replacing only the two MQTT publish calls (the envelopes, chunking and manifests are the real
ones). Its strategy halves also run a toy federation in which one client misses phases, so the
optional tensors and keys (a client left out of an iteration) show up. The doc's fenced JSON
blocks that follow a `<!-- protocol-check: ... -->` comment must then describe exactly that.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.run import Run
from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from edge_agent.mqtt_link import status_payload
from fedal.data import ArrayDataset, content_hash
from fedal.models import build_model
from fedal.protocol import Message, RunManifest, decode, encode, split, topics
from fedal.strategies import STRATEGIES, STRATEGY_NAMES, ServerContext, StrategyParams, get_strategy
from fedal.strategies.fedal import FedALServer

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ROOT / "docs" / "protocol.md"
RUNTIME = ROOT / "docs" / "runtime.md"

K = 4  # classes of the toy deployments
B = 8  # public_batch_size (the public set has P = 20 rows)
P = 20
INPUT = (40,)
CLIENTS = ["pi-1", "pi-2", "pi-3"]
TRANSPORT_TASK = {"run", "client", "instance", "epoch", "seq"}
TRANSPORT_RESULT = {"run", "client", "epoch", "seq"}
COMMON = {"phase", "round", "iteration"}


def models_for(strategy: str) -> list[str]:
    """Mixed architectures where the strategy allows them (FedDF: a group of two and one alone)."""
    return ["mlp"] * 3 if get_strategy(strategy).homogeneous_models else ["mlp", "cnn1d", "mlp"]


def toy_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, *INPUT)).astype(np.float32), rng.integers(0, K, n).astype(np.int64)


# -- the in-memory deployment -----------------------------------------------------------------

@dataclass
class Capture:
    """Every whole envelope that crossed the (in-memory) broker, decoded, in order."""

    strategy: str
    tasks: list[tuple[str, Message]] = field(default_factory=list)  # (client, task)
    results: list[tuple[str, Message]] = field(default_factory=list)
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
            cap.results.append((cid, decode(payload)))
            sent = 0
            for part in split(payload, agent.config.broker.max_payload):
                engine.inbox.put((topics.result("doc", cid), part))
                sent += len(part)
            return sent

        agent.link.publish_result = publish_result

    def publish_task(cid: str, payload: bytes) -> int:
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
    server = spec.server(params, CLIENTS, ServerContext(num_classes=K, public_size=P, seed=0))
    seen = []
    for r in range(rounds):
        phase, position = server.begin_round(r), 0
        while phase is not None:
            results = {}
            for cid, task in phase.tasks.items():
                task = decode(encode(task))
                result = decode(encode(clients[cid].handle(task)))
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
def runs(tmp_path_factory) -> dict[str, Capture]:
    return {s: deploy(s, tmp_path_factory.mktemp(s)) for s in STRATEGY_NAMES}


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


WIRE_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int32": "I32", "int64": "I64", "uint8": "U8",
               "int8": "I8", "int16": "I16", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}
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
    symbols = {"B": B, "K": K, "P": P}
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
        want = tuple(symbols[s.strip()] if s.strip() in symbols else int(s) for s in shape.split(",") if s.strip())
        arr = msg.tensors[group]
        assert WIRE_DTYPES[str(arr.dtype)] == dtype and arr.shape == want, (
            f"{where}: {group} is {WIRE_DTYPES[str(arr.dtype)]} {list(arr.shape)}, the doc says {spec}")
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
            check_message(strategy, cid, where, msg, phases[msg.phase][direction], set()))
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


def test_transport_keys_are_the_documented_ones(runs):
    rows = checked_table(doc_text(), "transport-keys")
    documented = {ticked(r[0])[0]: {w.strip() for w in r[1].split(",")} for r in rows}
    assert {k for k, on in documented.items() if "tasks" in on} == TRANSPORT_TASK
    assert {k for k, on in documented.items() if "results" in on} == TRANSPORT_RESULT
    for cap in runs.values():
        tasks = {}
        for cid, task in cap.tasks:
            assert (task.meta["run"], task.meta["client"], task.meta["instance"]) == ("doc", cid, cap.engine.instance)
            assert type(task.meta["epoch"]) is int and type(task.meta["seq"]) is int
            tasks[(cid, task.meta["epoch"], task.meta["seq"])] = task
        for cid, result in cap.results:
            assert (result.meta["run"], result.meta["client"]) == ("doc", cid) and "instance" not in result.meta
            task = tasks[(cid, result.meta["epoch"], result.meta["seq"])]
            assert all(result.meta[k] == task.meta[k] for k in COMMON), "a result echoes phase, round, iteration"


def test_envelope_examples_are_what_the_code_encodes():
    """The two headers of section 5, from a real FedAL server and client half (B = 4, K = 3)."""
    import torch

    text = doc_text()
    blocks = checked_blocks(text)
    params = StrategyParams(tau=2, public_batch_size=4).resolve(get_strategy("fedal").preset)
    public_x = toy_arrays(P, 99)[0]
    server = FedALServer(params, ["pi-1", "pi-2"], ServerContext(num_classes=3, public_size=P, seed=0))
    clients = {}
    for i, cid in enumerate(["pi-1", "pi-2"]):
        torch.manual_seed(i)
        x, y = toy_arrays(24, i)
        clients[cid] = get_strategy("fedal").client(cid, build_model("mlp", INPUT, 3), ArrayDataset(x, y % 3, 3, cid),
                                                    public_x, params, seed=i)
    phase = server.begin_round(0)
    results = {cid: clients[cid].handle(task) for cid, task in phase.tasks.items()}
    transfer = server.collect(phase, results)
    task = transfer.tasks["pi-1"]

    def header_and_sizes(payload: bytes) -> tuple[dict, int, int]:
        n = int.from_bytes(payload[:8], "little")
        return json.loads(payload[8 : 8 + n]), len(payload), n

    def prose_sizes(marker: str) -> tuple[int, int, int]:
        before = text[: text.index(f"<!-- protocol-check: {marker} -->")]
        total, n, data = re.findall(r"(\d+)\s+bytes: 8 \+ (\d+) \+\s+(\d+)\)", before)[-1]
        first8 = re.findall(r"First 8 bytes: `([0-9a-f ]+)` \(N = (\d+)", before)[-1]
        assert bytes.fromhex(first8[0]) == int(first8[1]).to_bytes(8, "little") and int(first8[1]) == int(n)
        return int(total), int(n), int(data)

    payload = encode(task)
    header, total, n = header_and_sizes(payload)
    assert header == json.loads(blocks["envelope transfer-task"])
    assert prose_sizes("envelope transfer-task") == (total, n, total - 8 - n)

    result = clients["pi-1"].handle(decode(payload))
    documented = json.loads(json.loads(blocks["envelope transfer-result"])["__metadata__"]["fedal"])
    diagnostics = {"loss_kd", "gnorm_kd", "gnorm_lf", "gnorm_adv"}
    assert set(result.meta) == COMMON | diagnostics  # what the half sends; the values are the doc's round numbers
    result.meta.update({k: documented[k] for k in diagnostics})
    result.meta.update(run="demo", client="pi-1", epoch=0, seq=2)  # the keys the agent adds (as in Agent._on_task)
    payload = encode(result)
    header, total, n = header_and_sizes(payload)
    assert header == json.loads(blocks["envelope transfer-result"])
    assert prose_sizes("envelope transfer-result") == (total, n, total - 8 - n)


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
