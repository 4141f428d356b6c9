"""Trust: signed calls, replay refusal, the channel's keyed headers, bounded sizes, loopback store."""

import datetime
import time

import pytest
import torch

from delta_sync.auth import ENV, AuthError, Signer, Verifier, channel_token, load_secret
from delta_sync.bucket import Bucket
from delta_sync.channel import Channel, _store, free_port
from delta_sync.errors import ChannelError
from launchers.ranks import run_ranks

KEY = b"k" * 32


def test_signed_call_verifies_and_names_what_was_refused():
    sign, check = Signer(KEY), Verifier(KEY)
    env = sign.sign("update", {"version": 3})
    assert check.check(env)[:2] == ("update", {"version": 3})
    kept = "nothing was written"
    with pytest.raises(AuthError, match="already used") as e:  # replay of a recorded call
        check.check(env)
    assert kept in str(e.value)
    forged = Signer(b"x" * 32).sign("init", {"host": "evil"})
    with pytest.raises(AuthError, match="does not match this engine's secret"):
        check.check(forged)
    tampered = dict(sign.sign("finish", {"version": 4}), payload={"version": 5})
    with pytest.raises(AuthError, match="does not match"):
        check.check(tampered)
    with pytest.raises(AuthError, match="unsigned"):
        check.check({"method": "report", "payload": {}})
    with pytest.raises(AuthError, match="malformed nonce"):
        env = sign.sign("start")
        bad = dict(env, nonce="nocounter")
        from delta_sync.auth import canonical, mac
        bad["mac"] = mac(KEY, b"start", b"nocounter", b"", canonical({}))
        check.check(bad)
    with pytest.raises(AuthError, match=f"started without {ENV}"):
        Verifier(None).check(sign.sign("start"))


def test_a_call_signed_for_one_engine_is_refused_by_another():
    """The MAC covers the engine's identity for this boot: a call captured on engine A (a sibling
    with the same secret, or A before it restarted) is refused by engine B, naming both; a forged
    identity breaks the MAC. Identities are proven to the client with the secret."""
    sign = Signer(KEY)
    a, b = Verifier(KEY, engine="1700000000000000001"), Verifier(KEY, engine="1700000000000000002")
    call = sign.sign("finish", {"version": 3}, engine=a.engine)
    with pytest.raises(AuthError, match="'finish' was signed for engine 1700000000000000001, this is engine "
                                        "1700000000000000002: a call captured on another engine"):
        b.check(dict(call))
    assert a.check(dict(call))[0] == "finish"
    with pytest.raises(AuthError, match="does not match"):  # relabelled for B: the MAC breaks
        b.check(dict(sign.sign("finish", {"version": 3}, engine=a.engine), engine=b.engine))
    with pytest.raises(AuthError, match="signed for engine \\(none\\)"):
        b.check(sign.sign("report"))
    assert sign.identity_proven("c1", b.engine, b.prove_identity("c1"))
    assert not sign.identity_proven("c2", b.engine, b.prove_identity("c1"))
    assert not sign.identity_proven("c1", a.engine, b.prove_identity("c1"))
    assert not Signer(b"x" * 32).identity_proven("c1", b.engine, b.prove_identity("c1"))


def test_counters_may_arrive_out_of_order_but_never_twice():
    sign, check = Signer(KEY), Verifier(KEY)
    envs = [sign.sign("report") for _ in range(5)]
    for env in (envs[1], envs[0], envs[4], envs[2], envs[3]):
        check.check(env)
    for env in envs:
        with pytest.raises(AuthError, match="already used"):
            check.check(env)
    old = sign.sign("report")
    for _ in range(300):  # a call held back past the window is refused as stale
        check.check(sign.sign("report"))
    with pytest.raises(AuthError, match="already used"):
        check.check(old)


def test_secret_loading(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert load_secret(required=False) is None
    with pytest.raises(AuthError, match=f"set {ENV}"):
        load_secret()
    with pytest.raises(AuthError, match="at least 16"):
        load_secret("short")
    monkeypatch.setenv(ENV, "s" * 20)
    assert load_secret() == b"s" * 20
    a, b = channel_token(KEY, "n1"), channel_token(KEY, "n2")
    assert a != b and a == channel_token(KEY, "n1") and KEY.decode() not in a


def test_store_listens_only_on_the_address_it_is_given():
    port = free_port()
    store = _store("127.0.0.1", port, True, datetime.timedelta(seconds=5))  # noqa: F841 (listening)
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # LISTEN
                listening.add(addr)
    assert listening == {"0100007F"}, listening  # 127.0.0.1 only, not 0.0.0.0 / ::


def _keyed_node(rank, world, port, chan_port, case):
    chan = Channel.connect("127.0.0.1", chan_port, rank, 2, "tok", timeout_s=30)
    if rank == 0:
        try:
            if case == "forged":
                chan._key = b"another key"  # a sender that does not hold the channel token
                chan.send_bucket(Bucket({"version": 1, "seq": 0, "last": True, "kind": "delta", "entries": [],
                                         "value_counts": {}, "checksum": None}, torch.zeros(3, dtype=torch.int32), {}))
            else:  # a bucket's opening broadcast with sizes that would make the receiver allocate without bound
                from delta_sync.channel import PREAMBLE_BYTES

                pre = torch.zeros(PREAMBLE_BYTES, dtype=torch.uint8)
                pre[:24] = torch.tensor([1 << 40, 5, 1], dtype=torch.int64).view(torch.uint8)
                chan.broadcast(pre)
        except ChannelError:
            pass  # the receiver refused and left
        return "sent"
    with pytest.raises(ChannelError) as e:
        chan.recv_bucket()
    return str(e.value)


@pytest.mark.parametrize("case", ["forged", "oversized"])
def test_receiver_refuses_forged_or_oversized_headers(case):
    results = run_ranks(_keyed_node, 2, free_port(), case, init_world=False, timeout=90)
    assert results[0] == "sent"
    assert ("MAC does not match" if case == "forged" else "out of bounds") in results[1]


def _post(guard, path, body=b"", header=None, query=b""):
    """POST ``path`` through an ASGI ``guard``: (status, the refusal's message or "")."""
    import asyncio
    import json

    from delta_sync.auth import ROUTE_HEADER

    scope = {"type": "http", "method": "POST", "path": path, "query_string": query,
             "headers": [(ROUTE_HEADER.lower().encode(), header.encode())] if header else []}
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    status = sent[0]["status"]
    return status, (json.loads(sent[1]["body"])["error"]["message"] if status != 200 else "")


def test_the_api_server_guard_signs_or_refuses_before_the_app_runs():
    """``DeltaSyncGuard`` in front of an app that records what reached it: a signed /pause with its
    query passes once (a replay, another query or another route is refused), unsigned control routes
    and vLLM's weight routes never reach the app, /collective_rpc passes the body on untouched for
    the plugin's methods and refuses any other worker method unless an operator allows it."""
    import asyncio
    import json

    from delta_sync.auth import Signer, Verifier
    from patches.vllm_http_guard import DeltaSyncGuard

    key = b"k" * 32
    reached = []

    async def app(scope, receive, send):
        body = (await receive()).get("body", b"")
        reached.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = DeltaSyncGuard(app, verifier=Verifier(key))

    def call(path, body=b"", header=None, query=b""):
        return _post(guard, path, body, header, query)

    signer = Signer(key)
    pause = signer.sign_route("/pause", "mode=wait")
    assert call("/pause", header=pause, query=b"mode=wait") == (200, "")
    status, msg = call("/pause", header=pause, query=b"mode=wait")
    assert status == 401 and "already used" in msg
    status, msg = call("/pause", header=signer.sign_route("/pause", "mode=wait"), query=b"mode=abort")
    assert status == 401 and "not this request" in msg
    status, msg = call("/resume", header=signer.sign_route("/pause"))
    assert status == 401 and "signature is for route:/pause" in msg
    for path in ("/pause", "/resume", "/sleep", "/wake_up", "/release_kv_cache_memory"):
        status, msg = call(path)
        assert status == 401 and "needs the trainer's signature" in msg, path
    for path in ("/update_weights", "/start_weight_update", "/update_weight_version", "/weight_checker"):
        assert call(path)[0] == 403, path
    # behind --root-path /x, Starlette routes /x/pause to /pause: guarded the same
    scope_root = {"type": "http", "method": "POST", "path": "/x/pause", "root_path": "/x", "query_string": b"",
                  "headers": []}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope_root, receive, send))
    assert sent[0]["status"] == 401
    for bad in (b'{"method": []}', b'[1, 2]', b'{"method": "delta_sync_call", "args": {"a": 1}}', b"not json"):
        assert call("/collective_rpc", bad)[0] in (400, 401, 403), bad
    envelope = json.dumps(signer.sign("report", {}))
    rpc = json.dumps({"method": "delta_sync_call", "args": [envelope]}).encode()
    assert call("/collective_rpc", rpc) == (200, "")
    assert reached[-1] == ("/collective_rpc", rpc)  # the app reads the body the guard read
    assert call("/collective_rpc", rpc)[0] == 401  # replayed
    status, msg = call("/collective_rpc", json.dumps({"method": "reload_weights"}).encode())
    assert status == 403 and "'reload_weights' is refused" in msg
    assert call("/collective_rpc", json.dumps({"method": "delta_sync_status"}).encode())[0] == 200
    assert [p for p, _ in reached] == ["/pause", "/collective_rpc", "/collective_rpc"]
    import os

    os.environ["DELTA_SYNC_RPC_ALLOW"] = "reload_weights"
    try:
        assert call("/collective_rpc", json.dumps({"method": "reload_weights"}).encode())[0] == 200
    finally:
        del os.environ["DELTA_SYNC_RPC_ALLOW"]


def _sockets_of_this_process() -> dict[str, tuple[str, str]]:
    """inode -> (local address as /proc/net/tcp writes it, state) of this process's TCP sockets."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = {}
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        cols = line.split()
        if cols[9] in inodes:
            out[cols[9]] = (cols[1].split(":")[0], cols[3])
    return out


def test_the_gloo_channel_listens_and_connects_only_on_the_address_it_is_given():
    """The store was bound to the given address; gloo's own listening sockets took the address this
    host's name resolves to (here 127.0.0.1), reachable from wherever that is. A channel given
    127.0.0.2 now listens only there (outgoing connections keep the source address the kernel picks)."""
    import threading

    before = set(_sockets_of_this_process())
    port, channels, errors = free_port(), {}, []

    def join(rank):
        try:
            channels[rank] = Channel.connect("127.0.0.2", port, rank, 2, "tok", backend="gloo", timeout_s=30)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(channels) == 2, errors
    x = torch.arange(4, dtype=torch.float32)
    got = torch.zeros(4)
    sender = threading.Thread(target=channels[0].broadcast, args=(x,))
    sender.start()
    channels[1].broadcast(got)
    sender.join(30)
    assert torch.equal(got, x)
    listening = {inode: addr for inode, (addr, state) in _sockets_of_this_process().items()
                 if inode not in before and state == "0A"}
    try:
        assert len(listening) >= 2, "the store and gloo's listeners were not seen"
        assert set(listening.values()) == {"0200007F"}, listening  # 127.0.0.2 only
    finally:
        for c in channels.values():
            c.close()


def test_a_signed_route_replayed_to_another_api_server_of_the_engine_is_refused():
    """With ``--api-server-count`` > 1 each API-server process has its own guard and nonce window;
    the workers are the engine's. A signed /pause accepted by one API server is refused by another
    (the workers saw its nonce), and a worker that refuses the signature refuses the route."""
    import json
    from types import SimpleNamespace

    from delta_sync.auth import Signer, Verifier
    from patches.vllm_http_guard import DeltaSyncGuard

    key = b"k" * 32
    workers = Verifier(key)  # the engine's workers: one nonce state for the engine
    rpcs = []

    class EngineClient:
        async def collective_rpc(self, method, args=()):
            rpcs.append(method)
            return [dict(zip(("method", "payload"), workers.check(json.loads(args[0]))))]

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    owner = SimpleNamespace(state=SimpleNamespace(engine_client=EngineClient()))
    servers = [DeltaSyncGuard(app, verifier=Verifier(key), owner=owner) for _ in range(2)]
    for guard in servers:
        guard._on = True

    def call(guard, header):
        return _post(guard, "/pause", header=header)

    pause = Signer(key).sign_route("/pause")
    assert call(servers[0], pause) == (200, "") and rpcs == ["delta_sync_call"]
    status, msg = call(servers[1], pause)  # its own window has not seen the nonce; the workers have
    assert status == 401 and "workers refused" in msg and "already used" in msg
    status, msg = call(servers[1], Signer(b"x" * 32).sign_route("/pause"))  # refused before the workers
    assert status == 401 and len(rpcs) == 2


@pytest.mark.parametrize("lease_report", [{"in_flight": 1, "idle_s": None}, {"in_flight": 0, "idle_s": 0.01}])
def test_the_pause_lease_is_the_engines_not_one_api_servers(lease_report, caplog):
    """An API server whose own lease ran out (the trainer's calls went through another API server of
    this engine) asks the workers, who saw every call: a call in flight, or one that ended within
    the lease, keeps the engine paused, quietly; once the workers' calls are older than the lease
    too, it resumes."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from patches.vllm_plugin import _lease_state, _watch

    calls: list = []
    llm = SimpleNamespace()

    async def is_paused():
        return True

    llm.is_paused = is_paused
    _lease_state(llm)["last"] = time.monotonic() - 60.0
    reports = iter([lease_report, lease_report, {"in_flight": 0, "idle_s": 5.0}])

    async def rpc(_llm, method):
        calls.append(method)
        return [{"version": 3, "partial": False, "lease": next(reports)}]

    async def resume(_llm):
        calls.append("resume")

    with caplog.at_level(logging.WARNING, logger="patches.vllm_plugin"):
        asyncio.run(asyncio.wait_for(_watch(llm, 0.05, resume, rpc), 10))
    assert calls == ["delta_sync_status"] * 3 + ["resume"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_trainer_loads_its_secret_once_and_a_missing_one_is_named(monkeypatch):
    """WeightSync reads the secret once and hands the loaded key to every engine client; an HTTP
    engine without any secret is refused when the sync is built, naming the variable."""
    from delta_sync.sync import WeightSync

    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(AuthError, match=f"no engine secret: set {ENV}"):
        WeightSync(["http://127.0.0.1:9"])
    reads = []  # loads that read a secret (not the passing on of a loaded key)

    def counted(secret=None, **kw):
        if not isinstance(secret, bytes):
            reads.append(secret)
        return load_secret(secret, **kw)
    for where in ("delta_sync.sync", "delta_sync.engines"):
        monkeypatch.setattr(f"{where}.load_secret", counted)
    sync = WeightSync(["http://127.0.0.1:9", "http://127.0.0.1:10"], secret="s" * 32)
    assert len(reads) == 1
    assert all(e._signer._key == b"s" * 32 for e in sync.engines)
    sync.close()
