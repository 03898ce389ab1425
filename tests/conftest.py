"""Shared fixtures: short socket directories, the agent as a real process, the fake kubelet, the fake NVML, and the
project's one-file executable and images (built once a session: the packaging tests and the real node use them)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from mpsagent_testing import images
from mpsagent_testing.agents import AgentLauncher, pod_resources_socket
from mpsagent_testing.kubelet.fake import FakeKubelet
from mpsagent_testing.kubelet.podresources import FakePodResources
from mpsagent_testing.nvml.build import build_fake_nvml
from mpsagent_testing.processes import kill_processes_using
from mpsagent_testing.repo import BUILD


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (unix socket paths are limited to 107 bytes); every process that a test
    started for it (agents, MPS daemons in their own sessions) is killed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="mpa", dir="/tmp"))
    yield path
    kill_processes_using(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agents(short_dir: Path) -> Iterator[AgentLauncher]:
    launcher = AgentLauncher(short_dir)
    yield launcher
    launcher.close()


@pytest.fixture
def kubelet(short_dir: Path, pod_resources: FakePodResources) -> Iterator[FakeKubelet]:
    (short_dir / "dp").mkdir()
    fake = FakeKubelet(short_dir / "dp" / "kubelet.sock").start()
    yield fake
    fake.stop()


@pytest.fixture
def pod_resources(short_dir: Path) -> Iterator[FakePodResources]:
    """The kubelet's pod-resources endpoint; agents started by `agents` use it (an empty listing by default)."""
    fake = FakePodResources(pod_resources_socket(short_dir)).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def fake_nvml_library() -> Path:
    return build_fake_nvml(BUILD)


@pytest.fixture(scope="session")
def binary() -> Iterator[Path]:
    """The one-file executable (packaging/binary/build.sh), in a temporary directory removed afterwards."""
    out = Path(tempfile.mkdtemp(prefix="mpsagent-onefile-"))
    try:
        yield images.build_binary(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def base_image() -> str:
    missing = [tool for tool in ("podman", "debootstrap") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        why = f"{', '.join(missing)} not installed" if missing else "not root"
        if os.environ.get("CI"):
            pytest.fail(f"the image tests cannot run in CI: {why} (scripts/install-system-deps.sh installs both)")
        pytest.skip(f"the image tests need podman, debootstrap and root: {why}")
    return images.base_image()


@pytest.fixture(scope="session")
def venv_image(base_image: str) -> str:
    return images.venv_image(base_image)


@pytest.fixture(scope="session")
def onefile_image(base_image: str, binary: Path) -> str:
    return images.onefile_image(base_image, binary)


# --- two workers -------------------------------------------------------------------------------------------

NODE_TESTS = ("tests/e2e/", "tests/packaging/test_packaging.py::")
"""The tests that use the real node or the project's images. `scripts/test` runs the suite on two workers
(pytest-xdist, `-n 2`), and one worker runs all of these, one after the other: the node is one, the images are built
once a session (session fixtures are a worker's own), and the node's agents and the image tests serve metrics on
one port. The other worker takes the rest, a module at a time; each worker runs its tests as the suite would alone."""


class NodeTestsTogether(LoadScopeScheduling):
    """xdist's module-at-a-time scheduling, with the real node's and the images' tests one unit."""

    def _split_scope(self, nodeid: str) -> str:
        return "the real node and the images" if nodeid.startswith(NODE_TESTS) else super()._split_scope(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> NodeTestsTogether:
    return NodeTestsTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real node's and the images' tests first, in their own order: the longest unit, which `scripts/test`
    (`--no-loadscope-reorder`) hands out first; by their folders' names they would come after most areas'."""
    items.sort(key=lambda item: not item.nodeid.startswith(NODE_TESTS))
