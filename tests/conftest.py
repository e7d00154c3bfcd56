import json

import pytest

from hcp_compile.testing import worlds

DEFAULT_SUITE = "cp_cases"  # the eager suite: cp_cases.suite(mesh)


@pytest.fixture(scope="session")
def cp_world():
    """``cp_world(mesh, suite=..., deadline_s=...)`` -> the :class:`worlds.WorldResults`
    of that mesh's suite (default: ``cp_cases``, the eager suite).

    Each (mesh, suite) world's processes are started once per session, the first time a test
    asks for it."""
    started: dict[tuple[tuple[int, int], str], worlds.WorldResults] = {}

    def get(
        mesh: tuple[int, int], suite: str = DEFAULT_SUITE, deadline_s: float = worlds.WORLD_DEADLINE_S,
    ) -> worlds.WorldResults:
        key = (tuple(mesh), suite)
        if key not in started:
            started[key] = worlds.run_world(*mesh, suite=suite, deadline_s=deadline_s)
        return started[key]

    return get


@pytest.fixture
def mask_builds(monkeypatch) -> list[int]:
    """How many flex block masks are built from here on (a one-element list)."""
    from hcp_compile.kernels import flex_mask

    builds = [0]
    build = flex_mask.build_document_mask

    def counting(*args, **kwargs):
        builds[0] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(flex_mask, "build_document_mask", counting)
    return builds


@pytest.fixture
def recorded_measurements(monkeypatch, tmp_path):
    """``use(recorded)``: kernels/measured.py reads the dict ``recorded`` as its measured.json
    from here on; what it keeps of either file is dropped now and after the test."""
    from hcp_compile.kernels import measured

    caches = (measured.recorded, measured._throughputs, measured.recorded_sizes)

    def forget() -> None:
        for cache in caches:
            cache.cache_clear()

    def use(recorded: dict) -> None:
        path = tmp_path / "measured.json"
        path.write_text(json.dumps(recorded))
        monkeypatch.setattr(measured, "MEASURED_FILE", path)
        forget()

    yield use
    forget()


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo world and its 1 x 1 mesh, for one test only (other tests need
    torch.distributed uninitialized)."""
    import torch.distributed as dist

    import hcp_compile as hc

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield hc.make_mesh(1, 1, "cpu")
    finally:
        dist.destroy_process_group()


@pytest.fixture
def traced_flex(monkeypatch):
    """Flex compiled on CPU with ``aot_eager``: Dynamo traces the same forward and backward
    graphs as on CUDA (Inductor has no CPU flex backward). No row shape gets a graph of its
    own (``STATIC_SHAPES`` 0): the graphs with dynamic rows, which must serve every shape."""
    from hcp_compile.kernels import flex

    monkeypatch.setitem(flex.COMPILE_BACKENDS, "cpu", "aot_eager")
    monkeypatch.setattr(flex, "STATIC_SHAPES", 0)
    flex.clear_compiled()
    yield
    flex.clear_compiled()
