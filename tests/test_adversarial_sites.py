"""Registration is one transaction: `starfed server sites add|remove` at once, relative key
paths, and a key Flower knows but sites.json does not.

Two `sites add` at once used to both say "registered" while sites.json kept one of them; the
other key was Flower's only, could not be added again (``[code: 23]``) and needed a new key.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy
from cryptography.hazmat.primitives import serialization
from flwr.supercore.state.schema.linkstate_tables import create_linkstate_metadata
from in_process import starfed

from starfed.ops import pki
from starfed.server.ops import sites
from starfed.server.ops.layout import ServerFolder

pytestmark = pytest.mark.adversarial


@pytest.fixture
def folder(tmp_path: Path) -> ServerFolder:
    folder = ServerFolder.at(tmp_path / "server")
    folder.create()
    folder.flwr_home.mkdir(parents=True)
    folder.flwr_config.write_text("")
    return folder


def test_two_adds_at_once_both_land_in_sites_json(
    folder: ServerFolder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower takes a while to answer a registration; two operators add a site each in that
    while. Both keys are in sites.json, each with the node id Flower gave it."""
    node_ids = itertools.count(101)

    def slow_flwr(folder: ServerFolder, *args: str) -> dict:
        time.sleep(0.5)
        return {"success": True, "node-id": next(node_ids)}

    monkeypatch.setattr(sites, "flwr_json", slow_flwr)
    keys = {name: pki.write_site_key(tmp_path / f"{name}.key", name) for name in ("a", "b")}
    errors: list[BaseException] = []

    def add(name: str) -> None:
        try:
            sites.add(folder, name, tmp_path / f"{name}.pub")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=add, args=(name,)) for name in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    registry = sites.Registry.load(folder.sites_file)
    assert sorted((s.name, s.fingerprint) for s in registry.sites) == [
        (name, key.fingerprint) for name, key in sorted(keys.items())
    ]
    assert sorted(s.node_id for s in registry.sites) == [101, 102]


def test_a_relative_key_path_is_the_callers_and_a_missing_one_says_so(
    folder: ServerFolder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flwr`` runs in the Flower home: starfed hands it the key's absolute path."""
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(
        sites, "flwr_json", lambda folder, *args: calls.append(args) or {"node-id": 7}
    )
    pki.write_site_key(tmp_path / "hospital-a.key", "hospital-a")
    monkeypatch.chdir(tmp_path)
    sites.add(folder, "hospital-a", Path("hospital-a.pub"))
    assert calls[0][2] == str(tmp_path / "hospital-a.pub")
    with pytest.raises(pki.SiteKeyError, match=r"Public key file '.*/missing.pub' does not exist"):
        sites.add(folder, "hospital-b", Path("missing.pub"))


def _flower_registry(folder: ServerFolder, key: pki.SiteKey, node_id: int, status: str) -> None:
    """Flower's own ``node`` table (its SQLAlchemy schema) holding ``key``, as `flwr
    supernode register` leaves it."""
    engine = sqlalchemy.create_engine(f"sqlite:///{folder.database}")
    metadata = create_linkstate_metadata()
    metadata.create_all(engine)
    pem = serialization.load_ssh_public_key(key.openssh.encode()).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with engine.begin() as db:
        db.execute(
            metadata.tables["node"]
            .insert()
            .values(
                node_id=node_id,
                owner_aid="",
                owner_name="",
                status=status,
                public_key=pem,
            )
        )
    engine.dispose()


def test_a_key_flower_knows_and_sites_json_does_not_is_adopted(
    folder: ServerFolder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered with bare `flwr supernode register`: adding it again is Flower's code 23
    (the error says to adopt it); ``--adopt`` records it with Flower's node id, asking Flower
    nothing."""
    key = pki.write_site_key(tmp_path / "a.key", "a")
    _flower_registry(folder, key, 4242, "registered")

    def refuse(folder: ServerFolder, *args: str) -> dict:
        raise sites.SitesError(sites._flower_message("[code: 23] Public key already in use."))

    monkeypatch.setattr(sites, "flwr_json", refuse)
    with pytest.raises(sites.SitesError, match="--adopt"):
        sites.add(folder, "a", tmp_path / "a.pub")
    record = sites.add(folder, "a", tmp_path / "a.pub", adopt=True)
    assert (record.name, record.node_id, record.fingerprint) == ("a", 4242, key.fingerprint)
    assert sites.Registry.load(folder.sites_file).active("a") == record
    other = pki.write_site_key(tmp_path / "b.key", "b")
    with pytest.raises(
        sites.SitesError, match=re.escape(f"no registration of key {other.fingerprint}")
    ):
        sites.add(folder, "b", tmp_path / "b.pub", adopt=True)


def test_a_sites_json_edited_into_garbage_is_damage_that_status_reports(
    folder: ServerFolder, capsys: pytest.CaptureFixture[str]
) -> None:
    folder.sites_file.write_text("{ not json")
    code, out, _ = starfed(capsys, "server", "status", "--dir", str(folder.root), "--json")
    status = json.loads(out)
    assert code == 1 and not status["success"]
    assert any("sites.json is damaged" in line and "--adopt" in line for line in status["problems"])
