"""What a site's policy and release record cost per message, up to 10,000 classes in one message.

Per message a site checks the request against its policy (``SitePolicy.refusal``), leaves out the
classes it does not admit when it reads its folder (``site.admitted``), hashes the reply's bytes
(``reply_sha256``) and appends one line to its release record under its lock, synced
(``ReleaseRecord.append``). This times each, for a message of a task's few classes and for
one of 10,000 (an evaluation report of every class a site holds: the longest line), with and
without the privacy setting (ε and δ per class in the line), and ``verify`` per line. The
machine's load and the commit are printed with the numbers (docs/benchmarks.md).

    python bench/release_record.py                      # 2 and 10,000 classes
    python bench/release_record.py --classes 2 100 10000 --messages 50
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from starfed.client.policy import PrivacyTerms, SitePolicy
from starfed.client.release_record import Release, ReleaseRecord, now
from starfed.client.site import admitted
from starfed.shared.data.site_folder import SiteFolder, SiteTask
from starfed.shared.protocol import reply_sha256

#: A policy that sets every item (the default's checks return at once).
POLICY = SitePolicy(
    allow=("*",),
    deny=("tomato*", "*___virus_*"),
    min_images=5,
    privacy_required=True,
    max_epsilon=8.0,
    max_delta=1e-5,
    privacy_unit="image",
    withhold=("evaluation",),
    wire_dtypes=("float32",),
    max_reply_bytes=64 << 20,
    server_certificate="a" * 64,
    federation="f" * 32,
)
TERMS = PrivacyTerms(4.0, 1e-6, "image")


def names(n: int) -> list[str]:
    """Class names as long as CropDiseases' (``Cherry_(including_sour)___Powdery_mildew``)."""
    return [f"Crop_{i:05d}_(variety)___Disease_name_{i % 97:02d}" for i in range(n)]


def timed(work, repeat: int) -> float:
    """Median seconds of ``work()`` over ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(classes: int, messages: int, private: bool, folder: Path) -> dict:
    own = names(classes)
    task = SiteFolder(
        folder, [SiteTask("t1", {n: [f"{n}/{i}.jpg" for i in range(10)] for n in own})]
    )
    spent = {n: (3.21, 1e-6) for n in own} if private else {}
    reply = os.urandom(30 * classes)  # an evaluation report: ≈ 30 bytes a class
    record = ReleaseRecord(folder)
    check = timed(
        lambda: (
            POLICY.refusal(("counts",), "float32", "f" * 32, "a" * 64, TERMS),
            POLICY.oversized(len(reply)),
        ),
        messages,
    )
    admit = timed(lambda: admitted(task, POLICY, patients=False), max(3, messages // 10))
    digest = timed(lambda: reply_sha256([("report", reply)]), messages)
    step = iter(range(10**9))

    def append() -> None:
        release = Release(
            now(),
            "a" * 64,
            "f" * 32,
            1,
            next(step),
            "evaluate",
            0,
            42,
            tuple(own),
            ("evaluation",),
            len(reply),
            hashlib.sha256(reply).hexdigest(),
            spent,
        )
        record.append(release)

    write = timed(append, messages)
    lines = record.path.read_text().splitlines()
    start = time.perf_counter()
    assert record.verify() == len(lines)
    verify = (time.perf_counter() - start) / len(lines)
    return {
        "classes": classes,
        "privacy": private,
        "line_bytes": len(lines[-1]) + 1,
        "policy_check_ms": check * 1e3,
        "admit_ms": admit * 1e3,
        "sha256_ms": digest * 1e3,
        "record_write_ms": write * 1e3,
        "verify_ms_per_line": verify * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[2, 10_000])
    parser.add_argument("--messages", type=int, default=30, help="messages timed per case")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(json.dumps({"commit": commit, "load": os.getloadavg(), "cpus": os.cpu_count()}))
    for classes in args.classes:
        for private in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                print(json.dumps(bench(classes, args.messages, private, Path(folder))))
    print(json.dumps({"load_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
