"""The container image's two recipes agree (issue 26, item 3): ``make image`` (image/build.py)
and image/Containerfile, for builders with a registry, which cannot be built here.

Both run image/install.sh and read image/packages-*.txt; what each says of its own -- the
configuration, the labels, what the Containerfile mounts -- is compared here. The pure parts of
build.py (the apt sources it takes from the host, the layers' diff) are tested too; the build
itself (mmdebstrap, chroots, podman) is `make image`, run by hand (docs/running/container-image.md).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import sys
import tarfile
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from jaild.daemon.config import load_config_file

REPO = Path(__file__).resolve().parents[2]
IMAGE = REPO / "image"


def _load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("jaild_image_build", IMAGE / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build = _load_build()
CONTAINERFILE = (IMAGE / "Containerfile").read_text(encoding="utf-8")
INSTALL_SH = (IMAGE / "install.sh").read_text(encoding="utf-8")


def _instructions() -> list[tuple[str, str]]:
    """The Containerfile's instructions (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", CONTAINERFILE)
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _one(word: str) -> str:
    values = [rest for w, rest in _instructions() if w == word]
    assert len(values) == 1, f"{word}: {values}"
    return values[0]


def test_the_containerfile_has_builds_configuration() -> None:
    assert json.loads(_one("ENTRYPOINT")) == list(build.ENTRYPOINT)
    assert json.loads(_one("CMD")) == list(build.CMD)
    assert _one("STOPSIGNAL") == build.STOPSIGNAL
    assert _one("EXPOSE") == build.METRICS_PORT
    assert build.ENTRYPOINT == ("/usr/bin/tini", "--")
    assert build.CMD == ("/opt/jaild/venv/bin/jaild", "serve")


def test_the_containerfile_labels_what_build_labels() -> None:
    labels = dict(re.findall(r'(org\.opencontainers\.image\.[a-z.]+)="([^"]*)"', _one("LABEL")))
    inputs = build.Inputs("0.1.0", "abc", 0, 0, [], [], [])
    ours = build.labels(inputs)
    # created is the build's own time; base.name says which base each used
    assert set(labels) == set(ours) - {"org.opencontainers.image.created"}
    with open(REPO / "pyproject.toml", "rb") as f:
        assert labels["org.opencontainers.image.version"] == tomllib.load(f)["project"]["version"]
    for key in ("title", "description"):
        name = f"org.opencontainers.image.{key}"
        assert labels[name] == ours[name]


def test_both_run_the_same_steps_of_install_sh() -> None:
    runs = [rest for w, rest in _instructions() if w == "RUN"]
    steps = [re.findall(r"install\.sh (apt \w+|wheels|jaild)", r) for r in runs]
    assert [s for step in steps for s in step] == [
        "apt runtime", "apt build", "wheels", "apt runtime", "jaild",
    ]  # fmt: skip
    source = (IMAGE / "build.py").read_text(encoding="utf-8")
    for step in ('"wheels"', '"jaild"'):  # build.py runs the same two in its chroots
        assert f'"/tmp/jaild-src/image/install.sh",\n            {step},' in source
    assert 'packages("runtime") + packages("build")' in source  # the wheel chroot's packages


def test_the_final_stage_takes_nothing_but_the_wheelhouse_from_the_build_stage() -> None:
    final = CONTAINERFILE.split("\nFROM ")[-1]
    assert final.startswith("docker.io/library/debian:bookworm-slim\n")
    assert "from=wheels,source=/wheelhouse" in final
    assert "COPY" not in final  # bind mounts only: no wheelhouse or source in a layer
    assert "apt build" not in final


def test_the_package_lists() -> None:
    runtime, buildtime = build.packages("runtime"), build.packages("build")
    assert {"python3", "python3-venv", "libseccomp2", "libcap2", "tini", "ca-certificates"} <= set(
        runtime
    )
    assert {"gcc", "python3-dev", "libcap-dev"} <= set(buildtime)
    assert not set(runtime) & set(buildtime)
    # install.sh reads the lists the way build.py does (comments dropped)
    assert "grep -v '^#'" in INSTALL_SH


def test_the_layout_install_sh_makes() -> None:
    for path in ("/opt/jaild", "/etc/jaild", "/var/lib/jaild", "/run/jaild"):
        assert path.rsplit("/", 1)[-1] in INSTALL_SH or path in INSTALL_SH
    assert "OPT=/opt/jaild" in INSTALL_SH and "STATE=/var/lib/jaild" in INSTALL_SH
    assert 'env build "$name" -r "$req" --state-dir "$STATE"' in INSTALL_SH
    assert "EXTRAS=mcp,otel" in INSTALL_SH
    assert "PIP_NO_INDEX=1" in INSTALL_SH  # the jaild step is offline
    assert build.CMD[0].startswith("/opt/jaild/venv/bin/")
    # what the Containerfile bind-mounts of the checkout holds what install.sh reads
    for path in build.SOURCE_PATHS:
        assert (REPO / path).exists(), path


def test_the_images_config_file_is_valid_and_says_what_the_docs_say() -> None:
    sections = load_config_file(str(IMAGE / "jaild.toml"))
    daemon = sections["daemon"]
    assert daemon.socket == "/run/jaild/jaild.sock"
    assert daemon.policies_dir == "/etc/jaild/policies"
    assert daemon.state_dir == "/var/lib/jaild"
    assert daemon.metrics_address.endswith(":" + build.METRICS_PORT.split("/")[0])
    # the drain and the shutdown's grace fit a pod's default terminationGracePeriodSeconds
    limits = sections.get("limits")
    grace = limits.shutdown_grace_s if limits else 10.0
    assert daemon.drain_s + grace < 30


def test_debian_sources_come_from_the_hosts_apt(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb-src\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
        "Components: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n",
        encoding="utf-8",
    )
    (d / "vendor.sources").write_text(
        "Types: deb\nURIs: https://vendor.example/apt\nSuites: nodistro\nComponents: main\n",
        encoding="utf-8",
    )
    (tmp_path / "sources.list").write_text(
        "deb [signed-by=/k.gpg arch=amd64] http://other.example/debian bookworm main\n"
        "deb http://old.example/debian bullseye main\n",
        encoding="utf-8",
    )
    assert build.debian_sources(tmp_path) == [
        "deb http://other.example/debian bookworm main",
        "deb http://mirror.example/debian bookworm main contrib",
        "deb http://mirror.example/debian bookworm-updates main contrib",
        "deb http://mirror.example/debian-security bookworm-security main",
    ]


def _tar(path: Path, members: dict[str, bytes | None], mtime: int = 100) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.mtime = mtime
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))


def test_the_jaild_layer_is_the_difference_from_the_base(tmp_path: Path) -> None:
    base = tmp_path / "base.tar.gz"
    _tar(base, {"etc": None, "etc/keep": b"k", "etc/gone": b"g", "usr": None,
                "usr/old": None, "usr/old/f": b"f"})  # fmt: skip
    root = tmp_path / "root"
    for name, data in (("etc/keep", b"k"), ("etc/gone", b"g"), ("usr/old/f", b"f")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    for name in ("etc/keep", "etc/gone", "usr/old/f", "usr/old", "etc", "usr"):
        os.chmod(root / name, 0o755 if (root / name).is_dir() else 0o644)
        os.utime(root / name, (100, 100))
    index = build.layer_index(base)
    (root / "etc/gone").unlink()
    (root / "usr/old/f").unlink()
    (root / "usr/old").rmdir()
    (root / "opt").mkdir()
    (root / "opt/new").write_bytes(b"new")
    os.utime(root / "etc", (100, 100))
    os.utime(root / "usr", (100, 100))
    blob, count = build.diff_layer(root, index, tmp_path / "layer.tar.gz", epoch=1000)
    with tarfile.open(blob.path) as tar:
        members = {m.name: m for m in tar}
    assert set(members) == {"etc/.wh.gone", "opt", "opt/new", "usr/.wh.old"}
    assert count == 4
    assert all(m.mtime <= 1000 and m.uname == "" for m in members.values())
    assert blob.diff_id.startswith("sha256:") and blob.digest.startswith("sha256:")


def test_a_layer_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a/f").write_bytes(b"x" * 1000)
    digests = {build.diff_layer(root, {}, tmp_path / f"l{i}.tar.gz", epoch=5)[0].digest
               for i in range(2)}  # fmt: skip
    assert len(digests) == 1


@pytest.mark.parametrize("epoch", ["1700000000", ""])
def test_an_envs_built_at_is_source_date_epoch_where_set(
    epoch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaild import envs

    monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
    stamp = envs._now()
    assert (stamp == "2023-11-14T22:13:20Z") == bool(epoch)
