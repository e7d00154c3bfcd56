import pytest

import distributed


@pytest.fixture(scope="session")
def cp_world():
    """``cp_world(mesh)`` -> the :class:`distributed.WorldResults` of that mesh's suite.

    Each mesh's processes are started once per session, the first time a test asks for it."""
    worlds: dict[tuple[int, int], distributed.WorldResults] = {}

    def get(mesh: tuple[int, int]) -> distributed.WorldResults:
        if mesh not in worlds:
            worlds[mesh] = distributed.run_world(*mesh)
        return worlds[mesh]

    return get
