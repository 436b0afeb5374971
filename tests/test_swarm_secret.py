"""The swarm secret: flags, keyed names and tokens, and signed DHT records between real hivemind DHTs on 127.0.0.1."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import hivemind
import pytest
from hivemind.dht.validation import CompositeValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from decentralized_sgd.secret import (
    MembershipCheck,
    SwarmSecret,
    SwarmSecretError,
    SwarmSecretValidator,
    announce_member,
    diagnose_members,
    keyed_prefix,
    members_key,
    read_members,
)
from vissl_swarm.swarm import SECRET_ENV, SwarmError, SwarmSettings

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.timeout(30)
def test_secret_flags_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)

    def from_args(secret: str = "", secret_file: object = "") -> SwarmSecret | None:
        return SwarmSettings(swarm_secret=secret, swarm_secret_file=str(secret_file)).secret()

    assert from_args() is None and from_args("", "") is None
    key_file = tmp_path / "swarm.key"
    key_file.write_text("  s3cret\n")
    from_file, from_flag = from_args(secret_file=key_file), from_args("s3cret")
    assert from_file.keyed_prefix("run") == from_flag.keyed_prefix("run")  # whitespace around it does not count
    assert "s3cret" not in repr(from_flag)
    with pytest.raises(SwarmError, match="either --swarm_secret or --swarm_secret_file"):
        from_args("a", key_file)
    with pytest.raises(SwarmError, match="--swarm_secret is empty"):
        from_args("   ")
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(SwarmError, match="empty.key is empty"):
        from_args(secret_file=tmp_path / "empty.key")
    with pytest.raises(SwarmError, match="cannot read .*missing.key"):
        from_args(secret_file=tmp_path / "missing.key")


@pytest.mark.timeout(30)
def test_keyed_prefix_and_member_tokens():
    secret, other = SwarmSecret(b"one"), SwarmSecret(b"two")
    assert keyed_prefix("run_abc", None) == "run_abc"  # no secret: the prefix of today
    keyed = keyed_prefix("run_abc", secret)
    assert keyed.startswith("run_abc_") and "." not in keyed and keyed == SwarmSecret(b"one").keyed_prefix("run_abc")
    assert keyed != keyed_prefix("run_abc", other) and keyed != keyed_prefix("run_abd", secret)
    token = secret.member_token(b"peer-a")
    assert secret.is_member(b"peer-a", token)
    assert not secret.is_member(b"peer-b", token)  # bound to the (libp2p-authenticated) sender
    assert not other.is_member(b"peer-a", token) and not secret.is_member(b"peer-a", None)
    assert secret.tag("x", b"ab", b"c") != secret.tag("x", b"a", b"bc")  # parts are length-prefixed
    with pytest.raises(SwarmSecretError, match="one swarm secret"):
        CompositeValidator([SwarmSecretValidator(secret), SwarmSecretValidator(other)])


@pytest.mark.timeout(30)
def test_diagnosis_names_the_problem():
    secret, other = SwarmSecret(b"one"), SwarmSecret(b"two")

    def tag(s: SwarmSecret | None, peer: bytes) -> bytes:
        return b"" if s is None else s.tag("members-key", peer)

    swarm = {b"a": tag(secret, b"a"), b"b": tag(secret, b"b")}
    assert diagnose_members(swarm, b"a", secret, "run") is None
    assert diagnose_members({b"me": tag(secret, b"me")}, b"me", secret, "run") is None  # alone: nothing to say
    wrong = diagnose_members({**swarm, b"me": tag(other, b"me")}, b"me", other, "run")
    assert wrong.startswith("no peer of this swarm accepts our secret") and "2 peer(s) of run 'run'" in wrong
    missing = diagnose_members({**swarm, b"me": b""}, b"me", None, "run")
    assert "all of them use a swarm secret" in missing and "--swarm_secret" in missing
    stolen = {b"x": tag(secret, b"a")}  # a tag copied from another peer id proves nothing
    assert "accepts our secret" in diagnose_members(stolen, b"me", secret, "run")


@pytest.mark.timeout(120)
def test_only_peers_with_the_secret_read_and_write_the_swarm_records():
    secret, other = SwarmSecret(b"right"), SwarmSecret(b"wrong")
    exempt = [members_key("run")]

    def dht(swarm_secret: SwarmSecret, initial_peers=None) -> hivemind.DHT:
        return hivemind.DHT(
            start=True,
            host_maddrs=LOCAL,
            initial_peers=initial_peers,
            record_validators=[SwarmSecretValidator(swarm_secret, exempt)],
        )

    dhts = [dht(secret)]
    try:
        first = dhts[0].get_visible_maddrs()
        dhts += [dht(secret, first), dht(other, first)]
        ours, mate, outsider = dhts
        expiration = get_dht_time() + 60
        # not asserted: hivemind's store returns the status of the replica that answered last (node.py, store_many),
        # here maybe the outsider's refusal; what counts is that the mate reads it
        ours.store("run_metrics", b"ours", subkey=b"peer-a", expiration_time=expiration)
        found = mate.get("run_metrics", latest=True)
        assert found is not None and found.value[b"peer-a"].value == b"ours"
        assert outsider.get("run_metrics", latest=True) is None  # its validator rejects our tags
        # the outsider's records: stored only in its own node, rejected by ours when they read them
        outsider.store("run_donors", b"forged", subkey=b"peer-x", expiration_time=expiration)
        assert ours.get("run_donors", latest=True) is None and mate.get("run_donors", latest=True) is None
        # everybody can say "I am here" under the members' key; only the outsider finds nobody with its secret
        for node, node_secret in zip(dhts, (secret, secret, other), strict=True):
            assert announce_member(node, "run", node_secret).result(timeout=30)
        check = MembershipCheck(outsider, "run", other, patience=0.5)  # what the outsider's averager runs
        assert check.poll(time.monotonic(), group_formed=False) is None  # starts its silence clock
        deadline, line = time.monotonic() + 30, None
        while line is None:
            assert time.monotonic() < deadline, "the membership check said nothing"
            time.sleep(0.05)
            line = check.poll(time.monotonic(), group_formed=False)
        assert line.startswith("no peer of this swarm accepts our secret")
        assert MembershipCheck(ours, "run", secret, patience=0.0).poll(time.monotonic(), group_formed=True) is None
        for node, node_secret in zip(dhts, (secret, secret, other), strict=True):
            members = read_members(node, "run")
            assert set(members) == {d.peer_id.to_bytes() for d in dhts}
            verdict = diagnose_members(members, node.peer_id.to_bytes(), node_secret, "run")
            if node is outsider:
                assert verdict.startswith("no peer of this swarm accepts our secret"), verdict
            else:
                assert verdict is None
    finally:
        for node in reversed(dhts):
            node.shutdown()


@pytest.mark.timeout(60)
def test_trainer_and_monitor_take_the_secret_from_a_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    import run_monitor
    import run_trainer
    from vissl_swarm import swarm
    from vissl_swarm.swarm_progress import record_validators

    key = tmp_path / "swarm.key"
    key.write_text("s3cret\n")
    from_file = run_trainer.swarm_settings(
        run_trainer.parse_args(["--config", "swav_tiny", "--swarm_secret_file", str(key)])
    )
    inline = run_trainer.swarm_settings(run_trainer.parse_args(["--config", "swav_tiny", "--swarm_secret", "s3cret"]))
    assert from_file.secret().keyed_prefix("run") == inline.secret().keyed_prefix("run")
    config = inline.to_config()  # what VISSL logs and hands to its workers: never the secret itself
    assert "s3cret" not in repr(config) and "s3cret" not in repr(inline)
    assert swarm.SwarmSettings.from_config(config).secret() is None
    # what run_trainer.py hands VISSL (which logs its config and every environment variable): a private file's path
    monkeypatch.setenv(swarm.SECRET_ENV, "s3cret")
    for given in (inline, swarm.SwarmSettings(run_id="run")):  # --swarm_secret, or the environment variable
        hidden = swarm.hide_secret(given)
        assert swarm.SECRET_ENV not in os.environ and "s3cret" not in repr(hidden.to_config())
        assert os.stat(hidden.swarm_secret_file).st_mode & 0o077 == 0  # this user's only
        in_worker = swarm.SwarmSettings.from_config(hidden.to_config())
        assert in_worker.secret().keyed_prefix("run") == inline.secret().keyed_prefix("run")
        monkeypatch.setenv(swarm.SECRET_ENV, "s3cret")
    with pytest.raises(swarm.SwarmError, match="need the improved averager"):
        run_trainer.swarm_settings(
            run_trainer.parse_args(["--config", "swav_tiny", "--averager", "old", "--swarm_secret", "s3cret"])
        )
    with pytest.raises(swarm.SwarmError, match="cannot read .*missing.key"):
        run_monitor.settings_from(
            run_monitor.build_parser().parse_args(["--swarm_secret_file", str(tmp_path / "missing.key")])
        )
    monitor = run_monitor.settings_from(run_monitor.build_parser().parse_args(["--swarm_secret_file", str(key)]))
    assert any(isinstance(v, SwarmSecretValidator) for v in record_validators("run", secret=monitor.secret()))
    dht = SimpleNamespace(get_visible_maddrs=lambda: ["/ip4/203.0.113.5/tcp/31337/p2p/QmPeer"])
    line = swarm.join_command(dht, from_file)  # the join line asks for the key file, never shows the secret
    assert "--swarm_secret_file" in line and "s3cret" not in line


@pytest.mark.timeout(60)
def test_members_key_reads_back_off_for_the_whole_run():
    """Each read is a DHT search that matchmaking waits behind: a swarm whose groups come 12 s apart reads a few
    times in ten minutes, not after every gap (at 16 peers that cost groups and consensus time: consensus16.md)."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCAL)
    try:
        check = MembershipCheck(dht, "run", None, patience=float("inf"))
        reads, reading = 0, None
        for second in range(600):  # a clock the test moves: a group every 12 s
            check.poll(float(second), group_formed=second > 0 and second % 12 == 0)
            if check._reading is not None and check._reading is not reading:
                reads, reading = reads + 1, check._reading
                reading.result(timeout=30)
        assert 1 <= reads <= 3, f"{reads} members-key reads in 600 s with a group every 12 s"
    finally:
        dht.shutdown()


@pytest.mark.timeout(180)
def test_a_joining_box_refuses_a_pushed_record_of_another_secret_and_reads_the_swarms(monkeypatch):
    """A DHT takes the records its peers push as it joins. Before its validators, it took a record of another
    secret that it cannot strip, and every later read of the key hung (hivemind 1.1.12's search raises in
    ``_SearchState.finish_search`` and never answers): a box of another recipe then joined unrefused, and the
    swarm's counts went unread. ``swarm.start_dht`` builds the DHT with the records' validators."""
    from decentralized_sgd import FixedDHT
    from vissl_swarm import swarm
    from vissl_swarm.swarm_progress import SwarmProgress, fetch_records, record_validators

    monkeypatch.delenv(SECRET_ENV, raising=False)
    run = "pushtest"
    keys, other_secret = [RSAPrivateKey(), RSAPrivateKey()], SwarmSecret(b"another")  # two boxes' own keys

    def box(index: int, secret: SwarmSecret | None, initial_peers: list[str]) -> FixedDHT:
        validators = record_validators(run, keys[index], secret)
        return FixedDHT(start=True, host_maddrs=LOCAL, initial_peers=initial_peers, record_validators=validators)

    dhts = [first := box(0, None, [])]
    addresses = [str(a) for a in first.get_visible_maddrs()]
    try:
        assert SwarmProgress(first, run, 16, start=False, private_key=keys[0]).publish()
        dhts.append(stranger := box(1, other_secret, addresses))
        stranger_progress = SwarmProgress(stranger, run, 16, secret=other_secret, start=False, private_key=keys[1])
        stranger_progress.publish()  # the first refuses it
        dialed = addresses + [str(a) for a in stranger.get_visible_maddrs()]  # the stranger meets the joiner for sure
        joiner = swarm.start_dht(SwarmSettings(run_id=run, initial_peers=dialed, host_maddrs=LOCAL))
        dhts.append(joiner)
        stranger_progress.publish()  # to its nearest peers, the joiner among them
        SwarmProgress(joiner, run, 16, start=False)  # as the joiner's task builds it
        records = fetch_records(joiner, run)  # TimeoutError when the joiner took the stranger's record
        assert [record["owner"] for record in records.values()] == [keys[0].get_public_key().to_bytes()]
    finally:
        for dht in dhts:
            dht.shutdown()
