"""`slotkeeper engine` as a llama-server drop-in, for prompts that share a prefix: a new
conversation with another's system prompt starts from that slot's state (and leaves it there), a
caller can name or forbid the slots it may start from, and every answer says what it was compared
with and, on a miss, which part of the conversation changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..conftest import CHECKPOINT_ARGS, EngineProcess, run_engine

SYSTEM = "You are a careful coding agent. Read the files, run the tests, fix what fails. " * 6
PATH = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": PATH}}
]


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    slots = str(tmp_path_factory.mktemp("slots"))
    yield from run_engine(
        tmp_path_factory,
        models["qwen35"],
        "-np",
        "3",
        "-c",
        "3072",
        "--slot-save-path",
        slots,
        *CHECKPOINT_ARGS,
    )


@pytest.fixture
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60.0) as c:
        for slot in range(3):
            assert c.post(f"/slots/{slot}", params={"action": "erase"}).status_code == 200
        yield c


def chat(c: httpx.Client, user: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "tools": TOOLS,
        "max_tokens": 6,
        "temperature": 0,
        **extra,
    }
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_new_conversation_starts_from_another_slots_system_prompt(client: httpx.Client) -> None:
    first = chat(client, "Fix the failing test in parser.py.")
    assert first["slotkeeper"]["served"] == "cold" and first["timings"]["cache_n"] == 0
    second = chat(client, "Add a changelog entry for the release.")
    assert second["id_slot"] != first["id_slot"]  # the first conversation stays in its slot
    report = second["slotkeeper"]
    assert report["served"] == "prefix" and report["source_slot"] == first["id_slot"]
    n_prompt = second["usage"]["prompt_tokens"]
    assert second["timings"]["cache_n"] > 0.8 * n_prompt  # the system prompt and tools: not evaluated
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["timings"]["cache_n"]
    # Where the two conversations part: in the user message (index 1), not an earlier part.
    assert report["diverged"]["part"] == "message" and report["diverged"]["message"] == 1
    # The same prompt evaluated from scratch in the same slot gives the same answer.
    client.post(f"/slots/{second['id_slot']}", params={"action": "erase"})
    scratch = chat(
        client, "Add a changelog entry for the release.", id_slot=second["id_slot"], prefix_slots=[]
    )
    assert scratch["timings"]["cache_n"] == 0
    assert scratch["choices"][0]["message"] == second["choices"][0]["message"]


def test_the_caller_names_the_slots_a_prompt_may_start_from(client: httpx.Client) -> None:
    first = chat(client, "Fix the failing test in parser.py.", id_slot=0)
    none = chat(client, "Another task entirely.", id_slot=1, prefix_slots=[])
    assert none["timings"]["cache_n"] == 0 and "source_slot" not in none["slotkeeper"]
    named = chat(client, "A third task.", id_slot=2, prefix_slots=[first["id_slot"]])
    assert named["slotkeeper"]["source_slot"] == 0
    # A slot that another owner's request ran on is no source, whoever lists it, and is not
    # reused as the request's own either.
    chat(client, "Fix the failing test in parser.py.", id_slot=0, slot_owner="acme")
    beta = chat(client, "A beta task.", id_slot=1, prefix_slots=[0], slot_owner="beta")
    assert "source_slot" not in beta["slotkeeper"]
    client.post("/slots/2", params={"action": "erase"})
    acme = chat(client, "An acme task.", id_slot=2, prefix_slots=[0, 1], slot_owner="acme")
    assert acme["slotkeeper"]["source_slot"] == 0
    again = chat(client, "Fix the failing test in parser.py.", id_slot=0, slot_owner="beta", prefix_slots=[])
    assert again["timings"]["cache_n"] == 0  # acme's state in beta's slot: cleared first


def test_a_slot_is_labelled_with_the_session_its_last_request_ran_for(client: httpx.Client) -> None:
    def labels() -> dict[int, tuple[str, str] | None]:
        listed = client.get("/slots").json()
        return {s["id"]: (s["owner"], s["session"]) if "session" in s else None for s in listed}

    chat(client, "Fix the failing test in parser.py.", id_slot=0, slot_owner="acme", slot_session="s-1")
    chat(client, "Another task.", id_slot=1, slot_owner="acme", slot_session="s-2")
    assert labels()[0] == ("acme", "s-1") and labels()[1] == ("acme", "s-2")
    chat(client, "An unnamed request.", id_slot=1)  # its state is nobody's the gateway named
    assert labels()[1] is None
    client.post("/slots/0", params={"action": "erase"})  # nor is an erased slot's
    assert labels()[0] is None


def test_a_request_expecting_its_session_in_the_slot_is_refused_when_another_is_there(
    client: httpx.Client, engine: EngineProcess
) -> None:
    chat(client, "Fix the failing test in parser.py.", id_slot=0, slot_owner="acme", slot_session="s-1")
    chat(client, "Another task.", id_slot=1, slot_owner="beta", slot_session="s-1")
    # Its own label: served, from the slot's state.
    kept = chat(
        client,
        "Fix the failing test in parser.py.",
        id_slot=0,
        slot_owner="acme",
        slot_session="s-1",
        slot_expect="s-1",
    )
    assert kept["timings"]["cache_n"] > 0
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "id_slot": 1}
    for label, stream in ((("acme", "s-1"), False), (("acme", "s-1"), True), (("beta", "s-2"), False)):
        r = client.post(
            "/v1/chat/completions",
            json={
                **body,
                "slot_owner": label[0],
                "slot_session": label[1],
                "slot_expect": label[1],
                "stream": stream,
            },
        )
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "slot_changed"
    # Nothing ran: the slot still holds beta's s-1, its label unchanged.
    listed = {s["id"]: s for s in client.get("/slots").json()}
    assert (listed[1]["owner"], listed[1]["session"]) == ("beta", "s-1")
    # A save that names whose state it means: refused unless the label says so.
    for owner, session, status in (("acme", "s-1", 409), ("beta", "s-1", 200)):
        r = client.post(
            "/slots/1",
            params={"action": "save"},
            json={"filename": "fenced.slot", "slot_owner": owner, "slot_expect": session},
        )
        assert r.status_code == status, r.text
    assert r.json()["n_saved"] > 0
    # A restore that names whose state it loads labels the slot with it: a turn expecting that
    # session there goes on from it.
    r = client.post(
        "/slots/2",
        params={"action": "restore"},
        json={"filename": "fenced.slot", "slot_owner": "beta", "slot_session": "s-1"},
    )
    assert r.status_code == 200, r.text
    listed = {s["id"]: s for s in client.get("/slots").json()}
    assert (listed[2]["owner"], listed[2]["session"]) == ("beta", "s-1")
    resumed = chat(
        client, "Another task.", id_slot=2, slot_owner="beta", slot_session="s-1", slot_expect="s-1"
    )
    assert resumed["timings"]["cache_n"] > 0
    r = client.post("/slots/2", params={"action": "restore"}, json={"filename": "fenced.slot"})
    assert r.status_code == 200 and "session" not in client.get("/slots").json()[2]  # nobody's
    client.post("/slots/1", params={"action": "erase"})  # an erased slot holds nobody's
    r = client.post(
        "/v1/chat/completions",
        json={**body, "slot_owner": "beta", "slot_session": "s-1", "slot_expect": "s-1"},
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "slot_changed"


def test_a_miss_names_the_part_that_changed(client: httpx.Client) -> None:
    chat(client, "Fix the failing test in parser.py.", id_slot=0)
    edited = chat(
        client, "Fix the failing test in parser.py.", system=SYSTEM.replace("careful", "careless"), id_slot=0
    )
    assert edited["slotkeeper"]["diverged"]["part"] == "system"
    assert edited["timings"]["prompt_n"] > 0.8 * edited["usage"]["prompt_tokens"]


def test_a_continued_conversation_leaves_its_state_in_the_last_reply(client: httpx.Client) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
    first = client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0, "id_slot": 0}
    ).json()
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "Go on."}]
    nxt = client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0, "id_slot": 0}
    ).json()
    diverged = nxt["slotkeeper"].get("diverged")
    assert diverged is None or diverged["part"] == "reply"  # never a miss in an earlier part
    assert nxt["slotkeeper"]["prefix"]["slot"] == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prefix_slots": [3]}, "prefix_slots"),
        ({"prefix_slots": [0, 1, 2, 0]}, "prefix_slots"),
        ({"prefix_slots": "0"}, "prefix_slots"),
        ({"prefix_slots": [True]}, "prefix_slots"),
        ({"slotkeeper": {"served": "teleported"}}, "slotkeeper.served"),
        ({"slotkeeper": {"rules": ["x" * 65]}}, "slotkeeper.rules"),
        ({"slotkeeper": {"rules": [f"r{i}" for i in range(17)]}}, "slotkeeper.rules"),
        ({"slotkeeper": []}, "slotkeeper"),
        ({"slot_owner": "o" * 129}, "slot_owner"),
        ({"slot_owner": 7}, "slot_owner"),
        ({"slot_session": "s" * 129}, "slot_session"),
        ({"slot_expect": "s" * 129}, "slot_expect"),
        ({"slot_expect": "s-1", "id_slot": 0}, "slot_expect"),  # without its owner
        ({"slot_expect": "s-1", "slot_owner": "acme"}, "slot_expect"),  # without its slot
    ],
)
def test_bad_prefix_fields_are_refused_precisely(
    client: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_openai_client_reads_the_report(engine: EngineProcess, client: httpx.Client) -> None:
    oa = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    try:
        msgs: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "One."}]
        oa.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
        msgs = [msgs[0], {"role": "user", "content": "Two."}]
        done = oa.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
        assert done.model_extra is not None and done.model_extra["slotkeeper"]["served"] == "prefix"
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        assert done.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        oa.close()
