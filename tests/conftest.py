import pytest

import distributed


@pytest.fixture(scope="session")
def cp_world():
    """``cp_world(mesh, suite=..., deadline_s=...)`` -> the :class:`distributed.WorldResults`
    of that mesh's suite (default: ``cp_cases``, the eager suite).

    Each (mesh, suite) world's processes are started once per session, the first time a test
    asks for it."""
    worlds: dict[tuple[tuple[int, int], str], distributed.WorldResults] = {}

    def get(
        mesh: tuple[int, int], suite: str = distributed.DEFAULT_SUITE,
        deadline_s: float = distributed.WORLD_DEADLINE_S,
    ) -> distributed.WorldResults:
        key = (tuple(mesh), suite)
        if key not in worlds:
            worlds[key] = distributed.run_world(*mesh, deadline_s=deadline_s, suite=suite)
        return worlds[key]

    return get
