"""A site leaves (issue 46): ``starfed server sites withdraw`` in immediate mode.

One federation is built in process, in three runs at the tiny preset: farm-a and farm-b bring
two classes each (step 1); farm-c joins with a class of its own and one that farm-a and farm-b
bring too (step 2); farm-a brings one more (step 3). Each test works on a copy. The shared
class is checked against the merge of the other holders' rows, recomputed here from the rows
the folder kept — which are themselves checked against the codebook the run merged them into.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from in_process import TINY_RUN, site_nodes, starfed
from site_folders import CLASSES, site_folder

from starfed.client import app as client_app
from starfed.ops import leave_request, pki
from starfed.server import folder_check
from starfed.server.app import run_server
from starfed.server.federation import Federation
from starfed.server.folder_files import (
    CODEBOOK_FILE,
    HISTORY_FILE,
    QUARANTINE_FILE,
    REGISTRY_FILE,
    WITHDRAWING_FILE,
    read_withdrawals,
)
from starfed.server.ops import sites
from starfed.server.ops.layout import ServerFolder
from starfed.server.withdrawal import readmit
from starfed.shared.codebook import wire
from starfed.shared.codebook.merge import merge_mixtures
from starfed.simulations.local_grid import LocalGrid

SITES = ("farm-a", "farm-b", "farm-c")
OWN, SHARED, LATER = CLASSES[5], CLASSES[4], CLASSES[6]
STAGE2_FIELDS = ("query_prompt", "query_weight", "head_weight", "head_bias")


def run(root: Path, sites: tuple[str, ...], run_id: int) -> dict:
    config = {**TINY_RUN, "federation-dir": str(root / "server" / "federation")}
    nodes = site_nodes(root, SITES, sites)
    return run_server(LocalGrid(client_app.app, config, nodes, run_id=run_id), config, run_id)


@pytest.fixture(scope="module")
def built(tmp_path_factory, one_torch_thread) -> Path:
    root = tmp_path_factory.mktemp("withdrawal")
    site_folder(root / "farm-a", {"t1": CLASSES[0:2]})
    site_folder(root / "farm-b", {"t1": CLASSES[2:4]})
    assert run(root, SITES[:2], 7001)["status"] == "completed"
    site_folder(root / "farm-a", {"t2": [SHARED]})
    site_folder(root / "farm-b", {"t2": [SHARED]})
    site_folder(root / "farm-c", {"t1": [SHARED, OWN]})
    assert run(root, SITES, 7002)["status"] == "completed"
    site_folder(root / "farm-a", {"t3": [LATER]})
    assert run(root, SITES, 7003)["status"] == "completed"
    return root


@pytest.fixture
def root(built: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(built, copy, symlinks=True)
    return copy


def folder(root: Path) -> Path:
    return root / "server" / "federation"


def withdraw(root: Path, capsys, *flags: str) -> tuple[int, dict]:
    code, out, err = starfed(
        capsys, "server", "sites", "withdraw", "farm-c", "--dir", root / "server", "--json", *flags
    )
    assert "\n" not in err.strip(), err
    return code, json.loads(out)


def test_the_kept_rows_are_what_the_merge_merged(built: Path) -> None:
    """Each site's kept rows are the rows the run merged: farm-c's own class is its row (one
    holder: the mean of one), the shared class the coordinate-wise median of three."""
    fed = Federation.open(folder(built))
    rows, codebook = fed.contributions(), fed.checkpoints.codebook()
    assert rows.holders(OWN) == ["farm-c"] and rows.holders(SHARED) == list(SITES)
    assert rows.holders(CLASSES[0]) == ["farm-a"] and rows.holders(LATER) == ["farm-a"]
    own = rows.rows["farm-c", OWN]
    for field in STAGE2_FIELDS:
        assert torch.equal(codebook[OWN].tensor(field), own.values[field])
        stacked = torch.stack([rows.rows[s, SHARED].values[field] for s in SITES])
        assert torch.equal(codebook[SHARED].tensor(field), stacked.median(dim=0).values)
    assert codebook[SHARED].count == sum(rows.rows[s, SHARED].counts["head_weight"] for s in SITES)


def test_the_dry_run_lists_what_changes_and_what_is_not_undone(root: Path, capsys) -> None:
    exported = root / "exports" / "codebook.bin"
    code, _, err = starfed(capsys, "server", "export", "--out", exported, "--dir", root / "server")
    assert code == 0, err
    before = (folder(root) / CODEBOOK_FILE).read_bytes()
    code, plan = withdraw(root, capsys, "--dry-run")
    assert code == 0 and plan["dry_run"]
    assert plan["removed"] == [OWN] and plan["remerged"] == [SHARED]
    # the later steps other sites trained on a codebook holding farm-c's rows: the history's
    history = Federation.open(folder(root)).history()
    joined = min(r.step for r in history if "farm-c" in r.sites)
    later = {str(r.step + 1): list(r.classes) for r in history if r.step > joined}
    assert later == {"3": [LATER]} and plan["touched"] == later
    assert "checkpoints/step-0003.bin" in plan["holding"]
    assert any(line.startswith(f"export {exported.resolve()} (") for line in plan["holding"])
    assert (folder(root) / CODEBOOK_FILE).read_bytes() == before  # nothing written


def test_withdrawing_a_site_removes_its_class_and_remerges_the_shared_one(
    root: Path, capsys
) -> None:
    fed = Federation.open(folder(root))
    rows, before = fed.contributions(), fed.checkpoints.codebook()
    code, done = withdraw(root, capsys, "--yes")
    assert code == 0 and done["removed"] == [OWN] and done["remerged"] == [SHARED]
    after = Federation.open(folder(root)).checkpoints.codebook()
    assert OWN not in after and after.names == [n for n in before.names if n != OWN]
    # the shared class: the count-weighted mean of farm-a's and farm-b's rows (two holders:
    # median = mean), recomputed here in float64 and rounded once to float32, as the merge does
    a, b = rows.rows["farm-a", SHARED], rows.rows["farm-b", SHARED]
    for field in STAGE2_FIELDS:
        ca, cb = a.counts[field], b.counts[field]
        mean = (a.values[field].double() * ca + b.values[field].double() * cb) / (ca + cb)
        assert torch.equal(after[SHARED].tensor(field), mean.float()), field
    assert after[SHARED].count == a.counts["head_weight"] + b.counts["head_weight"]
    mixture = merge_mixtures(
        [a.values["vit_mixture"], b.values["vit_mixture"]],
        n_components=after[SHARED].mixture("vit_mixture").weights.numel(),
    )
    got = after[SHARED].mixture("vit_mixture")
    assert got.count == mixture.count
    # the union's mean is kept exactly by the reduction (``merge_mixtures``)
    assert torch.allclose(got.weights @ got.means, mixture.weights @ mixture.means, atol=1e-9)
    assert after[SHARED].frozen and after.frozen == set(after.names)
    # classes farm-c never held keep their trained rows (replays realign heads and keys only)
    for name in CLASSES[0:4]:
        for field in STAGE2_FIELDS:
            assert torch.equal(after[name].tensor(field), before[name].tensor(field))
    # the site is gone from the registry, quarantined, its rows forgotten, the leave recorded
    registry = json.loads((folder(root) / REGISTRY_FILE).read_text())
    assert OWN not in registry and all("farm-c" not in r["sites"] for r in registry.values())
    quarantine = json.loads((folder(root) / QUARANTINE_FILE).read_text())
    assert "withdrawn" in quarantine["farm-c"]["reason"]
    kept = Federation.open(folder(root)).contributions()
    assert "farm-c" not in kept.sites() and OWN not in {n for _, n in kept.rows}
    [record] = read_withdrawals(folder(root))
    assert record.site == "farm-c" and record.touched == (3,)
    assert folder_check.check(folder(root)).ok
    # a second withdrawal is refused in one line (bad input)
    code, again = withdraw(root, capsys, "--yes")
    assert code == 2 and "already left" in again["error"]


def test_a_withdrawn_site_takes_no_part_in_later_steps(root: Path, capsys) -> None:
    assert withdraw(root, capsys, "--yes")[0] == 0
    site_folder(root / "farm-c", {"t2": [CLASSES[7]]})
    metrics = run(root, SITES, 7004)
    assert CLASSES[7] not in Federation.open(folder(root)).checkpoints.codebook()
    assert metrics["status"] in ("completed", "degraded")
    # a new `sites add` under its name lets it back (as a new site: nothing is restored)
    assert (
        readmit(folder(root), "farm-c")
        and "farm-c" not in Federation.open(folder(root)).quarantine()
    )
    assert not readmit(folder(root), "farm-a")  # never withdrawn: nothing to lift


def test_a_sites_signed_request_is_checked_and_kept_in_the_record(root: Path, capsys) -> None:
    """`starfed site leave` signs the request with farm-c's key; the operator's withdraw checks
    it against farm-c's registration (its mode too) and the record keeps it whole."""
    server = ServerFolder.at(root / "server")
    key = root / "farm-c.key"
    public = pki.write_site_key(key, "farm-c")
    added = "2026-01-01T00:00:00+00:00"
    sites.Registry([sites.SiteRecord("farm-c", 7, public.openssh, public.fingerprint, added)]).save(
        server.sites_file
    )
    request = root / "leave.json"
    code, out, err = starfed(
        capsys,
        "site",
        "leave",
        "--key",
        key,
        "--name",
        "farm-c",
        "--out",
        request,
        "--reason",
        "consent withdrawn",
        "--json",
    )
    assert code == 0 and json.loads(out)["mode"] == "immediate", err
    code, plan = withdraw(root, capsys, "--dry-run", "--request", str(request))
    assert code == 0 and plan["request"][0].startswith("request    verified: farm-c asked at")
    code, refused = withdraw(root, capsys, "--dry-run", "--exact", "--request", str(request))
    assert code == 2 and "run this without --exact" in refused["error"]
    other = root / "farm-x.key"
    pki.write_site_key(other, "farm-x")
    leave_request.write(request, leave_request.sign(other, "farm-c", leave_request.Mode.IMMEDIATE))
    code, refused = withdraw(root, capsys, "--dry-run", "--request", str(request))
    assert code == 2 and "registered key is" in refused["error"]
    # the withdrawal made with a verified request keeps it: the proof verifies again later.
    # No server runs here, so the key stays registered: said, and the site quarantined anyway
    signed = leave_request.sign(key, "farm-c", leave_request.Mode.IMMEDIATE)
    leave_request.write(request, signed)
    code, done = withdraw(root, capsys, "--yes", "--request", str(request))
    assert code == 0 and done["key_removed"] is None and "still registered" in done["key_kept"]
    assert "farm-c" in Federation.open(folder(root)).quarantine()
    [record] = read_withdrawals(folder(root))
    kept = leave_request.SignedRequest.from_json(record.request)
    assert kept == signed
    leave_request.verify(kept, "farm-c", public.openssh, added)


# --- exact mode: equal to a federation the site never joined ------------------------------


def test_an_exact_withdrawal_equals_the_federation_without_the_site(
    root: Path, tmp_path: Path, capsys
) -> None:
    """Federation X (``built``: farm-c joins at step 2 with a class of its own and one shared
    with farm-a and farm-b) withdraws farm-c exactly, then runs again; federation Y had farm-a
    and farm-b alone, the same task folders and seeds, in the same runs. Every class of the
    two codebooks is equal, bitwise: the steps run again are the same computation on the same
    inputs (the tolerance is zero; ``starfed codebook diff`` says "unchanged" for each)."""
    y = tmp_path / "y"
    site_folder(y / "farm-a", {"t1": CLASSES[0:2]})
    site_folder(y / "farm-b", {"t1": CLASSES[2:4]})
    assert run(y, SITES[:2], 7001)["status"] == "completed"
    site_folder(y / "farm-a", {"t2": [SHARED]})
    site_folder(y / "farm-b", {"t2": [SHARED]})
    assert run(y, SITES[:2], 7002)["status"] == "completed"
    site_folder(y / "farm-a", {"t3": [LATER]})
    assert run(y, SITES[:2], 7003)["status"] == "completed"

    code, plan = withdraw(root, capsys, "--dry-run")
    assert code == 0 and plan["first"] == 1 and plan["exact"] == ""
    code, done = withdraw(root, capsys, "--yes", "--exact")
    assert code == 0 and done["rerun_from"] == 1, done
    fed = Federation.open(folder(root))
    assert [r.step for r in fed.history()] == [0] and fed.rerunning() is not None
    assert fed.checkpoints.codebook().names == CLASSES[0:4]
    metrics = run(root, SITES, 7004)  # farm-c connects, and is refused at the sync
    assert metrics["status"] == "degraded" and metrics["steps"] == 3
    assert Federation.open(folder(root)).rerunning() is None

    a, b = wire.read_file(folder(y) / CODEBOOK_FILE), wire.read_file(folder(root) / CODEBOOK_FILE)
    code, out, _ = starfed(
        capsys, "codebook", "diff", folder(y) / CODEBOOK_FILE, folder(root) / CODEBOOK_FILE
    )
    assert code == 0 and "added        —" in out and "removed      —" in out, out
    assert a.names == b.names
    for name in a.names:
        assert set(a[name].values) == set(b[name].values)
        for field, value in a[name].values.items():
            other = b[name].values[field]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (name, field)
            else:
                assert torch.equal(value.means, other.means), (name, field)
                assert torch.equal(value.variances, other.variances), (name, field)
                assert torch.equal(value.weights, other.weights), (name, field)


# --- SIGKILL at three points: the old federation or the new one, never a mix -------------

KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from starfed.cli import main
    from starfed.server import checkpoints, federation, folder_files, history, quarantine, registry
    from starfed.shared.codebook import store_io
    target = sys.argv[1]
    for module in (checkpoints, federation, folder_files, history, quarantine, registry, store_io):
        real = module.write_atomic
        def write(path, data, real=real):
            if Path(path).name == target:
                os.kill(os.getpid(), signal.SIGKILL)
            real(path, data)
        module.write_atomic = write
    command = ["server", "sites", "withdraw", "farm-c", "--dir", sys.argv[2], "--yes"]
    sys.exit(main(command + sys.argv[3:]))
    """
)


@pytest.mark.slow  # a process each (about 40 s on a loaded machine): `-m faults` runs them
@pytest.mark.faults
@pytest.mark.parametrize(
    ("flags", "at", "new"),
    [
        ((), WITHDRAWING_FILE, False),
        ((), CODEBOOK_FILE, False),
        ((), REGISTRY_FILE, True),
        (("--exact",), WITHDRAWING_FILE, False),
        (("--exact",), CODEBOOK_FILE, False),
        (("--exact",), HISTORY_FILE, True),
    ],
)
def test_a_withdrawal_killed_leaves_the_old_federation_or_the_new(
    root: Path, capsys, flags: tuple[str, ...], at: str, new: bool
) -> None:
    """SIGKILL before the record is written ahead, at the commit, and after it: the next
    `repair` (or run) leaves the old federation, whole, or finishes the new one."""
    before = Federation.open(folder(root)).checkpoints.codebook()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", KILLED, at, str(root / "server"), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    problems = folder_check.check(folder(root)).problems
    assert any(p.startswith(WITHDRAWING_FILE) for p in problems) is (at != WITHDRAWING_FILE)
    code, out, _ = starfed(capsys, "server", "repair", "--dir", root / "server")
    assert code == 0 and (WITHDRAWING_FILE in out) is (at != WITHDRAWING_FILE), out
    fed = Federation.open(folder(root))
    codebook = fed.checkpoints.codebook()
    assert (OWN not in codebook) is new
    if not new:
        assert wire.encode(codebook.broadcast()) == wire.encode(before.broadcast())
        assert "farm-c" in fed.registry[OWN].sites and not read_withdrawals(folder(root))
        assert ("farm-c", OWN) in fed.contributions().rows
        assert [r.step for r in fed.history()] == [0, 1, 2]
    else:
        assert [w.site for w in read_withdrawals(folder(root))] == ["farm-c"]
        assert "farm-c" not in fed.contributions().sites()
        assert "farm-c" in fed.quarantine()
        exact = bool(flags)
        assert ([r.step for r in fed.history()] == [0]) is exact
        assert (codebook.names == CLASSES[0:4]) is exact
    assert not (folder(root) / WITHDRAWING_FILE).exists()
    assert folder_check.check(folder(root)).ok, folder_check.check(folder(root)).problems
