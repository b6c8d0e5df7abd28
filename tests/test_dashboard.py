"""``starfed server dashboard``: the operator's web page, on folders made here.

The fast tests drive the Starlette app with its ``TestClient`` on a federation folder written
through ``Federation`` itself (two step records, a step running, a codebook with tiny dims) and
a server folder (``sites.json``, a SuperLink log with a refused key): what the page shows, that
``/api/state`` is ``status``'s reading, that damaged files are named while the rest is shown and
nothing is written, and that logs are served from ``logs/`` only. The slow test runs a real
federation in process (tiny backbones, as tests/test_server_status.py), leaves a step running,
starts the dashboard as a real process and looks at it in headless Chromium.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import FINGERPRINT, TINY_DIMS, random_codebook
from matplotlib.figure import Figure
from starlette.testclient import TestClient

from starfed.cli import main
from starfed.ops.processes import free_port
from starfed.server.federation import Federation
from starfed.server.ops import sites
from starfed.server.ops.dashboard import Dashboard
from starfed.server.ops.dashboard_page import fragment
from starfed.server.ops.dashboard_plots import ACCURACY_NOTE, PLOTS, _clock_axis, step_label
from starfed.server.ops.layout import ServerFolder
from starfed.server.records import Exchange, PhaseTime, Position, StepRecord, StepScores
from starfed.shared.privacy.unit import PrivacyUnit
from starfed.shared.run_status import COMPLETED, DEGRADED

T0 = 1_790_000_000.0  # 2026-09-21, when the first step started
REFUSAL = (
    "2026-09-21 10:00:00,123 INFO :      [/v1/fleet/activate-node][ApiError:2004] Failed to "
    "activate SuperNode\n"
)


def _scores(accuracy: list[float], sites: dict[str, tuple[int, int]]) -> StepScores:
    by_site = {
        s: {"images": n, "correct": c, "accuracy": 100 * c / n} for s, (n, c) in sites.items()
    }
    classes = {
        f"class_{i}": {"images": 4, "correct": 3, "selection_hits": 4, "sites": 1}
        for i in range(2 * len(accuracy))
    }
    return StepScores(accuracy, accuracy, sum(accuracy) / len(accuracy), by_site, classes)


def _exchanges(step: int, silent: str | None = None) -> tuple[Exchange, ...]:
    return tuple(
        Exchange(
            step,
            phase,
            0,
            node,
            site,
            down,
            *((0, "no reply") if site == silent and phase == "evaluate" else (up, "ok")),
        )
        for phase, down, up in (
            ("sync", 10, 200),
            ("stage1", 40_000, 30_000),
            ("evaluate", 40_000, 900),
        )
        for node, site in ((7, "farm-a"), (9, "farm-b"))
    )


def write_server_folder(root: Path) -> ServerFolder:
    """Two finished steps (one degraded: farm-b silent at evaluation), step 3 running after
    its sync and stage 1; sites.json, a SuperLink log with a refused key."""
    folder = ServerFolder.at(root)
    folder.create()
    federation = Federation(folder.federation, FINGERPRINT, TINY_DIMS)
    codebook = random_codebook(n_classes=5)
    phases = (PhaseTime("sync", 0, 1.0), PhaseTime("stage1", 0, 30.0))
    for step, (classes, brought, accuracy, silent) in enumerate(
        (
            (["class_0", "class_1"], {"class_0": ["farm-a"], "class_1": ["farm-b"]}, [62.5], None),
            (
                ["class_2", "class_3"],
                {"class_2": ["farm-a"], "class_3": ["farm-a"]},
                [50.0, 75.0],
                "farm-b",
            ),
        )
    ):
        federation.begin_step(codebook)
        federation.register(classes, step, brought)
        record = StepRecord(
            step,
            DEGRADED if silent else COMPLETED,
            T0 + 600 * step,
            240.0,
            classes=tuple(classes),
            sites=("farm-a", "farm-b"),
            phase_seconds=phases,
            exchanges=_exchanges(step, silent),
            codebook_version=3 * (step + 1),
            scores=_scores(accuracy, {"farm-a": (8, 6), "farm-b": (8, 4 + step)}),
        )
        federation.end_step(record, codebook)
    federation.begin_step(codebook)
    federation.register(["class_4"], 2, {"class_4": ["farm-b"]})
    federation.checkpoint(codebook, Position(2, True, ("sync/0", "stage1/0"), ("class_4",)))
    private = sites.DeclaredPrivacy(4.0, PrivacyUnit.PATIENT)  # sites add --privacy-epsilon 4
    registry = sites.Registry(
        [sites.SiteRecord("farm-a", 7, "ssh-ed", "SHA256:aaaa", "then", privacy=private)]
    )
    registry.save(folder.sites_file)
    folder.logs.mkdir()
    folder.superlink_log.write_text("2026-09-21 09:59:00,000 INFO : Starting\n" + REFUSAL)
    return folder


@pytest.fixture
def folder(tmp_path: Path) -> ServerFolder:
    return write_server_folder(tmp_path / "server")


def _client(folder: ServerFolder) -> TestClient:
    return TestClient(Dashboard(folder, folder.federation, 5.0).app())


def _plots(page: str) -> list[str]:
    return re.findall(r'<img class="plot" src="([^"]+)"', page)


def test_the_page_shows_the_sites_the_steps_the_running_phase_and_the_plots(folder) -> None:
    client = _client(folder)
    reply = client.get("/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    page = reply.text
    sites_table = page.partition('<table id="sites-table">')[2].partition("</table>")[0]
    assert "farm-a" in sites_table and "farm-b" in sites_table
    farm_a, farm_b = sites_table.split("<tr><td>farm-")[1:]
    assert ">failing<" in farm_b and "its last exchange failed, the last with no reply" in farm_b
    assert "failing" not in farm_a  # step 2's last exchanges: farm-b silent at evaluation
    steps_table = page.partition('<table id="steps-table">')[2].partition("</table>")[0]
    assert re.findall(r">(?:completed|degraded)<", steps_table) == [">completed<", ">degraded<"]
    assert "<td>0.15</td>" in steps_table  # MiB down in step 1: 2 sites x 80,010 bytes
    # a degraded step says why (it said "—"), in the words of status's errors (issue 47)
    assert "<td>farm-b no reply in evaluate/0</td>" in steps_table
    assert "step 3" in page and ">running<" in page
    assert '<span class="phase now">stage1_stats</span>' in page  # after sync/0 and stage1/0
    assert "classes in play: class_4" in page
    classes = page.partition('<table id="classes-table">')[2].partition("</table>")[0]
    assert "class_4" in classes and "farm-b (" in classes
    assert "SHA256:aaaa" in page and "key not registered" in page  # sites.json, refused keys
    assert '<a href="logs/superlink.log">superlink.log</a>' in page
    assert "<td>farm-b</td><td>2</td><td>evaluate/0</td><td>no reply</td>" in page
    assert 'id="unreadable"' not in page
    plots = _plots(page)
    names = ("steps", "bytes", "accuracy", "sites", "matrix")
    assert [p.partition(".png")[0] for p in plots] == [f"plots/{n}" for n in names]
    for src in plots:
        image = client.get(src)
        assert image.status_code == 200 and image.headers["content-type"] == "image/png"
        assert image.content.startswith(b"\x89PNG") and len(image.content) > 5000
        if "steps.png" not in src:  # the running step's bar grows with every reading
            assert image.headers["cache-control"] == "max-age=86400"  # its digest is current
    live = client.get("/live").text
    assert live.startswith("<header>") and "<html" not in live and 'id="sites-table"' in live
    assert client.get("/plots/nope.png").status_code == 404


def test_the_plots_read_as_a_person_reads_them(folder) -> None:
    """Clock times on the steps' axis, never fractions of a second; a large accuracy matrix on
    a row of its own (scrolling, never squeezed); long class names cut in the middle with the
    whole name on hover."""
    fig = Figure()
    ax = fig.subplots()
    _clock_axis(ax, T0, T0 + 4.0)  # a 4 s step
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and all(re.fullmatch(r"\d\d:\d\d:\d\d", label) for label in labels), labels
    assert ax.get_xlabel() == "UTC, 2026-09-21"

    state = Dashboard(folder, folder.federation, 5.0).state()
    assert "class=wide" not in fragment(state)  # two steps: beside the other plots
    big = dataclasses.replace(state, accuracy_matrix=[[50.0] * (i + 1) for i in range(28)])
    assert '<figure class=wide><img class="plot" src="plots/matrix.png' in fragment(big)

    long = "Cherry_(including_sour)___Powdery_mildew"
    classes = [dataclasses.replace(state.status.classes[0], name=long)]
    page = fragment(
        dataclasses.replace(state, status=dataclasses.replace(state.status, classes=classes))
    )
    table = page.partition('<table id="classes-table">')[2].partition("</table>")[0]
    assert f'<span title="{html.escape(long)}">Cherry…Powdery_mildew</span>' in table


def test_api_state_is_the_reading_that_status_prints(folder, capsys) -> None:
    state = _client(folder).get("/api/state").json()
    assert main(["server", "status", "--dir", str(folder.root), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {"success": True, **state["status"]} == printed
    assert state["running"]["step"] == 2 and state["running"]["phase"] == "stage1_stats"
    assert state["accuracy_matrix"] == [[62.5], [50.0, 75.0]]
    assert state["site_accuracy"] == {
        "farm-a": {"0": 75.0, "1": 75.0},
        "farm-b": {"0": 50.0, "1": 62.5},
    }
    assert [(s["bytes_down"], s["bytes_up"]) for s in state["steps"]] == [
        (160_020, 62_200),
        (160_020, 61_300),
    ]
    assert [r["code"] for r in state["refused"]] == ["2004"]
    assert [r["privacy"] for r in state["registrations"]] == [{"epsilon": 4.0, "unit": "patient"}]
    assert [f["name"] for f in state["logs"]] == ["superlink.log"]


def test_a_class_one_site_brought_alone_is_marked_on_the_page_and_in_api_state(folder) -> None:
    """As `server status` marks it: class_1 is brought again by farm-a (two sites), every
    other class by one site alone."""
    Federation.open(folder.federation).register([], 0, {"class_1": ["farm-a"]})
    client = _client(folder)
    classes = client.get("/").text.partition('<table id="classes-table">')[2]
    rows = {
        re.search(r'<span title="(class_\d)">', row)[1]: row
        for row in classes.partition("</table>")[0].split("<tr>")[2:]
    }
    assert sorted(rows) == [f"class_{i}" for i in range(5)]
    marked = {name for name, row in rows.items() if ">one site alone</span>" in row}
    assert marked == {"class_0", "class_2", "class_3", "class_4"}
    assert "farm-b (" in rows["class_1"] and "farm-a (" in rows["class_1"]
    state = client.get("/api/state").json()["status"]["classes"]
    assert {c["name"]: c["single_site"] for c in state} == {f"class_{i}": i != 1 for i in range(5)}


def test_names_from_the_folders_are_text_on_the_page_never_markup(folder) -> None:
    """Autoescaping: a class or site name holding markup (a site chooses both) is shown as the
    characters it is, in the page and in the live part, and the page runs its own script only."""
    hostile = "<script>alert('x')</script>"
    Federation.open(folder.federation).register([hostile], 2, {hostile: [f"farm-{hostile}"]})
    client = _client(folder)
    for text in (client.get("/").text, client.get("/live").text):
        classes = text.partition('<table id="classes-table">')[2].partition("</table>")[0]
        assert "<script>" not in classes
        escaped = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
        assert f'<span title="{escaped}">' in classes and f"farm-{escaped} (" in classes
    page = client.get("/").text
    assert page.count("<script>") == 1 and "alert(" not in page.partition("<script>")[2]
    names = [c["name"] for c in client.get("/api/state").json()["status"]["classes"]]
    assert hostile in names  # the data as it is; only the page escapes it


def test_a_quarantined_site_is_shown_with_its_step_and_why(folder) -> None:
    """The quarantine's entries, typed (``Quarantined``), on the page (the step 1-based) and in
    the API's state as ``quarantine.json`` holds them."""
    Federation.open(folder.federation).add_quarantine({"farm-m": "3 findings"}, 1)
    client = _client(folder)
    table = client.get("/live").text.partition("<h3>quarantined sites</h3>")[2]
    assert "<td>farm-m</td><td>2</td><td>3 findings</td>" in table
    entry = client.get("/api/state").json()["status"]["quarantine"]["farm-m"]
    assert (entry["step"], entry["reason"]) == (1, "3 findings")


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).digest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _append(path: Path, text: str) -> None:
    with path.open("a") as file:
        file.write(text)


#: How a file gets damaged -> what the page says it cannot read, a part it still shows, and
#: whether `server status` reads that file too (sites.json: only while the server runs).
DAMAGE = {
    "a damaged history line": (
        lambda f: _append(f.federation / "history.jsonl", '{"step": 2, "sta\n'),
        "history.jsonl: ",
        "classes-table",
        True,
    ),
    "a truncated codebook": (
        lambda f: _truncate(f.federation / "codebook.bin"),
        "codebook.bin: ",
        "steps-table",
        True,
    ),
    "a missing registry": (
        lambda f: (f.federation / "registry.json").unlink(),
        "registry.json: 5 class(es) of the codebook are not in it",
        "steps-table",
        True,
    ),
    "a damaged metrics.json": (
        lambda f: (f.federation / "metrics.json").write_text("{"),
        "metrics.json: ",
        "steps-table",
        True,
    ),
    "a damaged run.json": (
        lambda f: f.run_file.write_text('{"boot_id": '),
        "run.json: ",
        "steps-table",
        True,
    ),
    "a damaged sites.json": (
        lambda f: f.sites_file.write_text("["),
        "sites.json: ",
        "steps-table",
        False,
    ),
    "a damaged federation.json": (
        lambda f: _truncate(f.federation / "federation.json"),
        "federation.json is damaged",
        "sites",
        True,
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_folder_still_renders_and_says_what_it_cannot_read(
    folder, damage, capsys
) -> None:
    spoil, note, still_shown, status_reads = DAMAGE[damage]
    (folder.federation / "metrics.json").write_text(json.dumps({"status": "completed"}))
    spoil(folder)
    before = _snapshot(folder.root)
    client = _client(folder)
    page = client.get("/").text
    problems = page.partition('<div class="problems" id="unreadable">')[2].partition("</div>")[0]
    assert html.escape(note) in problems, problems
    assert f'id="{still_shown}"' in page
    for src in _plots(page):
        assert client.get(src).status_code == 200
    state = client.get("/api/state").json()["status"]
    assert any(note in line for line in [*state["unreadable"], state["problem"] or ""])
    # the federation folder's own files damaged: `status` exits 1 (issue 21), and so does a
    # damaged sites.json (who may take part is unknown: issue 35); run.json is shown as
    # unreadable only
    damaged = bool(state["problems"])
    assert damaged is (damage != "a damaged run.json")
    assert main(["server", "status", "--dir", str(folder.root)]) == (1 if damaged else 0)
    assert (note in capsys.readouterr().out) is status_reads  # `status` says it in words too
    assert _snapshot(folder.root) == before  # nothing written, nothing touched


def test_a_server_folder_without_a_federation(tmp_path) -> None:
    page = _client(ServerFolder.at(tmp_path)).get("/").text
    assert "is not a federation folder (no federation.json)" in page
    assert "no logs yet" in page and "no step finished yet" in page


def test_logs_are_served_from_the_logs_folder_only(folder) -> None:
    client = _client(folder)
    reply = client.get("/logs/superlink.log")
    assert reply.status_code == 200 and reply.text.endswith(REFUSAL)
    assert reply.headers["content-type"] == "text/plain; charset=utf-8"
    assert reply.headers["x-content-type-options"] == "nosniff"
    (folder.logs / "escape.log").symlink_to(folder.sites_file)
    (folder.logs / "sub").mkdir()
    (folder.logs / "sub" / "x.log").write_text("x")
    for path in (
        "/logs/..%2Fsites.json",
        "/logs/%2E%2E%2Frun.json",
        "/logs/%2E%2E",
        "/logs/escape.log",
        "/logs/sub",
        "/logs/sub%2Fx.log",
        "/logs/nope.log",
        "/logs/%2Fetc%2Fpasswd",
    ):
        assert client.get(path).status_code == 404, path
    assert client.post("/logs/superlink.log").status_code == 405
    dashboard = Dashboard(folder, folder.federation, 5.0)  # what a browser would not send
    assert [dashboard.log(name) for name in ("..", "../sites.json", "", ".")] == [None] * 4
    page = client.get("/").text
    assert "escape.log" not in page and ">sub<" not in page


def test_the_command_checks_its_address_before_serving(tmp_path, capsys) -> None:
    base = ["server", "dashboard", "--dir", str(tmp_path)]
    for flags, words in (
        (["--listen", "0.0.0.0:9097"], "no authentication; keep it on 127.0.0.1 and use an SSH"),
        (["--listen", "nope"], "--listen nope: expected HOST:PORT"),
        (["--refresh-s", "0"], "--refresh-s 0: expected a number >= 1"),
    ):
        assert main([*base, *flags]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and words in err, err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert main([*base, "--listen", address]) == 1
    out, err = capsys.readouterr()
    assert f"{address} is in use or cannot be bound" in err
    # --allow-remote: a warning first; 192.0.2.1 (TEST-NET) is no address of this machine
    assert main([*base, "--allow-remote", "--listen", "192.0.2.1:9097"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("WARNING: --allow-remote: anyone who reaches 192.0.2.1:9097")
    assert "cannot be bound" in err


# --- a real browser ----------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def live_federation(tmp_path_factory, one_torch_thread) -> Path:
    """A real federation in process: step 1 degraded (farm-b silent at evaluation), step 2
    completed, step 3 left running by a server that died in stage 2."""
    from in_process import Crash, run_two_sites
    from site_folders import CLASSES, site_folder

    root = tmp_path_factory.mktemp("dashboard")
    site_folder(root / "farm-a", {"2026-03": CLASSES[0:2]})
    site_folder(root / "farm-b", {"2026-04": CLASSES[2:4]})
    silent = {(2, "evaluate"): lambda reply: None}  # a run's last step evaluates on its own
    assert run_two_sites(root, silent, **{"max-steps": 1})["status"] == "degraded"
    site_folder(root / "farm-a", {"2026-05": CLASSES[4:6]})
    site_folder(root / "farm-b", {"2026-05": CLASSES[6:8]})
    assert run_two_sites(root, {})["status"] == "completed"
    site_folder(root / "farm-a", {"2026-06": CLASSES[8:10]})

    def crash(reply):
        raise Crash

    with pytest.raises(Crash):
        run_two_sites(root, {(1, "train.stage2"): crash})
    logs = root / "server" / "logs"
    logs.mkdir()
    (logs / "superlink.log").write_text(REFUSAL)
    return root / "server"


def _chromium(url: str, profile: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1280,2200",
        "--virtual-time-budget=5000",
        *flags,
        url,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian: apt-get install chromium)")
def test_the_dashboard_in_a_real_browser(live_federation, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "starfed.cli",
            "server",
            "dashboard",
            "--dir",
            str(live_federation),
            "--listen",
            f"127.0.0.1:{port}",
            "--refresh-s",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                state = httpx.get(url + "api/state", timeout=5).json()
                break
            except httpx.TransportError:
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "the dashboard did not answer"
                time.sleep(0.3)
        assert state["running"]["phase"] == "stage2" and state["running"]["step"] == 2
        dom = _chromium(url, tmp_path / "profile", "--dump-dom").stdout
        sites_table = dom.partition('<table id="sites-table">')[2].partition("</table>")[0]
        assert "farm-a" in sites_table and "farm-b" in sites_table
        steps_table = dom.partition('<table id="steps-table">')[2].partition("</table>")[0]
        assert ">degraded<" in steps_table and ">completed<" in steps_table
        assert "farm-b no reply in evaluate/0" in steps_table  # why it is degraded (issue 47)
        assert "random backbones" in ACCURACY_NOTE and step_label(5, 1) == "6 (try 2)"
        assert '<figure class="double">' in dom or "<figure class=double>" in dom
        assert "step 3" in dom and ">running<" in dom
        assert '<span class="phase now">stage2</span>' in dom
        plots = _plots(dom)
        assert len(plots) == len(PLOTS)
        for src in plots:
            assert httpx.get(url + src.replace("&amp;", "&")).content.startswith(b"\x89PNG")
        screenshot = tmp_path / "dashboard.png"
        _chromium(url, tmp_path / "profile", f"--screenshot={screenshot}")
        image = screenshot.read_bytes()
        assert image.startswith(b"\x89PNG") and len(image) > 50_000  # tables and plots drawn
        if keep := os.environ.get("STARFED_DASHBOARD_SCREENSHOT"):  # docs/images/dashboard.png
            shutil.copy(screenshot, keep)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=20)
    out, err = process.communicate()
    assert code == 0, err
    assert out.startswith(f"dashboard of {live_federation} on {url}")
