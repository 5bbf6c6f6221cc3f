"""pytest plugin (registered by hp-dtensor's ``pytest11`` entry point): one
:func:`~hyper_parallel.dtensor.testing.rank_pool` per test module, so the multi-rank tests of a
module share their ranks instead of starting, importing and initialising new ones per test.
``HP_TEST_POOL=0`` turns the pools off. Imports no torch; without pytest it defines nothing."""

from __future__ import annotations

from collections.abc import Iterator

__all__: list[str] = []

try:
    import pytest
except ImportError:  # pragma: no cover - imported outside pytest, by a module walker
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="module", autouse=True)
    def hp_rank_pool() -> Iterator[None]:
        """Every multi-rank call of this test module shares its ranks (see rank_pool)."""
        from hyper_parallel.dtensor.testing import rank_pool

        with rank_pool():
            yield
